"""RoPE frequencies shared by the torch forward (engine.model) and the fused decode step (engine.decode_fused)."""

from __future__ import annotations

import torch

from engine.config import ModelConfig


def rope_inverse_frequency(config: ModelConfig, device) -> torch.Tensor:
    """theta^(-i / (hd/2)) for i < hd/2, float32 [hd/2]: plain RoPE's frequencies (hd: the rotated dims,
    `config.rotary_dim`: the head dim, or latent attention's shared RoPE key)."""
    half = config.rotary_dim // 2
    return config.rope_theta ** (-torch.arange(half, device=device, dtype=torch.float32) / half)
