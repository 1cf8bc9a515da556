"""Edit configuration B: the flag overrides B applies on top of A (`FLAG=VALUE, ...`).

Validated with `engine.comma_list.parse_flag_list`, the parser of `compare --b`; a bad entry (an empty
one too) is refused in place with the parser's message, and B keeps its previous overrides.
"""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Footer, Input, Static

from engine.errors import UserError
from engine.comma_list import parse_flag_list
from engine.flags import SPECS, format_value
from inspector.widgets.config_b_row import DEFAULT_B_OVERRIDES

WHERE = "configuration B"


def assignments_text(overrides: dict[str, Any]) -> str:
    return ", ".join(f"{name}={format_value(name, value)}" for name, value in overrides.items())


class EditBScreen(ModalScreen[dict | None]):
    """Dismisses with the new overrides, or None when left with escape."""

    BINDINGS = [
        Binding("escape", "dismiss(None)", "Keep B"),
        Binding("f6", "defaults", "Default B"),
    ]

    def __init__(self, overrides: dict[str, Any]) -> None:
        super().__init__()
        self.overrides = dict(overrides)

    def compose(self) -> ComposeResult:
        with Vertical(id="edit-b", classes="dialog"):
            yield Static("Configuration B = A's flags with these overrides (empty: B is A). "
                         "Enter applies, escape keeps B as it was, f6 restores the default.", classes="dialog-help")
            yield Input(assignments_text(self.overrides), placeholder="FLAG=VALUE, FLAG=VALUE", id="b-overrides")
            yield Static("", id="b-refusal", markup=False)
            table = Text()
            width = max(len(name) for name in SPECS) + 2  # the longest name, then two spaces before its values
            for name, spec in SPECS.items():
                table.append(f"{name:<{width}}", style="bold")
                table.append(f"{spec.allowed}  (default {format_value(name, spec.default)})\n")
            yield Static(table, classes="dialog-flags")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self.query_one(Input).focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        try:
            overrides = parse_flag_list(event.value, WHERE)
        except UserError as error:
            refusal = self.query_one("#b-refusal", Static)
            refusal.update(f"refused: {error}")
            refusal.add_class("-refused")
            return
        self.dismiss(overrides)

    def action_defaults(self) -> None:
        self.query_one(Input).value = assignments_text(DEFAULT_B_OVERRIDES)
