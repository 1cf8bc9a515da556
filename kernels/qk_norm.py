"""OLMoE's attention inputs after the q/k/v product: RMSNorms over the whole q and k projections, then clip_qkv,
in one launch, in place.

Computes what engine.model writes as two RMSNorms and three clamps (about a dozen torch kernels a layer):

    q = RMSNorm(q) * q_weight;  k = RMSNorm(k) * k_weight      (norm_row's rounding: the normed value, then the
                                                                product with the weight; `rounds_once` the product only)
    q, k, v = clamp(q, -clip, clip), clamp(k, ...), clamp(v, ...)   when `clip` is given

Shapes: qkv [B, Nq + Nk + Nv] (the packed q/k/v GEMV's output, unit stride along it), q_weight [Nq], k_weight [Nk].
Grid (B, 3): a program holds one row's whole q, k or v part (each at most MAX_WIDTH), reads it and writes it back.
h differs from the torch path only through the order of the mean's sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import launches, pdl
from kernels.parts import norm_row
from kernels.rms_norm import num_warps

MAX_WIDTH = 16384


@triton.jit
def _clip(x, clip, CLIP: tl.constexpr):
    """x clamped to [-clip, clip] in float32 and rounded back, as torch's clamp with a float bound."""
    if CLIP:
        x = tl.minimum(tl.maximum(x.to(tl.float32), -clip), clip).to(x.dtype)
    return x


@triton.jit
def _qk_norm_kernel(
    qkv_ptr,  # [B, Nq + Nk + Nv], normed and clipped in place
    q_weight_ptr,  # [Nq]
    k_weight_ptr,  # [Nk]
    q_width, k_width, v_width,
    stride_b,
    eps,
    clip,
    BLOCK: tl.constexpr,  # next power of two of the widest part
    NORM: tl.constexpr,  # the q and k norms (else clip only)
    CLIP: tl.constexpr,
    USE_GDC: tl.constexpr,  # programmatic dependent launch (kernels.pdl)
    ROUND_ONCE: tl.constexpr = False,  # h = (x32 * r * weight) rounded once (gpt-oss's norm)
):
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()  # three short programs per row: let the next grid queue up
    b = tl.program_id(0)
    part = tl.program_id(1)  # 0: q, 1: k, 2: v
    offs = tl.arange(0, BLOCK)
    row = qkv_ptr + b.to(tl.int64) * stride_b
    if part == 0:
        mask = offs < q_width
        x = tl.load(row + offs, mask=mask, other=0.0)
        if NORM:
            x = norm_row(x, q_weight_ptr, offs, mask, q_width, eps, ROUND_ONCE)
        tl.store(row + offs, _clip(x, clip, CLIP), mask=mask)
    elif part == 1:
        mask = offs < k_width
        x = tl.load(row + q_width + offs, mask=mask, other=0.0)
        if NORM:
            x = norm_row(x, k_weight_ptr, offs, mask, k_width, eps, ROUND_ONCE)
        tl.store(row + q_width + offs, _clip(x, clip, CLIP), mask=mask)
    elif CLIP:
        mask = offs < v_width
        x = tl.load(row + q_width + k_width + offs, mask=mask, other=0.0)
        tl.store(row + q_width + k_width + offs, _clip(x, clip, CLIP), mask=mask)


def qk_norm_clip(qkv: torch.Tensor, q_width: int, k_width: int, q_weight: torch.Tensor | None,
                 k_weight: torch.Tensor | None, eps: float, clip: float | None = None,
                 rounds_once: bool = False) -> torch.Tensor:
    """Norm the q columns [0, q_width) and the k columns [q_width, q_width + k_width) of every row of `qkv` with
    q_weight and k_weight (both None: no norm), then clamp every column to [-clip, clip] (None: no clamp); in place,
    returns qkv."""
    norm = q_weight is not None
    if (k_weight is not None) != norm:
        raise ValueError("qk_norm_clip: give both q_weight and k_weight, or neither")
    if qkv.dim() != 2 or qkv.stride(1) != 1:
        raise ValueError(f"qk_norm_clip: qkv must be [B, N] with unit stride, got {tuple(qkv.shape)}")
    v_width = qkv.shape[1] - q_width - k_width
    if q_width < 1 or k_width < 1 or v_width < 0:
        raise ValueError(f"qk_norm_clip: q and k widths {q_width} and {k_width} do not fit a row of {qkv.shape[1]}")
    if max(q_width, k_width, v_width) > MAX_WIDTH:
        raise ValueError(f"qk_norm_clip: a part wider than {MAX_WIDTH}")
    if norm and (q_weight.shape != (q_width,) or k_weight.shape != (k_width,)):
        raise ValueError(f"qk_norm_clip: the norm weights must be [{q_width}] and [{k_width}], got "
                         f"{tuple(q_weight.shape)} and {tuple(k_weight.shape)}")
    if clip is not None and not clip > 0:
        raise ValueError(f"qk_norm_clip: clip must be > 0, got {clip}")
    if qkv.shape[0] == 0 or (not norm and clip is None):
        return qkv
    widest = max(q_width, k_width, v_width)
    _qk_norm_kernel[(qkv.shape[0], 3 if clip is not None else 2)](
        qkv, q_weight if norm else qkv, k_weight if norm else qkv, q_width, k_width, v_width, qkv.stride(0),
        float(eps), float(clip or 0.0), BLOCK=triton.next_power_of_2(widest), NORM=norm, CLIP=clip is not None,
        ROUND_ONCE=rounds_once, num_warps=num_warps(widest), **pdl.launch_options(qkv.device),
    )
    launches.record("qk_norm_clip", kernel=_qk_norm_kernel)
    return qkv
