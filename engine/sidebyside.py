"""Side-by-side comparison of two generations of the same prompt (configuration A vs B).

Each side decodes its own greedy continuation; after the first divergent token the two see
different inputs, which is what a user watching both panes sees.
"""

from __future__ import annotations

import torch

from engine.runtime import Generation


def first_divergence(tokens_a: list[int], tokens_b: list[int]) -> int | None:
    """Index of the first generated token that differs (or where one side stopped early), or None."""
    for index, (token_a, token_b) in enumerate(zip(tokens_a, tokens_b)):
        if token_a != token_b:
            return index
    return None if len(tokens_a) == len(tokens_b) else min(len(tokens_a), len(tokens_b))


def logit_relative_error(logits_a: torch.Tensor, logits_b: torch.Tensor) -> float:
    """||a - b|| / ||b|| of one step's last-position logits."""
    denominator = torch.linalg.vector_norm(logits_b.double())
    difference = torch.linalg.vector_norm(logits_a.double() - logits_b.double())
    return float(difference / denominator) if denominator > 0 else float(difference)


def compare(a: Generation, b: Generation, limit: int | None = None) -> dict:
    """`limit`: compare the first `limit` generated tokens only (B cancelled after that many: what it has is
    still compared, not discarded)."""
    return {
        "first_divergence": first_divergence(a.tokens[:limit], b.tokens[:limit]),
        "logit_rel_err": [logit_relative_error(la, lb) for la, lb in zip(a.logits[:limit], b.logits[:limit])],
    }
