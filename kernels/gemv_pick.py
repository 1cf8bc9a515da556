"""The LM head's decode GEMV with its RMSNorm and the step's argmax folded in: one launch where a graphed step
had three (kernels.rms_norm, kernels.gemv, kernels.next_tokens).

    logits = RMSNorm(x) @ w^T in float32      (kernels.gemv_norm's product: kernels.parts.fold_gemv)
    tokens[m] = argmax(logits[m])             the lowest id on ties, as torch.argmax
    inputs[0, m] = tokens[m]; inputs[1, m] += 1          with Pick.inputs: the next graph replay's feed
    next x[m] = table[tokens[m]]; next h[m] = RMSNorm(next x[m]) * weight   with Pick.next_norm

Shapes: M rows (<= kernels.gemv_norm.MAX_ROWS), K = D hidden, N = V vocabulary. out [M, V] float32;
tokens int64 (>= M elements); inputs [2, M] int64; next_norm's table [V, K], x and h [M, K].

Every program stores its slice of the logits; the last to arrive (kernels.arrivals) takes each row's argmax
with kernels.parts.argmax_row and feeds the next replay with kernels.parts.feed_next, the functions
kernels.next_tokens runs. With `next_norm` it also norms the picked token's embedding row with
kernels.parts.norm_row at kernels.rms_norm's warps (4: `next_norm_fits`), the same bits as that launch, so a
chained step of a graph of several steps skips its first rms_norm (docs/decode-step.md).

Does not: sample (temperature 0 only), or norm rows wider than kernels.rms_norm takes at 4 warps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import arrivals, launches
from kernels.gemv_norm import Fused, Norm, check_fold
from kernels.next_tokens import BLOCK as PICK_BLOCK
from kernels.parts import argmax_row, feed_next, fold_gemv, norm_row
from kernels.rms_norm import num_warps as norm_warps


@dataclass(frozen=True)
class NextNorm:
    """The next decode step's first RMSNorm, on the rows' picked tokens: x[m] = table[token m] and
    h[m] = RMSNorm(x[m]) * weight, as kernels.rms_norm's gather computes them (the same jit function, launched
    with its warps: the same bits), written by the program that picks."""

    table: torch.Tensor  # [V, K] the embedding
    weight: torch.Tensor  # [K]
    eps: float
    x: torch.Tensor  # [M, K] written
    h: torch.Tensor  # [M, K] written
    rounds_once: bool = False  # h rounded once (gpt-oss), as kernels.rms_norm's rounds_once


def next_norm_fits(k_in: int) -> bool:
    """Whether a pick can norm the next step's rows of K = k_in to kernels.rms_norm's bits: that launch reduces
    with this kernel's 4 warps only up to its own limit (kernels.rms_norm.num_warps)."""
    return norm_warps(k_in) == 4


@dataclass(frozen=True)
class Pick:
    """Each row's argmax of the float32 logits into `tokens` (int64, >= M elements); with `inputs`
    ([2, M] int64) also the next replay's token and position, as kernels.next_tokens; with `next_norm` also
    the next step's first norm on those tokens."""

    tokens: torch.Tensor
    inputs: torch.Tensor | None = None
    next_norm: NextNorm | None = None


@triton.jit
def _gemv_pick_kernel(
    x_ptr, residual_ptr, table_ptr, index_ptr, norm_ptr, x_out_ptr, h_ptr, w_ptr, out_ptr, bias_ptr,
    rows, n_out, k_in, eps, slice_cols,
    stride_xm, stride_rm, stride_t, stride_xo, stride_h, stride_wn, stride_om,
    tokens_ptr, feed_ptr, stride_feed,
    next_table_ptr, next_norm_ptr, next_x_ptr, next_h_ptr, next_eps, stride_next_t, stride_next_x, stride_next_h,
    arrivals_ptr,
    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SLICE: tl.constexpr,
    NORM: tl.constexpr, EXACT: tl.constexpr, GATHER: tl.constexpr, RESIDUAL: tl.constexpr,
    WRITE_X: tl.constexpr, WRITE_H: tl.constexpr, ROUND_ONCE: tl.constexpr, HAS_BIAS: tl.constexpr,
    FEED: tl.constexpr, PICK_BLOCK: tl.constexpr,
    NEXT_NORM: tl.constexpr, NEXT_BLOCK: tl.constexpr,  # the next step's norm on the tokens picked
    NEXT_ROUND_ONCE: tl.constexpr,  # that norm's h rounded once (NextNorm.rounds_once)
    USE_GDC: tl.constexpr,  # programmatic dependent launch (kernels.pdl)
    PRELOAD: tl.constexpr,  # the first weight tile loaded before the wait (kernels.pdl.preload)
):
    fold_gemv(x_ptr, residual_ptr, table_ptr, index_ptr, norm_ptr, x_out_ptr, h_ptr, w_ptr, out_ptr, bias_ptr,
              rows, n_out, k_in, eps, slice_cols,
              stride_xm, stride_rm, stride_t, stride_xo, stride_h, stride_wn, stride_om,
              M_PAD, BLOCK_N, BLOCK_K, SLICE, NORM, EXACT, GATHER, RESIDUAL, WRITE_X, WRITE_H, ROUND_ONCE, HAS_BIAS,
              USE_GDC, PRELOAD)
    # the last program takes every row's argmax
    tl.debug_barrier()
    arrived = tl.atomic_add(arrivals_ptr, 1, sem="acq_rel")
    if arrived == tl.num_programs(0) - 1:
        for row in range(rows):
            token = argmax_row(out_ptr + tl.cast(row, tl.int64) * stride_om, n_out, PICK_BLOCK)
            tl.store(tokens_ptr + row, token)
            if FEED:
                feed_next(feed_ptr, stride_feed, row, token)
            if NEXT_NORM:  # as kernels.rms_norm's gather of this token's embedding row
                cols = tl.arange(0, NEXT_BLOCK)
                lanes = cols < k_in
                x = tl.load(next_table_ptr + token.to(tl.int64) * stride_next_t + cols, mask=lanes, other=0.0)
                tl.store(next_x_ptr + tl.cast(row, tl.int64) * stride_next_x + cols, x, mask=lanes)
                tl.store(next_h_ptr + tl.cast(row, tl.int64) * stride_next_h + cols,
                         norm_row(x, next_norm_ptr, cols, lanes, k_in, next_eps, NEXT_ROUND_ONCE), mask=lanes)
        tl.atomic_xchg(arrivals_ptr, 0)


def gemv_pick(x: torch.Tensor | None, w: torch.Tensor, out_dtype: torch.dtype | None = torch.float32, *,
              pick: Pick, norm: Norm | None = None, bias: torch.Tensor | None = None,
              block: tuple[int, int] | None = None, preload: bool | None = None) -> Fused:
    """The float32 logits x @ w^T (or RMSNorm(x) @ w^T with `norm`) and each row's argmax into pick.tokens
    (with pick.inputs, the next replay's feed; with pick.next_norm, the next step's first norm), one launch.
    `out_dtype` must be float32 (the argmax is of float32 logits). `preload`: as kernels.gemv_norm.gemv_norm."""
    fold = check_fold("gemv_pick", x, w, norm, bias)
    rows, k_in, dtype = fold.rows, fold.k_in, fold.dtype
    if out_dtype != torch.float32:
        raise ValueError("gemv_pick: pick takes the argmax of float32 logits (out_dtype=torch.float32)")
    if pick.tokens.dtype != torch.int64 or pick.tokens.numel() < rows or not pick.tokens.is_contiguous():
        raise ValueError(f"gemv_pick: pick.tokens must be a contiguous int64 buffer of >= {rows}")
    if pick.inputs is not None and (pick.inputs.shape != (2, rows) or pick.inputs.dtype != torch.int64
                                    or pick.inputs.stride(1) != 1):
        raise ValueError(f"gemv_pick: pick.inputs must be int64 [2, {rows}], got {pick.inputs.dtype} "
                         f"{tuple(pick.inputs.shape)}")
    following = pick.next_norm
    if following is not None:
        if (following.table.dim() != 2 or following.table.shape[1] != k_in or following.table.stride(1) != 1
                or following.table.dtype != dtype or following.weight.shape != (k_in,)):
            raise ValueError(f"gemv_pick: next_norm needs table [V, {k_in}] in {dtype} and weight [{k_in}]")
        if any(t.shape != (rows, k_in) or t.stride(1) != 1 or t.dtype != dtype for t in (following.x, following.h)):
            raise ValueError(f"gemv_pick: next_norm.x and .h must be [{rows}, {k_in}] in {dtype}")
        if not next_norm_fits(k_in):
            raise ValueError(f"gemv_pick: next_norm at K = {k_in} would reduce in another order than "
                             f"kernels.rms_norm ({norm_warps(k_in)} warps)")
    result = fold.allocate(out_dtype, block, preload)
    dummy = result.out
    counters = arrivals.counters(fold.device, 1)
    feed = pick.inputs if pick.inputs is not None else dummy
    next_args = (dummy,) * 4 + (0.0, 0, 0, 0) if following is None else (
        following.table, following.weight, following.x, following.h, following.eps, following.table.stride(0),
        following.x.stride(0), following.h.stride(0))
    _gemv_pick_kernel[(fold.programs,)](
        *fold.args, pick.tokens, feed, feed.stride(0) if feed is not dummy else 0, *next_args, counters,
        FEED=feed is not dummy, PICK_BLOCK=min(PICK_BLOCK, triton.next_power_of_2(fold.n_out)),
        NEXT_NORM=following is not None, NEXT_BLOCK=triton.next_power_of_2(k_in),
        NEXT_ROUND_ONCE=following is not None and following.rounds_once,
        **fold.constexprs,
    )
    launches.record("gemv_pick_norm" if following is not None else "gemv_pick", kernel=_gemv_pick_kernel)
    return result
