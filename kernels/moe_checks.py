"""Input checks shared by the MoE launchers (gemv, grouped, torch grouped_mm peer): one place
that says what the `moe_reference` contract accepts, so the arms stay swappable.

Raises ValueError naming the argument, its shape or dtype, and what was expected. Never looks at
tensor values (that would wait for the device).
"""

from __future__ import annotations

import os

import torch


def check_moe_inputs(x, w13, w2, topk_ids, topk_weights) -> tuple[int, int, int, int, int]:
    """Shapes, dtypes and devices every MoE launcher needs; returns (T, D, E, F, k)."""
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, hidden], got shape {tuple(x.shape)}")
    tokens, hidden = x.shape
    if w13.dim() != 3 or w13.shape[2] != hidden or w13.shape[1] % 2:
        raise ValueError(f"w13 must be [E, 2F, D={hidden}], got shape {tuple(w13.shape)}")
    experts, two_f, _ = w13.shape
    intermediate = two_f // 2
    if tuple(w2.shape) != (experts, hidden, intermediate):
        raise ValueError(f"w2 must be [E={experts}, D={hidden}, F={intermediate}], got shape {tuple(w2.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != tokens:
        raise ValueError(f"topk_ids must be [T={tokens}, k], got shape {tuple(topk_ids.shape)}")
    top_k = topk_ids.shape[1]
    if tuple(topk_weights.shape) != (tokens, top_k):
        raise ValueError(f"topk_weights must be [T={tokens}, k={top_k}] like topk_ids, got {tuple(topk_weights.shape)}")
    if not 1 <= top_k <= experts:
        raise ValueError(f"k (topk_ids.shape[1]) must be in 1..E={experts}, got {top_k}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if not topk_weights.dtype.is_floating_point:
        raise ValueError(f"topk_weights must be a float tensor, got {topk_weights.dtype}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be bfloat16, float16 or float32, got {x.dtype}")
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"w13 ({w13.dtype}) and w2 ({w2.dtype}) must have x's dtype ({x.dtype})")
    devices = {t.device for t in (x, w13, w2, topk_ids, topk_weights)}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")
    for name, tensor in (("x", x), ("w13", w13), ("w2", w2)):
        if tensor.numel() and tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous along its last dimension (stride {tensor.stride()})")
    return tokens, hidden, experts, intermediate, top_k


def check_triton_device(tensor: torch.Tensor, arm: str) -> None:
    """Triton kernels need CUDA tensors, or CPU tensors under TRITON_INTERPRET=1 (tests)."""
    if tensor.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return
    raise ValueError(f"{arm} runs Triton kernels: its inputs must be on a CUDA device, got {tensor.device} "
                     "(the CPU path is kernels.reference.moe_reference; TRITON_INTERPRET=1 runs the "
                     "kernels slowly on the CPU)")
