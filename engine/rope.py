"""RoPE frequencies shared by the torch forward (engine.model) and the fused decode step (engine.decode_fused)."""

from __future__ import annotations

import torch

from engine.config import ModelConfig


def rope_inverse_frequency(config: ModelConfig, device) -> torch.Tensor:
    """theta^(-i / (hd/2)) for i < hd/2, float32 [hd/2]: plain RoPE's frequencies (hd: the rotated dims,
    `config.rotary_dim`: the head dim, or latent attention's shared RoPE key)."""
    half = config.rotary_dim // 2
    return config.rope_theta ** (-torch.arange(half, device=device, dtype=torch.float32) / half)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, hd]; cos, sin [T, hd/2] (one position per column) or [B, T, hd/2] (ragged rows);
    rotate-half RoPE in float32."""
    half = x.shape[-1] // 2
    x32 = x.float()
    first, second = x32[..., :half], x32[..., half:]
    if cos.dim() == 2:
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    else:
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1).to(x.dtype)
