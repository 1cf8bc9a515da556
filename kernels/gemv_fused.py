"""Decode GEMV with its neighbours folded in: the RMSNorm in front, and behind it the top-k routing
(router logits) or the argmax (LM-head logits). One launch where the decode step had two or three
(kernels.rms_norm, kernels.gemv, kernels.router / kernels.next_tokens).

    out[m, n] = sum_k w[n, k] * a[m, k]                     a = x (no norm), or
    out[m, n] = r[m] * sum_k w[n, k] * (g[k] * x[m, k])     RMSNorm folded: r = rsqrt(mean_k(x^2) + eps)

with x, the norm's input, one of (each row m):
    plain      x[m]                                    the given activations
    residual   (x_prev[m] + residual[m]) rounded to the dtype, as torch's add
    gather     table[index[m]]                         the step's embedding rows

Shapes: M rows (1 <= M <= MAX_ROWS), K = D hidden, N outputs. x / residual / x_out / h [M, K];
g [K]; table [V, K]; index [M]; w [N, K] unit stride along K; out [M, N].

Folded norm. The torch forward rounds h = (x32 * r).to(dtype) * g to the dtype and multiplies h;
here the product is taken with g * x in float32 and scaled by r at the end, so the outputs differ
from gemv(h, w) by the two roundings of h (each <= 2^-9 relative in bf16, 2^-11 in fp16, 2^-24 in
fp32) spread over the K terms: of the order of one rounding of the output, not a bit-equal
result (tests/test_decode_fused.py bounds it). Every program sums x^2 over all K in the same order,
so every program holds the same r. What the rest of the step needs as tensors, each program writes
a disjoint slice of: the new residual stream x_out (residual / gather) and h, computed exactly as
kernels.rms_norm computes them (x rounded after the add, x32 * r rounded, times g rounded), so
they are what that kernel writes up to the order of the mean's sum.
Norm.exact: a first pass over x for r, then the product with h rounded as kernels.rms_norm rounds it:
the output is then gemv(h, w) to the bit (the same sums in the same order), as the unfused launches
give it; for consumers that jump at a near tie (top-k routing, the argmax of logits), at the price of
reading x (and the residual) twice.

Epilogues (one per launch):
    store       out rounded to out_dtype (x's, or float32 for logits)
    route       out = float32 logits; the last program to arrive (kernels.arrivals) reads the N
                logits of every row past L1 and does what kernels.router.topk_softmax does (the
                same jit function): ids [M, k] int32, weights [M, k], and the number of distinct
                experts chosen (0-d int64; Route.into: written into the given int64 element instead,
                e.g. the graphed step's output buffer, so no copy gathers it; for one row that is k, stored
                without the count's second read of the ids)
    pick        out = float32 logits; the last program to arrive takes each row's argmax (the lowest id
                on ties, as torch.argmax: kernels.next_tokens's jit function) into tokens[m], and with
                `inputs` feeds the next replay: inputs[0, m] = that token, inputs[1, m] += 1 (what
                kernels.next_tokens does in a launch of its own); with `next_norm` it also gathers that
                token's embedding row and norms it (kernels.rms_norm's jit function, at its warps: the
                same bits) into the next step's x[m] and h[m], the rms_norm launch a chained step skips

Grid (cdiv(N, BLOCK_N),), the block sizes of kernels.gemv for one row (FMA path only: rows are
looped over, never padded to a tensor-core tile, so MAX_ROWS is below gemv's TENSOR_CORE_ROWS).

What a program reads (L2 traffic beside its BLOCK_N x K weights from DRAM): per row, K elements
of the activation (one vector in plain and gather modes, two -- x_prev and residual -- in residual
mode) and, with a norm, the K elements of g; at the end its slice (cdiv(K, programs) columns) of
those again; an exact norm reads the activation once more. At the v4 shape (K = 4096, bf16, one row)
that is 24 KB per program for a residual fold into the router or LM head (40 KB exact; 256 programs:
6 or 10 MB against 2 MB). A residual fold into a wide GEMV is the caller's choice (engine.decode_fused
folds residuals only into narrow products).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import arrivals, launches, pdl, scratch
from kernels.gemv import TENSOR_CORE_ROWS, block_sizes
from kernels.next_tokens import BLOCK as PICK_BLOCK
from kernels.next_tokens import _argmax_row, _feed
from kernels.rms_norm import _normed
from kernels.rms_norm import num_warps as norm_warps
from kernels.router import MAX_EXPERTS, _count_ids, _topk_softmax_row

MAX_ROWS = TENSOR_CORE_ROWS - 1  # the FMA path of kernels.gemv


@dataclass(frozen=True)
class Norm:
    """The RMSNorm in front of the product. Its input x is the launcher's `x` (plain), `x` + residual
    (rounded to the dtype) or table[index] (pass x=None). write_x: also return the new residual stream
    (residual / gather modes); write_h: also return h = RMSNorm(x) * weight."""

    weight: torch.Tensor  # [K]
    eps: float
    residual: torch.Tensor | None = None  # [M, K]
    table: torch.Tensor | None = None  # [V, K]
    index: torch.Tensor | None = None  # [M] int
    write_x: bool = False
    write_h: bool = False
    exact: bool = False  # round h before the product (a first pass over x for the scale), as rms_norm + gemv


@dataclass(frozen=True)
class Route:
    """Top-k softmax of the float32 logits, as kernels.router.topk_softmax (woken: also the count of
    distinct experts chosen)."""

    top_k: int
    weight_dtype: torch.dtype
    woken: bool = True
    into: torch.Tensor | None = None  # one int64 element the count is written into (else a scratch buffer)


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


@dataclass
class Fused:
    """What one launch produced; fields a mode does not produce are None."""

    out: torch.Tensor  # [M, N]: the product (the logits for Route and Pick)
    x: torch.Tensor | None = None  # [M, K] the new residual stream (Norm.write_x)
    h: torch.Tensor | None = None  # [M, K] the normed activations (Norm.write_h)
    ids: torch.Tensor | None = None  # [M, k] int32 (Route)
    weights: torch.Tensor | None = None  # [M, k] (Route)
    woken: torch.Tensor | None = None  # 0-d int64 (Route with woken)


@triton.jit
def _activation(x_ptr, residual_ptr, table_ptr, index_ptr, m, rows, cols, lanes, stride_xm, stride_rm, stride_t,
                GATHER: tl.constexpr, RESIDUAL: tl.constexpr):
    """Row m's x at columns `cols` (masked by `lanes`), in the dtype: the gathered embedding row, x + residual
    rounded as torch's add, or x itself."""
    if GATHER:
        source = tl.load(index_ptr + m, mask=m < rows, other=0).to(tl.int64)
        x = tl.load(table_ptr + source * stride_t + cols, mask=lanes, other=0.0)
    else:
        x = tl.load(x_ptr + m * stride_xm + cols, mask=lanes, other=0.0)
        if RESIDUAL:
            residual = tl.load(residual_ptr + m * stride_rm + cols, mask=lanes, other=0.0)
            x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _fused_step(accumulator, squares, scale, w32, k0, offs_k, offs_m, x_ptr, residual_ptr, table_ptr, index_ptr,
                norm_ptr, rows, k_in, stride_xm, stride_rm, stride_t, M_PAD: tl.constexpr, NORM: tl.constexpr,
                EXACT: tl.constexpr, GATHER: tl.constexpr, RESIDUAL: tl.constexpr):
    """The accumulator (and, for the norm without EXACT, the sums of squares) plus one loaded [BLOCK_N,
    BLOCK_K] weight tile, as fp32, times every row's activation at k0 (normed by `scale` with EXACT)."""
    cols = k0 + offs_k
    k_mask = cols < k_in
    if NORM:
        g = tl.load(norm_ptr + cols, mask=k_mask, other=0.0).to(tl.float32)
    for m in tl.static_range(M_PAD):
        lanes = k_mask & (tl.full(offs_k.shape, m, dtype=tl.int32) < rows)
        x = _activation(x_ptr, residual_ptr, table_ptr, index_ptr, m, rows, cols, lanes, stride_xm, stride_rm,
                        stride_t, GATHER, RESIDUAL)
        a = x.to(tl.float32)
        if NORM:
            if EXACT:  # h as kernels.rms_norm rounds it
                r = tl.sum(tl.where(offs_m == m, scale, 0.0), axis=0)
                a = ((a * r).to(x.dtype).to(tl.float32) * g).to(x.dtype).to(tl.float32)
            else:
                squares += tl.where(offs_m == m, tl.sum(a * a, axis=0), 0.0)
                a = a * g
        partial = tl.sum(w32 * a[None, :], axis=1)  # [BLOCK_N]
        accumulator += tl.where(offs_m[:, None] == m, partial[None, :], 0.0)
    return accumulator, squares


@triton.jit
def _gemv_fused_kernel(
    x_ptr, residual_ptr, table_ptr, index_ptr, norm_ptr,  # the norm's input and weight
    x_out_ptr, h_ptr,  # [M, K] slices written (WRITE_X / WRITE_H)
    w_ptr, out_ptr,  # [N, K], [M, N]
    ids_ptr, weights_ptr, woken_ptr,  # ROUTE
    tokens_ptr, feed_ptr, stride_feed,  # PICK
    next_table_ptr, next_norm_ptr, next_x_ptr, next_h_ptr, next_eps, stride_next_t, stride_next_x, stride_next_h,
    arrivals_ptr,  # ROUTE, PICK: 1 counter
    rows, n_out, k_in, eps, slice_cols,
    stride_xm, stride_rm, stride_t, stride_xo, stride_h, stride_wn, stride_om, stride_ids, stride_weights,
    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SLICE: tl.constexpr,
    NORM: tl.constexpr, EXACT: tl.constexpr, GATHER: tl.constexpr, RESIDUAL: tl.constexpr,
    WRITE_X: tl.constexpr, WRITE_H: tl.constexpr,
    ROUTE: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, WOKEN: tl.constexpr,
    COUNT_BLOCK: tl.constexpr,
    PICK: tl.constexpr, FEED: tl.constexpr, PICK_BLOCK: tl.constexpr,
    NEXT_NORM: tl.constexpr, NEXT_BLOCK: tl.constexpr,  # PICK: the next step's norm on the tokens picked
    USE_GDC: tl.constexpr,  # programmatic dependent launch (kernels.pdl)
    PRELOAD: tl.constexpr,  # the first weight tile loaded before the wait (kernels.pdl.preload)
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_out
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, M_PAD)
    m_mask = offs_m < rows
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    if PRELOAD:  # the weight does not depend on the grid before: its first tile (at one row of the router
        # and the LM head, all of the program's weight) while that grid ends
        w_first = tl.load(w_ptrs, mask=n_mask[:, None] & (offs_k < k_in)[None, :], other=0.0)
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
    accumulator = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
    squares = tl.zeros([M_PAD], dtype=tl.float32)  # sum of x^2 per row (NORM)
    scale = tl.full([M_PAD], 1.0, dtype=tl.float32)  # the rows' norm scale (NORM; EXACT: before the product)
    if NORM and EXACT:  # a first pass for the scale, so h can be rounded before the product
        for k0 in range(0, k_in, BLOCK_K):
            cols = k0 + offs_k
            for m in tl.static_range(M_PAD):
                lanes = (cols < k_in) & (tl.full([BLOCK_K], m, dtype=tl.int32) < rows)
                a = _activation(x_ptr, residual_ptr, table_ptr, index_ptr, m, rows, cols, lanes, stride_xm,
                                stride_rm, stride_t, GATHER, RESIDUAL).to(tl.float32)
                squares += tl.where(offs_m == m, tl.sum(a * a, axis=0), 0.0)
        scale = tl.math.rsqrt(squares / k_in + eps)  # [M_PAD], the same in every program
    k_start = 0
    if PRELOAD:  # the loop's first step, on the preloaded tile
        accumulator, squares = _fused_step(
            accumulator, squares, scale, w_first.to(tl.float32), 0, offs_k, offs_m, x_ptr, residual_ptr, table_ptr,
            index_ptr, norm_ptr, rows, k_in, stride_xm, stride_rm, stride_t, M_PAD, NORM, EXACT, GATHER, RESIDUAL)
        w_ptrs += BLOCK_K
        k_start = BLOCK_K
    for k0 in range(k_start, k_in, BLOCK_K):
        k_mask = k0 + offs_k < k_in  # as _fused_step's lanes: one mask for both (ptxas keeps the old schedule)
        w32 = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        accumulator, squares = _fused_step(
            accumulator, squares, scale, w32, k0, offs_k, offs_m, x_ptr, residual_ptr, table_ptr, index_ptr,
            norm_ptr, rows, k_in, stride_xm, stride_rm, stride_t, M_PAD, NORM, EXACT, GATHER, RESIDUAL)
        w_ptrs += BLOCK_K
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    if NORM:
        if not EXACT:
            scale = tl.math.rsqrt(squares / k_in + eps)  # [M_PAD], the same in every program
            accumulator = accumulator * scale[:, None]
        if WRITE_X or WRITE_H:  # this program's slice of the new residual stream and of h
            cols = pid * slice_cols + tl.arange(0, SLICE)
            in_slice = (tl.arange(0, SLICE) < slice_cols) & (cols < k_in)
            g_slice = tl.load(norm_ptr + cols, mask=in_slice, other=0.0)
            for m in tl.static_range(M_PAD):
                lanes = in_slice & (tl.full([SLICE], m, dtype=tl.int32) < rows)
                x = _activation(x_ptr, residual_ptr, table_ptr, index_ptr, m, rows, cols, lanes, stride_xm,
                                stride_rm, stride_t, GATHER, RESIDUAL)
                if WRITE_X:
                    tl.store(x_out_ptr + m * stride_xo + cols, x, mask=lanes)
                if WRITE_H:  # as kernels.rms_norm: x32 * r rounded, times the weight, rounded
                    r = tl.sum(tl.where(offs_m == m, scale, 0.0), axis=0)
                    normed = (x.to(tl.float32) * r).to(h_ptr.dtype.element_ty)
                    h = (normed.to(tl.float32) * g_slice.to(tl.float32)).to(h_ptr.dtype.element_ty)
                    tl.store(h_ptr + m * stride_h + cols, h, mask=lanes)
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    values = accumulator.to(out_ptr.dtype.element_ty)
    tl.store(out_ptrs, values, mask=out_mask)
    if ROUTE:  # the last program routes every row (kernels.arrivals)
        tl.debug_barrier()
        arrived = tl.atomic_add(arrivals_ptr, 1, sem="acq_rel")
        if arrived == tl.num_programs(0) - 1:
            offs_e = tl.arange(0, E_PAD)
            for row in range(rows):
                logits = tl.load(out_ptr + tl.cast(row, tl.int64) * stride_om + offs_e, mask=offs_e < n_out,
                                 other=float("-inf"), cache_modifier=".cg")
                _topk_softmax_row(logits, offs_e, n_out, ids_ptr + tl.cast(row, tl.int64) * stride_ids,
                                  weights_ptr + tl.cast(row, tl.int64) * stride_weights, E_PAD, TOP_K, K_PAD)
            if WOKEN:
                if M_PAD == 1:  # one row: its k ids are distinct (the top-k never takes an id twice)
                    tl.store(woken_ptr, tl.full([], TOP_K, tl.int64))
                else:
                    tl.debug_barrier()
                    tl.store(woken_ptr, _count_ids(ids_ptr, rows * TOP_K, n_out, E_PAD, COUNT_BLOCK).to(tl.int64))
            tl.atomic_xchg(arrivals_ptr, 0)
    if PICK:  # the last program takes every row's argmax
        tl.debug_barrier()
        arrived = tl.atomic_add(arrivals_ptr, 1, sem="acq_rel")
        if arrived == tl.num_programs(0) - 1:
            for row in range(rows):
                token = _argmax_row(out_ptr + tl.cast(row, tl.int64) * stride_om, n_out, PICK_BLOCK)
                tl.store(tokens_ptr + row, token)
                if FEED:
                    _feed(feed_ptr, stride_feed, row, token)
                if NEXT_NORM:  # as kernels.rms_norm's gather of this token's embedding row
                    cols = tl.arange(0, NEXT_BLOCK)
                    lanes = cols < k_in
                    x = tl.load(next_table_ptr + token.to(tl.int64) * stride_next_t + cols, mask=lanes, other=0.0)
                    tl.store(next_x_ptr + tl.cast(row, tl.int64) * stride_next_x + cols, x, mask=lanes)
                    tl.store(next_h_ptr + tl.cast(row, tl.int64) * stride_next_h + cols,
                             _normed(x, next_norm_ptr, cols, lanes, k_in, next_eps), mask=lanes)
            tl.atomic_xchg(arrivals_ptr, 0)


# Elements of a program's one weight tile at one row: 2 outputs x the whole K (4096 at v4-shape: 32 registers a
# thread at 4 warps), so the preload is a program's whole weight and the router's and the LM head's folds (N = 256)
# run 128 programs, each reading the activation, residual and norm weight once for two outputs. On the H200
# (runs 40, 41: v4 tg128 @ b1, three processes each) the step took 119.3 / 119.3 and 118.5 / 118.6 / 118.4 us
# against 119.6 / 119.5 and 118.7 / 119.0 / 118.8 with one output per program; four per program (64 programs,
# 64 registers of weights) 119.9 / 119.5.
ROW_TILE_ELEMENTS = 8192


def _row_block(rows: int, k_in: int, device: torch.device) -> tuple[int, int] | None:
    """(2, K) for a one-row fold on a GPU whose K fits ROW_TILE_ELEMENTS / 2, else None (kernels.gemv's block
    sizes)."""
    k_pad = triton.next_power_of_2(k_in)
    if rows != 1 or device.type != "cuda" or 2 * k_pad > ROW_TILE_ELEMENTS:
        return None
    return 2, k_pad


def gemv_fused(x: torch.Tensor | None, w: torch.Tensor, out_dtype: torch.dtype | None = None, *,
               norm: Norm | None = None, route: Route | None = None,
               pick: Pick | None = None, block: tuple[int, int] | None = None, preload: bool | None = None) -> Fused:
    """out = x @ w^T (or RMSNorm(x) @ w^T with `norm`) for M <= MAX_ROWS rows, fp32 accumulation, one
    launch; with `route` the top-k routing of the logits, with `pick` each row's argmax (and the next
    replay's inputs). `preload`: load the first weight tile before the PDL wait (None: as kernels.pdl.preload
    says for the device; the same result either way)."""
    if route is not None and pick is not None:
        raise ValueError("gemv_fused: one epilogue per launch (route or pick)")
    gather = norm is not None and norm.table is not None
    residual = norm.residual if norm is not None else None
    if gather:
        if x is not None or norm.index is None or residual is not None:
            raise ValueError("gemv_fused: a gather takes table and index, and no x or residual")
        source, rows = norm.table, norm.index.numel()
    else:
        if x is None or (norm is not None and norm.index is not None):
            raise ValueError("gemv_fused: give x, or (with a norm) table and index")
        source, rows = x, x.shape[0]
    if source.dim() != 2 or w.dim() != 2 or source.shape[1] != w.shape[1]:
        raise ValueError(f"gemv_fused: x must be [M, K] and w [N, K] with the same K, got {tuple(source.shape)} "
                         f"and {tuple(w.shape)}")
    dtype, device = source.dtype, source.device
    k_in, n_out = w.shape[1], w.shape[0]
    if w.dtype != dtype or source.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"gemv_fused: x ({dtype}) and w ({w.dtype}) need one dtype and unit stride along K")
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"gemv_fused takes 1..{MAX_ROWS} rows, got {rows}")
    if norm is not None:
        if norm.weight.shape != (k_in,) or norm.weight.stride(0) != 1:
            raise ValueError(f"gemv_fused: the norm weight must be [{k_in}], got {tuple(norm.weight.shape)}")
        if residual is not None and (residual.shape != x.shape or residual.stride(1) != 1 or residual.dtype != dtype):
            raise ValueError(f"gemv_fused: residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
        if norm.write_x and residual is None and not gather:
            raise ValueError("gemv_fused: write_x needs a residual add or a gather (else x is the input)")
    if route is not None:
        out_dtype = torch.float32
        if not 1 <= route.top_k <= n_out or n_out > MAX_EXPERTS:
            raise ValueError(f"gemv_fused: need 1 <= k <= E <= {MAX_EXPERTS}, got k={route.top_k}, E={n_out}")
    if pick is not None:
        if out_dtype != torch.float32:
            raise ValueError("gemv_fused: pick takes the argmax of float32 logits (out_dtype=torch.float32)")
        if pick.tokens.dtype != torch.int64 or pick.tokens.numel() < rows or not pick.tokens.is_contiguous():
            raise ValueError(f"gemv_fused: pick.tokens must be a contiguous int64 buffer of >= {rows}")
        if pick.inputs is not None and (pick.inputs.shape != (2, rows) or pick.inputs.dtype != torch.int64
                                        or pick.inputs.stride(1) != 1):
            raise ValueError(f"gemv_fused: pick.inputs must be int64 [2, {rows}], got {pick.inputs.dtype} "
                             f"{tuple(pick.inputs.shape)}")
        following = pick.next_norm
        if following is not None:
            if (following.table.dim() != 2 or following.table.shape[1] != k_in or following.table.stride(1) != 1
                    or following.table.dtype != dtype or following.weight.shape != (k_in,)):
                raise ValueError(f"gemv_fused: next_norm needs table [V, {k_in}] in {dtype} and weight [{k_in}]")
            if any(t.shape != (rows, k_in) or t.stride(1) != 1 or t.dtype != dtype for t in (following.x, following.h)):
                raise ValueError(f"gemv_fused: next_norm.x and .h must be [{rows}, {k_in}] in {dtype}")
            if not next_norm_fits(k_in):
                raise ValueError(f"gemv_fused: next_norm at K = {k_in} would reduce in another order than "
                                 f"kernels.rms_norm ({norm_warps(k_in)} warps)")
    if route is not None and route.into is not None and (route.into.dtype != torch.int64 or route.into.numel() != 1):
        raise ValueError("gemv_fused: route.into must be one int64 element")
    out = scratch.empty((rows, n_out), out_dtype or dtype, device)
    result = Fused(out)
    block_n, block_k = block or _row_block(rows, k_in, device) or block_sizes(n_out, k_in, w.element_size(), device, rows)
    dummy = out
    write_x = norm is not None and norm.write_x
    write_h = norm is not None and norm.write_h
    if write_x:
        result.x = scratch.empty((rows, k_in), dtype, device)
    if write_h:
        result.h = scratch.empty((rows, k_in), dtype, device)
    programs = triton.cdiv(n_out, block_n)
    slice_cols = triton.cdiv(k_in, programs)
    counters = dummy
    routing = {"ids": dummy, "weights": dummy, "woken": dummy, "stride_ids": 0, "stride_weights": 0}
    top_k = e_pad = count_block = 1
    if route is not None:
        result.ids = scratch.empty((rows, route.top_k), torch.int32, device)
        result.weights = scratch.empty((rows, route.top_k), route.weight_dtype, device)
        count = scratch.empty((1,), torch.int64, device) if route.into is None else route.into.reshape(1)
        result.woken = count[0] if route.woken else None
        routing = {"ids": result.ids, "weights": result.weights, "woken": count,
                   "stride_ids": result.ids.stride(0), "stride_weights": result.weights.stride(0)}
        top_k, e_pad = route.top_k, triton.next_power_of_2(n_out)
        count_block = max(1, min(64, 16384 // e_pad, triton.next_power_of_2(rows * top_k)))
        counters = arrivals.counters(device, 1)
    if pick is not None:
        counters = arrivals.counters(device, 1)
    feed = pick.inputs if pick is not None and pick.inputs is not None else dummy
    following = pick.next_norm if pick is not None else None
    next_args = (dummy,) * 4 + (0.0, 0, 0, 0) if following is None else (
        following.table, following.weight, following.x, following.h, following.eps, following.table.stride(0),
        following.x.stride(0), following.h.stride(0))
    _gemv_fused_kernel[(programs,)](
        x if x is not None else dummy, residual if residual is not None else dummy,
        norm.table if gather else dummy, norm.index if gather else dummy,
        norm.weight if norm is not None else dummy,
        result.x if write_x else dummy, result.h if write_h else dummy,
        w, out, routing["ids"], routing["weights"], routing["woken"],
        pick.tokens if pick is not None else dummy, feed, feed.stride(0) if feed is not dummy else 0,
        *next_args, counters,
        rows, n_out, k_in, norm.eps if norm is not None else 0.0, slice_cols,
        x.stride(0) if x is not None else 0, residual.stride(0) if residual is not None else 0,
        norm.table.stride(0) if gather else 0, result.x.stride(0) if write_x else 0,
        result.h.stride(0) if write_h else 0, w.stride(0), out.stride(0),
        routing["stride_ids"], routing["stride_weights"],
        M_PAD=triton.next_power_of_2(rows), BLOCK_N=block_n, BLOCK_K=block_k,
        SLICE=triton.next_power_of_2(slice_cols),
        NORM=norm is not None, EXACT=norm is not None and norm.exact, GATHER=gather, RESIDUAL=residual is not None,
        WRITE_X=write_x, WRITE_H=write_h,
        ROUTE=route is not None, TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), E_PAD=e_pad,
        WOKEN=route is not None and route.woken, COUNT_BLOCK=count_block,
        PICK=pick is not None, FEED=feed is not dummy, PICK_BLOCK=min(PICK_BLOCK, triton.next_power_of_2(n_out)),
        NEXT_NORM=following is not None, NEXT_BLOCK=triton.next_power_of_2(k_in),
        num_warps=4, **pdl.launch_options(device), PRELOAD=pdl.preload(device, "fused") if preload is None else preload,
    )
    launches.record("gemv_route" if route is not None
                    else ("gemv_pick_norm" if following is not None else "gemv_pick") if pick is not None
                    else "gemv_norm" if norm is not None else "gemv")
    return result
