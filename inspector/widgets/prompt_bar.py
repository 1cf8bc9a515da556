"""The prompt box (focused at start; Enter runs A and B) and the max-tokens box."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.message import Message
from textual.widgets import Input, Label

DEFAULT_MAX_TOKENS = 48


class PromptBar(Horizontal):
    """Posts `PromptBar.Run(prompt, max_tokens_text)` on Enter in either box."""

    class Run(Message):
        def __init__(self, prompt: str, max_tokens_text: str) -> None:
            super().__init__()
            self.prompt, self.max_tokens_text = prompt, max_tokens_text

    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS, id: str | None = None) -> None:  # noqa: A002
        super().__init__(id=id)
        self.max_tokens = max_tokens

    def compose(self) -> ComposeResult:
        yield Input(placeholder="prompt — Enter runs it through A and B at temperature 0", id="prompt")
        yield Label("max tokens", id="max-tokens-label")
        yield Input(str(self.max_tokens), id="max-tokens", restrict=r"[0-9]*", max_length=5)

    @property
    def prompt(self) -> str:
        return self.query_one("#prompt", Input).value

    @property
    def max_tokens_text(self) -> str:
        return self.query_one("#max-tokens", Input).value

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.post_message(self.Run(self.prompt, self.max_tokens_text))
