"""A small modal asking for a path: save the session as (ctrl+s), open one (ctrl+o), export the
dispatch log (ctrl+t) or load a prompt from a file (ctrl+n).

Enter hands the text to `attempt` (the app's save or open); a UserError it raises is shown in
place and the dialog stays, so a bad path or a malformed session changes nothing. Saving over
an existing file other than the current session asks for a second Enter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Footer, Input, Static

from engine.errors import UserError

TITLES = {
    "save": "Save the session as (a .toml file; its results go beside it as .results.jsonl). "
            "Recording continues into the new file.",
    "open": "Open a session (.toml) for this model: recording continues into it, and f7 replays its steps.",
    "export": "Export the dispatch log's shown rows (the filters apply) to a file: .csv, .json or .jsonl, one row per "
              "layer per step with the whole decision (the same rows as `generate --format csv`).",
    "prompt": "Load a prompt from a text file (UTF-8; its text exactly, newlines kept) into the prompt box.",
}
VERBS = {"save": "save", "open": "open", "export": "export", "prompt": "load"}
PLACEHOLDERS = {"save": "path/to/session.toml", "open": "path/to/session.toml", "export": "path/to/rows.csv",
                "prompt": "path/to/prompt.txt"}
OVERWRITES = ("save", "export")  # modes that write a file: replacing another one asks for a second Enter


class SessionPathScreen(ModalScreen[str | None]):
    """Dismisses with the path that was saved, opened, exported or loaded, or None when left with escape."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel")]

    def __init__(self, mode: str, initial: str, attempt: Callable[[str], object], current: str | None = None,
                 check: Callable[[str], object] | None = None) -> None:
        """`check(text)`: raises UserError for a path refused whatever the answer (the open session's files for an
        export), before the second-Enter question about replacing an existing file."""
        super().__init__()
        self.mode, self.initial, self.attempt, self.current, self.check = mode, initial, attempt, current, check
        self._confirmed: str | None = None  # a path whose overwrite the user confirmed with a second Enter
        self.refusal: str | None = None

    def compose(self) -> ComposeResult:
        with Vertical(id="session-dialog", classes="dialog"):
            yield Static(TITLES[self.mode], classes="dialog-help")
            yield Input(self.initial, placeholder=PLACEHOLDERS[self.mode], id="session-path")
            yield Static(f"Enter: {VERBS[self.mode]} · escape: cancel", id="session-refusal",
                         markup=False)  # a message quotes TOML tables: [session] is text
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self.query_one(Input).focus()

    def refuse(self, message: str) -> None:
        self.refusal = message
        line = self.query_one("#session-refusal", Static)
        line.update(f"refused: {message}")
        line.add_class("-refused")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        text = event.value.strip()
        if self.check is not None and text:
            try:
                self.check(text)
            except UserError as error:
                self.refuse(str(error))
                return
        if self.mode in OVERWRITES and text and text != self._confirmed:
            path = Path(text).expanduser()
            if path.is_file() and (self.current is None or path.resolve() != Path(self.current).resolve()):
                self._confirmed = text
                line = self.query_one("#session-refusal", Static)
                what = " (and its results)" if self.mode == "save" else ""
                line.update(f"{path} exists: Enter again to replace it{what}, escape to keep it")
                line.add_class("-refused")
                return
        try:
            self.attempt(text)
        except UserError as error:
            self.refuse(str(error))
            return
        self.dismiss(text)
