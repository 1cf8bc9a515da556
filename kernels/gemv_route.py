"""The router's decode GEMV with its RMSNorm and its top-k routing folded in: one launch where the step had
three (kernels.rms_norm, kernels.gemv, kernels.router.topk_softmax).

    logits = RMSNorm(x) @ w^T in float32      (kernels.gemv_norm's product: kernels.parts.fold_gemv)
    ids, weights = top-k softmax of each row's logits, and the number of distinct experts chosen

Shapes: M rows (<= kernels.gemv_norm.MAX_ROWS), K = D hidden, N = E experts (<= kernels.router.MAX_EXPERTS).
out [M, E] float32; ids [M, k] int32; weights [M, k] in Route.weight_dtype; woken 0-d int64.

Every program stores its slice of the logits; the last to arrive (kernels.arrivals) reads every row's E
logits past L1 and routes them with kernels.parts.topk_softmax_row, the function kernels.router runs: the
same ids and weights as the unfused launches. The woken count goes into Route.into when given (the graphed
step's output buffer, so no copy gathers it); for one row it is k, stored without reading the ids again.

With Route.over_all the weights are the softmax over every expert at the k chosen (softmax-then-top-k
without renormalisation), with Route.scale times routed_scaling_factor (kernels.parts.topk_softmax_row).

Does not: route more than one group of rows per launch, or route group-limited (engine.decode_fused launches
kernels.router.group_topk after an unfused GEMV).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import arrivals, launches, scratch
from kernels.gemv_norm import FOLD_WARPS, Fused, Norm, check_fold
from kernels.parts import count_ids, fold_gemv, topk_softmax_row
from kernels.router import MAX_EXPERTS, count_block, route_replicas


@dataclass(frozen=True)
class Route:
    """Top-k softmax of the float32 logits, as kernels.router.topk_softmax (woken: also the count of
    distinct experts chosen; over_all and scale: as there)."""

    top_k: int
    weight_dtype: torch.dtype
    woken: bool = True
    into: torch.Tensor | None = None  # one int64 element the count is written into (else a scratch buffer)
    over_all: bool = False  # the softmax over every expert, not renormalised over the k chosen (DeepSeek-V2)
    scale: float = 1.0  # routed_scaling_factor: the weights times it


@triton.jit
def _gemv_route_kernel(
    x_ptr, residual_ptr, table_ptr, index_ptr, norm_ptr, x_out_ptr, h_ptr, w_ptr, out_ptr, bias_ptr,
    rows, n_out, k_in, eps, slice_cols,
    stride_xm, stride_rm, stride_t, stride_xo, stride_h, stride_wn, stride_om,
    ids_ptr, weights_ptr, woken_ptr, arrivals_ptr, stride_ids, stride_weights, route_scale,
    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SLICE: tl.constexpr,
    NORM: tl.constexpr, EXACT: tl.constexpr, GATHER: tl.constexpr, RESIDUAL: tl.constexpr,
    WRITE_X: tl.constexpr, WRITE_H: tl.constexpr, ROUND_ONCE: tl.constexpr, HAS_BIAS: tl.constexpr,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, WOKEN: tl.constexpr, COUNT_BLOCK: tl.constexpr,
    OVER_ALL: tl.constexpr,
    REPLICAS: tl.constexpr,  # copies of a row the last program routes (kernels.router.route_replicas)
    USE_GDC: tl.constexpr,  # programmatic dependent launch (kernels.pdl)
    PRELOAD: tl.constexpr,  # the first weight tile loaded before the wait (kernels.pdl.preload)
):
    fold_gemv(x_ptr, residual_ptr, table_ptr, index_ptr, norm_ptr, x_out_ptr, h_ptr, w_ptr, out_ptr, bias_ptr,
              rows, n_out, k_in, eps, slice_cols,
              stride_xm, stride_rm, stride_t, stride_xo, stride_h, stride_wn, stride_om,
              M_PAD, BLOCK_N, BLOCK_K, SLICE, NORM, EXACT, GATHER, RESIDUAL, WRITE_X, WRITE_H, ROUND_ONCE, HAS_BIAS,
              USE_GDC, PRELOAD)
    # the last program routes every row (kernels.arrivals)
    tl.debug_barrier()
    arrived = tl.atomic_add(arrivals_ptr, 1, sem="acq_rel")
    if arrived == tl.num_programs(0) - 1:
        for row in range(rows):
            topk_softmax_row(out_ptr + tl.cast(row, tl.int64) * stride_om, n_out,
                             ids_ptr + tl.cast(row, tl.int64) * stride_ids,
                             weights_ptr + tl.cast(row, tl.int64) * stride_weights, E_PAD, TOP_K, K_PAD,
                             OVER_ALL, route_scale, REPLICAS, ".cg")
        if WOKEN:
            if M_PAD == 1:  # one row: its k ids are distinct (the top-k never takes an id twice)
                tl.store(woken_ptr, tl.full([], TOP_K, tl.int64))
            else:
                tl.debug_barrier()
                tl.store(woken_ptr, count_ids(ids_ptr, rows * TOP_K, n_out, E_PAD, COUNT_BLOCK).to(tl.int64))
        tl.atomic_xchg(arrivals_ptr, 0)


def gemv_route(x: torch.Tensor | None, w: torch.Tensor, *, route: Route, norm: Norm | None = None,
               bias: torch.Tensor | None = None, block: tuple[int, int] | None = None,
               preload: bool | None = None) -> Fused:
    """The float32 logits x @ w^T (or RMSNorm(x) @ w^T with `norm`), plus `bias` [E] where given (gpt-oss's router
    bias, added in float32 before the routing reads them), and their top-k routing, one launch:
    Fused.out, .ids, .weights and (route.woken) .woken; with the norm's write_x / write_h also .x and .h.
    `preload`: as kernels.gemv_norm.gemv_norm."""
    fold = check_fold("gemv_route", x, w, norm, bias)
    if not 1 <= route.top_k <= fold.n_out or fold.n_out > MAX_EXPERTS:
        raise ValueError(f"gemv_route: need 1 <= k <= E <= {MAX_EXPERTS}, got k={route.top_k}, E={fold.n_out}")
    if route.into is not None and (route.into.dtype != torch.int64 or route.into.numel() != 1):
        raise ValueError("gemv_route: route.into must be one int64 element")
    rows, device = fold.rows, fold.device
    result = fold.allocate(torch.float32, block, preload)
    result.ids = scratch.empty((rows, route.top_k), torch.int32, device)
    result.weights = scratch.empty((rows, route.top_k), route.weight_dtype, device)
    count = scratch.empty((1,), torch.int64, device) if route.into is None else route.into.reshape(1)
    result.woken = count[0] if route.woken else None
    e_pad = triton.next_power_of_2(fold.n_out)
    _gemv_route_kernel[(fold.programs,)](
        *fold.args, result.ids, result.weights, count, arrivals.counters(device, 1),
        result.ids.stride(0), result.weights.stride(0), float(route.scale),
        TOP_K=route.top_k, OVER_ALL=route.over_all, K_PAD=triton.next_power_of_2(route.top_k), E_PAD=e_pad, WOKEN=route.woken,
        COUNT_BLOCK=count_block(e_pad, rows * route.top_k), REPLICAS=route_replicas(e_pad, FOLD_WARPS),
        **fold.constexprs,
    )
    launches.record("gemv_route", kernel=_gemv_route_kernel)
    return result
