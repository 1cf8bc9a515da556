"""The Textual app: holds the engine, the starting flags and the open session, installs the main
screen, and records every user action into the session. Everything else lives in the screens
and widgets."""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

from textual.app import App
from textual.binding import Binding

from engine.errors import UserError
from engine.flags import ResolvedFlags
from engine.runtime import Engine
from inspector import events
from inspector.screens.main import MainScreen
from inspector.prompt_history import PromptHistory
from inspector.screens.palette import InspectorCommands
from inspector.widgets.config_b_row import DEFAULT_B_OVERRIDES
from inspector.widgets.prompt_bar import DEFAULT_MAX_TOKENS


class InspectorApp(App):
    """moe-inspector's TUI. `session` (an inspector.tui.TuiSession) receives every action; without
    one (tests, embedding) `record_action` records nothing."""

    CSS_PATH = Path(__file__).with_name("app.tcss")  # absolute, so subclasses elsewhere find it
    TITLE = "moe-inspector"
    COMMANDS = App.COMMANDS | {InspectorCommands}
    BINDINGS = [
        Binding("f1", "help", "Help"),
        Binding("question_mark", "help", "Help", show=False),
        Binding("ctrl+s", "save_session", "Save as", show=False),
        Binding("ctrl+o", "open_session", "Open", show=False),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    def __init__(self, engine: Engine, flags: ResolvedFlags, *, b_overrides: dict[str, Any] | None = None,
                 max_tokens: int = DEFAULT_MAX_TOKENS, timed: bool = True, sweep_path: str | None = None,
                 startup_notes: list[str] | None = None, session=None, history_path: str | None = None,
                 prompt: str = "", engine_b: Engine | None = None, b_model: str | None = None) -> None:
        """`history_path`: where the prompt history is kept between runs (None: for this run only);
        `prompt`: the prompt box's text at start (--prompt-file); `engine_b`: B's own model (--b-model, as a
        session records it in `b_model`), else B runs on `engine`."""
        super().__init__()
        self.history = PromptHistory(history_path)
        self.initial_prompt = prompt
        # What the bench screen showed when it was left, shown again on the next visit (BenchScreen.memory).
        self.bench_memory: dict | None = None
        self.engine, self.flags, self.timed = engine, flags, timed
        self.engine_b, self.b_model = engine_b, b_model
        # B on its own model starts at A's flags (the panes then differ by the model alone, as compare --b-model
        # runs them); B on A's model starts at the reference configuration
        default_b = {} if engine_b is not None else DEFAULT_B_OVERRIDES
        self.b_overrides = dict(default_b if b_overrides is None else b_overrides)
        self.max_tokens, self.sweep_path = max_tokens, sweep_path
        self.startup_notes = list(startup_notes or [])
        self.session = session
        # One engine, one user at a time: a generation, a replayed step or a bench waits for the others
        # (a bench timed beside a generation would measure both).
        self.engine_lock = threading.Lock()

    # The engine thread makes many short torch calls, each re-taking the GIL; at Python's default
    # 5 ms switch interval each waits out the UI thread's slice whenever the UI is drawing, which
    # made a tiny-model run several times slower inside the TUI than headless (measured with
    # time.thread_time on both threads). 0.5 ms keeps the engine near its headless speed.
    SWITCH_INTERVAL = 0.0005

    def on_mount(self) -> None:
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(self.SWITCH_INTERVAL)
        self.push_screen(MainScreen(self.engine, self.flags, self.b_overrides, self.max_tokens, self.timed,
                                    self.history, self.initial_prompt, engine_b=self.engine_b, b_model=self.b_model))
        self._session_changed()
        for note in self.startup_notes:  # long enough to be read once the first screen is drawn
            self.notify(note, severity="warning", timeout=30)
        if self.session is not None:
            new = "" if self.session.path.exists() else "new session (no such file yet): "
            self.notify(f"{new}recording into session {self.session.describe()}: saved after every action "
                        f"(ctrl+s saves as, ctrl+o opens, f7 replays)", title="session", timeout=10)

    def on_unmount(self) -> None:
        sys.setswitchinterval(self._switch_interval)

    @property
    def main_screen(self) -> MainScreen:
        return next(screen for screen in self.screen_stack if isinstance(screen, MainScreen))

    # -- the session ------------------------------------------------------------------------------------

    def record_action(self, action: dict, outcome: dict | None = None) -> None:
        """Every user action (prompt run, flag, config B, curve, check-attention, bench), as plain
        values; `outcome` is what the TUI computed for it (generations, the check's dict, the bench
        report), kept as the step's recorded results. Saved atomically before this returns; a save that fails
        is shown as an error notification and in the status bar (until the next save succeeds), never dropped."""
        if self.session is None:
            return
        try:
            self.session.record(action, outcome)
        except (UserError, OSError) as error:  # never silent: a long notification and the status bar say so
            self.notify(f"{action.get('action')}: not recorded in the session: {error}", title="session",
                        severity="error", markup=False, timeout=30)
            self._session_changed(f"NOT SAVED: the last {action.get('action')} was not recorded")
            return
        self._session_changed()  # clears a NOT SAVED note once a save succeeds

    def _session_changed(self, note: str = "") -> None:
        if self.session is not None:
            self.main_screen.post_message(events.SessionChanged(str(self.session.path),
                                                                len(self.session.session.steps), note))

    @staticmethod
    def check_session_path(text: str) -> Path:
        """What ctrl+s refuses whatever the answer to "replace it?" (UserError): no path, a directory, a name
        not ending in .toml, a missing directory. The dialog asks it before that question."""
        path = Path(text.strip()).expanduser()
        if not text.strip():
            raise UserError("give a file path, e.g. sessions/mine.toml")
        if path.is_dir():
            raise UserError(f"{path} is a directory: name a .toml file inside it")
        if path.suffix != ".toml":
            raise UserError(f"{path}: a session file ends in .toml (its results go beside it as .results.jsonl)")
        if not path.parent.is_dir():
            raise UserError(f"{path.parent} is not a directory: create it first, or pick another place")
        return path

    def save_session_as(self, text: str) -> Path:
        """ctrl+s: refuses (UserError, shown in place) a path that is not a writable .toml file."""
        if self.session is None:
            raise UserError("no session is open in this inspector")
        path = self.check_session_path(text)
        try:
            saved = self.session.save_as(path)
        except OSError as error:
            raise UserError(f"{path}: cannot write it ({error.strerror}); pick a writable directory") from None
        self._session_changed()
        self.notify(f"saved; recording continues into {saved}", title="session")
        return saved

    def open_session(self, text: str) -> None:
        """ctrl+o: opens a session for this engine; a malformed one raises UserError (the parser's
        message, shown in place) and leaves the current session untouched."""
        from inspector.tui_session import TuiSession

        path = Path(text.strip()).expanduser()
        if not text.strip():
            raise UserError("give the path of a session file, e.g. sessions/quickstart.toml")
        main = self.main_screen
        if main.running:
            raise UserError("a generation is running: wait for it (or press escape on the main screen) first")
        session = TuiSession.open(path, self.engine)
        self.session = session
        main.load_session_state(session.starting_flags(), session.b_overrides())
        self._session_changed()
        steps = len(session.session.steps)
        recorded = len(session.lines)
        self.notify(f"opened {path}: {steps} steps, {recorded} with recorded results (f7 replays them)"
                    + (f"; {session.note}" if session.note else ""), title="session",
                    severity="warning" if session.note else "information")

    def action_save_session(self) -> None:
        from inspector.screens.session_path import SessionPathScreen

        if self.session is not None and not isinstance(self.screen, SessionPathScreen):
            self.push_screen(SessionPathScreen("save", str(self.session.path), self.save_session_as,
                                               current=str(self.session.path), check=self.check_session_path))

    def action_open_session(self) -> None:
        from inspector.screens.session_path import SessionPathScreen

        if not isinstance(self.screen, SessionPathScreen):
            self.push_screen(SessionPathScreen("open", "", self.open_session))

    # -- the rest -----------------------------------------------------------------------------------------

    def action_help(self) -> None:
        from inspector.screens.help import HelpScreen

        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    async def action_quit(self) -> None:
        """Cancel a running generation first, so its worker thread ends at its next step."""
        for screen in self.screen_stack:
            if isinstance(screen, MainScreen) and screen.current_run is not None:
                screen.current_run.cancel.set()
            cancel = getattr(screen, "cancel_work", None)
            if cancel is not None:
                cancel()
        self.exit()
