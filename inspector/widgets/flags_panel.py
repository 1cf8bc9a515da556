"""Configuration A: every flag of `engine.flags.SPECS`, its effective value and where it came from.

The panel owns the `ResolvedFlags` of configuration A. A change the user makes here is recorded
with the source `tui`, beside default / environment / session / command line.
"""

from __future__ import annotations

from typing import Any

from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

from engine.errors import UserError
from engine.flags import SPECS, ResolvedFlags, parse_value
from inspector.events import FlagChanged, FlagRefused
from inspector.widgets.flag_row import WHERE, FlagRow

TUI = "tui"  # the source of a value set in the flags panel


class FlagsPanel(VerticalScroll):
    """Edits configuration A in place; posts `FlagChanged` / `FlagRefused`."""

    def __init__(self, flags: ResolvedFlags, id: str | None = None) -> None:  # noqa: A002 - Textual's name
        super().__init__(id=id)
        self.flags = flags
        self.border_title = "A: flags"

    def compose(self) -> ComposeResult:
        for name, spec in SPECS.items():
            yield FlagRow(spec, self.flags[name], self.flags.sources[name])
        yield Static("tab: next · enter: apply", classes="flags-hint")

    def row(self, name: str) -> FlagRow:
        return self.query_one(f"#flag-{name}", FlagRow)

    def set_flag(self, name: str, value: Any) -> None:
        """Apply a value from elsewhere (the command palette); validated like typed input."""
        try:
            value = parse_value(name, value, WHERE)
        except UserError as error:
            self.post_message(FlagRefused(name, str(value), str(error)))
            return
        self._apply(name, value)

    def load(self, flags: ResolvedFlags) -> None:
        """Show a whole new configuration A (an opened session's) without posting changes: nothing
        the user did, so nothing to record."""
        self.flags = flags
        for name in SPECS:
            self.row(name).show(flags[name], flags.sources[name])

    def _apply(self, name: str, value: Any) -> None:
        self.flags = self.flags.with_overrides({name: value}, TUI)
        self.row(name).show(value, TUI)
        self.post_message(FlagChanged(name, value, self.flags))

    def on_flag_row_changed(self, event: FlagRow.Changed) -> None:
        event.stop()
        self._apply(event.name, event.value)

    def on_flag_row_refused(self, event: FlagRow.Refused) -> None:
        event.stop()
        self.post_message(FlagRefused(event.name, event.text, event.message))
