"""A progress bar on stderr for long headless runs, so stdout stays clean for tables and JSON.

On a terminal the bar redraws in place (`\r`); otherwise (a pipe, a CI log) it writes a line each
time another ~10 % is done. Knows nothing of what is being counted.
"""

from __future__ import annotations

import sys
from typing import TextIO


class Progress:
    def __init__(self, total: int, label: str, stream: TextIO | None = None, width: int = 30) -> None:
        self.total, self.label, self.width = max(total, 1), label, width
        self.stream = sys.stderr if stream is None else stream
        self.done = 0
        self._tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._last_decile = -1
        self._closed = False

    def advance(self, steps: int = 1, note: str = "") -> None:
        self.done = min(self.total, self.done + steps)
        fraction = self.done / self.total
        if self._tty:
            filled = round(self.width * fraction)
            self.stream.write(f"\r{self.label} [{'#' * filled}{'.' * (self.width - filled)}] "
                              f"{self.done}/{self.total} {note}".ljust(self.width + len(self.label) + 40))
            self.stream.flush()
            return
        decile = int(fraction * 10)
        if decile != self._last_decile:
            self._last_decile = decile
            self.stream.write(f"{self.label}: {self.done}/{self.total} ({100 * fraction:.0f} %) {note}".rstrip() + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._tty:
            self.stream.write("\n")
            self.stream.flush()
