"""The attention check screen: does the fused arm compute the attention the loaded model runs?

Which check runs follows the model's attention (`check_kind`), reusing what `moe-inspector check-attention`
does for that configuration:
    sinks   learned sinks and a composite-masked layer: `engine.compare.check_attention` at the model's shape
            (head_dim, heads, kv heads, the window and block of its first masked layer); the discrimination
            check, the fused output's relative error against the masked, causal and unmasked references beside
            the 1-ULP control, the per-component ablation, the worst position, the sink sweep and the verdict
    mla     latent attention the fused MLA kernel takes: `engine.compare_mla.check_mla` (`check-attention --mla`)
            at the model's latent shape (kv_lora_rank, RoPE, no-RoPE and value dims), shown as the CLI prints it
    decode  plain causal or sliding-window layers (Qwen3-MoE, Mixtral, OLMoE, gpt-oss's window layers), with or
            without sinks: `engine.compare_decode.check_decode` (`check-attention --decode`), the split-KV decode
            kernel the decode step runs over a cache with stale entries, at the model's heads, kv heads, head_dim,
            window and sinks; the cache capacity and the batch are editable; shown as the CLI prints it
Any other attention (a composite mask without sinks, a head_dim no fused kernel takes, a latent shape the MLA
kernel declines) has no such check: the screen says so in one line and runs nothing.
The check runs in a thread worker; `engine.compare` is imported lazily: where a build lacks it, the screen says
so instead of failing. Its sizes are checked against this machine's memory before it starts (as the command's
are). It holds the app's engine lock while it runs, so it never runs beside a generation, a replayed step or a
bench, nor beside a check left running: the Triton interpreter cannot run two kernels at once. Leaving the
screen stops it after its current part (a reference or one kernel call: the interpreter cannot be interrupted
inside one), unrecorded.

On a CPU the kernels run under the Triton interpreter, so the default sizes are cut to run in about ten
seconds; every size is editable.
"""

from __future__ import annotations

from typing import Any, Callable

import threading
import time

import torch
from rich.console import Group
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
from engine.triton_support import missing_message, triton_installed
from inspector import attention_kind, events
from inspector.attention_kind import DECODE, MLA, SINKS
from inspector.events import EngineQueue

NOT_AVAILABLE = "attention check not available in this build (engine.compare is missing)"
VERDICT_STYLE = {"masked": "bold green", "causal": "bold red", "unmasked": "bold red", "none": "bold yellow"}
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
SIZES = ("seq_len", "window", "block", "pad")


MLA_SIZES = ("seq_len", "heads")
DECODE_SIZES = ("seq_len", "batch")


class CheckCancelled(Exception):
    """The screen was left: the check stops after its current part."""


class CheckProgress:
    """The engine check's progress object: each finished part becomes a note on the queue; once the screen is
    left, the next part raises CheckCancelled."""

    def __init__(self, queue: EngineQueue, cancel: threading.Event) -> None:
        self.queue, self.cancel = queue, cancel

    def advance(self, steps: int = 1, note: str = "") -> None:
        if self.cancel.is_set():
            raise CheckCancelled()
        self.queue.put(events.CheckProgressEvent(note))


def check_request(kind: str | None, parameters: dict[str, Any], where: str = "the attention check") -> None:
    """The check's memory at these sizes against this machine's, before anything is allocated: the bounds
    `check-attention` applies (UserError naming both sizes)."""
    p, device = parameters, parameters["device"]
    if kind == MLA:
        from engine.compare_mla import check_request as mla_request

        mla_request(p["seq_len"], p["heads"], p["kv_lora_rank"], p["rope_dim"], device, where, p["nope_dim"],
                    p["v_dim"])
    elif kind == DECODE:
        from engine.compare_decode import check_request as decode_request

        decode_request(p["seq_len"], p["batch"], p["heads"], p["kv_heads"], p["head_dim"], device, where)
    else:
        from engine.limits import check_attention_request

        check_attention_request(p["seq_len"], p["heads"], p["kv_heads"], p["head_dim"], device, where)


def load_check(kind: str | None = SINKS) -> Callable[..., dict] | None:
    """The engine's check for `kind` (`check_kind`), None where this build lacks it."""
    try:
        if kind == MLA:
            from engine.compare_mla import check_mla

            return check_mla
        if kind == DECODE:
            from engine.compare_decode import check_decode

            return check_decode
        from engine.compare import check_attention
    except ImportError:
        return None
    return check_attention


def attention_shape(engine: Engine) -> dict[str, Any]:
    """The model's attention shape, and sizes the check can run at on this engine's device."""
    return attention_kind.attention_shape(engine.config, engine.device.type == "cuda")


def model_attention(engine: Engine) -> str:
    return attention_kind.model_attention(engine.config)


def check_kind(engine: Engine) -> str | None:
    """The check that matches the attention the model runs (inspector.attention_kind.check_kind)."""
    return attention_kind.check_kind(engine.config)


def why_not_this_model(engine: Engine) -> str | None:
    """Why no check matches the model's own attention, in one line (None: one does)."""
    return attention_kind.why_not(engine.config)


def _float(value: Any) -> str:
    return f"{value:.3e}" if isinstance(value, float) else str(value)


def _times(value: Any, control: Any) -> str:
    if isinstance(value, (int, float)) and isinstance(control, (int, float)) and control > 0:
        return f"{value / control:.3g}×"
    return ""


def _table(*columns: str) -> Table:
    table = Table(show_header=bool(columns[0]), box=None, padding=(0, 2), expand=False, header_style="bold")
    for column in columns:
        table.add_column(column, no_wrap=True)
    return table


def _generic(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{key}={_generic(item)}" for key, item in value.items())
    if isinstance(value, (list, tuple)):
        return "; ".join(_generic(item) for item in value)
    return _float(value)


def render_result(result: dict) -> Group:
    """check_attention's dict, section by section; unknown shapes are shown as they are."""
    parts: list = []
    verdict = str(result.get("verdict", "none"))
    headline = Text("verdict: ", style="bold")
    headline.append(verdict, style=VERDICT_STYLE.get(verdict, "bold"))
    if "ok" in result:
        headline.append("   (check " + ("passed" if result["ok"] else "FAILED") + ")",
                        style="green" if result["ok"] else "bold red")
    parts += [headline, Text(str(result.get("sentence", ""))), Text("")]
    control = result.get("control")

    discrimination = result.get("discrimination")
    if isinstance(discrimination, dict):
        line = Text("discrimination: ", style="bold")
        line.append(f"masked vs causal {_float(discrimination.get('masked_vs_causal'))}, masked vs unmasked "
                    f"{_float(discrimination.get('masked_vs_unmasked'))}, {_float(discrimination.get('ratio'))}× "
                    f"the control (needs > {_float(discrimination.get('threshold'))}×): ")
        fires = discrimination.get("fires")
        line.append("the mask discriminates" if fires else "the mask does NOT discriminate here",
                    style="green" if fires else "bold yellow")
        parts.append(line)
    elif discrimination is not None:
        parts.append(Text(f"discrimination: {_generic(discrimination)}"))
    parts.append(Text(f"1-ULP control: {_float(control)}", style="bold"))

    errors = result.get("errors") or {}
    table = _table("fused vs", "relative error", "× control")
    for reference in ("masked", "causal", "unmasked"):
        if reference in errors:
            style = "bold" if reference == verdict else ""
            table.add_row(f"{reference} reference", _float(errors[reference]), _times(errors[reference], control),
                          style=style)
    parts += [Text(""), table]

    ablation = result.get("ablation")
    if isinstance(ablation, dict):
        table = _table("ablation (mask part off)", "reference moves", "fused vs it")
        for component, value in ablation.items():
            if isinstance(value, dict):
                table.add_row(component, _float(value.get("effect")), _float(value.get("fused")))
        parts += [Text(""), table]
        if "nearest" in ablation:
            parts.append(Text(f"of these ablated references the fused output is nearest the one with "
                              f"{ablation['nearest']} (the verdict above compares the whole references)"))
    elif ablation is not None:
        parts.append(Text(f"ablation: {_generic(ablation)}"))

    worst = result.get("worst")
    if isinstance(worst, dict):
        line = Text("\nworst position: ", style="bold")
        line.append(", ".join(WORST_WORDS.get(key, key) + " " + _worst_value(key, value)
                              for key, value in worst.items() if key != "why_masked_differs"))
        if worst.get("why_masked_differs"):
            line.append(f"\n  {worst['why_masked_differs']}")
        parts.append(line)

    sinks = result.get("sink_sweep")
    if isinstance(sinks, list) and all(isinstance(row, dict) for row in sinks):
        table = _table("sink σ", "fused vs masked", "× control", "ok")
        for row in sinks:
            ok = row.get("ok")
            table.add_row(str(row.get("sink")), _float(row.get("error")), _times(row.get("error"), row.get("control")),
                          Text("yes" if ok else "NO", style="green" if ok else "bold red"))
        parts += [Text(""), table]
    elif sinks is not None:
        parts.append(Text(f"sink sweep: {_generic(sinks)}"))

    if isinstance(result.get("config"), dict):
        parts.append(Text(f"\nran: {_generic(result['config'])}", style="dim"))
    return Group(*parts)


WORST_WORDS = {"row_error": "row error (fused vs masked)", "compared_with": "the key's visibility compared with the",
               "visible_in_masked": "key visible under the mask:", "visible_in_causal": "visible causally:",
               "weight_in_causal": "its causal attention weight"}


def _worst_value(key: str, value) -> str:
    """A worst-position field in words: yes/no for a flag, 'reference' after a reference's name."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if key == "compared_with":
        return f"{value} reference"
    return _float(value)


def render_decode_result(result: dict) -> Text:
    """check_decode's dict as `check-attention --decode` prints it, under its verdict and sentence (what a screen of
    24 lines shows first), the verdict styled."""
    from inspector.commands.check_decode import format_decode_result

    style = "bold green" if result.get("ok") else "bold red"
    shown = Text("verdict: ", style="bold")
    shown.append(str(result.get("verdict")), style=style)
    shown.append("   (check " + ("passed" if result.get("ok") else "FAILED") + ")", style=style)
    shown.append(f"\n{result.get('sentence', '')}\n\n")
    shown.append(format_decode_result(result).rsplit("\n\nverdict: ", 1)[0])  # said above already
    return shown


def render_mla_result(result: dict) -> Text:
    """check_mla's dict as `check-attention --mla` prints it, the verdict styled."""
    from inspector.commands.check_attention import format_mla_result

    shown = Text(format_mla_result(result))
    shown.highlight_words([f"verdict: {result.get('verdict')}"],
                          "bold green" if result.get("ok") else "bold red")
    return shown


class AttentionCheckScreen(Screen):
    BINDINGS = [
        Binding("escape,f3", "leave", "Back"),
        Binding("f7", "run_check", "Run check"),
    ]

    def __init__(self, engine: Engine, flags: ResolvedFlags,
                 check: Callable[..., dict] | None | bool = True) -> None:
        """`check`: True loads the model's check (`check_kind`) lazily; tests pass a function or None."""
        super().__init__()
        self.engine, self.flags = engine, flags
        self.kind = check_kind(engine)  # SINKS, MLA, or None: no check matches the model's attention
        self.check = load_check(self.kind) if check is True else check
        # Why the check cannot run here, said in place of its result (None: it can).
        self.unavailable: str | None = why_not_this_model(engine)
        if self.unavailable is None and self.check is None:
            self.unavailable = NOT_AVAILABLE
        elif self.unavailable is None and check is True and not triton_installed():
            self.unavailable = missing_message("the attention check")
        self.shape = attention_shape(engine)
        self.sizes = {MLA: MLA_SIZES, SINKS: SIZES, DECODE: DECODE_SIZES}.get(self.kind, ())
        self.queue = EngineQueue()
        self.cancel = threading.Event()
        self.running = False
        self.started = 0.0  # perf_counter when the running check was asked for
        self.running_line = ""  # what the output says while it runs: the check and its arguments
        self.result: dict | None = None
        self._action: dict | None = None  # the session's record of the running check, saved when it finishes

    def compose(self) -> ComposeResult:
        shape, c = self.shape, self.engine.config
        cpu = self.engine.device.type != "cuda"
        if c.latent_attention is not None:
            what = (f"{model_attention(self.engine)}, {c.n_heads} heads, latent {shape['kv_lora_rank']} + RoPE "
                    f"{shape['rope_dim']}, no-RoPE {shape['nope_dim']}, value {shape['v_dim']} dims")
        else:
            what = (f"head_dim {shape['head_dim']}, {shape['heads']} heads / {shape['kv_heads']} kv heads, "
                    f"{model_attention(self.engine)}")
        yield Static(f"{c.name} attention: {what}; {self.engine.device_label}"
                     + ("; the fused kernel runs under the Triton interpreter, so the sizes below are cut to run "
                        "in ~10 s" if cpu and self.sizes else ""), id="check-shape")
        with Horizontal(id="check-params"):
            for name in self.sizes:
                yield Label(name.replace("_", " "))
                yield Input(str(shape[name]), id=f"check-{name.replace('_', '-')}", restrict=r"[0-9]*",
                            compact=True)
            if self.sizes:
                yield Label("mode")
                mode = "drop" if self.flags["fused_mask"] == "drop" else "honor"
                yield Select([("honor", "honor"), ("drop", "drop")], value=mode, allow_blank=False, compact=True,
                             id="check-mode")
        with VerticalScroll(id="check-result"):
            yield Static(self.unavailable or "f7 (or Enter in a box) runs the check", id="check-output")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self.query_one("#check-params").display = bool(self.sizes)  # no sizes of a check that does not apply
        self.set_interval(events.DRAIN_INTERVAL, self.drain)

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        if action == "run_check":  # hidden where no check applies, dimmed while one runs
            return False if self.unavailable else None if self.running else True
        return True

    def parameters(self) -> dict[str, Any]:
        def whole(name: str, minimum: int) -> int:
            text = self.query_one(f"#check-{name.replace('_', '-')}", Input).value.strip()
            if not text.isdigit() or int(text) < minimum:
                raise UserError(f"{name.replace('_', ' ')} {text!r}: give a whole number >= {minimum}")
            return int(text)

        common = {"mode": self.query_one("#check-mode", Select).value, "device": self.engine.device.type,
                  "dtype": self.engine.dtype, "seed": self.engine.seed}
        if self.kind == MLA:  # engine.compare_mla.check_mla's arguments
            from engine.compare_mla import latent_dims

            return {"seq_len": whole("seq_len", 2), "heads": whole("heads", 1),
                    **latent_dims(self.engine.config.latent_attention), **common}
        if self.kind == DECODE:  # engine.compare_decode.check_decode's arguments: the model's dims, editable sizes
            dims = {name: self.shape[name] for name in ("head_dim", "heads", "kv_heads", "window", "sinks")}
            return {"seq_len": whole("seq_len", 2), "batch": whole("batch", 2), **dims, **common}
        return {"seq_len": whole("seq_len", 1), "head_dim": self.shape["head_dim"], "heads": self.shape["heads"],
                "kv_heads": self.shape["kv_heads"], "window": whole("window", 1), "block": whole("block", 1),
                "pad": whole("pad", 0), **common}

    def action_run_check(self) -> None:
        output = self.query_one("#check-output", Static)
        if self.unavailable:
            output.update(self.unavailable)
            return
        if self.running:
            return
        try:
            parameters = self.parameters()
            check_request(self.kind, parameters)
        except UserError as error:
            output.update(f"refused: {error}")
            return
        self.running = True
        self.started = time.perf_counter()
        self.cancel.clear()
        self.refresh_bindings()
        shown = {**parameters, "dtype": DTYPE_NAMES.get(parameters["dtype"], parameters["dtype"])}
        name = {MLA: "check_mla", DECODE: "check_decode"}.get(self.kind, "check_attention")
        self.running_line = f"running {name}({', '.join(f'{k}={v}' for k, v in shown.items())})"
        output.update(f"{self.running_line} …")
        # Plain values for sessions: "torch.float32" (the session format reads float32); the latent check is the
        # step's mla = true, the decode check its decode = true, with the model's dims written out
        kind = {MLA: {"mla": True}, DECODE: {"decode": True}}.get(self.kind, {})
        self._action = {"action": "check-attention", **kind, **parameters, "dtype": str(parameters["dtype"])}
        self.run_check(parameters)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.action_run_check()

    @work(thread=True, exclusive=True, group="attention-check")
    def run_check(self, parameters: dict[str, Any]) -> None:
        """On the worker thread: only the queue is touched. Waits for the app's engine lock (a generation, a
        replayed step, a bench or a check left running finishes first), giving up when the screen is left."""
        lock = getattr(self.app, "engine_lock", None) or threading.Lock()
        if not lock.acquire(blocking=False):
            self.queue.put(events.CheckProgressEvent("waiting for the run before it to finish"))
            while not lock.acquire(timeout=0.1):
                if self.cancel.is_set():
                    self.queue.put(events.CheckDoneEvent(None, None, cancelled=True))
                    return
        try:
            started = time.perf_counter()
            result = self.check(**parameters, progress=CheckProgress(self.queue, self.cancel))
        except CheckCancelled:
            self.queue.put(events.CheckDoneEvent(None, None, cancelled=True))
            return
        except UserError as error:
            self.queue.put(events.CheckDoneEvent(None, str(error)))
            return
        finally:
            lock.release()
        self.queue.put(events.CheckDoneEvent(result, None, time.perf_counter() - started))

    def cancel_work(self) -> None:
        """Stop a running check after its current part (the app calls this on quit)."""
        self.cancel.set()

    def action_leave(self) -> None:
        if self.running:
            self.cancel_work()
            self.app.notify(f"attention check stopping after its current part ({time.perf_counter() - self.started:.0f} "
                            f"s in; the interpreter cannot stop inside a kernel call); not recorded",
                            severity="warning")
        self.app.pop_screen()

    def drain(self) -> None:
        for message in self.queue.drain():
            self.post_message(message)

    def on_attention_check_progressed(self, message: events.AttentionCheckProgressed) -> None:
        if self.running:
            self.query_one("#check-output", Static).update(
                f"{self.running_line} … {message.note} ({time.perf_counter() - self.started:.0f} s)")

    def on_attention_check_finished(self, message: events.AttentionCheckFinished) -> None:
        self.running = False
        self.refresh_bindings()
        output = self.query_one("#check-output", Static)
        if message.cancelled:
            output.update("check stopped when the screen was left; f7 runs it again")
            self._action = None
            return
        if message.error is not None:
            output.update(f"check refused: {message.error}")
            return
        self.result = message.result
        render = {MLA: render_mla_result, DECODE: render_decode_result}.get(self.kind, render_result)
        output.update(render(message.result))
        if self._action is not None:  # recorded with what the user saw, as the step's results
            self.app.record_action(self._action, {"result": message.result, "wall_s": message.wall_s})
            self._action = None
