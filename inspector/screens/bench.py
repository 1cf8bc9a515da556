"""The bench screen: llama-bench rows (engine.bench) on the current engine under configuration A, B,
or A then B.

A thread worker runs `run_bench` once per configuration, holding the engine lock; each row reaches
the tables as its timed repetitions finish (t/s, clocks, counters; and the latency table: TTFT, TPOT
and ITL mean ± stddev beside p50/p90/p99), its kernel shares once every row is timed (profiles run
last: a profiler session slows the process's later CUDA calls); its progress object only puts
notes on the queue, which a timer drains into the progress bar. Below: the steady-state trajectory
(generated tokens/s in 2-second bins, one coloured series per configuration and row, named in the
legend), the kernel shares when profiled on a GPU, and B/A per row after A against B. A refused
measurement (MeasurementError: zero tokens, zero time, a non-finite rate) shows its reason instead
of a table.

The default plan fits the device: on a CPU about ten seconds on `demo`; on a GPU the rows the
issue asks for at a size that still finishes in a minute. Leaving the screen stops the bench
after its current repetition; what the screen showed is kept on the app and shown again on the
next visit. A finished bench is recorded into the session as a `bench` step per configuration.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Input, Label, ProgressBar, Select, Static, Switch
from textual_plotext import PlotextPlot

from engine import bench
from engine.errors import MeasurementError, UserError
from engine.flags import ResolvedFlags, format_value
from engine.runtime import Engine
from inspector import events
from inspector.describe import changed_flags
from inspector.events import EngineQueue
from inspector.session import BENCH_TG_PROMPT

# pp, tg, batch, reps. CPU: ~3 s on demo, ~5 s on tiny (2-core machine, measured with
# `moe-inspector bench --pp 16,64 --tg 16 --batch 1,4 --reps 2`).
CPU_PLAN = ("16,64", "16", "1,4", "2")
GPU_PLAN = ("128,512", "128", "1,8", "3")
PLAN_BOXES = ("pp", "tg", "batch", "reps")
NO_PROFILE_ON_CPU = ("kernel shares need a GPU: torch.profiler records no device kernels on a CPU, and an empty "
                     "profile is refused, never shown as zeros")
SHARES_PER_ROW = 8


class BenchCancelled(Exception):
    """The screen was left: the bench stops at its next repetition."""


class QueueProgress:
    """engine.bench's progress object: each finished repetition becomes a note on the queue."""

    def __init__(self, queue: EngineQueue, cancel: threading.Event) -> None:
        self.queue, self.cancel = queue, cancel

    def advance(self, steps: int = 1, note: str = "") -> None:
        self.queue.put(events.BenchProgressEvent(note))
        if self.cancel.is_set():
            raise BenchCancelled()


@dataclass(frozen=True)
class Plan:
    pp: list[int]
    tg: list[int]
    batch: list[int]
    reps: int
    profile: bool

    @property
    def specs(self) -> list:
        return bench.row_specs(self.pp, self.tg, self.batch, BENCH_TG_PROMPT)

    @property
    def repetitions(self) -> int:
        """What the progress bar counts: per row a warm-up, the timed repetitions, and the profiled one."""
        return len(self.specs) * (self.reps + 1 + int(self.profile))

    def action(self, flags: ResolvedFlags) -> dict:
        """The session's record of this bench (the `bench` step's keys; profiling is not a step key)."""
        return {"action": "bench", "pp": self.pp or None, "tg": self.tg or None, "batch": self.batch,
                "reps": self.reps, "flags": dict(flags.values)}


def parse_list(name: str, text: str, allow_empty: bool) -> list[int]:
    text = text.strip()
    if allow_empty and text.lower() in ("", "none", "0"):
        return []
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts or not all(part.isdigit() and int(part) >= 1 for part in parts):
        empty = " (or none)" if allow_empty else ""
        raise UserError(f"{name} {text!r}: give comma-separated whole numbers >= 1, e.g. 16,64{empty}")
    return [int(part) for part in parts]


def parse_plan(values: dict[str, str], profile: bool, context: int) -> Plan:
    pp, tg = parse_list("pp", values["pp"], True), parse_list("tg", values["tg"], True)
    batch = parse_list("batch", values["batch"], False)
    reps_text = values["reps"].strip()
    if not reps_text.isdigit() or int(reps_text) < 1:
        raise UserError(f"reps {reps_text!r}: give a whole number >= 1 (timed repetitions after one warm-up)")
    if not pp and not tg:
        raise UserError("pp and tg are both empty: nothing to measure")
    plan = Plan(pp, tg, batch, int(reps_text), profile)
    for spec in plan.specs:
        if spec.prompt_len + spec.max_tokens > context:
            raise UserError(f"{spec.name} needs {spec.prompt_len + spec.max_tokens} positions, more than the context "
                            f"of {context}: choose shorter pp/tg")
    return plan


def row_cells(row: dict) -> list[str]:
    if row["state"] == "admitting":
        wall = device = "admitting"
        clocks = ms_token = host = "—"
    else:
        wall = bench.spread_cell(row["tps_wall"], 1)
        device = "n/a" if row["tps_device"] is None else f"{row['tps_device']['mean']:.1f}"
        clocks = ("n/a" if row["clock_disagreement"] is None else
                  f"{100 * row['clock_disagreement']:.1f} %" + (" ⚠" if row["clock_flag"] else ""))
        ms_token, host = f"{row['ms_per_token']:.3f}", f"{row['host_us_per_step']:.0f}"
    counters = row["counters"]
    launches = ", ".join(f"{name} {count}" for name, count in counters["arms"].items() if count)
    return [row.get("config", "A"), row["test"], wall, device, clocks, f"{row['ttft_ms']['mean']:.1f}", ms_token, host,
            launches, bench.replays_cell(counters), str(sum(counters["kernels"].values()))]


ROW_COLUMNS = ("cfg", "test", "t/s (wall)", "t/s (device)", "Δclock", "TTFT ms", "ms/tok", "host µs/step", "launches",
               "replays", "kernels")
LATENCY_NAMES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"))
LATENCY_COLUMNS = ("cfg", "test") + tuple(f"{label} {column}" for _, label in LATENCY_NAMES
                                          for column in ("ms", "p50", "p90", "p99"))


def latency_cells(row: dict) -> list[str]:
    """vllm bench's latencies: mean ± stddev beside p50/p90/p99, in ms (engine.bench.latency_summary)."""
    cells = [row.get("config", "A"), row["test"]]
    for name, _ in LATENCY_NAMES:
        stats = (row.get("latency") or {}).get(name)
        cells += (["—"] * 4 if stats is None else
                  [bench.spread_cell(stats, 1)] + [f"{stats[q]:.1f}" for q in ("p50", "p90", "p99")])
    return cells


CONFIGS = (("A", "A"), ("B", "B"), ("A vs B", "A,B"))
# One colour per series of the trajectory, in order: its legend names each (configuration and row).
SERIES_COLORS = ("cyan", "magenta", "green", "orange", "blue", "red", "yellow", "white")


def ratio_text(rows: list[dict]) -> str:
    """B's t/s over A's, per row both benched: one pass each, so read beside the ±."""
    by = {(row.get("config", "A"), row["test"]): row for row in rows}
    parts = []
    for (config, test), row_a in by.items():
        row_b = by.get(("B", test))
        if config != "A" or row_b is None or row_a["tps_wall"] is None or row_b["tps_wall"] is None:
            continue
        parts.append(f"{test} {row_b['tps_wall']['mean'] / row_a['tps_wall']['mean']:.2f}×")
    return ("B / A, t/s (wall): " + ", ".join(parts) + " (one pass each, one after the other in this process: "
            "read it beside each row's ±)") if parts else ""


class BenchScreen(Screen):
    BINDINGS = [
        Binding("escape,f8", "leave", "Back"),
        Binding("ctrl+r", "run_bench", "Run bench"),
    ]

    def __init__(self, engine: Engine, flags: ResolvedFlags, engine_lock: threading.Lock | None = None, *,
                 flags_b: ResolvedFlags | None = None, run_bench: Callable = bench.run_bench,
                 clock: Callable[[], float] | None = None) -> None:
        """`flags` is configuration A, `flags_b` B (None: the B choices are not offered). `run_bench` and `clock`
        are engine.bench's; tests pass a clock that stands still to force a refusal. What the screen showed is
        kept on the app (`bench_memory`) and shown again on the next visit."""
        super().__init__()
        self.engine, self.flags, self.flags_b = engine, flags, flags_b
        self.engine_lock = engine_lock or threading.Lock()
        self.run_bench_function, self.clock = run_bench, clock
        self.gpu = engine.device.type == "cuda"
        self.queue = EngineQueue()
        self.cancel = threading.Event()
        self.running = False
        self.plan: Plan | None = None
        self.rows: list[dict] = []
        self.report: dict | None = None
        self.reports: dict[str, dict] = {}  # configuration -> its finished report
        self.refused: str | None = None
        self.finished_at: str | None = None

    def configs_chosen(self) -> list[str]:
        if self.flags_b is None:
            return ["A"]
        return self.query_one("#bench-config", Select).value.split(",")

    def flags_of(self, config: str) -> ResolvedFlags:
        return self.flags if config == "A" or self.flags_b is None else self.flags_b

    def compose(self) -> ComposeResult:
        c = self.engine.config
        yield Static(f"{c.name} on {self.engine.device_label}: llama-bench rows over the batched engine, a warm-up "
                     f"per row excluded; tg rows use {BENCH_TG_PROMPT}-token prompts."
                     + ("" if self.gpu else " On a CPU the screen shares the cores with the engine: "
                        "`moe-inspector bench` headless gives steadier numbers."), id="bench-about")
        yield Static(self._configs_text(), id="bench-configs")
        with Horizontal(id="bench-params"):
            for name, value in zip(PLAN_BOXES, GPU_PLAN if self.gpu else CPU_PLAN):
                yield Label(name)
                yield Input(value, id=f"bench-{name}", restrict=r"[0-9,a-z ]*", compact=True)
            if self.flags_b is not None:
                yield Label("config")
                yield Select(list(CONFIGS), value="A", allow_blank=False,
                             compact=True, id="bench-config")
            if self.gpu:
                yield Label("profile")
                yield Switch(False, id="bench-profile")
        with Horizontal(id="bench-progress-row"):
            yield ProgressBar(total=1, id="bench-progress", show_eta=False)  # 0 % until a run: no idle animation
            yield Static("ctrl+r (or Enter in a box) runs the bench", id="bench-status", markup=False)
        with VerticalScroll(id="bench-body"):
            yield Static("", id="bench-refusal", markup=False)
            yield DataTable(id="bench-rows", cursor_type="row", zebra_stripes=True)
            yield Static("latency, ms: mean ± stddev, p50 / p90 / p99 over every request (ITL: every gap) of the "
                         "timed repetitions", id="bench-latency-title")
            yield DataTable(id="bench-latency", cursor_type="row", zebra_stripes=True)
            yield Static("", id="bench-ratio")
            with Horizontal(id="bench-lower"):
                yield PlotextPlot(id="bench-trajectory")
                with Vertical(id="bench-shares"):
                    yield Static("" if self.gpu else NO_PROFILE_ON_CPU, id="bench-shares-note")
                    yield DataTable(id="bench-kernels", zebra_stripes=True)
            yield Static("", id="bench-footer")
        yield Footer(compact=True)

    def _configs_text(self) -> str:
        text = f"A (the flags panel): {changed_flags(self.flags)}"
        if self.flags_b is not None:
            changed = [f"{name}={format_value(name, value)}" for name, value in self.flags_b.values.items()
                       if self.flags[name] != value]
            text += "\nB: A with " + (", ".join(changed) or "no change (B is A)")
        return text

    def on_mount(self) -> None:
        self.set_interval(events.DRAIN_INTERVAL, self.drain)
        self.query_one("#bench-rows", DataTable).add_columns(*ROW_COLUMNS)
        self.query_one("#bench-latency", DataTable).add_columns(*LATENCY_COLUMNS)
        self.query_one("#bench-kernels", DataTable).add_columns("row", "kernel", "device µs", "calls", "share",
                                                                "launches/step", "adds µs/step")
        self.query_one("#bench-kernels").display = False
        self.query_one("#bench-refusal").display = False
        self.query_one(f"#bench-{PLAN_BOXES[0]}", Input).focus()
        self.restore()
        self.draw_trajectory()

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        if action == "run_bench":
            return None if self.running else True
        return True

    # -- what the last visit showed ------------------------------------------------------------------------

    @property
    def memory(self) -> dict | None:
        return getattr(self.app, "bench_memory", None)

    def remember(self) -> None:
        """Keep what the screen shows on the app, for the next visit (the rows so far, while running)."""
        if not hasattr(self.app, "bench_memory"):
            return
        self.app.bench_memory = {
            "plan": {name: self.query_one(f"#bench-{name}", Input).value for name in PLAN_BOXES},
            "config": None if self.flags_b is None else self.query_one("#bench-config", Select).value,
            "rows": list(self.rows), "reports": dict(self.reports), "refused": self.refused,
            "status": str(self.query_one("#bench-status", Static).render()), "finished_at": self.finished_at}

    def restore(self) -> None:
        memory = self.memory
        if not memory:
            return
        for name, value in memory["plan"].items():
            self.query_one(f"#bench-{name}", Input).value = value
        if memory.get("config") and self.flags_b is not None:
            self.query_one("#bench-config", Select).value = memory["config"]
        self.rows, self.reports, self.refused = list(memory["rows"]), dict(memory["reports"]), memory["refused"]
        self.report = next(reversed(self.reports.values()), None)
        self.finished_at = memory.get("finished_at")
        for row in self.rows:
            self._add_row(row)
        for report in self.reports.values():
            for row in report["rows"]:
                if "profile" in row:
                    self._add_profile(row)
        if self.refused:
            self.show_refusal(f"refused: {self.refused}")
        self._show_footer()
        when = f" at {self.finished_at}" if self.finished_at else ""
        self.query_one("#bench-status", Static).update(
            f"the last bench{when}: {len(self.rows)} rows (kept from your last visit); ctrl+r runs again")

    # -- running -----------------------------------------------------------------------------------------

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.action_run_bench()

    def action_run_bench(self) -> None:
        if self.running:
            return
        values = {name: self.query_one(f"#bench-{name}", Input).value for name in PLAN_BOXES}
        profile = self.gpu and self.query_one("#bench-profile", Switch).value
        try:
            plan = parse_plan(values, profile, self.engine.config.max_seq_len)
        except UserError as error:
            self.show_refusal(f"not run: {error}")
            return
        configs = self.configs_chosen()
        self.plan, self.rows, self.report, self.reports, self.refused = plan, [], None, {}, None
        self.running = True
        self.cancel.clear()
        self.refresh_bindings()
        self.query_one("#bench-refusal").display = False
        for table in ("#bench-rows", "#bench-latency"):
            self.query_one(table).display = True
            self.query_one(table, DataTable).clear()
        self.query_one("#bench-kernels", DataTable).clear()
        self.query_one("#bench-footer", Static).update("")
        self.query_one("#bench-ratio", Static).update("")
        self.query_one("#bench-progress", ProgressBar).update(total=plan.repetitions * len(configs), progress=0)
        self.query_one("#bench-status", Static).update(
            f"{len(plan.specs)} rows × ({plan.reps} reps + warm-up{' + profile' if profile else ''})"
            + (f" × configurations {' and '.join(configs)}" if len(configs) > 1 else f" under {configs[0]}")
            + (" — waiting for the engine" if self.engine_lock.locked() else ""))
        self.draw_trajectory()
        self.remember()
        self.run_rows(plan, [(config, self.flags_of(config)) for config in configs])

    @work(thread=True, exclusive=True, group="bench")
    def run_rows(self, plan: Plan, configs: list[tuple[str, ResolvedFlags]]) -> None:
        """On the worker thread: one run_bench per configuration, each row sent as its timed repetitions finish,
        then each row's kernel shares (profiled after every timed row: a profiler session slows later CUDA
        calls); only the queue is touched."""
        progress = QueueProgress(self.queue, self.cancel)
        for index, (config, flags) in enumerate(configs):
            last = index == len(configs) - 1
            started = time.perf_counter()

            def arrived(row, config: str = config) -> None:
                self.queue.put(events.BenchRowEvent({**row.to_json(), "config": config}))

            try:
                with self.engine_lock:
                    report = self.run_bench_function(self.engine, flags, plan.specs, plan.reps, profile=plan.profile,
                                                     progress=progress, clock=self.clock, on_row=arrived).to_json()
                for row in report["rows"]:
                    row["config"] = config
                    if "profile" in row:
                        self.queue.put(events.BenchProfileEvent(row))
            except BenchCancelled:
                self.queue.put(events.BenchDoneEvent(None, cancelled=True, config=config))
                return
            except MeasurementError as error:
                self.queue.put(events.BenchDoneEvent(None, refused=f"{config}: {error}" if len(configs) > 1
                                                     else str(error), config=config))
                return
            except UserError as error:
                self.queue.put(events.BenchDoneEvent(None, error=str(error), config=config))
                return
            self.queue.put(events.BenchDoneEvent(report, wall_s=time.perf_counter() - started, config=config,
                                                 last=last))

    def cancel_work(self) -> None:
        self.cancel.set()

    def action_leave(self) -> None:
        self.cancel_work()  # a running bench stops after its current repetition
        if self.running:
            self.query_one("#bench-status", Static).update(f"stopped when left: {len(self.rows)} rows")
        self.remember()
        self.app.pop_screen()

    def drain(self) -> None:
        for message in self.queue.drain():
            self.post_message(message)

    # -- messages ------------------------------------------------------------------------------------------

    def on_bench_progressed(self, message: events.BenchProgressed) -> None:
        self.query_one("#bench-progress", ProgressBar).advance(len(message.notes))
        self.query_one("#bench-status", Static).update(f"done: {message.notes[-1]}")

    def _add_row(self, row: dict) -> None:
        key = f"{row.get('config', 'A')} {row['test']}"
        self.query_one("#bench-rows", DataTable).add_row(*row_cells(row), key=key)
        self.query_one("#bench-latency", DataTable).add_row(*latency_cells(row), key=key)

    def on_bench_row_arrived(self, message: events.BenchRowArrived) -> None:
        self.rows.append(message.row)
        self._add_row(message.row)
        self.remember()

    def _add_profile(self, row: dict) -> None:
        kernels = self.query_one("#bench-kernels", DataTable)
        kernels.display = True
        label = row["test"] if row.get("config", "A") == "A" and self.flags_b is None else f"{row['config']} {row['test']}"
        for entry in row["profile"]["kernels"][:SHARES_PER_ROW]:
            name = entry["kernel"] if len(entry["kernel"]) <= 48 else entry["kernel"][:47] + "…"
            kernels.add_row(label, name, f"{entry['device_us']:.1f}", str(entry["calls"]),
                            f"{100 * entry['share']:.1f} %", f"{entry['launches_per_step']:.2f}",
                            bench.critical_cell(entry))
        self.query_one("#bench-shares-note", Static).update(f"kernel shares, {row['profile']['note']}")

    def on_bench_profile_arrived(self, message: events.BenchProfileArrived) -> None:
        if "profile" in message.row:
            self._add_profile(message.row)

    def on_bench_finished(self, message: events.BenchFinished) -> None:
        status = self.query_one("#bench-status", Static)
        if message.report is not None:
            self.reports[message.config] = message.report
            self.report = message.report
            # Recorded with what the user saw, as the step's results: one bench step per configuration.
            self.app.record_action(self.plan.action(self.flags_of(message.config)),
                                   {"report": message.report, "wall_s": message.wall_s})
            if not message.last:
                return
        self.running = False
        self.refresh_bindings()
        if message.cancelled:
            status.update(f"stopped: {len(self.rows)} rows")
        elif message.refused is not None:
            self.refused = message.refused
            self.show_refusal(f"refused: {message.refused}")
            status.update("refused: no table")
        elif message.error is not None:
            self.show_refusal(f"not run: {message.error}")
            status.update("not run")
        else:
            self.finished_at = time.strftime("%H:%M:%S")
            self.draw_trajectory()  # once, at the end: plotting while rows are timed would take the CPU from them
            status.update(f"done: {len(self.rows)} rows in {message.wall_s:.1f} s")
            self._show_footer()
        self.remember()

    def _show_footer(self) -> None:
        self.query_one("#bench-footer", Static).update(
            "\n".join(footer_text(report) for report in self.reports.values()))
        self.query_one("#bench-ratio", Static).update(ratio_text(self.rows))
        self.draw_trajectory()

    def show_refusal(self, text: str) -> None:
        """A refused measurement prints no table: the reason takes its place."""
        refusal = self.query_one("#bench-refusal", Static)
        refusal.update(text)
        refusal.display = True
        for table in ("#bench-rows", "#bench-latency", "#bench-kernels"):
            self.query_one(table).display = False

    # -- the trajectory --------------------------------------------------------------------------------------

    def draw_trajectory(self) -> None:
        plt = self.query_one("#bench-trajectory", PlotextPlot).plt
        plt.clear_figure()
        tg_rows = [row for row in self.rows if row["kind"] == "tg"]
        bin_s = bench.TRAJECTORY_BIN_S
        single = tg_rows and all(len(row["trajectory"]["tokens_per_s"]) <= 1 for row in tg_rows)
        plt.title(f"tg t/s from arrival, prefill in, {bin_s:g}-s bins" + ("; one bin each" if single else ""))
        for index, row in enumerate(tg_rows):
            rates = row["trajectory"]["tokens_per_s"]
            if not rates:
                continue
            span = row["trajectory"].get("span_s") or bin_s * len(rates)  # the last bin ends with the run
            times = [min(bin_s * (bin_index + 1), span) for bin_index in range(len(rates))]
            color = SERIES_COLORS[index % len(SERIES_COLORS)]
            label = f"{row.get('config', 'A')} {row['test']}"  # the legend tells the series apart
            if len(rates) == 1:  # one bin: a visible point, not a braille dot
                plt.scatter(times, rates, label=label, marker="●", color=color)
            else:
                plt.plot(times, rates, label=label, marker="braille", color=color)
        if tg_rows:
            longest = max(row["trajectory"].get("span_s") or bin_s * len(row["trajectory"]["tokens_per_s"])
                          for row in tg_rows)
            plt.xlim(0, longest * 1.1 if longest > 0 else bin_s)
        else:
            plt.text("no tg rows yet" if self.running or not self.rows else "no tg rows in this plan", 0.5, 0.5)
            plt.xlim(0, 1)
            plt.ylim(0, 1)
        plt.xlabel("x: seconds from arrival (bin end) · y: tokens/s")  # one line: plotext's y label covers the x one
        self.query_one("#bench-trajectory", PlotextPlot).refresh()


def footer_text(report: dict) -> str:
    foot = report["footer"]
    lines = [f"{foot['model']} ({foot['dtype']}) on {foot['device']} · commit {foot['commit']} · "
             + " · ".join(f"{name} {version}" for name, version in foot["versions"].items()),
             f"graphs {foot['graphs']} · weights: {foot['weights']} · clocks: {foot['clocks']}"]
    for entry in report.get("targets", {}).get("rows", []):
        share = ("device time n/a here, so no host share" if entry.get("host_share") is None else
                 f"host {100 * entry['host_share']:.1f} % of the device step (target < "
                 f"{100 * entry['target_host_share']:.0f} %)")
        lines.append(f"{entry['test']} @ b1: {entry['tps']:.1f} t/s; the weight-bandwidth bound, "
                     f"{entry['bound_tps']:.1f} t/s, is {entry['ratio_to_bound']:.2f}× that "
                     + (f"(target ≤ {entry['target_ratio']}×)" if entry.get("target_ratio") is not None
                        else "(no target for this model)") + f"; {share}")
    return "\n".join(lines)
