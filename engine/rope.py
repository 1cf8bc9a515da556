"""RoPE frequencies shared by the torch forward (engine.model) and the fused decode step (engine.decode_fused)."""

from __future__ import annotations

import math

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


_YARN_FREQUENCIES: dict[tuple, torch.Tensor] = {}


def yarn_inverse_frequency(config: ModelConfig, device: torch.device) -> torch.Tensor:
    """YaRN's inverse frequencies [hd/2], computed on the CPU (as transformers does) and kept per device:
    the first call is an eager step's, so a CUDA graph's capture copies nothing from the host."""
    key = (config.rope_scaling, config.rotary_dim, config.rope_theta, str(device))
    cached = _YARN_FREQUENCIES.get(key)
    if cached is None:
        cached = _YARN_FREQUENCIES[key] = _yarn_inverse_frequency_cpu(config).to(device)
    return cached


def _yarn_inverse_frequency_cpu(config: ModelConfig) -> torch.Tensor:
    yarn, dim, base = config.rope_scaling, config.rotary_dim, config.rope_theta

    def correction_dimension(rotations: float) -> float:  # the dimension that turns `rotations` times
        return dim * math.log(yarn.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dimension(yarn.beta_fast), correction_dimension(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # [hd/2]
    position_frequency = base ** (torch.arange(0, dim, 2).float() / dim)  # [hd/2]
    extrapolation = 1 - ramp  # 1: keep the original frequency
    return (1.0 / (yarn.factor * position_frequency)) * (1 - extrapolation) + (1.0 / position_frequency) * extrapolation
