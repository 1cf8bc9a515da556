"""A family's expert math that no kernel arm's plain SwiGLU computes: gpt-oss's biases and clamped SwiGLU.

engine.model's forward and engine.decode_fused's decode step hand it to the hooks' `moe` as `experts=`; the
dispatcher runs it on the GEMV arm's clamped epilogue (kernels.moe_gemv.moe_gemv_clamped) or on the reference
arm, and records why. Knows nothing of arms, flags or devices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import ModelConfig
from kernels.reference import moe_reference_gpt_oss


@dataclass(frozen=True)
class FamilyExperts:
    """gpt-oss's expert extras: biases and the clamped SwiGLU. Called, it is the torch reference of the whole
    layer's experts (kernels.reference.moe_reference_gpt_oss)."""

    description: str
    b13: torch.Tensor | None  # [E, 2F]
    b2: torch.Tensor | None  # [E, D]
    alpha: float
    limit: float

    def __call__(self, h, w13, w2, topk_ids, topk_weights) -> torch.Tensor:
        return moe_reference_gpt_oss(h, w13, w2, topk_ids, topk_weights, self.b13, self.b2, self.alpha, self.limit)


def family_experts(config: ModelConfig, weights: dict[str, torch.Tensor], layer: int) -> FamilyExperts | None:
    """The layer's expert extras, or None when its experts are plain SwiGLU (every arm computes them)."""
    if config.plain_experts:
        return None
    p = f"layers.{layer}."
    return FamilyExperts(
        f"gpt-oss experts (clamped SwiGLU alpha={config.activation_alpha:g} limit={config.activation_limit:g}"
        + (", biases)" if config.expert_bias else ")"),
        weights.get(p + "b13"), weights.get(p + "b2"), config.activation_alpha, config.activation_limit)
