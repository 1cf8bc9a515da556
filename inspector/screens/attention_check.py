"""The attention check screen: does the fused arm compute the masked attention it should?

Runs `engine.compare.check_attention` on the current model's attention shape (the first layer
with a non-causal mask) in a thread worker, then shows the discrimination check, the fused
output's relative error against the masked, causal and unmasked references beside the 1-ULP
control, the per-component ablation, the worst position, the sink sweep and the verdict.
`engine.compare` is imported lazily: where this build lacks it, the screen says so.
"""

from __future__ import annotations

from typing import Any, Callable

from rich.table import Table
from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Input, Label, Select, Static

from engine.errors import UserError
from engine.flags import ResolvedFlags
from engine.runtime import Engine
from inspector import events
from inspector.events import EngineQueue

NOT_AVAILABLE = "attention check not available in this build (engine.compare is not installed yet)"
VERDICT_STYLE = {"masked": "bold green", "causal": "bold red", "unmasked": "bold red", "none": "bold yellow"}


def load_check() -> Callable[..., dict] | None:
    try:
        from engine.compare import check_attention  # noqa: PLC0415 - lands with the attention issue
    except ImportError:
        return None
    return check_attention


def attention_shape(engine: Engine) -> dict[str, Any]:
    """The model's attention shape; window and block from its first masked layer."""
    c = engine.config
    masked = next((mask for mask in c.layer_masks if mask.kind != "causal"), None)
    window = masked.window if masked is not None else 0
    block = masked.block if masked is not None else 0
    # Long enough that the window and several summary blocks matter; small on a CPU, where the
    # kernel runs under the Triton interpreter.
    wanted = 4 * max(window, block, 64) if engine.device.type == "cuda" else 2 * max(window, 32) + 16
    return {"seq_len": min(c.max_seq_len, wanted), "head_dim": c.head_dim, "heads": c.n_heads,
            "kv_heads": c.n_kv_heads, "window": window, "block": block}


def _number(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3e}"
    if isinstance(value, dict):
        return ", ".join(f"{key}={_number(item)}" for key, item in value.items())
    if isinstance(value, (list, tuple)):
        return ", ".join(_number(item) for item in value)
    return str(value)


def render_result(result: dict) -> Table:
    """check_attention's dict as one table; unknown extra keys are shown as they are."""
    table = Table(show_header=False, expand=True, box=None, padding=(0, 1))
    table.add_column(style="bold", no_wrap=True)
    table.add_column()
    verdict = str(result.get("verdict", "none"))
    table.add_row("verdict", Text(verdict, style=VERDICT_STYLE.get(verdict, "bold")))
    if result.get("sentence"):
        table.add_row("", str(result["sentence"]))
    table.add_row("discrimination", _number(result.get("discrimination")))
    control = result.get("control")
    table.add_row("1-ULP control", _number(control))
    errors = result.get("errors") or {}
    for reference in ("masked", "causal", "unmasked"):
        if reference in errors:
            value = errors[reference]
            ratio = (f"  ({value / control:.1f}× control)" if isinstance(value, (int, float))
                     and isinstance(control, (int, float)) and control > 0 else "")
            table.add_row(f"fused vs {reference} ref", f"{_number(value)}{ratio}")
    ablation = result.get("ablation")
    if isinstance(ablation, dict):
        for component, value in ablation.items():
            table.add_row(f"ablation: {component}", _number(value))
    elif ablation is not None:
        table.add_row("ablation", _number(ablation))
    table.add_row("worst position", _number(result.get("worst")))
    sinks = result.get("sink_sweep")
    if isinstance(sinks, dict):
        for sigma, value in sinks.items():
            table.add_row(f"sink σ={sigma}", _number(value))
    elif sinks is not None:
        table.add_row("sink sweep", _number(sinks))
    known = {"verdict", "sentence", "discrimination", "control", "errors", "ablation", "worst", "sink_sweep"}
    for key, value in result.items():
        if key not in known:
            table.add_row(key, _number(value))
    return table


class AttentionCheckScreen(Screen):
    BINDINGS = [
        Binding("escape,f3", "app.pop_screen", "Back"),
        Binding("f7", "run_check", "Run check"),
    ]

    def __init__(self, engine: Engine, flags: ResolvedFlags,
                 check: Callable[..., dict] | None | bool = True) -> None:
        """`check`: True loads engine.compare.check_attention lazily; tests pass a function or None."""
        super().__init__()
        self.engine, self.flags = engine, flags
        self.check = load_check() if check is True else check
        self.shape = attention_shape(engine)
        self.queue = EngineQueue()
        self.running = False
        self.result: dict | None = None

    def compose(self) -> ComposeResult:
        shape = self.shape
        yield Static(f"{self.engine.config.name} attention: head_dim {shape['head_dim']}, {shape['heads']} heads / "
                     f"{shape['kv_heads']} kv heads, window {shape['window']}, block {shape['block']}, sinks; "
                     f"{self.engine.device_label}", id="check-shape")
        with Horizontal(id="check-params"):
            yield Label("seq len")
            yield Input(str(shape["seq_len"]), id="check-seq-len", restrict=r"[0-9]*", compact=True)
            yield Label("pad")
            yield Input("3", id="check-pad", restrict=r"[0-9]*", compact=True)
            yield Label("mode")
            mode = "drop" if self.flags["fused_mask"] == "drop" else "honor"
            yield Select([("honor", "honor"), ("drop", "drop")], value=mode, allow_blank=False, compact=True,
                         id="check-mode")
        with VerticalScroll(id="check-result"):
            yield Static(NOT_AVAILABLE if self.check is None else "f7 (or Enter in a box) runs the check",
                         id="check-output")
        yield Footer()

    def on_mount(self) -> None:
        self.set_interval(events.DRAIN_INTERVAL, self.drain)

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        if action == "run_check":
            return None if self.check is None or self.running else True
        return True

    def parameters(self) -> dict[str, Any]:
        def whole(widget_id: str, minimum: int) -> int:
            text = self.query_one(widget_id, Input).value.strip()
            if not text.isdigit() or int(text) < minimum:
                raise UserError(f"{widget_id.removeprefix('#check-')} {text!r}: give a whole number >= {minimum}")
            return int(text)

        return {**self.shape, "seq_len": whole("#check-seq-len", 1), "pad": whole("#check-pad", 0),
                "mode": self.query_one("#check-mode", Select).value, "device": self.engine.device,
                "dtype": self.engine.dtype, "seed": self.engine.seed}

    def action_run_check(self) -> None:
        output = self.query_one("#check-output", Static)
        if self.check is None:
            output.update(NOT_AVAILABLE)
            return
        if self.running:
            return
        try:
            parameters = self.parameters()
        except UserError as error:
            output.update(f"refused: {error}")
            return
        self.running = True
        self.refresh_bindings()
        output.update(f"running check_attention(seq_len={parameters['seq_len']}, mode={parameters['mode']}, "
                      f"pad={parameters['pad']}) …")
        self.app.record_action({"action": "check-attention",
                                **{key: value for key, value in parameters.items() if key not in ("device", "dtype")},
                                "device": str(parameters["device"]), "dtype": str(parameters["dtype"])})
        self.run_check(parameters)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.action_run_check()

    @work(thread=True, exclusive=True, group="attention-check")
    def run_check(self, parameters: dict[str, Any]) -> None:
        """On the worker thread: only the queue is touched."""
        try:
            result = self.check(**parameters)
        except UserError as error:
            self.queue.put(events.CheckDoneEvent(None, str(error)))
            return
        self.queue.put(events.CheckDoneEvent(result, None))

    def drain(self) -> None:
        for message in self.queue.drain():
            self.post_message(message)

    def on_attention_check_finished(self, message: events.AttentionCheckFinished) -> None:
        self.running = False
        self.refresh_bindings()
        output = self.query_one("#check-output", Static)
        if message.error is not None:
            output.update(f"check refused: {message.error}")
            return
        self.result = message.result
        output.update(render_result(message.result))
