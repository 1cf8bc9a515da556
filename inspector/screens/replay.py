"""The replay screen: step through the open session, re-running each step beside its recording.

For the step in view, the recorded results line (what the TUI saw, or what `moe-inspector run`
wrote) sits on the left and the re-run on the right: per configuration the tokens with the first
token that differs from the other side marked, the counters, a summary of the decisions, and the
timings (shown, never compared); the curve's, check's or bench's numbers for the other steps. The
verdict under the title says match, or differs with the step, configuration and token.

Each step is re-run once, on arrival, in a thread worker through the session runner
(`run_step`, the same code as `moe-inspector replay`), holding the engine lock; the result comes
back through the queue. `r` re-runs the step in view again.
"""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Static

from engine.errors import UserError
from engine.runtime import Engine
from engine.sidebyside import first_divergence
from inspector import events
from inspector.describe import fill_text
from inspector.events import EngineQueue
from inspector.session import Session, Step, step_to_plain
from inspector.session_report import NO_STEPS, decided_summary, executed_summary, run_label
from inspector.session_runner import diff_step, make_context, preflight_step, run_step
from inspector.widgets.output_pane import TokenText, render_tokens, token_text, tokenizer_token_text

MATCH, DIFFERS, NO_RECORDING, FAILED, RUNNING, PENDING = "match", "differs", "no recording", "failed", "running", ""
MARKS = {MATCH: ("✓", "green"), DIFFERS: ("✗", "bold red"), NO_RECORDING: ("?", "yellow"), FAILED: ("!", "bold yellow"),
         RUNNING: ("…", "bold"), PENDING: ("·", "dim")}


def describe_step(step: Step) -> str:
    """One line: what the step does, as its definition says."""
    plain = step_to_plain(step)
    action = plain.pop("action")
    if "prompt" in plain:
        prompt = plain.pop("prompt")
        shown = prompt if len(prompt) <= 40 else prompt[:39] + "…"
        return f"{action} {shown!r} " + " ".join(f"{key}={value}" for key, value in plain.items())
    return f"{action} " + " ".join(f"{key}={value}" for key, value in plain.items())


def _overrides(run: dict, base: dict) -> str:
    changed = [f"{name}={'on' if value is True else 'off' if value is False else value}"
               for name, value in run.get("flags", {}).items() if base.get(name) != value]
    return ", ".join(changed) or "[flags] alone"


def _float(value: Any, digits: str = ".2e") -> str:
    return format(value, digits) if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def render_runs(line: dict, other: dict | None, base_flags: dict, shown: TokenText = token_text) -> list:
    """A prompt/compare step's configurations, tokens marked from the first one the other side lacks."""
    parts: list = []
    other_list = list((other or {}).get("runs", []))
    for index, run in enumerate(line.get("runs", [])):
        heading = Text(f"config {run_label(run)}", style="bold")  # B's model where it ran on its own
        heading.append(f"  ({_overrides(run, base_flags)})", style="dim")
        parts.append(heading)
        # the same position in the other recording (A and B may share a config name: a compare step's b_model)
        mirror = other_list[index] if index < len(other_list) and other_list[index]["config"] == run["config"] \
            else next((candidate for candidate in other_list if candidate["config"] == run["config"]), None)
        divergence = first_divergence(run["tokens"], mirror["tokens"]) if mirror is not None else None
        tokens = render_tokens(run["tokens"], divergence, shown)
        tokens.append(f"   {len(run['tokens'])} tokens after {run['prompt_tokens']} prompt tokens", style="dim")
        parts.append(tokens)
        if divergence is not None:
            token = run["tokens"][divergence] if divergence < len(run["tokens"]) else "end"
            parts.append(Text(f"first differing token: {divergence} ({token})", style="bold red"))
        parts.append(Text(f"decided: {decided_summary(run)}"))
        parts.append(Text(f"ran (counters): {executed_summary(run)}"))
        timings = run.get("timings", {})
        timing = Text(f"this side's generation {timings.get('wall_s', 0):.2f} s", style="dim")
        for family in ("moe", "attention"):
            if timings.get(f"{family}_us") is not None:
                timing.append(f" · its {family} layers {timings[f'{family}_us'] / 1e6:.2f} s", style="dim")
        timing.append("  (timings: shown, not compared)", style="dim italic")
        parts += [timing, Text("")]
    numbers = line.get("numbers") or {}
    if len(line.get("runs", [])) == 2 and numbers:
        divergence = numbers.get("first_divergence")
        where = "none" if divergence is None else f"at generated token {divergence}"
        parts.append(Text(f"A vs B: first divergence {where}, max logit rel err "
                          f"{_float(numbers.get('max_logit_rel_err'))}"))
    return parts


def render_bench(numbers: dict) -> list:
    table = Table(box=None, padding=(0, 1), header_style="bold")
    for column in ("test", "t/s (wall)", "TTFT ms", "state", "launches"):
        table.add_column(column, no_wrap=column != "launches")
    for row in numbers.get("rows", []):
        wall = row.get("tps_wall")
        rate = "admitting" if wall is None else f"{wall['mean']:.1f} ± {wall['std']:.1f}"
        arms = row.get("counters", {}).get("arms", {})
        launches = ", ".join(f"{name} {count}" for name, count in arms.items() if count)
        table.add_row(row["test"], Text(rate, style="dim"), Text(f"{row['ttft_ms']['mean']:.1f}", style="dim"),
                      row.get("state", ""), launches)
    return [table, Text("rates and TTFT are timings: shown, not compared", style="dim italic")]


def render_numbers(action: str, numbers: dict) -> list:
    if action == "curve":
        head = Text(f"top-{numbers.get('k')} of {numbers.get('experts')} experts, TILE_M={numbers.get('tile_m')}: "
                    f"m-tiles amortize from {numbers.get('min_tokens')} tokens")
        rows = [f"n={row['n']}: {row['pairs_per_woken']:.2f} pairs/woken, fill "
                f"{fill_text(row['pairs_per_woken'], numbers.get('tile_m') or 16)}" for row in numbers.get("rows", [])]
        return [head, Text("\n".join(rows))]
    if action == "check-attention":
        errors = numbers.get("errors") or {}
        lines = [Text(f"verdict: {numbers.get('verdict')}", style="bold"), Text(str(numbers.get("sentence", "")))]
        lines += [Text(f"fused vs {name}: {_float(value, '.3e')}") for name, value in errors.items()]
        lines.append(Text(f"control: {_float(numbers.get('control'), '.3e')}"))
        return lines
    if action == "bench":
        return render_bench(numbers)
    return [Text(", ".join(f"{key}={value}" for key, value in numbers.items()
                           if not isinstance(value, (dict, list))))]


def render_line(line: dict | None, other: dict | None, base_flags: dict, empty: str,
                shown: TokenText = token_text) -> Group:
    if line is None:
        return Group(Text(empty, style="dim"))
    parts: list = [Text(f"step {line['step']} · {line['action']} · the whole step {line.get('wall_s', 0):.2f} s",
                        style="dim")]
    if line.get("runs"):
        parts += render_runs(line, other, base_flags, shown)
    else:
        parts += render_numbers(line["action"], line.get("numbers") or {})
    if line.get("check"):
        check = line["check"]
        parts.append(Text(f"check ({check['expect']}): {'held' if check['held'] else 'FAILED'}: {check['detail']}",
                          style="green" if check["held"] else "bold red"))
    return Group(*parts)


class ReplayScreen(Screen):
    BINDINGS = [
        Binding("escape,f7", "app.pop_screen", "Back"),
        Binding("left,p", "move(-1)", "Previous step"),
        Binding("right,n", "move(1)", "Next step"),
        Binding("r", "rerun", "Re-run step"),
    ]

    def __init__(self, engine: Engine, session: Session, where: str, recorded: dict[int, dict], engine_lock,
                 start: int = 1) -> None:
        super().__init__()
        self.engine, self.session, self.where, self.recorded = engine, session, where, recorded
        self.engine_lock = engine_lock
        self.context = make_context(session, where, engine)
        self.index = min(max(start, 1), max(len(session.steps), 1))
        self.results: dict[int, dict] = {}
        self.errors: dict[int, str] = {}
        self.running: int | None = None
        self.queue = EngineQueue()

    @property
    def total(self) -> int:
        return len(self.session.steps)

    def compose(self) -> ComposeResult:
        yield Static("", id="replay-head")
        yield Static("", id="replay-overview")
        yield Static("", id="replay-verdict")
        with Horizontal(id="replay-sides"):
            with VerticalScroll(id="replay-recorded-side", classes="replay-side") as side:
                side.border_title = "recorded"
                yield Static("", id="replay-recorded")
            with VerticalScroll(id="replay-rerun-side", classes="replay-side") as side:
                side.border_title = "re-run now"
                yield Static("", id="replay-rerun")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self.set_interval(events.DRAIN_INTERVAL, self.drain)
        self.show()

    # -- state -----------------------------------------------------------------------------------------

    def verdict(self, index: int) -> str:
        if index in self.errors:
            return FAILED
        if index not in self.results:
            return RUNNING if self.running == index else PENDING
        if index not in self.recorded:
            return NO_RECORDING
        return DIFFERS if self.differences(index) else MATCH

    def differences(self, index: int) -> list[str]:
        if index not in self.results or index not in self.recorded:
            return []
        return diff_step(self.recorded[index], self.results[index])

    # -- running ---------------------------------------------------------------------------------------

    def _start(self, index: int) -> None:
        if self.running is not None or index in self.results or index in self.errors or not self.total:
            return
        self.running = index
        self.rerun_step(index, self.session.steps[index - 1])

    @work(thread=True, group="replay")
    def rerun_step(self, index: int, step: Step) -> None:
        """On the worker thread: only the queue is touched."""
        try:
            preflight_step(self.where, index, step, self.engine.config, self.engine.device)
            with self.engine_lock:
                result = run_step(self.context, index, step)
        except UserError as error:
            self.queue.put(events.ReplayStepEvent(index, None, str(error)))
            return
        self.queue.put(events.ReplayStepEvent(index, result, None))

    def drain(self) -> None:
        for message in self.queue.drain():
            self.post_message(message)

    def on_replay_step_finished(self, message: events.ReplayStepFinished) -> None:
        self.running = None
        if message.error is not None:
            self.errors[message.index] = message.error
        else:
            self.results[message.index] = message.result
        self.show()

    # -- keys ------------------------------------------------------------------------------------------

    def action_move(self, delta: int) -> None:
        if self.total:
            self.index = min(max(self.index + delta, 1), self.total)
            self.show()

    def action_rerun(self) -> None:
        if self.running is None:
            self.results.pop(self.index, None)
            self.errors.pop(self.index, None)
            self.show()

    # -- drawing ---------------------------------------------------------------------------------------

    def show(self) -> None:
        """Draw the step in view, and start its re-run if it has none yet."""
        head = self.query_one("#replay-head", Static)
        if not self.total:
            head.update(f"replay of {self.where}: {NO_STEPS} yet; run a prompt (or open a session, ctrl+o) "
                        f"and come back")
            return
        self._start(self.index)
        index, step = self.index, self.session.steps[self.index - 1]
        title = Text(f"replay of {self.session.name} ", style="bold")
        title.append(f"({self.where})  ", style="dim")
        title.append(f"step {index}/{self.total}: {describe_step(step)}")
        head.update(title)

        overview = Text("steps: ")
        for number in range(1, self.total + 1):
            mark, style = MARKS[self.verdict(number)]
            label = f"{number}{mark}"
            overview.append(f"[{label}]" if number == index else f" {label} ", style=style)
            overview.append(" ")
        overview.append("   ←/p previous · →/n next · r re-run", style="dim")
        self.query_one("#replay-overview", Static).update(overview)

        verdict = self.verdict(index)
        line = Text()
        if verdict == RUNNING:
            line.append(f"re-running step {index} …", style="bold")
        elif verdict == PENDING:
            line.append(f"waiting for step {self.running}'s re-run to finish", style="dim")
        elif verdict == FAILED:
            line.append(f"could not re-run step {index}: {self.errors[index]}", style="bold yellow")
        elif verdict == NO_RECORDING:
            line.append(f"step {index}: no recorded results (recorded before results were kept, or set aside on "
                        f"opening); the re-run is shown alone", style="yellow")
        elif verdict == MATCH:
            line.append(f"step {index}: match", style="bold green")
            line.append(" — tokens, counters and decisions as recorded (timings shown, not compared)")
        else:
            differences = self.differences(index)
            line.append(f"step {index}: differs", style="bold red")
            line.append(f" — {differences[0]}")
            if len(differences) > 1:
                line.append(f" (and {len(differences) - 1} more)")
        self.query_one("#replay-verdict", Static).update(line)
        self.query_one("#replay-verdict").set_class(verdict == DIFFERS, "-differs")

        base = dict(self.context.base.values)
        recorded, rerun = self.recorded.get(index), self.results.get(index)
        shown = tokenizer_token_text(self.engine.tokenizer)
        self.query_one("#replay-recorded", Static).update(
            render_line(recorded, rerun, base, "no recorded results for this step", shown))
        self.query_one("#replay-rerun", Static).update(
            render_line(rerun, recorded, base, "re-running …" if verdict == RUNNING else
                        self.errors.get(index, "waiting to re-run"), shown))
