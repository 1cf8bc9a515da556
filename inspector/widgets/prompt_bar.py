"""The prompt editor (focused at start) and the max-tokens box.

The prompt is a TextArea: Enter runs it through A and B, ctrl+j (or shift+enter, where the
terminal reports it) starts a new line, and a pasted multi-line prompt keeps every line. Up on
the first line and down on the last recall earlier prompts (`PromptHistory`). TextArea's own
f6/f7 (select line / select all) are left out: those keys belong to the screens.
"""

from __future__ import annotations

from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.message import Message
from textual.widgets import Input, Label, TextArea

from inspector.prompt_history import PromptHistory

DEFAULT_MAX_TOKENS = 48
MAX_TOKENS_LABEL = "max tokens"  # the box's label, which the TUI's refusals name (the CLI's name --max-tokens)
NEWLINE_KEYS = ("ctrl+j", "shift+enter")


class PromptArea(TextArea, inherit_bindings=False):
    """A TextArea that submits on Enter. `value` reads and replaces the whole text (as Input's does)."""

    BINDINGS = [binding for binding in TextArea.BINDINGS if getattr(binding, "key", "") not in ("f6", "f7")] + [
        Binding("enter", "submit", "Run", show=True),
        Binding("ctrl+j", "newline", "Newline", show=True, key_display="^j"),
        Binding("ctrl+up", "history(-1)", "Earlier prompt", show=False),
        Binding("ctrl+down", "history(1)", "Later prompt", show=False),
    ]

    class Submitted(Message):
        def __init__(self, area: "PromptArea", text: str) -> None:
            super().__init__()
            self.area, self.text = area, text

        @property
        def control(self) -> "PromptArea":
            return self.area

    def __init__(self, history: PromptHistory | None = None, **kwargs) -> None:
        super().__init__(soft_wrap=True, show_line_numbers=False, tab_behavior="focus", **kwargs)
        self.prompts = history if history is not None else PromptHistory()

    @property
    def value(self) -> str:
        return self.text

    @value.setter
    def value(self, text: str) -> None:
        self.load_text(text)
        self.move_cursor(self.document.end)

    async def _on_key(self, event: events.Key) -> None:
        # Before TextArea's own handling, which would insert a newline for Enter.
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.action_submit()
            return
        if event.key in NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            self.action_newline()
            return
        if event.key == "up" and self.cursor_location[0] == 0 and self._recall(-1):
            event.stop()
            event.prevent_default()
            return
        if event.key == "down" and self.cursor_location[0] == self.document.line_count - 1 and self._recall(1):
            event.stop()
            event.prevent_default()
            return
        await super()._on_key(event)

    def action_submit(self) -> None:
        self.post_message(self.Submitted(self, self.text))

    def action_newline(self) -> None:
        start, end = self.selection
        self._replace_via_keyboard("\n", start, end)

    def action_history(self, direction: int) -> None:
        self._recall(direction)

    def _recall(self, direction: int) -> bool:
        """Show the previous (-1) or next (+1) prompt of the history; False when there is none."""
        text = self.prompts.previous(self.text) if direction < 0 else self.prompts.next()
        if text is None:
            return False
        self.value = text
        return True


class PromptBar(Horizontal):
    """Posts `PromptBar.Run(prompt, max_tokens_text)` on Enter in either box."""

    class Run(Message):
        def __init__(self, prompt: str, max_tokens_text: str) -> None:
            super().__init__()
            self.prompt, self.max_tokens_text = prompt, max_tokens_text

    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS, history: PromptHistory | None = None,
                 prompt: str = "", id: str | None = None) -> None:  # noqa: A002
        super().__init__(id=id)
        self.max_tokens, self.history, self.initial_prompt = max_tokens, history, prompt

    def compose(self) -> ComposeResult:
        area = PromptArea(self.history, text=self.initial_prompt, id="prompt",
                          placeholder="prompt — Enter runs it through A and B at temperature 0; ctrl+j: new line; "
                                      "↑ earlier prompts")
        area.border_title = "prompt"
        yield area
        with Horizontal(id="max-tokens-box"):
            yield Label(MAX_TOKENS_LABEL, id="max-tokens-label")
            yield Input(str(self.max_tokens), id="max-tokens", restrict=r"[0-9]*", max_length=9, compact=True)

    def on_mount(self) -> None:
        self._show_lines()

    @property
    def area(self) -> PromptArea:
        return self.query_one("#prompt", PromptArea)

    @property
    def prompt(self) -> str:
        return self.area.text

    @property
    def max_tokens_text(self) -> str:
        return self.query_one("#max-tokens", Input).value

    def set_prompt(self, text: str) -> None:
        self.area.value = text
        self._show_lines()

    def on_text_area_changed(self, event: TextArea.Changed) -> None:
        self._show_lines()

    def _show_lines(self) -> None:
        lines = self.area.document.line_count
        size = len(self.area.text.encode("utf-8", "surrogatepass"))
        self.area.border_subtitle = f"{lines} lines · {size} bytes" if lines > 1 else ""

    def on_prompt_area_submitted(self, event: PromptArea.Submitted) -> None:
        event.stop()
        self.post_message(self.Run(self.prompt, self.max_tokens_text))

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.post_message(self.Run(self.prompt, self.max_tokens_text))
