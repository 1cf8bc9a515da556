"""The routing screen (f10): where a run's tokens went, per MoE layer and expert.

A layer x expert heatmap of load (tokens routed to each expert) over the last step, a window of the last N steps
or the whole run, and per layer the imbalance along the expert axis (max/mean load, coefficient of variation),
the woken experts per step against the uniform prediction and the hottest experts by name (engine.routing_stats:
the numbers `moe-inspector routing FILE` prints). The routing is the last run's, configuration A's, when it
was recorded (the flag record_routing), or a routing file opened from the path box; ctrl+r writes the run's
routing to the path in the box. It runs nothing on the engine.
"""

from __future__ import annotations

from pathlib import Path

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Input, Static

from engine import routing_stats
from engine.errors import UserError

def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


COLUMNS = ("layer", "tokens", "max/mean", "cv", "woken/step", "uniform", "woken", "uniform", "hottest (share)")
# Cell colours from cold to hot; a zero-load expert is a dim dot
RAMP = ("#1d3557", "#2a5d8f", "#3a86a8", "#52b69a", "#99d98c", "#e9c46a", "#f4a261", "#e76f51", "#d62828")
DEFAULT_WINDOW = 16
NOT_RECORDED = ("no routing recorded for the last run: set record_routing = on (flags panel, or ctrl+p \"Set "
                "record_routing = on\") and run a prompt, or open a routing file above")


def heat_row(load, columns: int, top: float) -> Text:
    """One layer's cells: each a block coloured by its bin's load relative to `top`, a dot where it is zero."""
    binned = routing_stats.bin_load(load, columns)
    text = Text()
    for value in binned:
        if value <= 0 or top <= 0:
            text.append("·", style="dim")
        else:
            text.append("█", style=RAMP[min(len(RAMP) - 1, int(value / top * (len(RAMP) - 1) + 0.5))])
    return text


def heatmap(summary: routing_stats.Summary, columns: int) -> Text:
    """The whole map: a ruler of expert numbers, then a row per MoE layer, then the colour key."""
    columns = max(8, min(columns, summary.experts))
    per_cell = routing_stats.experts_per_cell(summary.experts, columns)
    cells = min(columns, summary.experts)
    top = max((float(routing_stats.bin_load(stats.load, cells).max(initial=0)) for stats in summary.layers),
              default=0.0)
    ruler = [" "] * cells
    for cell in range(0, cells, 8):
        label = str(int(round(cell * per_cell)))
        for offset, char in enumerate(label):
            if cell + offset < cells:
                ruler[cell + offset] = char
    out = Text("expert " + "".join(ruler) + "\n", style="dim")
    for stats in summary.layers:
        out.append(f"L{stats.layer:<5} ")
        out.append_text(heat_row(stats.load, cells, top))
        out.append("\n")
    out.append(f"{'one expert' if per_cell == 1 else f'{per_cell:.1f} experts (their max)'} per cell; "
               f"cold ", style="dim")
    for colour in RAMP:
        out.append("█", style=colour)
    out.append(f" hot = {_count(round(top), 'token')}; · none", style="dim")
    return out


class RoutingScreen(Screen):
    DEFAULT_CSS = """
    #routing-path-row { height: auto; max-height: 10; }
    #routing-path { width: 2fr; }
    #routing-status { width: 1fr; padding-left: 1; height: auto; }
    #routing-scope { height: 1; }
    #routing-map { height: auto; max-height: 2fr; overflow-y: auto; }
    #routing-layers { height: 1fr; }
    """
    BINDINGS = [Binding("escape,f10", "app.pop_screen", "Back"),
                Binding("l", "scope('last')", "Last step"),
                Binding("w", "scope('window')", "Window"),
                Binding("a", "scope('run')", "Whole run"),
                Binding("plus,equals_sign", "window(2)", "Window ×2", show=False),
                Binding("minus", "window(0.5)", "Window ÷2", show=False),
                Binding("ctrl+r", "export", "Write file", show=False),
                Binding("ctrl+l", "focus_path", "Routing file", show=False)]

    def __init__(self, recording=None, source: str = "") -> None:
        super().__init__()
        self.recording = recording  # the last run's (engine.routing_record.RoutingRecording), or a file's
        self.run_recording = recording
        self.source = source or ("the last run (A)" if recording is not None else "")
        self.scope = routing_stats.RUN
        self.window = DEFAULT_WINDOW
        self.summary: routing_stats.Summary | None = None  # what is shown (tests read it)

    def compose(self) -> ComposeResult:
        with Horizontal(id="routing-path-row"):
            yield Input("", placeholder="routing file (.safetensors): Enter opens it; ctrl+r writes the run's there",
                        compact=True, id="routing-path")
            yield Static("", id="routing-status", markup=False)
        yield Static("", id="routing-scope")
        yield Static("", id="routing-map")
        yield DataTable(id="routing-layers", cursor_type="row", zebra_stripes=True)
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#routing-layers", DataTable).add_columns(*COLUMNS)
        if self.recording is None:
            self.query_one("#routing-status", Static).update(NOT_RECORDED)
            self.query_one("#routing-path", Input).focus()
        else:
            self.show()
            self.query_one("#routing-layers", DataTable).focus()

    def on_resize(self) -> None:
        if self.recording is not None:
            self.show()

    # -- actions ----------------------------------------------------------------------------------------

    def action_focus_path(self) -> None:
        self.query_one("#routing-path", Input).focus()

    def action_scope(self, kind: str) -> None:
        self.scope = {"last": routing_stats.LAST, "run": routing_stats.RUN}.get(
            kind, routing_stats.Scope("window", self.window))
        self.show()

    def action_window(self, factor: float) -> None:
        self.window = max(1, min(1 << 20, int(self.window * factor)))
        if self.scope.kind == "window":
            self.scope = routing_stats.Scope("window", self.window)
        self.show()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.open(event.value.strip())

    def open(self, path: str) -> None:
        """A routing file instead of the run's; a bad one is refused in place (the shown routing stays)."""
        from engine import routing_file

        status = self.query_one("#routing-status", Static)
        if not path:
            status.update("give a routing file's path (generate --record-routing FILE writes one)")
            return
        try:
            recording = routing_file.load(Path(path).expanduser())
        except UserError as error:
            status.update(f"refused: {error}")
            return
        self.recording, self.source = recording, path
        self.show()
        self.query_one("#routing-layers", DataTable).focus()

    def action_export(self) -> None:
        """Write the last run's routing to the path in the box (a new file: an existing one is not replaced)."""
        from engine import routing_file

        status = self.query_one("#routing-status", Static)
        path = self.query_one("#routing-path", Input).value.strip()
        if self.run_recording is None:
            status.update("refused: " + NOT_RECORDED)
            return
        if not path:
            status.update("refused: type a new file's path in the box first, e.g. routing.safetensors")
            self.action_focus_path()
            return
        where = Path(path).expanduser()
        if where.exists():
            status.update(f"refused: {path} exists (Enter opens it); give a new file's name")
            return
        try:
            routing_file.save(self.run_recording, where)
        except UserError as error:
            status.update(f"refused: {error}")
            return
        status.update(f"wrote {path} ({where.stat().st_size / 1024:.1f} KiB)")

    # -- drawing ----------------------------------------------------------------------------------------

    def show(self) -> None:
        recording = self.recording
        summary = self.summary = routing_stats.summarize(recording, self.scope)
        header = recording.header
        self.query_one("#routing-status", Static).update(
            f"{self.source}: {header.get('model', '?')}, {_count(recording.n_steps, 'step')}, {_count(recording.tokens, 'token')}"
            + (f"; cut at the cap at step {recording.truncated.get('at_step')}" if recording.truncated else ""))
        scope = (f"{self.scope.describe()}: steps {summary.first_step}..{summary.last_step}, {_count(summary.tokens, 'token')}, "
                 f"top-{summary.top_k} of {summary.experts}" if summary.layers else f"{self.scope.describe()}: "
                 f"nothing recorded")
        self.query_one("#routing-scope", Static).update(
            f"{scope}   ·  l last step  w window ({self.window} steps, +/-)  a whole run")
        width = max(16, (self.size.width or 80) - 10)
        self.query_one("#routing-map", Static).update(heatmap(summary, width) if summary.layers else Text(""))
        table = self.query_one("#routing-layers", DataTable)
        table.clear()
        for stats in summary.layers:
            table.add_row(str(stats.layer), str(stats.tokens), f"{stats.max_over_mean:.2f}", f"{stats.cv:.2f}",
                          f"{stats.woken_per_step:.1f}", f"{stats.woken_per_step_predicted:.1f}", str(stats.woken),
                          f"{stats.woken_predicted:.1f}",
                          ", ".join(f"{expert} ({100 * share:.1f}%)" for expert, _, share in stats.hottest),
                          key=str(stats.layer))
