"""Latent attention over an MLA cache (the absorbed form of DeepSeek's multi-head latent attention):
causal softmax attention of Hq query heads against ONE shared key/value stream per sequence, the
cache of R latent + r RoPE dims per token, split over the keys (split-KV) and merged by a second
launch. Its reference is `kernels.reference.mla_latent_reference`.

Shapes (R = kv_lora_rank, r = RoPE dims, M = Tq * Hq query rows, t-major: row m is query m // Hq of
head m % Hq):
    q          [B, Tq, Hq, R + r]    the absorbed query: q_nope W_UK, then the rotated q_rope
    cache      [B, Tk, 1, R + r]     the latent c (also the value) then the rotated k_r; any batch and
                                     token strides (views of the KV cache), stride 1 along R + r
    q_start    int or [B]            position of each sequence's first query: row m sees keys
                                     j <= q_start + m // Hq
    partials   [S, B, M, R] float32  each split's normalised output
    lse        [S, B, M] float32     each split's log2-sum-exp2 of its scaled scores (-inf: saw nothing)
    out        [B, Tq, Hq, R]        q's dtype; = sum_s 2^(lse_s - L) partials_s, L = log2 sum_s 2^lse_s

    score(m, j) = (q[m, :R] . c_j + q[m, R:] . k_r_j) * scale;  out[m] = sum_j softmax_j(score) c_j

Grid of the split kernel: (cdiv(M, BLOCK_M), S, B): a program takes BLOCK_M query rows (heads of one
query, at decode) and walks split s of the key tiles, so each latent byte it loads serves BLOCK_M
heads: at 128 heads and BLOCK_M 64 a key tile is read by two programs (L2 serves the second), against
Hq reads of decompressed K and V. A row's walk stops at its causal bound (read on the device from
q_start), so a graph that reads the whole cache still walks only the visible keys.
The combine kernel: grid (cdiv(M, BLOCK_M_COMBINE), B, R // BLOCK_D), splits merged in order 0..S-1
(deterministic). With one split the split kernel writes `out` itself: one launch.

Block sizes at R = 512, r = 64, bf16 (the H200 shape; `default_config`): 64 rows x 64 keys, 8 warps, 2
stages: q 64 x 576 x 2 B = 72 KB and two 72 KB key tiles, 216 KB of shared memory; the accumulator
64 x 512 fp32 is 128 registers per thread at 8 warps. `MlaConfig`'s structure candidates (`unchained`, `tma`, `lazy_rescale`) are off until
bench/mla_bench.py --sweep has timed them; docs/mla.md gives the roofline and why each exists.
Split count (`default_num_splits`, host-side, shapes only: CUDA-graph safe): one wave of programs
(S x B x row blocks <= SMs), each split >= MIN_TILES_PER_SPLIT key tiles (a short walk: up to
SHORT_WALK_SPLITS splits of one tile or more), at most MAX_SPLITS; one tile a split where the consumer merges.
`mla_split` leaves the partials to a consumer that merges them itself (kernels.mla_absorb.unabsorb at decode);
`mla_decode` merges them here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from kernels import launches, pdl
from kernels.attention_common import LOG2_E, is_power_of_two, remember_compiled

# Latent ranks and RoPE widths the kernel takes: powers of two (tl.arange), at least tl.dot's 16, the
# latent at most 512 (the accumulator's registers). engine.attention_dispatch keeps a copy of these
# bounds (it must import without triton); tests/test_attention_mla.py asserts they agree.
MIN_DIM, MAX_LATENT, MAX_ROPE = 16, 512, 128
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_SPLITS = 64
# Each split walks at least this many key tiles: a split costs its q tile, its pipeline's prologue and
# M x R x 4 B of partials (at 64 rows and R 512: 128 KB, about two 64-key tiles of 72 KB). Predicted.
MIN_TILES_PER_SPLIT = 4
# A short walk is split up to this many ways even into one-tile splits: where the programs are few (one token at
# 16 heads is one program a split) a split's walk is a chain of load latencies, not bandwidth. One token at
# DeepSeek-V2-Lite's widths, the combine kernel merging (bench/RESULTS.md, run 77): 159 keys, attention added 9.1
# µs at 1 split, 6.4 at 5; 512 keys, 10.3 at 4 splits, 9.7 at 8, 10.8 at 16.
SHORT_WALK_SPLITS = 8
# Lazy rescaling keeps a row's reference max until the tile max passes it by more than this (log2 units):
# the probabilities are then at most 2^8 (bf16 and fp16 hold it; the fp32 sum over any walk too), and the
# accumulator's 64 x 512 multiply is skipped on most tiles. Exact either way: the sum and the accumulator
# always share one reference max.
RESCALE_THRESHOLD = 8.0
_RESCALE_THRESHOLD = tl.constexpr(RESCALE_THRESHOLD)  # what the jit reads (a global must be a constexpr)


@dataclass(frozen=True)
class MlaConfig:
    block_m: int  # query rows per program (heads x queries), a power of two >= 16
    block_n: int  # keys per step of the walk
    num_warps: int
    num_stages: int
    # Structure candidates, off by default until bench/mla_bench.py --sweep has timed them (docs/mla.md):
    lazy_rescale: bool = False  # rescale the accumulator only when a row's max grows by > RESCALE_THRESHOLD
    unchained: bool = False  # P and the rescale factors pass through a global scratch (see _attend_tile)
    tma: bool = False  # key tiles through device-side tensor descriptors (TMA), not pointer arithmetic

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < 16 or not is_power_of_two(value):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")

    def label(self) -> str:
        """"64x64 w8 s2" plus the candidates switched on ("+lazy", "+unchained", "+tma")."""
        flags = "".join(f" +{name}" for name, on in (("lazy", self.lazy_rescale), ("unchained", self.unchained),
                                                     ("tma", self.tma)) if on)
        return f"{self.block_m}x{self.block_n} w{self.num_warps} s{self.num_stages}{flags}"


def supports(kv_lora_rank: int, rope_dim: int) -> str:
    """"" when the kernel takes this latent shape, else why not (for a decline's record)."""
    if not (is_power_of_two(kv_lora_rank) and MIN_DIM <= kv_lora_rank <= MAX_LATENT):
        return f"kv_lora_rank {kv_lora_rank} is not a power of two in {MIN_DIM}..{MAX_LATENT}"
    if not (is_power_of_two(rope_dim) and MIN_DIM <= rope_dim <= MAX_ROPE):
        return f"qk_rope_head_dim {rope_dim} is not a power of two in {MIN_DIM}..{MAX_ROPE}"
    return ""


def default_config(kv_lora_rank: int, rows: int) -> MlaConfig:
    """The launch config for `rows` query rows per sequence (M = Tq x Hq) at latent rank R: BLOCK_M the
    rows rounded up to a power of two, at most 64; 8 warps once the accumulator is 64 x 512 fp32, and then
    64-key tiles read through TMA: the fastest of the H200 sweep at 128 heads (bench/RESULTS.md, run 63:
    249.4 µs against 278.3 through pointers; docs/mla.md). `mla_decode` drops TMA for a misaligned cache."""
    block_m = max(16, min(64, triton.next_power_of_2(rows)))
    warps = 8 if block_m * kv_lora_rank >= 64 * 512 else 4
    block_n = 64 if warps == 8 or kv_lora_rank < 256 else 32
    return MlaConfig(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=2,
                     tma=warps == 8 and block_n == 64)


def _tma_misaligned(cache: torch.Tensor) -> list[str]:
    """What of the cache [B, Tk, 1, R + r] is not 16-byte aligned, as TMA needs (empty: it may use TMA)."""
    size = cache.element_size()
    return [what for what, value in (("address", cache.data_ptr()), ("batch stride", cache.stride(0) * size),
                                     ("token stride", cache.stride(1) * size)) if value % 16]


@triton.jit
def _attend_tile(
    q_latent, q_rope,  # [BLOCK_M, R], [BLOCK_M, r]
    cache_base, latent_desc, rope_desc,  # the sequence's cache rows; its tensor descriptors (TMA only)
    stride_ct, start, walk_end, position,  # position [BLOCK_M]: each row's last visible key
    qk_scale_log2,
    running_max, running_sum, accumulator,  # [BLOCK_M], [BLOCK_M], [BLOCK_M, R] float32
    scratch_p, scratch_alpha,  # this program's slot of the step's parity (UNCHAINED only)
    LATENT: tl.constexpr, ROPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    LAZY_RESCALE: tl.constexpr, UNCHAINED: tl.constexpr, DOT_PRECISION: tl.constexpr, PTX: tl.constexpr,
    WIDE_OFFSETS: tl.constexpr, TMA: tl.constexpr,
):
    """One key tile of the online softmax: returns the updated (running_max, running_sum, accumulator).
    running_max is the reference max both the sum and the accumulator are scaled to (with LAZY_RESCALE
    it may trail the true max by up to RESCALE_THRESHOLD).

    UNCHAINED: Triton lays out a dot whose result feeds another dot with every warp along M; at BLOCK_M
    64 and 8 warps that is 128 rows of warps over 64 rows, so both warpgroups compute the whole score
    tile (and its exp2) twice. Passing P and the rescale factors through a global scratch (a CTA
    barrier between the store and the load; two slots by step parity, so one barrier per step) cuts the
    dataflow from the score dot to the value dot, and the score dot's warps split the keys instead."""
    latent_dims = tl.arange(0, LATENT)
    rope_dims = tl.arange(0, ROPE)
    keys = start + tl.arange(0, BLOCK_N)
    key_valid = keys < walk_end
    if TMA:  # zero past the descriptors' last_key rows; keys in [walk_end, last_key) are real and masked below
        latent = latent_desc.load([start, 0])  # [BLOCK_N, R]
        key_rope = rope_desc.load([start, LATENT])  # [BLOCK_N, r]
    else:
        key_rows = cache_base + (keys.to(tl.int64) if WIDE_OFFSETS else keys)[:, None] * stride_ct  # int32: fewer regs
        latent = tl.load(key_rows + latent_dims[None, :], mask=key_valid[:, None], other=0.0)  # [BLOCK_N, R]
        key_rope = tl.load(key_rows + LATENT + rope_dims[None, :], mask=key_valid[:, None], other=0.0)  # [BLOCK_N, r]
    if UNCHAINED:  # the RoPE dot first: a dot feeding a dot takes the duplicated layout, so let it be the small one
        scores = tl.dot(q_rope, tl.trans(key_rope), input_precision=DOT_PRECISION)
        scores = tl.dot(q_latent, tl.trans(latent), scores, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
    else:
        scores = tl.dot(q_latent, tl.trans(latent), input_precision=DOT_PRECISION)
        scores = tl.dot(q_rope, tl.trans(key_rope), scores, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
    visible = key_valid[None, :] & (keys[None, :] <= position[:, None])
    scores = tl.where(visible, scores * qk_scale_log2, float("-inf"))
    new_max = tl.maximum(running_max, tl.max(scores, 1))
    if LAZY_RESCALE:  # keep the reference max unless some row's max grew past the threshold (block-uniform)
        growth = tl.where(new_max > running_max, new_max - running_max, 0.0)  # inf at a row's first key
        rescaled = tl.max(growth, 0) > _RESCALE_THRESHOLD
        new_max = tl.where(rescaled, new_max, running_max)
    # 1 exactly where the reference max stays (or nothing is visible yet: no NaN from -inf - -inf)
    rescale = tl.where(new_max == float("-inf"), 1.0, tl.math.exp2(running_max - new_max))
    running_sum = running_sum * rescale
    running_max = new_max
    if not UNCHAINED:
        if LAZY_RESCALE:
            if rescaled:
                accumulator = accumulator * rescale[:, None]
        else:
            accumulator = accumulator * rescale[:, None]
    safe_max = tl.where(running_max == float("-inf"), 0.0, running_max)
    probabilities = tl.math.exp2(scores - safe_max[:, None])  # [BLOCK_M, BLOCK_N], <= 2^RESCALE_THRESHOLD
    running_sum = running_sum + tl.sum(probabilities, 1)
    probabilities = probabilities.to(latent.dtype)
    if UNCHAINED:
        tile = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tl.store(scratch_p + tile, probabilities)
        tl.store(scratch_alpha + tl.arange(0, BLOCK_M), rescale)
        if PTX:  # bar.sync as inline asm: Triton 3.6 does not software-pipeline a loop holding gpu.barrier;
            # the loads' addresses take its result (0) so that the pipeliner cannot prefetch them past it
            after = tl.inline_asm_elementwise("bar.sync 0;\n mov.u32 $0, 0;", "=r,r", [start], dtype=tl.int32,
                                              is_pure=False, pack=1)
        else:
            tl.debug_barrier()  # every thread's P and factors stored before any thread reads them back
            after = 0
        probabilities = tl.load(scratch_p + after + tile, volatile=True)
        alpha = tl.load(scratch_alpha + after + tl.arange(0, BLOCK_M), volatile=True)
        if LAZY_RESCALE:
            if tl.min(alpha, 0) < 1.0:  # a rescaled step has a row grown past the threshold: its factor < 1
                accumulator = accumulator * alpha[:, None]
        else:
            accumulator = accumulator * alpha[:, None]
    accumulator = tl.dot(probabilities, latent, accumulator, input_precision=DOT_PRECISION)
    return running_max, running_sum, accumulator


@triton.jit
def _mla_split_kernel(
    q_ptr,  # [B, M, R + r] rows t-major (q viewed [B, Tq * Hq, R + r])
    cache_ptr,  # [B, Tk, R + r]
    out_ptr,  # [B, M, R] (OUTPUT "direct")
    partial_ptr,  # [S, B, M, R] float32 (OUTPUT "partials")
    lse_ptr,  # [S, B, M] float32 (OUTPUT "partials")
    q_start_ptr,  # [B] int32
    scratch_ptr,  # [programs, 2, BLOCK_M, BLOCK_N] q's dtype (UNCHAINED only; else never dereferenced)
    alpha_ptr,  # [programs, 2, BLOCK_M] float32 (UNCHAINED only)
    heads,  # Hq
    rows,  # M
    key_len,  # Tk
    num_splits,  # S
    walk_tiles,  # cdiv(Tk, BLOCK_N): split s walks tiles [s*T//S, (s+1)*T//S), stopped at its causal bound
    qk_scale_log2,  # softmax scale * log2(e)
    stride_qb, stride_qm,
    stride_cb, stride_ct,
    stride_ob, stride_om,
    LATENT: tl.constexpr,  # R
    ROPE: tl.constexpr,  # r
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    OUTPUT: tl.constexpr,  # "direct" (S == 1) or "partials"
    DOT_PRECISION: tl.constexpr,
    LAZY_RESCALE: tl.constexpr,
    UNCHAINED: tl.constexpr,
    PTX: tl.constexpr,  # compiled for a GPU (inline PTX allowed), not interpreted
    WIDE_OFFSETS: tl.constexpr,  # key offsets Tk x stride_ct reach 2^31: int64 (else int32, fewer registers)
    TMA: tl.constexpr,  # the key tiles through tensor descriptors (TMA on Hopper), not pointer arithmetic
    USE_GDC: tl.constexpr,  # programmatic dependent launch (kernels.pdl)
):
    """One program: BLOCK_M query rows of one sequence, split pid_split of its key walk."""
    pid_m, pid_split, batch = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if USE_GDC:  # q, q_start and the newest latent are the previous kernels' output
        tl.extra.cuda.gdc_wait()
    row = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = row < rows
    position = tl.load(q_start_ptr + batch) + row // heads  # [BLOCK_M] each row's last visible key
    latent_dims = tl.arange(0, LATENT)
    rope_dims = tl.arange(0, ROPE)
    q_rows = q_ptr + batch.to(tl.int64) * stride_qb + row.to(tl.int64)[:, None] * stride_qm
    q_latent = tl.load(q_rows + latent_dims[None, :], mask=row_valid[:, None], other=0.0)  # [BLOCK_M, R]
    q_rope = tl.load(q_rows + LATENT + rope_dims[None, :], mask=row_valid[:, None], other=0.0)  # [BLOCK_M, r]

    # The walk ends at the last row's causal bound (rows are t-major, so the block's largest position).
    last_key = tl.minimum(tl.max(tl.where(row_valid, position, 0), 0) + 1, key_len)
    walk_begin = (pid_split * walk_tiles // num_splits) * BLOCK_N
    walk_end = tl.minimum(((pid_split + 1) * walk_tiles // num_splits) * BLOCK_N, last_key)

    cache_base = cache_ptr + batch.to(tl.int64) * stride_cb
    if TMA:  # device-side descriptors bounded by the block's causal end: TMA zero-fills the keys past it
        latent_desc = tl.make_tensor_descriptor(cache_base, shape=[last_key, LATENT + ROPE], strides=[stride_ct, 1],
                                                block_shape=[BLOCK_N, LATENT])
        rope_desc = tl.make_tensor_descriptor(cache_base, shape=[last_key, LATENT + ROPE], strides=[stride_ct, 1],
                                              block_shape=[BLOCK_N, ROPE])
    else:
        latent_desc = cache_base
        rope_desc = cache_base
    running_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    accumulator = tl.zeros([BLOCK_M, LATENT], dtype=tl.float32)
    program = (batch * tl.num_programs(1) + pid_split) * tl.num_programs(0) + pid_m
    scratch_p = scratch_ptr + program.to(tl.int64) * (2 * BLOCK_M * BLOCK_N)
    scratch_alpha = alpha_ptr + program.to(tl.int64) * (2 * BLOCK_M)
    for start in range(walk_begin, walk_end, BLOCK_N):
        parity = ((start - walk_begin) // BLOCK_N) % 2
        running_max, running_sum, accumulator = _attend_tile(
            q_latent, q_rope, cache_base, latent_desc, rope_desc, stride_ct, start, walk_end, position, qk_scale_log2,
            running_max, running_sum, accumulator,
            scratch_p + parity * (BLOCK_M * BLOCK_N), scratch_alpha + parity * BLOCK_M,
            LATENT, ROPE, BLOCK_M, BLOCK_N, LAZY_RESCALE, UNCHAINED, DOT_PRECISION, PTX, WIDE_OFFSETS, TMA)
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()

    seen = running_sum > 0.0
    normalised = accumulator / tl.where(seen, running_sum, 1.0)[:, None]  # [BLOCK_M, R]; 0 where nothing was seen
    if OUTPUT == "direct":
        out_rows = out_ptr + batch.to(tl.int64) * stride_ob + row.to(tl.int64)[:, None] * stride_om
        tl.store(out_rows + latent_dims[None, :], normalised.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])
    else:
        flat_row = (pid_split * tl.num_programs(2) + batch).to(tl.int64) * rows + row  # [BLOCK_M] of [S, B, M]
        tl.store(partial_ptr + flat_row[:, None] * LATENT + latent_dims[None, :], normalised, mask=row_valid[:, None])
        lse = tl.where(seen, running_max + tl.math.log2(tl.where(seen, running_sum, 1.0)), float("-inf"))
        tl.store(lse_ptr + flat_row, lse, mask=row_valid)


@triton.jit
def _mla_combine_kernel(
    partial_ptr,  # [S, B, M, R] float32
    lse_ptr,  # [S, B, M] float32
    out_ptr,  # [B, M, R]
    rows,  # M
    batches,  # B
    num_splits,  # S
    stride_ob, stride_om,
    LATENT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    """out = sum_s 2^(lse_s - L) partial_s with L the log2-sum of the lse_s, splits in order 0..S-1."""
    pid_m, batch, pid_d = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
    row = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = row < rows
    columns = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    total_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for split in range(num_splits):  # the reference point first: every weight is then <= 1
        lse = tl.load(lse_ptr + (split * batches + batch).to(tl.int64) * rows + row, mask=row_valid,
                      other=float("-inf"))
        total_max = tl.maximum(total_max, lse)
    safe_max = tl.where(total_max == float("-inf"), 0.0, total_max)
    weight_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    out = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for split in range(num_splits):
        flat_row = (split * batches + batch).to(tl.int64) * rows + row
        weight = tl.math.exp2(tl.load(lse_ptr + flat_row, mask=row_valid, other=float("-inf")) - safe_max)
        partial = tl.load(partial_ptr + flat_row[:, None] * LATENT + columns[None, :], mask=row_valid[:, None],
                          other=0.0)
        out += partial * weight[:, None]
        weight_sum += weight
    out = out / tl.where(weight_sum > 0.0, weight_sum, 1.0)[:, None]
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    out_rows = out_ptr + batch.to(tl.int64) * stride_ob + row.to(tl.int64)[:, None] * stride_om
    tl.store(out_rows + columns[None, :], out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


def _device_sms(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_num_splits(batch: int, rows: int, key_len: int, config: MlaConfig, sms: int | None,
                       consumer_merges: bool = False) -> int:
    """Splits of the key walk (host-side, shapes only): one wave of programs on `sms` SMs, at most MAX_SPLITS.
    Merged by the combine kernel, each split walks >= MIN_TILES_PER_SPLIT tiles, or a short walk up to
    SHORT_WALK_SPLITS splits of >= 1 tile (the combine's loop over the splits grows with them); merged by the
    consumer (`consumer_merges`: unabsorb's unrolled merge), one tile a split is enough: at one V2-Lite token
    attention added 3.8 µs at 159 keys in 5 splits, 5.3 at 1024 in 32, 9.3 at 4096 in 64 (run 77: fewer splits
    were slower at every length). Under the interpreter (sms None) up to 4 splits of >= 1 tile, enough to
    exercise the merge."""
    tiles = max(1, triton.cdiv(key_len, config.block_n))
    if sms is None:
        return max(1, min(4, tiles))
    programs_per_split = batch * triton.cdiv(rows, config.block_m)
    wanted = tiles if consumer_merges else max(tiles // MIN_TILES_PER_SPLIT, min(tiles, SHORT_WALK_SPLITS))
    return max(1, min(MAX_SPLITS, sms // programs_per_split, wanted))


def _descriptor_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_descriptor_allocator() -> None:
    """Device-side tensor descriptors live in a global scratch Triton asks its allocator for at each launch
    (128 B per descriptor and program); set ours unless the caller has set one (a context variable, so
    each launching thread needs it)."""
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_descriptor_scratch)


def needs_wide_offsets(key_len: int, token_stride: int, width: int) -> bool:
    """Whether a key's element offset within its sequence (key x token stride + column) can reach 2^31: the
    walk then computes offsets in int64, else in int32 (fewer registers in the loop: 252 against 255 at
    the 64 x 64 default, bench/mla_sm90_compile.py)."""
    return key_len * token_stride + width >= 2 ** 31


@dataclass(frozen=True)
class LatentSplits:
    """What the split kernel leaves: `out` [B, Tq, Hq, R], written when one split ran (partials and lse None);
    else each split's `partials` [S, B, Tq * Hq, R] float32 and `lse` [S, B, Tq * Hq] float32, which `combine`
    merges into `out` (or a consumer merges itself: kernels.mla_absorb.unabsorb)."""

    out: torch.Tensor
    partials: torch.Tensor | None = None
    lse: torch.Tensor | None = None


def mla_decode(
    q: torch.Tensor,  # [B, Tq, Hq, R + r] absorbed queries
    cache: torch.Tensor,  # [B, Tk, 1, R + r] latents then RoPE keys
    kv_lora_rank: int,  # R
    scale: float,
    q_start: torch.Tensor | int = 0,  # [B] or int
    *,
    out: torch.Tensor | None = None,  # [B, Tq, Hq, R] to write into
    num_splits: int | None = None,  # None: `default_num_splits`
    config: MlaConfig | None = None,  # None: `default_config` (benchmark sweeps pass others)
) -> torch.Tensor:  # [B, Tq, Hq, R]
    """Causal attention of the absorbed queries over the latent cache; equal to `mla_latent_reference`."""
    splits = mla_split(q, cache, kv_lora_rank, scale, q_start, out=out, num_splits=num_splits, config=config)
    return splits.out if splits.partials is None else combine(splits)


def combine(splits: LatentSplits) -> torch.Tensor:
    """splits.out [B, Tq, Hq, R] = the splits' partials merged in order 0..S-1 (the combine kernel)."""
    partials, lse, out = splits.partials, splits.lse, splits.out
    num_splits, batch, rows, kv_lora_rank = partials.shape
    out_rows = out.view(batch, rows, kv_lora_rank)
    block_d = min(kv_lora_rank, 128)
    combine_rows = 16
    compiled = _mla_combine_kernel[(triton.cdiv(rows, combine_rows), batch, kv_lora_rank // block_d)](
        partials, lse, out_rows, rows, batch, num_splits, out_rows.stride(0), out_rows.stride(1),
        LATENT=kv_lora_rank, BLOCK_M=combine_rows, BLOCK_D=block_d, num_warps=4, **pdl.launch_options(out.device),
    )
    launches.record("mla_combine", kernel=_mla_combine_kernel)
    remember_compiled(f"mla_combine R{kv_lora_rank} {out.dtype}", compiled)
    return out


def mla_split(
    q: torch.Tensor,  # [B, Tq, Hq, R + r] absorbed queries
    cache: torch.Tensor,  # [B, Tk, 1, R + r] latents then RoPE keys
    kv_lora_rank: int,  # R
    scale: float,
    q_start: torch.Tensor | int = 0,  # [B] or int
    *,
    out: torch.Tensor | None = None,  # [B, Tq, Hq, R] to write into at one split
    num_splits: int | None = None,  # None: `default_num_splits`
    config: MlaConfig | None = None,  # None: `default_config`
    consumer_merges: bool = False,  # the caller merges the partials itself (the split count's rule)
) -> LatentSplits:
    """The split kernel of `mla_decode` alone: at one split the output, else the splits' partials unmerged."""
    if q.dim() != 4 or cache.dim() != 4 or cache.shape[2] != 1:
        raise ValueError(f"q must be [B, Tq, Hq, R + r] and cache [B, Tk, 1, R + r]; got {tuple(q.shape)}, "
                         f"{tuple(cache.shape)}")
    batch, query_len, heads, width = q.shape
    if cache.shape[0] != batch or cache.shape[3] != width:
        raise ValueError(f"cache must be [B={batch}, Tk, 1, {width}], got {tuple(cache.shape)}")
    why = supports(kv_lora_rank, width - kv_lora_rank)
    if why:
        raise ValueError(f"mla_decode does not take this latent shape: {why}")
    if q.dtype not in SUPPORTED_DTYPES or cache.dtype != q.dtype or q.device != cache.device:
        raise ValueError(f"q and cache must share a dtype of {SUPPORTED_DTYPES} and a device; got {q.dtype} on "
                         f"{q.device}, {cache.dtype} on {cache.device}")
    if cache.stride(3) != 1:
        raise ValueError(f"cache must be contiguous along R + r, got strides {cache.stride()}")
    if isinstance(q_start, torch.Tensor):
        if q_start.numel() not in (1, batch):
            raise ValueError(f"q_start must be an int or have B={batch} entries; got shape {tuple(q_start.shape)}")
        q_start = q_start.to(device=q.device, dtype=torch.int32).reshape(-1).expand(batch).contiguous()
    else:
        if q_start < 0:
            raise ValueError(f"q_start must be >= 0, got {q_start}")
        q_start = torch.full((batch,), int(q_start), dtype=torch.int32, device=q.device)
    rows, key_len = query_len * heads, cache.shape[1]
    q_rows = q.reshape(batch, rows, width)
    if q_rows.stride(2) != 1:
        q_rows = q_rows.contiguous()
    if out is None:
        out = torch.empty(batch, query_len, heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    elif out.shape != (batch, query_len, heads, kv_lora_rank) or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {q.dtype} [{batch}, {query_len}, {heads}, {kv_lora_rank}]")
    if rows == 0 or batch == 0:
        return LatentSplits(out)
    out_rows = out.view(batch, rows, kv_lora_rank)
    if config is None:
        config = default_config(kv_lora_rank, rows)
        if config.tma and _tma_misaligned(cache):
            config = replace(config, tma=False)
    tiles = max(1, triton.cdiv(key_len, config.block_n))
    if num_splits is None:
        num_splits = default_num_splits(batch, rows, key_len, config, _device_sms(q.device), consumer_merges)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in 1..{MAX_SPLITS}, got {num_splits}")
    num_splits = min(num_splits, tiles)
    output = "direct" if num_splits == 1 else "partials"
    if output == "direct":
        partials = lse = out_rows  # never dereferenced
    else:
        partials = torch.empty(num_splits, batch, rows, kv_lora_rank, dtype=torch.float32, device=q.device)
        lse = torch.empty(num_splits, batch, rows, dtype=torch.float32, device=q.device)
    cache_rows = cache[:, :, 0]  # [B, Tk, R + r]
    compiled_for_gpu = q.device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
    if config.tma:
        misaligned = _tma_misaligned(cache)
        if misaligned:
            raise ValueError(f"config {config.label()} reads the cache through TMA, which needs 16-byte aligned "
                             f"rows; the cache's {', '.join(misaligned)} is not (use a config without tma)")
        if compiled_for_gpu:
            _ensure_descriptor_allocator()
    grid = (triton.cdiv(rows, config.block_m), num_splits, batch)
    if config.unchained:
        programs = grid[0] * grid[1] * grid[2]
        scratch = torch.empty(programs, 2, config.block_m, config.block_n, dtype=q.dtype, device=q.device)
        alpha = torch.empty(programs, 2, config.block_m, dtype=torch.float32, device=q.device)
    else:
        scratch = alpha = q_start  # never dereferenced
    compiled = _mla_split_kernel[grid](
        q_rows, cache_rows, out_rows, partials, lse, q_start, scratch, alpha,
        heads, rows, key_len, num_splits, tiles, float(scale) * LOG2_E,
        q_rows.stride(0), q_rows.stride(1),
        cache_rows.stride(0), cache_rows.stride(1),
        out_rows.stride(0), out_rows.stride(1),
        LATENT=kv_lora_rank, ROPE=width - kv_lora_rank, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        OUTPUT=output, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        LAZY_RESCALE=config.lazy_rescale, UNCHAINED=config.unchained,
        PTX=compiled_for_gpu,
        WIDE_OFFSETS=needs_wide_offsets(key_len, cache_rows.stride(1), width), TMA=config.tma,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl.launch_options(q.device),
    )
    launches.record("mla_split", kernel=_mla_split_kernel)
    remember_compiled(f"mla_split R{kv_lora_rank} r{width - kv_lora_rank} {q.dtype} {output} {config.label()}",
                      compiled)
    if output == "direct":
        return LatentSplits(out)
    return LatentSplits(out, partials, lse)
