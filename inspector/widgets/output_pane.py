"""One side's generated tokens as they stream, with the tokens from the first divergence marked.

Tokens are bytes (the presets' vocabulary): printable ASCII is shown as text, anything else as a
dim `\\xNN` escape, so every token is visible and token N is always the N-th thing shown.
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

DIVERGED = "reverse"


def token_text(token: int) -> tuple[str, str]:
    """(text, style) for one byte-level token."""
    if 32 <= token < 127:
        return chr(token), ""
    if token == 10:
        return "\\n", "dim"
    return f"\\x{token:02x}", "dim"


def render_tokens(tokens: list[int], divergence: int | None) -> Text:
    text = Text()
    for index, token in enumerate(tokens):
        shown, style = token_text(token)
        if divergence is not None and index >= divergence:
            style = f"{style} {DIVERGED}".strip()
        text.append(shown, style=style)
    return text


class OutputPane(VerticalScroll):
    """The tokens of side A or B."""

    def __init__(self, side: str, id: str | None = None, hint: str = "") -> None:  # noqa: A002
        """`hint`: a key that acts on this side, shown in the title ("f4 edits")."""
        super().__init__(id=id, classes="output-pane")
        self.side = side
        self.label = f"{side} ({hint})" if hint else side
        self.tokens: list[int] = []
        self.divergence: int | None = None
        self.border_title = self.label

    def compose(self) -> ComposeResult:
        yield Static("", classes="output-text")

    def reset(self, title: str) -> None:
        self.tokens, self.divergence = [], None
        self.border_title = f"{self.label}: {title}"
        self.border_subtitle = ""
        self._refresh_text()

    def extend(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)
        self._refresh_text()
        self.scroll_end(animate=False)

    def mark_divergence(self, index: int | None) -> None:
        if index != self.divergence:
            self.divergence = index
            self._refresh_text()

    def set_note(self, note: str) -> None:
        self.border_subtitle = note

    def _refresh_text(self) -> None:
        self.query_one(".output-text", Static).update(render_tokens(self.tokens, self.divergence))
