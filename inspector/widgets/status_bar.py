"""The top line: which device (and whether it runs reference arms) and model, what runs now, the session
being recorded, and the model's details."""

from __future__ import annotations

from rich.console import Group
from rich.text import Text
from textual.widgets import Static

from engine.runtime import Engine


def device_text(engine: Engine) -> str:
    """`cpu: reference arms` where no kernel can run; else the GPU's name."""
    if engine.device.type == "cpu":
        return "cpu: reference arms"
    return f"{engine.device_label} ({engine.device})"


def model_details(engine: Engine) -> str:
    """The model's shape and weights, after its name (which the bar shows earlier)."""
    c = engine.config
    return (f"{c.n_layers} layers · top-{c.top_k} of {c.n_experts} experts · "
            f"head_dim {c.head_dim} · context {c.max_seq_len} · {engine.weights_source}")


NARROW = 140  # columns under which the bar names the session by its file name alone


class StatusBar(Static):
    """Model, device, and the state of the current generation."""

    def __init__(self, engine: Engine, id: str | None = None) -> None:  # noqa: A002 - Textual's name
        super().__init__(id=id)
        self.engine = engine
        self.activity = "idle"
        self.running = self.alert = False
        self.session = self.session_short = ""  # where actions are recorded; empty when nothing records

    def on_mount(self) -> None:
        self._render_line()

    def set_activity(self, activity: str, running: bool, alert: bool = False) -> None:
        """`alert`: the activity is a refusal or a failure whose reason must stay readable: the bar then holds it
        on lines of its own below the first (up to three), until the next activity."""
        self.activity, self.running, self.alert = activity, running, alert
        self.set_class(running, "-running")
        self.set_class(alert, "-alert")
        self._render_line()

    def set_session(self, text: str, short: str | None = None) -> None:
        """`text`: the session's path and state; `short`: the same with the file's name alone, shown where the bar is
        narrower than NARROW (a whole path would push the name off an 80-column line)."""
        self.session, self.session_short = text, short or text
        self._render_line()

    def on_resize(self) -> None:
        self._render_line()

    def _render_line(self) -> None:
        # Device and model name first, then what runs: on a narrow terminal the long parts (the activity, the
        # session's path, the model's details) are what gets cut, never which model on which device.
        # Under NARROW columns the banner goes and the separators narrow, so that an idle bar still names the
        # session's file at 80 columns (an autosaved session-YYYYMMDD-HHMMSS.toml included).
        narrow = self.size.width < NARROW
        bar = " │ " if narrow else "  │  "
        line = Text()
        if not narrow:
            line.append(" moe-inspector ", style="bold reverse")
            line.append("  ")
        line.append(device_text(self.engine), style="bold")
        line.append(bar)
        line.append(self.engine.config.name, style="bold")
        line.append(bar)
        if not self.alert:
            line.append(("● " if self.running else "○ ") + self.activity, style="bold" if self.running else "")
        else:
            line.append("○ see below", style="bold")
        if self.session:
            line.append(f"{bar}session {self.session_short if narrow else self.session}")
        line.append(f"{bar}{model_details(self.engine)}")
        line.no_wrap, line.overflow = True, "ellipsis"
        # an alert: the first line as ever, then the whole reason, wrapped
        self.update(Group(line, Text(self.activity, style="bold")) if self.alert else line)
