"""One dispatch flag: its name, the widget that fits its kind, its effective value and source.

bool -> Switch; select -> Select (moe_gate also gets an input for `threshold:N`); int -> Input.
Every value the user gives goes through `engine.flags.parse_value`; a refused value leaves the
previous valid value in place and shows the parser's message (which names the allowed values)
under the widget until the next valid change.
"""

from __future__ import annotations

from typing import Any

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.widgets import Input, Label, Select, Static, Switch

from engine.errors import UserError
from engine.flags import GATE_NAMES, FlagSpec, format_value, parse_value

WHERE = "the flags panel"
THRESHOLD = "threshold"  # the Select's stand-in for every threshold:N


class FlagRow(Vertical):
    """A flag of configuration A, editable in place."""

    class Changed(Message):
        """The user gave a valid value (already parsed)."""

        def __init__(self, row: "FlagRow", name: str, value: Any) -> None:
            super().__init__()
            self.row, self.name, self.value = row, name, value

        @property
        def control(self) -> "FlagRow":
            return self.row

    class Refused(Message):
        def __init__(self, row: "FlagRow", name: str, text: str, message: str) -> None:
            super().__init__()
            self.row, self.name, self.text, self.message = row, name, text, message

        @property
        def control(self) -> "FlagRow":
            return self.row

    def __init__(self, spec: FlagSpec, value: Any, source: str) -> None:
        super().__init__(id=f"flag-{spec.name}", classes="flag-row")
        self.spec, self.value, self.source = spec, value, source
        self.refusal: str | None = None

    # -- composition ---------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        spec = self.spec
        with Horizontal(classes="flag-line"):
            label = Label(spec.name, classes="flag-name")
            label.tooltip = f"{spec.help}\nallowed: {spec.allowed}"
            yield label
            if spec.kind == "bool":
                yield Switch(bool(self.value), id=f"control-{spec.name}")
            elif spec.name == "moe_gate":
                options = [(name, name) for name in GATE_NAMES[:2]] + [("threshold:N", THRESHOLD)]
                options += [(name, name) for name in GATE_NAMES[2:]]
                yield Select(options, value=self._gate_choice(self.value), allow_blank=False, compact=True,
                             id=f"control-{spec.name}")
                yield Input(self._gate_threshold(self.value), placeholder="N", compact=True,
                            id="control-moe_gate-threshold", classes="threshold-input")
            elif spec.kind == "select":
                yield Select([(format_value(spec.name, choice), choice) for choice in spec.choices],
                             value=self.value, allow_blank=False, compact=True, id=f"control-{spec.name}")
            else:
                yield Input(str(self.value), compact=True, id=f"control-{spec.name}")
        yield Static(self._status_text(), classes="flag-status")

    @staticmethod
    def _gate_choice(value: str) -> str:
        return THRESHOLD if value.startswith(f"{THRESHOLD}:") else value

    @staticmethod
    def _gate_threshold(value: str) -> str:
        return value.split(":", 1)[1] if value.startswith(f"{THRESHOLD}:") else ""

    def _status_text(self) -> str:
        shown = format_value(self.spec.name, self.value)
        return f"{shown} · {self.source}"

    # -- state -----------------------------------------------------------------------------------

    def show(self, value: Any, source: str) -> None:
        """Display a value that is now in effect (set by the panel, never by the user's keys)."""
        self.value, self.source, self.refusal = value, source, None
        self._sync_controls()
        status = self.query_one(".flag-status", Static)
        status.update(self._status_text())
        status.remove_class("-refused")

    def _sync_controls(self) -> None:
        name = self.spec.name
        control = self.query_one(f"#control-{name}")
        if isinstance(control, Switch):
            control.value = bool(self.value)
        elif isinstance(control, Select):
            control.value = self._gate_choice(self.value) if name == "moe_gate" else self.value
        elif isinstance(control, Input):
            control.value = str(self.value)
        if name == "moe_gate":
            threshold = self._gate_threshold(self.value)
            box = self.query_one("#control-moe_gate-threshold", Input)
            if threshold or not box.value.strip().isdigit():
                box.value = threshold

    def _refuse(self, text: str, error: UserError) -> None:
        self.refusal = str(error)
        self._sync_controls()  # the previous valid value stays, visibly
        status = self.query_one(".flag-status", Static)
        status.update(f"refused: {error}\nkept {self._status_text()}")
        status.add_class("-refused")
        self.post_message(self.Refused(self, self.spec.name, text, str(error)))

    def propose(self, raw: Any) -> None:
        """Validate a value from any widget of this row and report it as Changed or Refused."""
        try:
            value = parse_value(self.spec.name, raw, WHERE)
        except UserError as error:
            self._refuse(str(raw), error)
            return
        if value != self.value or self.refusal is not None:
            self.post_message(self.Changed(self, self.spec.name, value))

    # -- widget events -----------------------------------------------------------------------------

    def on_switch_changed(self, event: Switch.Changed) -> None:
        event.stop()
        if event.value != self.value:
            self.propose(event.value)

    def on_select_changed(self, event: Select.Changed) -> None:
        event.stop()
        if self.spec.name == "moe_gate":
            if event.value == THRESHOLD:
                if self.value.startswith(f"{THRESHOLD}:"):
                    return
                box = self.query_one("#control-moe_gate-threshold", Input)
                number = box.value.strip() or "16"
                self.propose(f"{THRESHOLD}:{number}")
                return
            if event.value != self.value:
                self.propose(event.value)
            return
        if event.value != self.value:
            self.propose(event.value)

    def _from_input(self, control: Input, text: str) -> None:
        if control.id == "control-moe_gate-threshold":
            text = text.strip()
            if not text:
                return
            # A bare number is the threshold; a whole gate name is accepted too.
            self.propose(f"{THRESHOLD}:{text}" if text[0].isdigit() or text[0] in "+-" else text)
            return
        if text.strip() != str(self.value):
            self.propose(text)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self._from_input(event.input, event.value)

    def on_input_blurred(self, event: Input.Blurred) -> None:
        event.stop()
        if event.input.id == "control-moe_gate-threshold" and event.value.strip() == self._gate_threshold(self.value):
            return
        self._from_input(event.input, event.value)
