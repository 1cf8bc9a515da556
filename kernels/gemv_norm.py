"""A decode GEMV with the RMSNorm in front folded in, one launch where the step had two (kernels.rms_norm,
kernels.gemv); and the host side the other fused GEMVs share (kernels.gemv_route, kernels.gemv_pick).

    out[m, n] = sum_k w[n, k] * a[m, k]                     a = x (no norm), or
    out[m, n] = r[m] * sum_k w[n, k] * (g[k] * x[m, k])     RMSNorm folded: r = rsqrt(mean_k(x^2) + eps)
    out[m, n] = round(round(out[m, n]) + bias[n])           with a bias, as torch adds one (parts.bias_epilogue)

with x, the norm's input, one of (each row m): plain x[m]; residual (x_prev[m] + residual[m]) rounded to
the dtype, as torch's add; gather table[index[m]] (the step's embedding rows).

Shapes: M rows (1 <= M <= MAX_ROWS), K = D hidden, N outputs. x / residual / x_out / h [M, K]; g [K];
table [V, K]; index [M]; w [N, K] unit stride along K; bias [N]; out [M, N] in out_dtype (x's, or float32).
Grid (cdiv(N, BLOCK_N),): kernels.gemv's blocks, or `row_block`'s at one row on a GPU; rows are
looped over, never padded to a tensor-core tile. The body is kernels.parts.fold_gemv.

Rounding: the one-pass norm takes the product with g * x in fp32 and scales by r at the end, about one
rounding of the output away from gemv(h, w); `Norm.exact` (a first pass for r, then h rounded as
kernels.rms_norm rounds it) gives gemv(h, w) to the bit, for consumers that jump at near ties; `Norm.rounds_once`
rounds that h (and the written h) once, as gpt-oss's norm does (kernels.rms_norm's ROUND_ONCE). Each
program writes a disjoint slice of the new residual stream and of h (write_x, write_h), as
kernels.rms_norm computes them. Why: docs/decode-step.md.

Does not: take more than MAX_ROWS rows (the caller uses torch matmuls there), or fold a residual into a
wide product by itself (engine.decode_fused decides which products take a fold).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import launches, pdl, scratch
from kernels.gemv import TENSOR_CORE_ROWS, block_sizes, check_bias
from kernels.parts import fold_gemv

MAX_ROWS = TENSOR_CORE_ROWS - 1  # the FMA path of kernels.gemv
# Elements of a program's one weight tile at one row on a GPU: 2 outputs x the whole K (4096 at v4-shape: 32
# registers a thread at 4 warps), so a program's preload is its whole weight and the router's and the LM
# head's folds (N = 256) run 128 programs, each reading the activation, residual and norm weight once for two
# outputs (measured: bench/RESULTS.md, "The one-row folds").
ROW_TILE_ELEMENTS = 8192
FOLD_WARPS = 4  # every fused GEMV's program


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
    rounds_once: bool = False  # h = (x * r * weight) rounded once (gpt-oss), not x * r rounded, then times weight


@dataclass
class Fused:
    """What one launch produced; fields a fusion does not produce are None."""

    out: torch.Tensor  # [M, N]: the product (the logits for kernels.gemv_route and kernels.gemv_pick)
    x: torch.Tensor | None = None  # [M, K] the new residual stream (Norm.write_x)
    h: torch.Tensor | None = None  # [M, K] the normed activations (Norm.write_h)
    ids: torch.Tensor | None = None  # [M, k] int32 (kernels.gemv_route)
    weights: torch.Tensor | None = None  # [M, k] (kernels.gemv_route)
    woken: torch.Tensor | None = None  # 0-d int64 (kernels.gemv_route with woken)


def row_block(rows: int, k_in: int, device: torch.device) -> tuple[int, int] | None:
    """(2, K) for a one-row fold on a GPU whose K fits ROW_TILE_ELEMENTS / 2, else None (kernels.gemv's block
    sizes)."""
    k_pad = triton.next_power_of_2(k_in)
    if rows != 1 or device.type != "cuda" or 2 * k_pad > ROW_TILE_ELEMENTS:
        return None
    return 2, k_pad


@dataclass
class Fold:
    """One fused GEMV's checked inputs, then (`allocate`) its outputs and the arguments every fused GEMV kernel
    takes first (`args`, `constexprs`: kernels.parts.fold_gemv's)."""

    name: str  # the launcher's, for messages
    x: torch.Tensor | None
    w: torch.Tensor
    norm: Norm | None
    bias: torch.Tensor | None  # [N], added to the rounded product
    source: torch.Tensor  # x, or the gather's table
    rows: int
    k_in: int
    n_out: int
    result: Fused | None = None
    args: tuple = ()
    constexprs: dict | None = None
    programs: int = 0

    @property
    def dtype(self) -> torch.dtype:
        return self.source.dtype

    @property
    def device(self) -> torch.device:
        return self.source.device

    def allocate(self, out_dtype: torch.dtype | None, block: tuple[int, int] | None, preload: bool | None) -> Fused:
        """The outputs (from kernels.scratch), the grid and the shared kernel arguments."""
        x, w, norm, rows, k_in, n_out, dtype, device = (self.x, self.w, self.norm, self.rows, self.k_in,
                                                        self.n_out, self.dtype, self.device)
        gather = norm is not None and norm.table is not None
        residual = norm.residual if norm is not None else None
        out = scratch.empty((rows, n_out), out_dtype or dtype, device)
        result = self.result = Fused(out)
        block_n, block_k = block or row_block(rows, k_in, device) or block_sizes(n_out, k_in, w.element_size(),
                                                                                 device, rows)
        dummy = out
        write_x = norm is not None and norm.write_x
        write_h = norm is not None and norm.write_h
        if write_x:
            result.x = scratch.empty((rows, k_in), dtype, device)
        if write_h:
            result.h = scratch.empty((rows, k_in), dtype, device)
        self.programs = triton.cdiv(n_out, block_n)
        slice_cols = triton.cdiv(k_in, self.programs)
        self.args = (
            x if x is not None else dummy, residual if residual is not None else dummy,
            norm.table if gather else dummy, norm.index if gather else dummy,
            norm.weight if norm is not None else dummy,
            result.x if write_x else dummy, result.h if write_h else dummy,
            w, out, self.bias if self.bias is not None else dummy,
            rows, n_out, k_in, norm.eps if norm is not None else 0.0, slice_cols,
            x.stride(0) if x is not None else 0, residual.stride(0) if residual is not None else 0,
            norm.table.stride(0) if gather else 0, result.x.stride(0) if write_x else 0,
            result.h.stride(0) if write_h else 0, w.stride(0), out.stride(0),
        )
        self.constexprs = dict(
            M_PAD=triton.next_power_of_2(rows), BLOCK_N=block_n, BLOCK_K=block_k,
            SLICE=triton.next_power_of_2(slice_cols),
            NORM=norm is not None, EXACT=norm is not None and norm.exact, GATHER=gather,
            RESIDUAL=residual is not None, WRITE_X=write_x, WRITE_H=write_h,
            ROUND_ONCE=norm is not None and norm.rounds_once, HAS_BIAS=self.bias is not None,
            num_warps=FOLD_WARPS, **pdl.launch_options(device),
            PRELOAD=pdl.preload(device, "fused") if preload is None else preload,
        )
        return result


def check_fold(name: str, x: torch.Tensor | None, w: torch.Tensor, norm: Norm | None,
               bias: torch.Tensor | None = None) -> Fold:
    """The inputs every fused GEMV takes, checked (ValueError naming the launcher and the problem)."""
    gather = norm is not None and norm.table is not None
    residual = norm.residual if norm is not None else None
    if gather:
        if x is not None or norm.index is None or residual is not None:
            raise ValueError(f"{name}: a gather takes table and index, and no x or residual")
        source, rows = norm.table, norm.index.numel()
    else:
        if x is None or (norm is not None and norm.index is not None):
            raise ValueError(f"{name}: give x, or (with a norm) table and index")
        source, rows = x, x.shape[0]
    if source.dim() != 2 or w.dim() != 2 or source.shape[1] != w.shape[1]:
        raise ValueError(f"{name}: x must be [M, K] and w [N, K] with the same K, got {tuple(source.shape)} "
                         f"and {tuple(w.shape)}")
    dtype = source.dtype
    k_in, n_out = w.shape[1], w.shape[0]
    if w.dtype != dtype or source.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"{name}: x ({dtype}) and w ({w.dtype}) need one dtype and unit stride along K")
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"{name} takes 1..{MAX_ROWS} rows, got {rows}")
    if norm is not None:
        if norm.weight.shape != (k_in,) or norm.weight.stride(0) != 1:
            raise ValueError(f"{name}: the norm weight must be [{k_in}], got {tuple(norm.weight.shape)}")
        if residual is not None and (residual.shape != x.shape or residual.stride(1) != 1 or residual.dtype != dtype):
            raise ValueError(f"{name}: residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
        if norm.write_x and residual is None and not gather:
            raise ValueError(f"{name}: write_x needs a residual add or a gather (else x is the input)")
    check_bias(name, bias, w)
    return Fold(name, x, w, norm, bias, source, rows, k_in, n_out)


@triton.jit
def _gemv_norm_kernel(
    x_ptr, residual_ptr, table_ptr, index_ptr, norm_ptr, x_out_ptr, h_ptr, w_ptr, out_ptr, bias_ptr,
    rows, n_out, k_in, eps, slice_cols,
    stride_xm, stride_rm, stride_t, stride_xo, stride_h, stride_wn, stride_om,
    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SLICE: tl.constexpr,
    NORM: tl.constexpr, EXACT: tl.constexpr, GATHER: tl.constexpr, RESIDUAL: tl.constexpr,
    WRITE_X: tl.constexpr, WRITE_H: tl.constexpr, ROUND_ONCE: tl.constexpr, HAS_BIAS: tl.constexpr,
    USE_GDC: tl.constexpr,  # programmatic dependent launch (kernels.pdl)
    PRELOAD: tl.constexpr,  # the first weight tile loaded before the wait (kernels.pdl.preload)
):
    fold_gemv(x_ptr, residual_ptr, table_ptr, index_ptr, norm_ptr, x_out_ptr, h_ptr, w_ptr, out_ptr, bias_ptr,
              rows, n_out, k_in, eps, slice_cols,
              stride_xm, stride_rm, stride_t, stride_xo, stride_h, stride_wn, stride_om,
              M_PAD, BLOCK_N, BLOCK_K, SLICE, NORM, EXACT, GATHER, RESIDUAL, WRITE_X, WRITE_H, ROUND_ONCE, HAS_BIAS,
              USE_GDC, PRELOAD)


def gemv_norm(x: torch.Tensor | None, w: torch.Tensor, out_dtype: torch.dtype | None = None, *,
              norm: Norm | None = None, bias: torch.Tensor | None = None, block: tuple[int, int] | None = None,
              preload: bool | None = None) -> Fused:
    """out = x @ w^T (or RMSNorm(x) @ w^T with `norm`) for M <= MAX_ROWS rows, fp32 accumulation, one launch,
    rounded to `out_dtype` (default x's); with `bias` [N] then + bias, rounded again (as torch adds it).
    `preload`: load the first weight tile before the PDL wait (None: as kernels.pdl.preload says for the device;
    the same result either way)."""
    fold = check_fold("gemv_norm", x, w, norm, bias)
    result = fold.allocate(out_dtype, block, preload)
    _gemv_norm_kernel[(fold.programs,)](*fold.args, **fold.constexprs)
    if norm is not None:
        launches.record("gemv_norm", kernel=_gemv_norm_kernel)
    else:  # the plain product kernels.gemv computes: counted under its name (its kernel registers the name)
        launches.record("gemv")
    return result
