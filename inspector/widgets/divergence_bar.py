"""Where A and B part: the first divergent token, and the per-step logit relative error of A
against B as a sparkline (flat at zero while they compute the same thing)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Sparkline, Static


def common_prefix_divergence(tokens_a: list[int], tokens_b: list[int]) -> int | None:
    """The first index where both sides have a token and they differ (a side still streaming, or
    cut short by a cancel, is not a divergence)."""
    for index, (token_a, token_b) in enumerate(zip(tokens_a, tokens_b)):
        if token_a != token_b:
            return index
    return None


class DivergenceBar(Vertical):
    def __init__(self, id: str | None = None) -> None:  # noqa: A002
        super().__init__(id=id)
        self.divergence: int | None = None
        self.errors: list[float] = []

    def compose(self) -> ComposeResult:
        yield Static("no run yet", id="divergence-line")
        with Horizontal(id="error-row"):
            yield Static("logit rel err/token (A vs B):", id="error-label")
            yield Sparkline([], id="error-sparkline")

    def show_line(self, text: str, diverged: bool = False) -> None:
        line = self.query_one("#divergence-line", Static)
        line.update(text)
        line.set_class(diverged, "-diverged")

    def show_errors(self, errors: list[float], log_steps: list[int] | None = None) -> None:
        """`errors[i]`: generated token i's logit relative error; `log_steps[i]`: the dispatch log's step that
        emitted it (named beside the worst)."""
        self.errors = list(errors)
        self.query_one("#error-sparkline", Sparkline).data = self.errors
        if errors and max(errors) == 0.0:
            label = f"logit rel err (A vs B): 0 at all {len(errors)} tokens (bit-identical logits)"
        elif errors:
            worst = max(range(len(errors)), key=errors.__getitem__)
            step = log_steps[worst] if log_steps and worst < len(log_steps) else None
            label = (f"logit rel err (A vs B): max {errors[worst]:.2e} at token {worst}"
                     + ("" if step is None else f" (log step {step})"))
        else:
            label = "logit rel err/token (A vs B):"
        self.query_one("#error-label", Static).update(label)
