"""Dense GEMV for decode: out[M, N] = x[M, K] @ w[N, K]^T for a decode batch of M rows, fp32 accumulation.

Shapes: M rows of activations (decode: one per sequence, M <= MAX_ROWS), K input features,
N output features; w is a torch Linear weight [N, K] with unit stride along K.

    x    [M, K]   bf16 / fp16 / fp32
    w    [N, K]   x's dtype
    out  [M, N]   x's dtype (a rounded matmul, as torch's), or float32 (router and LM-head logits,
                  which torch computes as x.float() @ w.float().t() in the model)

At one decode token the model's dense weights (q/k/v/o projections, router, LM head) are read
once per step and nothing is reused: pure bandwidth. cuBLAS answers M=1 with split-K kernels plus a
reduce kernel, and the model's fp32 logits with a cast of the whole weight to fp32 first; here one
launch reads each weight byte once.

Kernel: grid (cdiv(N, BLOCK_N),); a program owns BLOCK_N output features for all M rows, walks K in
BLOCK_K chunks (16-byte vectors: BLOCK_N x BLOCK_K bf16 = 8 KB of weights per step) and reduces each
chunk at once into [M_PAD, BLOCK_N] fp32 lanes (one static loop over the rows reusing the loaded
weight tile); from TENSOR_CORE_ROWS rows (a wide decode batch) the tile goes through tl.dot with
the rows padded to 16, so the same kernel serves batch 1 and batch 32. No atomics, no split-K:
each output is summed in one program, in a fixed order, so the result is the same on every run.
BLOCK_N shrinks for narrow outputs (the router, the LM head at N = 256) so there are still a few
programs per SM to keep loads in flight.

Rows M > MAX_ROWS belong to a GEMM (prefill); the caller uses torch there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import launches, pdl, scratch, streaming
from kernels.parts import bias_epilogue

MAX_ROWS = 64  # a decode batch; more rows are a prefill GEMM
TENSOR_CORE_ROWS = 9  # from this many rows (padded to 16) the tile goes through tl.dot
BYTES_PER_STEP = 8192  # weight bytes one program loads per K step


@triton.jit
def _gemv_step(accumulator, w, x_ptr, x_ptrs, k0, k_mask, offs_k, offs_m, rows, stride_xm, M_PAD: tl.constexpr,
               BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The accumulator plus one loaded [BLOCK_N, BLOCK_K] weight tile times the rows' x at k0."""
    m_mask = offs_m < rows
    if M_PAD >= 16:  # a skinny GEMM (a wide decode batch): tensor cores
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        accumulator = tl.dot(x, tl.trans(w), accumulator, input_precision=DOT_PRECISION)
    else:  # a few rows: FMAs on the loaded tile, reduced at once
        w32 = w.to(tl.float32)
        for m in tl.static_range(M_PAD):
            row_lanes = tl.full([BLOCK_K], m, dtype=tl.int32) < rows
            x_row = tl.load(x_ptr + m * stride_xm + k0 + offs_k, mask=k_mask & row_lanes, other=0.0)
            partial = tl.sum(w32 * x_row.to(tl.float32)[None, :], axis=1)  # [BLOCK_N]
            accumulator += tl.where(offs_m[:, None] == m, partial[None, :], 0.0)
    return accumulator


@triton.jit
def _gemv_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    out_ptr,  # [M, N]
    rows,  # M
    n_out,  # N
    k_in,  # K
    stride_xm,
    stride_wn,
    stride_om,
    M_PAD: tl.constexpr,  # rows rounded up to a power of two
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs: no TF32 rounding
    USE_GDC: tl.constexpr,  # programmatic dependent launch (kernels.pdl)
    PRELOAD: tl.constexpr,  # with USE_GDC: the first weight tile loaded before the wait (kernels.pdl.preload)
    WEIGHT_EVICTION: tl.constexpr,  # the weight loads' L2 policy (kernels.streaming)
    bias_ptr=None,  # [N] (HAS_BIAS)
    HAS_BIAS: tl.constexpr = False,  # out = the rounded product + bias, rounded again (as torch adds a bias)
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_out
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, M_PAD)
    m_mask = offs_m < rows
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]  # [M_PAD, BLOCK_K]
    if PRELOAD:  # the weight does not depend on the grid before: its first tile while that grid ends
        w_first = tl.load(w_ptrs, mask=n_mask[:, None] & (offs_k < k_in)[None, :], other=0.0,
                          eviction_policy=WEIGHT_EVICTION)
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
    accumulator = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
    k_start = 0
    if PRELOAD:  # the loop's first step, on the preloaded tile
        accumulator = _gemv_step(accumulator, w_first, x_ptr, x_ptrs, 0, offs_k < k_in, offs_k, offs_m, rows,
                                 stride_xm, M_PAD, BLOCK_K, DOT_PRECISION)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        k_start = BLOCK_K
    for k0 in range(k_start, k_in, BLOCK_K):
        k_mask = offs_k < k_in - k0
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0, eviction_policy=WEIGHT_EVICTION)
        accumulator = _gemv_step(accumulator, w, x_ptr, x_ptrs, k0, k_mask, offs_k, offs_m, rows, stride_xm, M_PAD,
                                 BLOCK_K, DOT_PRECISION)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, bias_epilogue(accumulator, bias_ptr, offs_n, n_mask, out_ptr.dtype.element_ty, HAS_BIAS),
             mask=m_mask[:, None] & n_mask[None, :])


def check_bias(name: str, bias: torch.Tensor | None, w: torch.Tensor) -> None:
    """A product's bias, where given, is [N] of w [N, K] with unit stride on w's device (ValueError naming `name`);
    kernels.gemv and the fused GEMVs (kernels.gemv_norm.check_fold) take it into parts.bias_epilogue."""
    if bias is not None and (bias.shape != (w.shape[0],) or bias.stride(0) != 1 or bias.device != w.device):
        raise ValueError(f"{name}: the bias must be [{w.shape[0]}] with unit stride on {w.device}, got "
                         f"{tuple(bias.shape)} on {bias.device}")


def block_sizes(n_out: int, k_in: int, element_bytes: int, device: torch.device, rows: int = 1) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K): 8 output features per program where N gives at least ~4 programs per SM,
    fewer for narrow outputs (16 for a tensor-core tile at >= 16 rows); BLOCK_K fills BYTES_PER_STEP
    of weights per step, never wider than K."""
    dot = rows >= TENSOR_CORE_ROWS
    if device.type != "cuda":  # the interpreter pays per program: few, wide ones
        return min(64, max(16 if dot else 1, triton.next_power_of_2(n_out))), min(128, triton.next_power_of_2(k_in))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    # One row: 2 x 2048 (or 1 x 4096) per program measured fastest on the H200 at K = 4096 (bench/gemv_bench.py;
    # bench/RESULTS.md, "The dense GEMV"); a few rows reuse a wider tile across them.
    block_n = 16 if dot else 2 if rows == 1 else 8
    while block_n > (16 if dot else 1) and triton.cdiv(n_out, block_n) < 4 * sms:
        block_n //= 2
    block_k = min(triton.next_power_of_2(k_in), max(16, BYTES_PER_STEP // (block_n * element_bytes)))
    return block_n, block_k


def gemv(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None, *,
         bias: torch.Tensor | None = None, block: tuple[int, int] | None = None,
         preload: bool | None = None) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T -> [M, N] in `out_dtype` (default x's), fp32 accumulation, one launch; with `bias` [N]
    then + bias in fp32 on the rounded product, rounded again (what `x @ w.t() + b` gives in torch). `preload`:
    load the first weight tile before the PDL wait (None: as kernels.pdl.preload says; the same result)."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"gemv: x must be [M, K] and w [N, K] with the same K, got {tuple(x.shape)} and "
                         f"{tuple(w.shape)}")
    if x.dtype != w.dtype:
        raise ValueError(f"gemv: x is {x.dtype} but w is {w.dtype}")
    if not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"gemv takes 1..{MAX_ROWS} rows, got {x.shape[0]}: use a GEMM for more")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("gemv: x and w need unit stride along K")
    check_bias("gemv", bias, w)
    rows, k_in = x.shape
    n_out = w.shape[0]
    out = scratch.empty((rows, n_out), out_dtype or x.dtype, x.device)
    block_n, block_k = block or block_sizes(n_out, k_in, w.element_size(), x.device, rows)
    m_pad = triton.next_power_of_2(rows)
    if rows >= TENSOR_CORE_ROWS:
        m_pad = max(16, m_pad)
        if block_n < 16 or block_k < 16:
            raise ValueError(f"gemv: {rows} rows go through tensor cores, which need blocks >= 16, got {block}")
    _gemv_kernel[(triton.cdiv(n_out, block_n),)](
        x, w, out, rows, n_out, k_in, x.stride(0), w.stride(0), out.stride(0),
        M_PAD=m_pad, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=4, **pdl.launch_options(x.device),
        PRELOAD=pdl.preload(x.device, "gemv") if preload is None else preload,
        WEIGHT_EVICTION=streaming.weight_eviction(x.device),
        **({} if bias is None else dict(bias_ptr=bias, HAS_BIAS=True)),
    )
    launches.record("gemv", kernel=_gemv_kernel)
    return out
