"""The prompts a user ran, newest last, for recalling with up/down in the TUI's prompt box;
kept in a JSON-lines file between runs when given one.

Plain Python: no widgets. Bounded: at most MAX_ENTRIES prompts of at most MAX_CHARACTERS each
are kept (a longer prompt runs, and is not remembered), so the file stays small. A file that
cannot be read or parsed is started afresh, never an error: history is a convenience.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

MAX_ENTRIES = 200
MAX_CHARACTERS = 64 * 1024


class PromptHistory:
    def __init__(self, path: str | os.PathLike | None = None, entries: list[str] | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self.entries: list[str] = list(entries or [])
        if self.path is not None and not entries:
            self.entries = self._read(self.path)
        self.position: int | None = None  # an index into entries while recalling, None at the draft
        self.draft = ""  # what the box held before recalling began

    @staticmethod
    def _read(path: Path) -> list[str]:
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError):
            return []
        entries = []
        for line in lines[-MAX_ENTRIES:]:
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, str) and entry:
                entries.append(entry)
        return entries

    def add(self, prompt: str) -> None:
        """A prompt that ran: newest last, once in a row, and saved when there is a file."""
        self.position, self.draft = None, ""
        if not prompt or len(prompt) > MAX_CHARACTERS:
            return
        if prompt in self.entries:
            self.entries.remove(prompt)
        self.entries.append(prompt)
        del self.entries[:-MAX_ENTRIES]
        if self.path is not None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                temporary = self.path.with_name(self.path.name + ".tmp")
                temporary.write_text("".join(json.dumps(entry, ensure_ascii=False) + "\n" for entry in self.entries),
                                     encoding="utf-8")
                os.replace(temporary, self.path)
            except OSError:
                pass  # a read-only cache: the history lives for this run only

    def previous(self, current: str) -> str | None:
        """The prompt before the one shown (the newest, from the draft `current`); None at the oldest."""
        if not self.entries:
            return None
        if self.position is None:
            self.draft, self.position = current, len(self.entries) - 1
        elif self.position == 0:
            return None
        else:
            self.position -= 1
        return self.entries[self.position]

    def next(self) -> str | None:
        """The prompt after the one shown, then the draft; None when not recalling."""
        if self.position is None:
            return None
        if self.position == len(self.entries) - 1:
            self.position = None
            return self.draft
        self.position += 1
        return self.entries[self.position]
