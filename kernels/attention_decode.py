"""Flash-decoding: a few queries per sequence against a long KV, the walk over keys split across
programs (split-KV) and merged. Same math, layout and masks as `kernels.attention`; its reference is
`kernels.reference.attention_reference`.

Shapes:
    q           [B, Tq, Hq, hd]   Tq small (decode: 1; speculative / tiny chunks: a few)
    k, v        [B, Tk, Hkv, hd]  any strides but head_dim's (views of the KV cache)
    sinks       [Hq] or None;  key_padding [B, Tk] or None;  q_start int or [B]
    partials    [S, B, Tq, Hq, hd] float32   each split's accumulator, scaled by exp2(-its max)
    stats       [S, B * Tq * Hq] float32 x 2 each split's running max (base 2) and running sum
    counters    [B * Hkv] int32               arrivals per (sequence, kv head), `kernels.arrivals`
    out         [B, Tq, Hq, hd]   q's dtype

One program per (split, sequence, kv head); its rows are the group's Hq / Hkv query heads times Tq,
padded to 16 (tl.dot's minimum), so each K/V byte is read once per split. Splits start from no sink;
the merge adds the sink once. How the splits are merged (`combine`; None: `default_combine`):
    "last"    one launch: the last split of each (sequence, kv head) to arrive merges every split's
              partials in the fixed order 0..S-1 and resets its counter (the default for one row per
              group);
    "kernel"  a second launch, `_flash_decode_combine_kernel`, merges them, one program per merge tile
              (the default for a GQA group of several rows, whose partials are more than one program
              reads quickly).
One split writes `out` directly, without partials. Both merges run `_merge_rows` on the same tiles in
the same split order. The split count (`default_num_splits`) keeps one wave of programs and enough key
tiles per split; a GQA group takes one tile per split. Why each of these: docs/attention-kernels.md;
the measurements: bench/RESULTS.md. As with every user of `kernels.arrivals`, two streams must not run
it at once (shared counters).

Does not: take more than MAX_ROWS rows per program (longer chunks are `kernels.attention`'s), autotune
(the configs are fixed per head dim), or read the device (shapes only: graph-safe).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import arrivals, launches, pdl
from kernels.attention_common import (
    _LOG2_E,
    _attend_key_tile,
    _key_walk_bounds,
    _visible_keys,
    check_attention_inputs,
    is_power_of_two,
    output_buffer,
    remember_compiled,
)
from kernels.reference import MaskSpec

MAX_SPLITS = 128
MAX_ROWS = 64  # (Hq / Hkv) * Tq; longer chunks belong to flash_attention
# Each split walks at least this many key tiles (a walk shorter than 2 x this is one split, no merge): a
# split pays a fixed cost whatever it walks (its Q tile, its pipeline's prologue, its partials stored and
# read back, the barrier and the atomic); at 4 tiles its partials cost <= 1/8 of its KV bytes
# (docs/attention-kernels.md, "Decode at the v4 shape").
MIN_TILES_PER_SPLIT = 4
# fp32 elements per merge load ([MERGE_ROWS, SPLITS, BLOCK_D]): 64 registers per thread at 4 warps,
# the walk accumulator's size; the accumulator is dead when the merge runs.
MERGE_ELEMENTS = 8192


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int  # keys per step of a split's walk
    num_stages: int
    num_warps: int | None = None  # None: 4, or 8 when the accumulator would need more registers
    # Programs resident per SM the split rule plans for ("one wave" = SMs x this): 1 at the table's
    # 145 KB of shared memory; 2 for configs of <= 113 KB (benchmark sweeps).
    programs_per_sm: int = 1

    def __post_init__(self) -> None:
        if self.block_n < 16 or not is_power_of_two(self.block_n):
            raise ValueError(f"block_n must be a power of two >= 16, got {self.block_n}")
        if self.programs_per_sm < 1:
            raise ValueError(f"programs_per_sm must be >= 1, got {self.programs_per_sm}")


# Head dim -> config; shared memory per program = Q + stages x (K + V tiles) (docs/attention-kernels.md, "Block sizes").
CONFIGS = {
    64: DecodeConfig(block_n=64, num_stages=3),
    128: DecodeConfig(block_n=64, num_stages=3),
    256: DecodeConfig(block_n=64, num_stages=2),
    # Three stages: 1.39x the KV-bytes bound against 1.73x with two, on the H200 (bench/results/),
    # 210 registers, 0 spills, 145 KB shared.
    512: DecodeConfig(block_n=32, num_stages=3),
}


@triton.jit
def _merge_max(split_max, sink):
    """(M, sink_takes_all): M = max(sigma, max_s m_s) as the merge's reference point, 0 when
    nothing was seen and there is no sink. A +inf sink is left out of the max (inf - inf is NaN);
    its weight 2^(inf - M) = inf then drives every output to 0, made exact by the caller."""
    sink_takes_all = sink == float("inf")
    total_max = tl.maximum(split_max, tl.where(sink_takes_all, float("-inf"), sink))
    safe_max = tl.where(total_max == float("-inf"), 0.0, total_max)
    return safe_max, sink_takes_all


@triton.jit
def _merge_rows(
    partial_out_ptr,  # [S, R, hd] float32
    partial_max_ptr,  # [S, R] float32
    partial_sum_ptr,  # [S, R] float32
    sinks_ptr,  # [Hq] float32 (unused without HAS_SINKS)
    out_ptr,  # [B, Tq, Hq, hd]
    batch,
    kv_head,
    row_start,  # the first of this tile's MERGE_ROWS rows of the group (member = group_member * Tq + t)
    column_begin,  # the output columns [column_begin, column_end) merged, BLOCK_D at a time
    column_end,
    num_splits,
    num_rows,  # R = B * Tq * Hq, the stats' split stride
    query_len,
    query_heads,
    kv_group,
    stride_partial_split,
    stride_ob, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr,
    MERGE_ROWS: tl.constexpr,  # rows of the group merged at once (power of two)
    SPLITS: tl.constexpr,  # next power of two >= S
    BLOCK_D: tl.constexpr,  # MERGE_ROWS x SPLITS x BLOCK_D <= MERGE_ELEMENTS
    HAS_SINKS: tl.constexpr,
    CACHE: tl.constexpr,  # "" or ".cg" (partials written by other programs of the same launch)
):
    """out[rows, columns] = (sum_s acc_s 2^(m_s - M)) / (2^(sigma - M) + sum_s l_s 2^(m_s - M)),
    M = max(sigma, max_s m_s), for MERGE_ROWS rows of one (sequence, kv head) group at once: one
    [MERGE_ROWS, SPLITS] load of each stats array, then one [MERGE_ROWS, SPLITS, BLOCK_D] load of
    partials per column chunk, the next chunk's load issued as soon as this chunk is stored (the
    first one together with the stats). The sum runs over the split axis in the order 0..S-1
    whatever the tile's shape, so both combine paths give the same bits under the interpreter."""
    members = row_start + tl.arange(0, MERGE_ROWS)
    row_valid = members < kv_group * query_len
    query_index = members % query_len
    head = kv_head * kv_group + members // query_len
    out_rows = (batch * query_len + query_index) * query_heads + head  # [MERGE_ROWS] rows (b, t, h)
    splits = tl.arange(0, SPLITS)
    split_valid = splits < num_splits
    chunk = tl.arange(0, BLOCK_D)

    tile_offsets = (
        splits.to(tl.int64)[None, :, None] * stride_partial_split + out_rows.to(tl.int64)[:, None, None] * HEAD_DIM
        + chunk[None, None, :]
    )  # [MERGE_ROWS, SPLITS, BLOCK_D]
    tile_valid = row_valid[:, None, None] & split_valid[None, :, None]
    partials = tl.load(
        partial_out_ptr + tile_offsets + column_begin, mask=tile_valid, other=0.0, cache_modifier=CACHE
    )
    stats_offsets = splits.to(tl.int64)[None, :] * num_rows + out_rows[:, None]  # [MERGE_ROWS, SPLITS]
    stats_valid = row_valid[:, None] & split_valid[None, :]
    maxes = tl.load(partial_max_ptr + stats_offsets, mask=stats_valid, other=float("-inf"), cache_modifier=CACHE)
    sums = tl.load(partial_sum_ptr + stats_offsets, mask=stats_valid, other=0.0, cache_modifier=CACHE)
    sink = tl.full([MERGE_ROWS], float("-inf"), dtype=tl.float32)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head, mask=row_valid, other=float("-inf")) * _LOG2_E
    safe_max, sink_takes_all = _merge_max(tl.max(maxes, 1), sink)
    weights = tl.math.exp2(maxes - safe_max[:, None])  # [MERGE_ROWS, SPLITS]; empty splits: 2^-inf = 0
    denominator = tl.sum(sums * weights, 1) + tl.math.exp2(sink - safe_max)
    denominator = tl.where(denominator == 0.0, 1.0, denominator)  # nothing seen, no sink: 0 / 1

    out_base = (
        out_ptr + batch.to(tl.int64) * stride_ob + query_index.to(tl.int64)[:, None] * stride_ot
        + head.to(tl.int64)[:, None] * stride_oh + chunk[None, :]
    )  # [MERGE_ROWS, BLOCK_D]
    for column in tl.range(column_begin, column_end, BLOCK_D, num_stages=1):
        out = tl.sum(partials * weights[:, :, None], 1) / denominator[:, None]
        out = tl.where(sink_takes_all[:, None], 0.0, out)  # sigma = +inf: all mass on the sink
        tl.store(out_base + column, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])
        # The next chunk; none after the last: a load predicated off (on the split axis, so the
        # column axis stays vectorisable) moves no bytes.
        next_column = column + BLOCK_D
        splits_left = tl.where(next_column < column_end, num_splits, 0)
        partials = tl.load(
            partial_out_ptr + tile_offsets + next_column,
            mask=row_valid[:, None, None] & (splits < splits_left)[None, :, None], other=0.0, cache_modifier=CACHE,
        )


@triton.jit
def _flash_decode_split_kernel(
    q_ptr,  # [B, Tq, Hq, hd]
    k_ptr,  # [B, Tk, Hkv, hd]
    v_ptr,  # [B, Tk, Hkv, hd]
    partial_out_ptr,  # [S, B * Tq * Hq, hd] float32 (unused with OUTPUT "direct")
    partial_max_ptr,  # [S, B * Tq * Hq] float32
    partial_sum_ptr,  # [S, B * Tq * Hq] float32
    sinks_ptr,  # [Hq] float32 (unused without HAS_SINKS or with OUTPUT "partials")
    out_ptr,  # [B, Tq, Hq, hd] (unused with OUTPUT "partials")
    counter_ptr,  # [B * Hkv] int32 arrival counters, all 0 (OUTPUT "last" only)
    q_start_ptr,  # [B] int32
    padding_ptr,  # [B, Tk] uint8 (unused without HAS_PADDING)
    query_len,  # Tq
    key_len,  # Tk
    query_heads,  # Hq
    kv_heads,  # Hkv
    kv_group,  # Hq // Hkv
    num_rows,  # B * Tq * Hq, the stats' split stride
    num_splits,  # S, the grid's first dimension
    walk_tiles,  # key tiles of the longest walk (host bound); split s walks tiles [s*T//S, (s+1)*T//S)
    window,
    summary_block,
    qk_scale_log2,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_partial_split,  # of partial_out
    stride_ob, stride_ot, stride_oh,
    stride_padding_b, stride_padding_t,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MERGE_ROWS: tl.constexpr,  # rows merged at once ("last"), see _merge_rows
    SPLITS: tl.constexpr,  # next power of two >= S ("last")
    BLOCK_D: tl.constexpr,  # merge tile width ("last")
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SUMMARIES: tl.constexpr,
    HAS_PADDING: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    OUTPUT: tl.constexpr,  # "last": the group's last split merges; "direct": S == 1; "partials": combine kernel
    DOT_PRECISION: tl.constexpr,
    USE_GDC: tl.constexpr,  # programmatic dependent launch (kernels.pdl)
):
    """One program: split pid_split of the key walk of one (sequence, kv head), all its
    kv_group x Tq query rows. Grid: (S, B * Hkv)."""
    if USE_GDC:  # q and the newest key are the previous kernel's output
        tl.extra.cuda.gdc_wait()
    pid_split = tl.program_id(0)
    pid_bk = tl.program_id(1)
    batch = pid_bk // kv_heads
    kv_head = pid_bk % kv_heads

    rows = tl.arange(0, BLOCK_M)  # row = group_member * Tq + t
    row_valid = rows < kv_group * query_len
    query_index = rows % query_len
    head = kv_head * kv_group + rows // query_len
    q_start = tl.load(q_start_ptr + batch)
    positions = q_start + query_index
    dims = tl.arange(0, HEAD_DIM)

    q_base = q_ptr + batch.to(tl.int64) * stride_qb
    q = tl.load(
        q_base + query_index.to(tl.int64)[:, None] * stride_qt + head.to(tl.int64)[:, None] * stride_qh + dims[None, :],
        mask=row_valid[:, None],
        other=0.0,
    )  # [BLOCK_M, HEAD_DIM]
    k_base = k_ptr + batch.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + batch.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh
    padding_row = padding_ptr + batch.to(tl.int64) * stride_padding_b

    band_lo, band_len, walk_len = _key_walk_bounds(
        q_start, q_start + query_len - 1, key_len, window, summary_block, CAUSAL, HAS_WINDOW, HAS_SUMMARIES
    )
    # Balanced: every split walks floor(T / S) or ceil(T / S) tiles (>= MIN_TILES_PER_SPLIT by default).
    walk_begin = (pid_split * walk_tiles // num_splits) * BLOCK_N
    walk_end = tl.minimum(((pid_split + 1) * walk_tiles // num_splits) * BLOCK_N, walk_len)

    # No sink here: the merge adds it once.
    running_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    accumulator = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for walk_start in range(walk_begin, walk_end, BLOCK_N):
        walk_index = walk_start + tl.arange(0, BLOCK_N)
        keys, key_in_range, visible = _visible_keys(
            walk_index, walk_end, positions, band_lo, band_len, key_len, window, summary_block,
            padding_row, stride_padding_t, CAUSAL, HAS_WINDOW, HAS_SUMMARIES, HAS_PADDING,
        )
        accumulator, running_max, running_sum = _attend_key_tile(
            accumulator, running_max, running_sum, q, k_base, v_base, keys, key_in_range, visible,
            dims, dims, stride_kt, stride_vt, qk_scale_log2, DOT_PRECISION,
        )
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()

    if OUTPUT == "direct":
        # The only split: merge with the sink in registers (the merge's formula at S = 1).
        sink = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + head, mask=row_valid, other=float("-inf")) * _LOG2_E
        safe_max, sink_takes_all = _merge_max(running_max, sink)
        weight = tl.math.exp2(running_max - safe_max)  # nothing visible: 2^-inf = 0
        denominator = running_sum * weight + tl.math.exp2(sink - safe_max)
        out = accumulator * weight[:, None] / tl.where(denominator == 0.0, 1.0, denominator)[:, None]
        out = tl.where(sink_takes_all[:, None], 0.0, out)
        out_offsets = (
            batch.to(tl.int64) * stride_ob + query_index.to(tl.int64)[:, None] * stride_ot
            + head.to(tl.int64)[:, None] * stride_oh + dims[None, :]
        )
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])
    else:
        out_rows = (batch * query_len + query_index) * query_heads + head  # [BLOCK_M] row of (b, t, h)
        stats_offsets = pid_split.to(tl.int64) * num_rows + out_rows
        tl.store(partial_max_ptr + stats_offsets, running_max, mask=row_valid)
        tl.store(partial_sum_ptr + stats_offsets, running_sum, mask=row_valid)
        partial_base = partial_out_ptr + pid_split.to(tl.int64) * stride_partial_split
        tl.store(
            partial_base + out_rows.to(tl.int64)[:, None] * HEAD_DIM + dims[None, :], accumulator,
            mask=row_valid[:, None],
        )
        if OUTPUT == "last":
            # Every thread's stores are issued before thread 0's release (bar.sync; the release is
            # cumulative); Triton runs a scalar atomic on one thread and broadcasts its result
            # through shared memory behind a barrier, so the branch below is uniform.
            tl.debug_barrier()
            arrived = tl.atomic_add(counter_ptr + pid_bk, 1, sem="acq_rel")
            if arrived == num_splits - 1:
                # The last of this group: every split's partials are visible (acquire). Merge them
                # in split order 0..S-1, whichever program this is, all the group's rows at once.
                for row_start in tl.range(0, kv_group * query_len, MERGE_ROWS, num_stages=1):
                    _merge_rows(
                        partial_out_ptr, partial_max_ptr, partial_sum_ptr, sinks_ptr, out_ptr, batch, kv_head,
                        row_start, 0, HEAD_DIM, num_splits, num_rows, query_len, query_heads, kv_group,
                        stride_partial_split, stride_ob, stride_ot, stride_oh,
                        HEAD_DIM, MERGE_ROWS, SPLITS, BLOCK_D, HAS_SINKS, ".cg",
                    )
                tl.atomic_xchg(counter_ptr + pid_bk, 0)  # ready for the next launch on this stream


@triton.jit
def _flash_decode_combine_kernel(
    partial_out_ptr,  # [S, R, hd] float32, R = B * Tq * Hq rows ordered (b, t, h)
    partial_max_ptr,  # [S, R] float32
    partial_sum_ptr,  # [S, R] float32
    sinks_ptr,  # [Hq] float32 (unused without HAS_SINKS)
    out_ptr,  # [B, Tq, Hq, hd]
    num_splits,  # S
    num_rows,  # R
    query_len,  # Tq
    query_heads,  # Hq
    kv_heads,  # Hkv
    kv_group,  # Hq // Hkv
    stride_partial_split,
    stride_ob, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr,
    MERGE_ROWS: tl.constexpr,
    SPLITS: tl.constexpr,  # next power of two >= S
    BLOCK_D: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    USE_GDC: tl.constexpr,  # programmatic dependent launch (kernels.pdl)
):
    """combine="kernel": the same merge as the single launch's last program (`_merge_rows`, same
    tile), one column chunk of MERGE_ROWS rows of one group per program.
    Grid: (B * Hkv, cdiv(kv_group * Tq, MERGE_ROWS), HEAD_DIM // BLOCK_D)."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
    pid_bk = tl.program_id(0)
    column = tl.program_id(2) * BLOCK_D
    _merge_rows(
        partial_out_ptr, partial_max_ptr, partial_sum_ptr, sinks_ptr, out_ptr, pid_bk // kv_heads, pid_bk % kv_heads,
        tl.program_id(1) * MERGE_ROWS, column, column + BLOCK_D, num_splits, num_rows, query_len, query_heads,
        kv_group, stride_partial_split, stride_ob, stride_ot, stride_oh,
        HEAD_DIM, MERGE_ROWS, SPLITS, BLOCK_D, HAS_SINKS, "",
    )


# A GQA group's short walk at head dim 512 (a decode step early in its sequence: the bench's tg rows) takes 16-key
# tiles at 2 stages: twice the one-tile splits of 32-key tiles, each half the KV bytes and latency (shared memory
# 16 + 2 x 32 KB); measured faster in the v4 step (bench/RESULTS.md, "Attention decode in the step"). Longer walks
# and one row per group keep CONFIGS (not measured against this).
SHORT_WALK_CONFIG = DecodeConfig(block_n=16, num_stages=2)
SHORT_WALK_KEYS = 256


def _config(head_dim: int, spec: MaskSpec, key_len: int, query_len: int, rows: int) -> DecodeConfig:
    """The config of a launch that names none: SHORT_WALK_CONFIG for a GQA group's (rows > 1) walk of at most
    SHORT_WALK_KEYS keys at head dim 512, else CONFIGS[head_dim]."""
    if head_dim == 512 and rows > 1 and _walk_upper_bound(spec, key_len, query_len) <= SHORT_WALK_KEYS:
        return SHORT_WALK_CONFIG
    return CONFIGS[head_dim]


def _walk_upper_bound(spec: MaskSpec, key_len: int, query_len: int) -> int:
    """The longest key walk any sequence can have (host-side, no device read: graph-safe)."""
    if spec.kind in ("window", "composite"):
        band = min(key_len, spec.window + query_len - 1)
    else:
        band = key_len
    summaries = triton.cdiv(key_len, spec.block) if spec.kind == "composite" else 0
    return band + summaries


def choose_splits(walk_tiles: int, wave: int, merge_ratio: float = 0.0, min_tiles: int = MIN_TILES_PER_SPLIT) -> int:
    """Splits per (sequence, kv head) for a walk of `walk_tiles` key tiles (pure; why:
    docs/attention-kernels.md, "Decode at the v4 shape"): at most `wave` (the programs per group that fit one wave) and
    MAX_SPLITS; few enough that each split walks >= `min_tiles` tiles (the kernel balances them:
    floor or ceil of walk_tiles / S each); and at most sqrt(walk_tiles / merge_ratio), where
    merge_ratio = bytes one split adds to the merging program's read / KV bytes of one tile, so that
    the serial merge reads no more than one split's walk does. Always >= 1."""
    splits = min(wave, MAX_SPLITS, walk_tiles // max(1, min_tiles))
    if merge_ratio > 0:
        splits = min(splits, math.isqrt(int(walk_tiles / merge_ratio)))
    return max(1, splits)


def _walk_tiles(spec: MaskSpec, key_len: int, query_len: int, block_n: int) -> int:
    return max(1, triton.cdiv(_walk_upper_bound(spec, key_len, query_len), block_n))


def _default_splits(
    sms: int | None, walk_tiles: int, programs_per_split: int, rows: int, config: DecodeConfig, element_size: int
) -> int:
    if sms is None:
        # The interpreter: up to 4 splits of >= 1 tile, enough to exercise the merge with few programs.
        return choose_splits(walk_tiles, 4, min_tiles=1)
    # One wave: splits x B x Hkv programs <= the SM count x programs per SM (1 at the table's 145 KB).
    block_n = config.block_n
    wave = sms * config.programs_per_sm // programs_per_split
    if default_combine(rows) == "kernel":
        # GQA groups: one key tile per split (up to GQA_MAX_SPLITS), merged by the combine kernel in
        # parallel: a program's walk costs about 2.5 us per tile at the v4 shape, so more programs beat
        # fewer, longer ones (bench/RESULTS.md, "Attention decode in the step").
        return choose_splits(walk_tiles, min(wave, GQA_MAX_SPLITS), min_tiles=1)
    # Per split the merging program reads rows x hd x 4 B of partials; a key tile is 2 x BLOCK_N x hd x e B.
    merge_ratio = (rows * 4) / (2 * block_n * element_size)
    return choose_splits(walk_tiles, wave, merge_ratio)


def _device_sms(device: torch.device) -> int | None:
    """SMs of a CUDA device; None (the interpreter's rule) elsewhere."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_num_splits(
    q: torch.Tensor,  # [B, Tq, Hq, hd] (any device, "meta" included: only shapes are read)
    k: torch.Tensor,  # [B, Tk, Hkv, hd]
    spec: MaskSpec,
    config: DecodeConfig | None = None,
    *,
    sms: int | None = None,  # None: q's device's SM count on CUDA, the interpreter's rule elsewhere
) -> int:
    """The split count `flash_decode` launches with num_splits=None (host-side, no device read)."""
    batch, query_len, query_heads, head_dim = q.shape
    key_len, kv_heads = k.shape[1], k.shape[2]
    rows = (query_heads // kv_heads) * query_len
    config = config or _config(head_dim, spec, key_len, query_len, rows)
    walk_tiles = _walk_tiles(spec, key_len, query_len, config.block_n)
    sms = _device_sms(q.device) if sms is None else sms
    return min(_default_splits(sms, walk_tiles, batch * kv_heads, rows, config, q.element_size()), walk_tiles)


def merge_tile(rows: int, splits: int, head_dim: int) -> tuple[int, int, int]:
    """(MERGE_ROWS, SPLITS, BLOCK_D) of the merge's [MERGE_ROWS, SPLITS, BLOCK_D] fp32 loads for a group of
    `rows` rows and `splits` splits: <= MERGE_ELEMENTS each, BLOCK_D >= 32 (128 B per (row, split))."""
    splits_pow2 = triton.next_power_of_2(splits)
    merge_rows = min(triton.next_power_of_2(rows), max(1, MERGE_ELEMENTS // (splits_pow2 * 32)))
    block_d = min(head_dim, MERGE_ELEMENTS // (merge_rows * splits_pow2))
    return merge_rows, splits_pow2, block_d


COMBINES = ("last", "kernel")
GQA_MAX_SPLITS = 32  # splits per group when a GQA group's rows are merged by the combine kernel


def default_combine(rows: int) -> str:
    """How splits are merged when the caller does not say: "last" (the last split merges, one launch) for
    one query row per (sequence, kv head); "kernel" (a second launch spreads the merge) for a group of
    several rows (GQA), which has more partials than one program reads quickly. Both measured so on the
    H200 (bench/RESULTS.md, "Attention decode in the step")."""
    return "last" if rows == 1 else "kernel"


def flash_decode(
    q: torch.Tensor,  # [B, Tq, Hq, hd], Tq small
    k: torch.Tensor,  # [B, Tk, Hkv, hd]
    v: torch.Tensor,  # [B, Tk, Hkv, hd]
    sinks: torch.Tensor | None,  # [Hq]
    spec: MaskSpec,
    q_start: torch.Tensor | int,  # [B] or int
    key_padding: torch.Tensor | None = None,  # [B, Tk] bool, True = padded
    scale: float | None = None,
    *,
    out: torch.Tensor | None = None,  # [B, Tq, Hq, hd] to write into
    num_splits: int | None = None,  # None: one wave of programs on this device
    config: DecodeConfig | None = None,  # overrides the head-dim table (benchmark sweeps)
    combine: str | None = None,  # "last": one launch, the last split merges; "kernel": a second combine
    # launch; None: `default_combine` ("last" for one row per group, "kernel" for GQA groups)
) -> torch.Tensor:  # [B, Tq, Hq, hd]
    """Split-KV attention with sinks, equal to `attention_reference` with the same arguments."""
    if combine is not None and combine not in COMBINES:
        raise ValueError(
            f"combine must be 'last' (one launch: the last split of each (sequence, kv head) merges) or "
            f"'kernel' (a second combine launch); got {combine!r}"
        )
    inputs = check_attention_inputs(q, k, v, sinks, spec, q_start, key_padding, scale)
    group = inputs.query_heads // inputs.kv_heads
    rows = group * inputs.query_len
    config = config or _config(inputs.head_dim, spec, inputs.key_len, inputs.query_len, rows)
    if rows > MAX_ROWS:
        raise ValueError(
            f"flash_decode takes (Hq / Hkv) * Tq <= {MAX_ROWS} rows per program, got {group} x "
            f"{inputs.query_len}; use kernels.attention.flash_attention for longer chunks"
        )
    out = output_buffer(q, out)
    if inputs.query_len == 0:
        return out

    walk_tiles = _walk_tiles(spec, inputs.key_len, inputs.query_len, config.block_n)
    programs_per_split = inputs.batch * inputs.kv_heads
    if num_splits is None:
        num_splits = _default_splits(
            _device_sms(q.device), walk_tiles, programs_per_split, rows, config, q.element_size()
        )
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in 1..{MAX_SPLITS}, got {num_splits}")
    num_splits = min(num_splits, walk_tiles)  # no split left without a tile to walk
    if combine is None:
        combine = "last" if num_splits == 1 else default_combine(rows)  # one split writes `out` directly

    head_dim = inputs.head_dim
    num_rows = inputs.batch * inputs.query_len * inputs.query_heads
    if combine == "kernel":
        output = "partials"
    else:
        output = "direct" if num_splits == 1 else "last"
    if output == "direct":
        partial_out = partial_max = partial_sum = out  # never dereferenced
        counters = inputs.q_start
    else:
        partial_out = torch.empty(num_splits, num_rows, head_dim, dtype=torch.float32, device=q.device)
        partial_max = torch.empty(num_splits, num_rows, dtype=torch.float32, device=q.device)
        partial_sum = torch.empty(num_splits, num_rows, dtype=torch.float32, device=q.device)
        # One arrival counter per (sequence, kv head), 0 before and after the launch.
        counters = arrivals.counters(q.device, programs_per_split) if output == "last" else inputs.q_start

    mask = inputs.mask
    block_m = max(16, triton.next_power_of_2(rows))
    # Accumulator registers per thread = block_m * hd / (32 * warps): 64 at (16, 512, 4 warps).
    num_warps = config.num_warps or (4 if block_m * head_dim <= 16 * 512 else 8)
    merge_rows, splits_pow2, block_d = merge_tile(rows, num_splits, head_dim)
    compiled = _flash_decode_split_kernel[(num_splits, programs_per_split)](
        q, k, v, partial_out, partial_max, partial_sum, inputs.sinks, out, counters, inputs.q_start, mask.padding,
        inputs.query_len, inputs.key_len, inputs.query_heads, inputs.kv_heads, group, num_rows, num_splits,
        walk_tiles, mask.window, mask.summary_block, inputs.qk_scale_log2,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        partial_out.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        mask.padding_strides[0], mask.padding_strides[1],
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=config.block_n,
        MERGE_ROWS=merge_rows,
        SPLITS=splits_pow2,
        BLOCK_D=block_d,
        CAUSAL=mask.causal,
        HAS_WINDOW=mask.has_window,
        HAS_SUMMARIES=mask.has_summaries,
        HAS_PADDING=mask.has_padding,
        HAS_SINKS=inputs.has_sinks,
        OUTPUT=output,
        DOT_PRECISION=inputs.dot_precision,
        num_warps=num_warps,
        num_stages=config.num_stages,
        **pdl.launch_options(q.device),
    )
    launches.record("flash_decode_split", kernel=_flash_decode_split_kernel)
    remember_compiled(
        f"flash_decode_split hd{head_dim} rows{block_m} {spec.kind} {q.dtype} {output} "
        f"merge{merge_rows}x{splits_pow2}x{block_d} {config}", compiled
    )
    if output != "partials":
        return out

    grid = (programs_per_split, triton.cdiv(rows, merge_rows), head_dim // block_d)
    compiled = _flash_decode_combine_kernel[grid](
        partial_out, partial_max, partial_sum, inputs.sinks, out,
        num_splits, num_rows, inputs.query_len, inputs.query_heads, inputs.kv_heads, group,
        partial_out.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        HEAD_DIM=head_dim,
        MERGE_ROWS=merge_rows,
        SPLITS=splits_pow2,
        BLOCK_D=block_d,
        HAS_SINKS=inputs.has_sinks,
        num_warps=4,
        **pdl.launch_options(q.device),
    )
    launches.record("flash_decode_combine", kernel=_flash_decode_combine_kernel)
    remember_compiled(f"flash_decode_combine hd{head_dim} rows{merge_rows} splits{splits_pow2}", compiled)
    return out
