"""Flash-attention forward (prefill, chunked prefill) with per-head sinks and real masks, head_dim
64..512. Its reference is `kernels.reference.attention_reference`; the decode kernel with split KV
is `kernels.attention_decode`; what both share (the visible-key walk, the sink-aware softmax
step, argument checks) is `kernels.attention_common`.

Shapes (the reference's layout; every stride but head_dim's is free, so views of a KV cache work):
    q           [B, Tq, Hq, hd]   queries of one chunk; query t of sequence b sits at absolute
                                  position q_start[b] + t
    k, v        [B, Tk, Hkv, hd]  keys/values at positions 0..Tk-1 (the cache up to the chunk's end)
    sinks       [Hq] or None      learned logit sigma_h per query head
    key_padding [B, Tk] or None   True = padded key
    out         [B, Tq, Hq, hd]   q's dtype, contiguous

Masks: `spec.kind` causal / window / composite / none as in `kernels.reference.MaskSpec`. There
is no "drop" switch here: the incident's kernel took no mask argument, and reproducing it is the
caller's choice of arguments — `flash_attention(q, k, v, sinks, MaskSpec("causal"), q_start,
key_padding=None)` is exactly "plain causal, the mask dropped". The kernel never guesses.

Block sizes (the reasoning; the compiler's report is `kernels.attention_common.resource_report`)
---------------------------------------------------------------------------------------------
H200 (Hopper): 227 KB of shared memory per block, 64 K 32-bit registers per SM, 255 per thread.
At head_dim 512 one program keeps resident:
  * the Q tile, BLOCK_M x 512 x 2 B = 64 KB at BLOCK_M 64 (shared memory: it is wgmma's A operand);
  * per pipeline stage a K tile BLOCK_N x 512 x 2 B (32 KB at BLOCK_N 32) and a V slice
    BLOCK_N x BLOCK_DV x 2 B;
  * the fp32 output accumulator BLOCK_M x BLOCK_DV in registers.
A full-width accumulator, 64 x 512 fp32 = 128 KB, is 128 registers per thread at 8 warps (256
threads), half the cap before the score tile (8), the probabilities as an operand (4), the row
statistics, and the addresses of the K and V loads (~16 each): an estimated 190-200, close enough
to 255 that a spill is likely and cannot be ruled out without ptxas. The default therefore splits
the output columns across programs (BLOCK_DV 256, two programs per row tile): 64 accumulator
registers per thread. The price: each program recomputes the score tile S = Q K^T over the full
head_dim for its half of V's columns, so the tensor work per visible pair grows from 4*hd to
6*hd FLOPs (1.5x), and K is read twice (the second time from the 50 MB L2: the sibling
programs are neighbours in the grid).
Shared memory at (BLOCK_M 64, BLOCK_N 32, BLOCK_DV 256, 2 stages): 64 + 2 * (32 + 16) = 160 KB;
full width (BLOCK_DV 512): 64 + 2 * (32 + 32) = 192 KB. Rejected: BLOCK_N 64 with a full-width V
(64 + 2 * (64 + 64) = 320 KB); BLOCK_M 32 (fits in registers, but wgmma's native M is 64 per
warpgroup, and Triton falls back to mma.sync, well below Hopper's wgmma rate). The full-width
variant stays in the benchmark's sweep with the resource report beside it, so the GPU can
overrule this estimate: if it shows 0 spills and a lower time, make it the table's entry.
The walk never visits a tile without a visible key (see attention_common), so what remains of
the composite mask's waste is the tiles' ragged edges: 1.07x the visible pairs at the benchmark
shape (bench/attention_bench.py computes it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import launches
from kernels.attention_common import (
    _key_walk_bounds,
    _LOG2_E,
    _attend_key_tile,
    _visible_keys,
    check_attention_inputs,
    is_power_of_two,
    output_buffer,
    remember_compiled,
)
from kernels.reference import MaskSpec


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int  # query rows per program
    block_n: int  # keys per step of the walk
    block_dv: int  # output columns per program (head_dim / block_dv programs share a row tile)
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        # tl.dot needs every dimension >= 16 on the GPU; tl.arange needs powers of two.
        for name in ("block_m", "block_n", "block_dv"):
            value = getattr(self, name)
            if value < 16 or not is_power_of_two(value):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")


# Head dim -> config. Not autotuned: autotuning at head_dim 512 compiles for minutes and picks
# configurations that spill; these follow the budget in the module docstring. Smaller head dims
# follow Triton tutorial 06 (BLOCK_M 128 x BLOCK_N 64) within the same shared-memory budget:
# hd 128: 32 KB Q + 3 stages x (16 + 16) KB = 128 KB; hd 256: 32 KB + 2 x (32 + 32) KB = 160 KB.
CONFIGS = {
    64: PrefillConfig(block_m=128, block_n=64, block_dv=64, num_warps=4, num_stages=3),
    128: PrefillConfig(block_m=128, block_n=64, block_dv=128, num_warps=8, num_stages=3),
    256: PrefillConfig(block_m=64, block_n=64, block_dv=256, num_warps=8, num_stages=2),
    512: PrefillConfig(block_m=64, block_n=32, block_dv=256, num_warps=8, num_stages=2),
}

# (head dim, mask kind) -> config, where a mask's walk allows more than the head-dim table. The
# composite walk compiles the full-width output tile at 255 registers with 0 spills and runs the
# benchmark problem in 0.99 ms against 1.76 ms for block_dv=256; the causal walk spills 8
# registers at full width, so it keeps the table's split tile (H200 runs under bench/results/).
MASK_CONFIGS = {
    (512, "composite"): PrefillConfig(block_m=64, block_n=32, block_dv=512, num_warps=8, num_stages=2),
}


@triton.jit
def _flash_attention_kernel(
    q_ptr,  # [B, Tq, Hq, hd]
    k_ptr,  # [B, Tk, Hkv, hd]
    v_ptr,  # [B, Tk, Hkv, hd]
    out_ptr,  # [B, Tq, Hq, hd]
    sinks_ptr,  # [Hq] float32 (unused without HAS_SINKS)
    q_start_ptr,  # [B] int32
    padding_ptr,  # [B, Tk] uint8, 1 = padded (unused without HAS_PADDING)
    query_len,  # Tq
    key_len,  # Tk
    query_heads,  # Hq
    kv_group,  # Hq // Hkv
    window,  # W (NO_WINDOW without one)
    summary_block,  # block-start period of the composite mask (1 without it)
    qk_scale_log2,  # softmax scale * log2(e)
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ob, stride_ot, stride_oh,
    stride_padding_b, stride_padding_t,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SUMMARIES: tl.constexpr,
    HAS_PADDING: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One program: BLOCK_M queries of one (sequence, query head), output columns
    [pid_dv * BLOCK_DV, +BLOCK_DV). Grid: (B * Hq * (HEAD_DIM // BLOCK_DV), cdiv(Tq, BLOCK_M)).
    The column slices of one row tile are neighbours on axis 0, so they run together and the
    second reads the K/V tiles the first just brought into L2. Row tiles go last to first (axis 1
    reversed), every head's at once: a row tile's walk never shrinks with its position under any
    mask here, so the longest programs start first and the short early rows fill the last wave
    (longest-first scheduling) instead of the longest rows of the last heads trailing alone."""
    pid_dv = tl.program_id(0) % (HEAD_DIM // BLOCK_DV)
    pid_bh = tl.program_id(0) // (HEAD_DIM // BLOCK_DV)
    pid_m = tl.num_programs(1) - 1 - tl.program_id(1)
    batch = pid_bh // query_heads
    head = pid_bh % query_heads
    kv_head = head // kv_group

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] query index in the chunk
    row_valid = rows < query_len
    q_start = tl.load(q_start_ptr + batch)
    positions = q_start + rows  # [BLOCK_M] absolute query positions
    p_first = q_start + pid_m * BLOCK_M
    p_last = q_start + tl.minimum(pid_m * BLOCK_M + BLOCK_M, query_len) - 1
    dims = tl.arange(0, HEAD_DIM)
    value_dims = pid_dv * BLOCK_DV + tl.arange(0, BLOCK_DV)

    # int64 before any multiply by a stride: a cache [B, ctx, Hkv, 512] passes 2^31 elements.
    q_base = q_ptr + batch.to(tl.int64) * stride_qb + head.to(tl.int64) * stride_qh
    k_base = k_ptr + batch.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + batch.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh
    padding_row = padding_ptr + batch.to(tl.int64) * stride_padding_b
    q = tl.load(
        q_base + rows.to(tl.int64)[:, None] * stride_qt + dims[None, :], mask=row_valid[:, None], other=0.0
    )  # [BLOCK_M, HEAD_DIM]

    band_lo, band_len, walk_len = _key_walk_bounds(
        p_first, p_last, key_len, window, summary_block, CAUSAL, HAS_WINDOW, HAS_SUMMARIES
    )
    # The sink is the softmax's starting point: max = sigma, sum = exp(sigma - max) = 1.
    sink = float("-inf")
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head) * _LOG2_E
    running_max = tl.zeros([BLOCK_M], dtype=tl.float32) + sink
    running_sum = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.where(sink == float("-inf"), 0.0, 1.0)
    # sigma = +inf takes all the mass: skip the walk, the row stays 0 / 1 = 0.
    walk_len = tl.where(sink == float("inf"), 0, walk_len)
    accumulator = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    for walk_start in range(0, walk_len, BLOCK_N):
        walk_index = walk_start + tl.arange(0, BLOCK_N)
        keys, key_in_range, visible = _visible_keys(
            walk_index, walk_len, positions, band_lo, band_len, key_len, window, summary_block,
            padding_row, stride_padding_t, CAUSAL, HAS_WINDOW, HAS_SUMMARIES, HAS_PADDING,
        )
        accumulator, running_max, running_sum = _attend_key_tile(
            accumulator, running_max, running_sum, q, k_base, v_base, keys, key_in_range, visible,
            dims, value_dims, stride_kt, stride_vt, qk_scale_log2, DOT_PRECISION,
        )

    # A row that saw nothing and has no sink: sum 0, accumulator 0 -> output 0, not NaN.
    out = accumulator / tl.where(running_sum == 0.0, 1.0, running_sum)[:, None]
    out_base = out_ptr + batch.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh
    tl.store(
        out_base + rows.to(tl.int64)[:, None] * stride_ot + value_dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None],
    )


def flash_attention(
    q: torch.Tensor,  # [B, Tq, Hq, hd]
    k: torch.Tensor,  # [B, Tk, Hkv, hd]
    v: torch.Tensor,  # [B, Tk, Hkv, hd]
    sinks: torch.Tensor | None,  # [Hq]
    spec: MaskSpec,
    q_start: torch.Tensor | int = 0,  # [B] or int
    key_padding: torch.Tensor | None = None,  # [B, Tk] bool, True = padded
    scale: float | None = None,
    *,
    out: torch.Tensor | None = None,  # [B, Tq, Hq, hd] to write into (a preallocated buffer)
    config: PrefillConfig | None = None,  # overrides the head-dim table (benchmark sweeps)
) -> torch.Tensor:  # [B, Tq, Hq, hd]
    """Fused attention with sinks, equal to `attention_reference` with the same arguments."""
    inputs = check_attention_inputs(q, k, v, sinks, spec, q_start, key_padding, scale)
    config = config or MASK_CONFIGS.get((inputs.head_dim, spec.kind)) or CONFIGS[inputs.head_dim]
    if inputs.head_dim % config.block_dv != 0:
        raise ValueError(f"block_dv {config.block_dv} does not divide head_dim {inputs.head_dim}")
    out = output_buffer(q, out)
    if inputs.query_len == 0:
        return out

    mask = inputs.mask
    grid = (
        inputs.batch * inputs.query_heads * (inputs.head_dim // config.block_dv),
        triton.cdiv(inputs.query_len, config.block_m),
    )
    compiled = _flash_attention_kernel[grid](
        q, k, v, out, inputs.sinks, inputs.q_start, mask.padding,
        inputs.query_len, inputs.key_len, inputs.query_heads, inputs.query_heads // inputs.kv_heads,
        mask.window, mask.summary_block, inputs.qk_scale_log2,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        mask.padding_strides[0], mask.padding_strides[1],
        HEAD_DIM=inputs.head_dim,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_DV=config.block_dv,
        CAUSAL=mask.causal,
        HAS_WINDOW=mask.has_window,
        HAS_SUMMARIES=mask.has_summaries,
        HAS_PADDING=mask.has_padding,
        HAS_SINKS=inputs.has_sinks,
        DOT_PRECISION=inputs.dot_precision,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    launches.record("flash_attention", kernel=_flash_attention_kernel)
    remember_compiled(f"flash_attention hd{inputs.head_dim} {spec.kind} {q.dtype} {config}", compiled)
    return out
