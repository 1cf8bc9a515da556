"""Command palette entries: every action of the inspector, and every value of every flag.

Commands are looked up on the main screen (the one under the palette), so they work from the
palette whichever widget had focus.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

from textual.command import DiscoveryHit, Hit, Hits, Provider

from engine.flags import SPECS, format_value

# (title, help, action on the main screen or the app)
ACTIONS: tuple[tuple[str, str, str], ...] = (
    ("Run prompt", "run the prompt box's text through A and B at temperature 0", "screen.run_prompt"),
    ("Cancel run", "stop the running generation at its next step", "screen.cancel"),
    ("Edit configuration B", "B = A's flags with overrides (default flash_512=off, moe_gate=reference)",
     "screen.edit_b"),
    ("Tile-fill curve", "pairs per woken expert vs n, TILE_M, the policy boundary, observed points",
     "screen.tile_fill"),
    ("Attention check", "fused attention vs masked / causal / unmasked references", "screen.attention_check"),
    ("Replay session", "step through the open session, each step re-run beside its recording", "screen.replay"),
    ("Bench", "llama-bench pp/tg rows on this engine, progress, trajectory, kernel shares", "screen.bench"),
    ("A/B report", "an `moe-inspector ab --json-out` report: rows, verdicts and each row's rounds", "screen.ab"),
    ("Routing", "the last run's (record_routing=on) or a file's load per layer and expert, imbalance, woken experts",
     "screen.routing"),
    ("Save session as", "save the session (and its results) under a new path; recording continues there",
     "app.save_session"),
    ("Open session", "open a session file for this model: recording continues into it", "app.open_session"),
    ("Follow dispatch log", "scroll the log to its newest row and keep following", "screen.follow"),
    ("Clear log filters", "show every row of the dispatch log", "screen.clear_filters"),
    ("Focus prompt", "put the cursor in the prompt box", "screen.focus_prompt"),
    ("Focus flags", "move to the flags panel (configuration A)", "screen.focus_flags"),
    ("Help", "every key, and what each panel shows", "app.help"),
    ("Quit", "cancel any run and leave", "app.quit"),
)


def flag_commands() -> list[tuple[str, str, str, object]]:
    """(title, help, flag, value) for every value of every select/bool flag."""
    commands = []
    for name, spec in SPECS.items():
        if spec.kind in ("select", "bool"):
            for value in spec.choices:
                commands.append((f"Set {name} = {format_value(name, value)}", spec.help, name, value))
        else:
            commands.append((f"Set {name} …", f"{spec.help} ({spec.allowed}): focus its box", name, None))
    return commands


class InspectorCommands(Provider):
    def _main(self):
        from inspector.screens.main import MainScreen

        return next((screen for screen in reversed(self.app.screen_stack) if isinstance(screen, MainScreen)), None)

    def _commands(self) -> list[tuple[str, str, Callable]]:
        commands: list[tuple[str, str, Callable]] = []
        for title, help_text, action in ACTIONS:
            commands.append((title, help_text, partial(self._run_action, action)))
        for title, help_text, name, value in flag_commands():
            commands.append((title, help_text, partial(self._set_flag, name, value)))
        return commands

    async def _run_action(self, action: str) -> None:
        main = self._main()
        if action.startswith("screen.") and main is not None:
            if self.app.screen is not main:  # leave tile-fill/attention screens for the main one
                while self.app.screen is not main and len(self.app.screen_stack) > 1:
                    self.app.pop_screen()
            await main.run_action(action.removeprefix("screen."))
        elif action.startswith("app."):
            await self.app.run_action(action.removeprefix("app."))

    def _set_flag(self, name: str, value: object) -> None:
        main = self._main()
        if main is None:
            return
        while self.app.screen is not main and len(self.app.screen_stack) > 1:
            self.app.pop_screen()
        main.set_flag(name, value)

    async def discover(self) -> Hits:
        for title, help_text, callback in self._commands():
            yield DiscoveryHit(title, callback, help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for title, help_text, callback in self._commands():
            score = matcher.match(title)
            if score > 0:
                yield Hit(score, matcher.highlight(title), callback, help=help_text)
