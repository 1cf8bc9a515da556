"""One side's generated tokens as they stream, with the tokens from the first divergence marked.

Byte tokens (the presets' vocabulary): printable ASCII is shown as text, anything else as a dim
`\\xNN` escape. A checkpoint's own tokenizer: each token's text, its unprintable characters as dim
escapes and a token with no text of its own (part of a multi-byte character, an id the tokenizer does
not know) as a dim `<id N>`. Either way every token is visible and token N is the N-th thing shown.
"""

from __future__ import annotations

from typing import Callable

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

from engine.printable import escape_char, is_printable_char
from engine.tokenizer import ByteTokenizer

DIVERGED = "reverse"
TokenText = Callable[[int], tuple[str, str]]


def token_text(token: int) -> tuple[str, str]:
    """(text, style) for one byte-level token (an id past the bytes, in a larger vocabulary: `<id N>`)."""
    if 32 <= token < 127:
        return chr(token), ""
    if token == 10:
        return "\\n", "dim"
    if not 0 <= token < 256:
        return f"<id {token}>", "dim"
    return f"\\x{token:02x}", "dim"


def tokenizer_token_text(tokenizer) -> TokenText:
    """(text, style) of one token of `tokenizer`: byte tokens as `token_text`, others by their decoded text."""
    if isinstance(tokenizer, ByteTokenizer):
        return token_text

    def shown(token: int) -> tuple[str, str]:
        piece = tokenizer.decode([token])
        if not piece or "\ufffd" in piece or piece == f"<id {token}>":
            return f"<id {token}>", "dim"
        if all(is_printable_char(character) for character in piece):
            return piece, ""
        return "".join("\\n" if character == "\n" else character if is_printable_char(character)
                       else escape_char(character) for character in piece), "dim"

    return shown


def render_tokens(tokens: list[int], divergence: int | None, shown: TokenText = token_text) -> Text:
    text = Text()
    for index, token in enumerate(tokens):
        shown_text, style = shown(token)
        if divergence is not None and index >= divergence:
            style = f"{style} {DIVERGED}".strip()
        text.append(shown_text, style=style)
    return text


class OutputPane(VerticalScroll):
    """The tokens of side A or B."""

    def __init__(self, side: str, id: str | None = None, hint: str = "",  # noqa: A002
                 shown: TokenText = token_text) -> None:
        """`hint`: a key that acts on this side, shown in the title ("f4 edits"); `shown`: a token's text
        (`tokenizer_token_text` of the engine's tokenizer)."""
        super().__init__(id=id, classes="output-pane")
        self.shown = shown
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

    def retitle(self, title: str) -> None:
        """The side's configuration changed between runs: the title names the new one at once, and tokens still
        shown (the last run's, made by the one before) say so."""
        self.border_title = f"{self.label}: {title}"
        if self.tokens:
            self.border_subtitle = "the last run's tokens, before this configuration"

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
        self.query_one(".output-text", Static).update(render_tokens(self.tokens, self.divergence, self.shown))
