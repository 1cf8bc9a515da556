"""RMSNorm with the residual add (or the embedding gather) in front, one launch for all rows.

Computes what engine.model writes as two or three torch kernels each:

    x = x + residual            (rounded to x's dtype, as torch's add)      when `residual` is given
    x = table[index]            (the embedding rows of the step's tokens)   when `index` is given
    h = (x32 * rsqrt(mean(x32^2) + eps)).to(dtype) * weight                 x32 = x in float32

and returns (x, h): the new residual stream and its normed copy. Rounding happens where the torch
expression rounds (the normalised value to the dtype, then the product with the weight; with
`rounds_once`, gpt-oss's norm, only the float32 product), so h differs from the torch path only through
the order of the mean's sum.

Shapes: rows R (tokens), D hidden.  x / residual / h [R, D]; weight [D]; table [V, D]; index [R].
Grid: (R,); a program holds its whole row (D <= MAX_HIDDEN).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import launches, pdl, scratch
from kernels.parts import norm_row

MAX_HIDDEN = 16384


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [R, D] the residual stream (read; written back when HAS_RESIDUAL)
    residual_ptr,  # [R, D] added to x first (unused without HAS_RESIDUAL)
    table_ptr,  # [V, D] embedding (unused without GATHER)
    index_ptr,  # [R] rows of the table (unused without GATHER)
    x_out_ptr,  # [R, D] the new residual stream
    weight_ptr,  # [D]
    h_ptr,  # [R, D]
    hidden,
    eps,
    stride_x, stride_r, stride_t, stride_xo, stride_h,
    BLOCK_D: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    GATHER: tl.constexpr,
    USE_GDC: tl.constexpr,  # programmatic dependent launch (kernels.pdl)
    ROUND_ONCE: tl.constexpr = False,  # h = (x32 * r * weight) rounded once (gpt-oss)
):
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()  # one short program per row: let the next grid queue up
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < hidden
    if GATHER:
        source = tl.load(index_ptr + row).to(tl.int64)
        x = tl.load(table_ptr + source * stride_t + offs, mask=mask, other=0.0)
    else:
        x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row.to(tl.int64) * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_out_ptr.dtype.element_ty)
    if HAS_RESIDUAL or GATHER:
        tl.store(x_out_ptr + row.to(tl.int64) * stride_xo + offs, x, mask=mask)
    tl.store(h_ptr + row.to(tl.int64) * stride_h + offs, norm_row(x, weight_ptr, offs, mask, hidden, eps, ROUND_ONCE),
             mask=mask)


def num_warps(hidden: int) -> int:
    """The warps a row of `hidden` elements is normed with (a reduction's order follows its layout)."""
    return 4 if hidden <= 4096 else 8


def rms_norm(x: torch.Tensor | None, weight: torch.Tensor, eps: float, *, residual: torch.Tensor | None = None,
             table: torch.Tensor | None = None, index: torch.Tensor | None = None, rounds_once: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x', h) with x' = x + residual, or table[index], or x itself; h = RMSNorm(x') * weight (rounded once with
    `rounds_once`, as engine.model.rms_norm's rounds_once)."""
    gather = table is not None
    if gather == (x is not None) or gather != (index is not None):
        raise ValueError("rms_norm: give either x, or table and index")
    if gather and residual is not None:
        raise ValueError("rms_norm: a residual add after a gather is not supported")
    source = table if gather else x
    hidden = source.shape[-1]
    rows = index.numel() if gather else x.shape[0]
    if source.dim() != 2 or source.stride(1) != 1 or weight.shape != (hidden,):
        raise ValueError(f"rms_norm: rows must be [R, D] with unit stride and weight [D], got "
                         f"{tuple(source.shape)} and {tuple(weight.shape)}")
    if hidden > MAX_HIDDEN:
        raise ValueError(f"rms_norm: hidden {hidden} > {MAX_HIDDEN}")
    if residual is not None and (residual.shape != x.shape or residual.stride(1) != 1):
        raise ValueError(f"rms_norm: residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
    dtype, device = source.dtype, source.device
    h = scratch.empty((rows, hidden), dtype, device)
    writes_x = gather or residual is not None
    x_out = scratch.empty((rows, hidden), dtype, device) if writes_x else x
    if rows == 0:
        return x_out, h
    dummy = h
    _rms_norm_kernel[(rows,)](
        dummy if gather else x, residual if residual is not None else dummy, table if gather else dummy,
        index if gather else dummy, x_out, weight, h, hidden, eps,
        0 if gather else x.stride(0), residual.stride(0) if residual is not None else 0,
        table.stride(0) if gather else 0, x_out.stride(0), h.stride(0),
        BLOCK_D=triton.next_power_of_2(hidden), HAS_RESIDUAL=residual is not None, GATHER=gather,
        num_warps=num_warps(hidden), **pdl.launch_options(weight.device), ROUND_ONCE=rounds_once,
    )
    launches.record("rms_norm", kernel=_rms_norm_kernel)
    return x_out, h
