"""A progress bar on stderr for long headless runs, so stdout stays clean for tables and JSON.

On a terminal the bar redraws in place (`\r`), kept narrower than the terminal (a line that wraps cannot
be redrawn: each `\r` would go back to its last row only, a new line per update); otherwise (a pipe, a CI
log) it writes a line each time another ~10 % is done. Knows nothing of what is being counted.
"""

from __future__ import annotations

import shutil
import sys
from typing import TextIO


class Progress:
    def __init__(self, total: int, label: str, stream: TextIO | None = None, width: int = 30) -> None:
        self.total, self.label, self.width = max(total, 1), label, width
        self.stream = sys.stderr if stream is None else stream
        self.done = 0
        self._tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._last_decile = -1
        self._last_length = 0  # of the line on screen, so a shorter redraw blanks what is left of it
        self._closed = False

    def advance(self, steps: int = 1, note: str = "") -> None:
        self.done = min(self.total, self.done + steps)
        fraction = self.done / self.total
        if self._tty:
            line = self._line(fraction, note)
            self.stream.write(f"\r{line}{' ' * max(0, self._last_length - len(line))}")
            self._last_length = len(line)
            self.stream.flush()
            return
        decile = int(fraction * 10)
        if decile != self._last_decile:
            self._last_decile = decile
            self.stream.write(f"{self.label}: {self.done}/{self.total} ({100 * fraction:.0f} %) {note}".rstrip() + "\n")
            self.stream.flush()

    def _line(self, fraction: float, note: str) -> str:
        """The bar in fewer columns than the terminal has: the bar narrows first, then the label is cut."""
        columns = max(20, shutil.get_terminal_size().columns - 1)
        tail = f" {self.done}/{self.total} {note}".rstrip()
        width = min(self.width, columns - len(self.label) - len(tail) - 3)
        if width >= 5:
            filled = round(width * fraction)
            return f"{self.label} [{'#' * filled}{'.' * (width - filled)}]{tail}"
        room = columns - len(tail)
        label = self.label if len(self.label) <= room else self.label[:max(0, room - 1)] + "…"
        return f"{label}{tail}"[:columns]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._tty:
            self.stream.write("\n")
            self.stream.flush()


class _Silent:
    """A stream that keeps nothing: a Progress given it draws nothing (--no-progress)."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


SILENT = _Silent()


def advance(progress, note: str = "") -> None:
    """`progress.advance(note=note)` where a progress object is given (a long computation's parts report to it,
    and a caller may stop the computation there by raising from advance)."""
    if progress is not None:
        progress.advance(note=note)
