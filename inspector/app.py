"""The Textual app: holds the engine and the starting flags, installs the main screen, and
offers the session hook. Everything else lives in the screens and widgets."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from textual.app import App
from textual.binding import Binding

from engine.flags import ResolvedFlags
from engine.runtime import Engine
from inspector.screens.main import MainScreen
from inspector.screens.palette import InspectorCommands
from inspector.widgets.config_b_row import DEFAULT_B_OVERRIDES
from inspector.widgets.prompt_bar import DEFAULT_MAX_TOKENS


class InspectorApp(App):
    """moe-inspector's TUI. `ctrl+s` / `ctrl+o` are left free for sessions (save / open)."""

    CSS_PATH = Path(__file__).with_name("app.tcss")  # absolute, so subclasses elsewhere find it
    TITLE = "moe-inspector"
    COMMANDS = App.COMMANDS | {InspectorCommands}
    BINDINGS = [
        Binding("f1", "help", "Help"),
        Binding("question_mark", "help", "Help", show=False),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    def __init__(self, engine: Engine, flags: ResolvedFlags, *, b_overrides: dict[str, Any] | None = None,
                 max_tokens: int = DEFAULT_MAX_TOKENS, timed: bool = True, sweep_path: str | None = None,
                 startup_notes: list[str] | None = None) -> None:
        super().__init__()
        self.engine, self.flags, self.timed = engine, flags, timed
        self.b_overrides = dict(DEFAULT_B_OVERRIDES if b_overrides is None else b_overrides)
        self.max_tokens, self.sweep_path = max_tokens, sweep_path
        self.startup_notes = list(startup_notes or [])

    # The engine thread makes many short torch calls, each re-taking the GIL; at Python's default
    # 5 ms switch interval each waits out the UI thread's slice whenever the UI is drawing, which
    # made a tiny-model run several times slower inside the TUI than headless (measured with
    # time.thread_time on both threads). 0.5 ms keeps the engine near its headless speed.
    SWITCH_INTERVAL = 0.0005

    def on_mount(self) -> None:
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(self.SWITCH_INTERVAL)
        self.push_screen(MainScreen(self.engine, self.flags, self.b_overrides, self.max_tokens, self.timed))
        for note in self.startup_notes:
            self.notify(note, severity="warning", timeout=10)

    def on_unmount(self) -> None:
        sys.setswitchinterval(self._switch_interval)

    @property
    def main_screen(self) -> MainScreen:
        return next(screen for screen in self.screen_stack if isinstance(screen, MainScreen))

    def record_action(self, action: dict) -> None:
        """Called with a plain dict for every user action (prompt, flag, config, curve,
        check-attention). A no-op here: sessions (save / replay) override or wrap it."""

    def action_help(self) -> None:
        from inspector.screens.help import HelpScreen

        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    async def action_quit(self) -> None:
        """Cancel a running generation first, so its worker thread ends at its next step."""
        for screen in self.screen_stack:
            if isinstance(screen, MainScreen) and screen.current_run is not None:
                screen.current_run.cancel.set()
        self.exit()
