"""The tile-fill screen: is the grouped GEMM's m-tile worth filling at this width?

Top plot: predicted pairs per woken expert against n tokens (uniform routing) for the current
model's k and E, log-x; the TILE_M line (tiles amortize above it); the current policy's boundary
(where it starts picking grouped, after decode_floor / moe_max_tokens); and the points observed
in the last run (n_tokens, observed pairs per woken expert), A and B.
Bottom plot, only where a sweep file is given: µs per arm against n, with the crossover marked.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.screen import Screen
from textual.widgets import Footer, Input, Static
from textual_plotext import PlotextPlot

from engine import calibration, dispatch
from engine.errors import UserError
from engine.flags import ResolvedFlags
from engine.runtime import Engine


def curve_tokens(limit: int) -> list[int]:
    """Quarter-octave steps from 1 to `limit`: even spacing on the log-x axis."""
    return sorted({max(1, round(2 ** (step / 4))) for step in range(0, int(4 * math.log2(limit)) + 1)})


def log2(value: float) -> float:
    """Where a positive value sits on a log axis drawn linear in log2. The plots transform their data themselves:
    plotext applies its own log scale to the figure's data in place on every rebuild, so a resized plot took the
    log of a log (a math domain error at the first resize)."""
    return math.log2(value)


def powers_of_two(plt, axis: str, limit: float) -> None:
    """Ticks at log2 positions 0, 1, 2, ... labelled 1, 2, 4, ... on an axis drawn in log2 (`log2`)."""
    powers = list(range(0, math.ceil(math.log2(max(limit, 2))) + 1))
    (plt.xticks if axis == "x" else plt.yticks)(powers, [str(2 ** power) for power in powers])


def policy_boundary(engine: Engine, flags: ResolvedFlags) -> tuple[int | None, str]:
    """The smallest n at which the current flags pick the grouped arm, and why (None: never, by policy)."""
    c = engine.config
    crossover = calibration.find_crossover(engine.device_label, c.top_k, c.n_experts, c.hidden, c.intermediate,
                                           flags["tile_m"])

    def decide(n: int) -> dispatch.Decision:
        return dispatch.decide(dispatch.GateInputs(
            n_tokens=n, k=c.top_k, n_experts=c.n_experts, tile_m=flags["tile_m"], policy=flags["moe_gate"],
            decode_floor=flags["decode_floor"], moe_max_tokens=flags["moe_max_tokens"],
            grouped_variant=flags["grouped_variant"], measured_crossover=crossover))

    boundary = decide(1).boundary
    if boundary is None:
        return None, f"moe_gate={flags['moe_gate']} forces one arm: no boundary"
    effective = max(boundary, flags["decode_floor"] + 1, flags["moe_max_tokens"] + 1)
    if decide(effective).arm != dispatch.GROUPED:  # a policy this screen does not understand: say so
        return None, f"moe_gate={flags['moe_gate']}: no grouped decision found at n={effective}"
    why = f"moe_gate={flags['moe_gate']} picks grouped from n={effective}"
    if effective != boundary:
        why += f" (policy boundary {boundary}, raised by decode_floor/moe_max_tokens)"
    return effective, why


# --------------------------------------------------------------------------------------------
# Sweep files (optional): µs per arm per token count
# --------------------------------------------------------------------------------------------

TOKEN_KEYS = ("n", "tokens", "n_tokens")
ARM_GROUP_KEYS = ("us", "arms", "times_us", "arm_us")


def load_sweep(path: str) -> dict:
    """{"rows": [(n, {arm: µs})], "crossover": int | None} from a sweep JSON.

    Accepts a list of rows or an object with `rows` / `results`; a row names its width as n,
    tokens or n_tokens and its timings either as a dict under us / arms / times_us or as keys
    ending in `_us`. The crossover is the file's `crossover` / `crossover_tokens` if it has one,
    else computed as the calibration does: the smallest n from which grouped beats GEMV at every
    larger measured width.
    """
    try:
        data = json.loads(Path(path).expanduser().read_text())
    except OSError as error:
        raise UserError(f"sweep file {path}: cannot read it ({error.strerror}); give the path of a sweep JSON") from None
    except ValueError as error:
        raise UserError(f"sweep file {path}: not JSON ({error})") from None
    rows = data if isinstance(data, list) else next(
        (data[key] for key in ("rows", "results") if isinstance(data, dict) and isinstance(data.get(key), list)), None)
    if rows is None:
        raise UserError(f"sweep file {path}: no list of rows (expected a list, or an object with 'rows')")
    parsed = []
    for row in rows:
        if not isinstance(row, dict):
            continue
        n = next((row[key] for key in TOKEN_KEYS if isinstance(row.get(key), int)), None)
        timings = next((row[key] for key in ARM_GROUP_KEYS if isinstance(row.get(key), dict)), None)
        if timings is None:
            timings = {key[:-3]: value for key, value in row.items() if key.endswith("_us")}
        timings = {arm: float(us) for arm, us in timings.items()
                   if isinstance(us, (int, float)) and math.isfinite(us) and us > 0}
        if n is not None and n > 0 and timings:
            parsed.append((n, timings))
    if not parsed:
        raise UserError(f"sweep file {path}: no row with a token count (n) and positive µs per arm")
    parsed.sort()
    crossover = data.get("crossover", data.get("crossover_tokens")) if isinstance(data, dict) else None
    if not isinstance(crossover, int):
        crossover = sweep_crossover(parsed)
    return {"rows": parsed, "crossover": crossover}


def sweep_crossover(rows: list[tuple[int, dict]]) -> int | None:
    def best(timings: dict, prefix: str) -> float | None:
        values = [us for arm, us in timings.items() if arm.startswith(prefix)]
        return min(values) if values else None

    crossover = None
    for n, timings in reversed(rows):
        gemv, grouped = best(timings, "gemv"), best(timings, "grouped")
        if gemv is None or grouped is None or grouped >= gemv:
            break
        crossover = n
    return crossover


class TileFillScreen(Screen):
    BINDINGS = [
        Binding("escape,f2", "app.pop_screen", "Back"),
        Binding("ctrl+l", "focus_sweep", "Sweep file", show=False),
    ]

    def __init__(self, engine: Engine, flags: ResolvedFlags, observations: list[tuple[int, float]],
                 sweep_path: str | None = None) -> None:
        super().__init__()
        self.engine, self.flags, self.observations = engine, flags, observations
        self.sweep_path = sweep_path
        self.sweep: dict | None = None
        c = engine.config
        self.k, self.experts, self.tile_m = c.top_k, c.n_experts, flags["tile_m"]
        self.min_tokens = dispatch.min_tokens(self.k, self.experts, self.tile_m)
        self.boundary, self.boundary_reason = policy_boundary(engine, flags)
        widest = max([4 * self.min_tokens, 256] + [n for n, _ in observations])
        self.limit = 2 ** math.ceil(math.log2(widest))

    def compose(self) -> ComposeResult:
        yield Static(self._summary(), id="tile-summary")
        with Horizontal(id="sweep-row"):
            yield Input(self.sweep_path or "", placeholder="sweep JSON (optional): path, then Enter", compact=True,
                        id="sweep-path")
            yield Static("", id="sweep-status", markup=False)
        yield PlotextPlot(id="fill-plot")
        yield PlotextPlot(id="sweep-plot")
        yield Footer(compact=True)

    def _summary(self) -> str:
        points = len(self.observations)
        return (f"{dispatch.routing_shape(self.engine.config).describe()}, TILE_M={self.tile_m}: m-tiles amortize "
                f"(pairs per woken expert ≥ TILE_M) from n={self.min_tokens} tokens under uniform routing. "
                f"{self.boundary_reason}. "
                + (f"{points} observed (n, pairs per woken expert) points from the last run."
                   if points else "No run yet: run a prompt to see observed points."))

    def on_mount(self) -> None:
        self.query_one("#sweep-path", Input).focus()  # the one thing to type here; also shows the footer's keys
        self.draw_fill()
        self.query_one("#sweep-plot").display = False
        if self.sweep_path:
            self.load(self.sweep_path)
        self.app.record_action({"action": "curve", "k": self.k, "experts": self.experts, "tile_m": self.tile_m,
                                "policy": self.flags["moe_gate"], "boundary": self.boundary,
                                "sweep": self.sweep_path})

    def draw_fill(self) -> None:
        plt = self.query_one("#fill-plot", PlotextPlot).plt
        plt.clear_figure()
        tokens = curve_tokens(self.limit)
        pairs = [dispatch.pairs_per_woken_expert(n, self.k, self.experts) for n in tokens]
        plt.title(f"pairs per woken expert vs n (top-{self.k} of {self.experts}, uniform routing; log-log)")
        powers_of_two(plt, "x", self.limit)
        powers_of_two(plt, "y", max(pairs))
        plt.plot([log2(n) for n in tokens], [log2(pair) for pair in pairs], label="predicted", marker="braille")
        plt.hline(log2(self.tile_m), "red")
        plt.text(f"TILE_M={self.tile_m}: tiles full above", log2(1.1), log2(self.tile_m * 1.25), color="red",
                 alignment="left")
        if self.boundary is not None and self.boundary <= self.limit:
            plt.vline(log2(self.boundary), "orange")
            plt.text(f"grouped from n={self.boundary}", log2(self.boundary), log2(max(pairs) / 2), color="orange")
        points = [(n, observed) for n, observed in self.observations if n > 0 and observed > 0]
        if points:
            plt.scatter([log2(n) for n, _ in points], [log2(observed) for _, observed in points],
                        label="observed (last run)", marker="x", color="green")
        # one label line naming both axes: plotext draws the y label on the x label's line, over it when narrow
        plt.xlabel("x: n tokens in the step · y: pairs per woken expert (both log)")

    def draw_sweep(self) -> None:
        plot = self.query_one("#sweep-plot", PlotextPlot)
        plot.display = True
        plt = plot.plt
        plt.clear_figure()
        rows, crossover = self.sweep["rows"], self.sweep["crossover"]
        arms = sorted({arm for _, timings in rows for arm in timings})
        plt.title("µs per arm vs n (sweep; log-x)")
        powers_of_two(plt, "x", max(n for n, _ in rows))
        for arm in arms:
            points = [(n, timings[arm]) for n, timings in rows if arm in timings and n > 0]
            plt.plot([log2(n) for n, _ in points], [us for _, us in points], label=arm, marker="braille")
        if crossover is not None:
            plt.vline(log2(crossover), "orange")
            plt.text(f"crossover {crossover}", log2(crossover), max(us for _, t in rows for us in t.values()) * 0.9,
                     color="orange")
        plt.xlabel("x: n tokens (log) · y: µs per MoE layer")

    def load(self, path: str) -> None:
        status = self.query_one("#sweep-status", Static)
        try:
            self.sweep = load_sweep(path)
        except UserError as error:
            status.update(f"refused: {error}")
            status.add_class("-refused")
            return
        self.sweep_path = path
        crossover = self.sweep["crossover"]
        status.update(f"{len(self.sweep['rows'])} widths; crossover "
                      + (f"at n={crossover}" if crossover is not None else "not found (grouped never wins to the end)"))
        status.remove_class("-refused")
        self.draw_sweep()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        if event.value.strip():
            self.load(event.value.strip())
            self.app.record_action({"action": "curve", "k": self.k, "experts": self.experts, "tile_m": self.tile_m,
                                    "policy": self.flags["moe_gate"], "boundary": self.boundary,
                                    "sweep": event.value.strip()})

    def action_focus_sweep(self) -> None:
        self.query_one("#sweep-path", Input).focus()
