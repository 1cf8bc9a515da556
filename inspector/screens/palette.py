"""Command palette entries: every action of the inspector, and every value of every flag.

Commands are looked up on the main screen (the one under the palette), so they work from the
palette whichever widget had focus.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

from rich.text import Text
from textual.command import DiscoveryHit, Hit, Hits, Provider
from textual.content import Content

from engine.flags import SPECS, format_value

# (title, key, help, action on the main screen or the app). The key is shown beside the title.
ACTIONS: tuple[tuple[str, str, str, str], ...] = (
    ("Run prompt", "enter", "run the prompt box's text through A and B at temperature 0 (ctrl+j: a new line)",
     "screen.run_prompt"),
    ("Cancel run", "escape", "stop the running generation at its next step", "screen.cancel"),
    ("Clear prompt", "", "empty the prompt box (ctrl+z in the box brings the text back)", "screen.clear_prompt"),
    ("Load prompt from a file", "ctrl+n", "put a text file's contents (newlines kept) in the prompt box",
     "screen.prompt_file"),
    ("Earlier / later prompt", "↑ / ↓", "in the prompt box, on its first / last line: the prompt history",
     "screen.focus_prompt"),
    ("Edit configuration B", "f4", "B = A's flags with overrides (default flash_512=off, moe_gate=reference)",
     "screen.edit_b"),
    ("Tile-fill curve", "f2", "pairs per woken expert vs n, TILE_M, the policy boundary, observed points",
     "screen.tile_fill"),
    ("Attention check", "f3", "fused attention vs masked / causal / unmasked references", "screen.attention_check"),
    ("Replay session", "f7", "step through the open session, each step re-run beside its recording", "screen.replay"),
    ("Bench", "f8", "llama-bench pp/tg rows under A, B or A against B; latency percentiles, trajectory",
     "screen.bench"),
    ("A/B report", "f9", "an `moe-inspector ab --json-out` report: rows, verdicts and each row's rounds", "screen.ab"),
    ("Routing", "f10", "the last run's (record_routing=on) or a file's load per layer and expert, imbalance, woken experts",
     "screen.routing"),
    ("Save session as", "ctrl+s", "save the session (and its results) under a new path; recording continues there",
     "app.save_session"),
    ("Open session", "ctrl+o", "open a session file for this model: recording continues into it", "app.open_session"),
    ("Follow dispatch log", "f5", "move to the log's newest row and keep following", "screen.follow"),
    ("Find in dispatch log", "ctrl+f", "text in any column of the shown rows; enter: the next match",
     "screen.find_in_log"),
    ("Go to step", "ctrl+g", "the dispatch log's first shown row of a step", "screen.go_to_step"),
    ("Export dispatch log", "ctrl+t", "the shown rows to .csv, .json or .jsonl, the whole decision per row",
     "screen.export_log"),
    ("Clear log filters", "", "show every row of the dispatch log", "screen.clear_filters"),
    ("Focus prompt", "ctrl+l", "put the cursor in the prompt box", "screen.focus_prompt"),
    ("Flags (configuration A)", "f6",
     "move to the flags panel; on a narrow screen f6 opens and closes it (escape closes it)",
     "screen.focus_flags"),
    ("Help", "f1", "every key, and what each panel shows", "app.help"),
    ("Quit", "ctrl+q", "cancel any run and leave", "app.quit"),
)
# Keys that act on one row of the dispatch log, said in the help only: enter (details), ←/→ in them.


def titled(title: str, key: str) -> Text:
    """A palette entry's title with its key beside it, so the palette teaches the keys."""
    text = Text(title)
    if key:
        text.append(f"   {key}", style="bold dim")
    return text


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

    def _commands(self) -> list[tuple[str, str, str, Callable]]:
        commands: list[tuple[str, str, str, Callable]] = []
        for title, key, help_text, action in ACTIONS:
            commands.append((title, key, help_text, partial(self._run_action, action)))
        for title, help_text, name, value in flag_commands():
            commands.append((title, "", help_text, partial(self._set_flag, name, value)))
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
        for title, key, help_text, callback in self._commands():
            yield DiscoveryHit(titled(title, key), callback, text=title, help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for title, key, help_text, callback in self._commands():
            score = matcher.match(title)
            if score > 0:
                shown = matcher.highlight(title)
                if key:
                    shown = shown + Content.styled(f"   {key}", "bold dim")
                yield Hit(score, shown, callback, text=title, help=help_text)
