"""On-device alignment of MoE routing: (token, expert) pairs sorted by expert, padded into m-tiles.

Routing metadata (every tensor int32, on the device of `topk_ids`)
------------------------------------------------------------------
    T = tokens, k = experts per token, E = experts, N = T*k pairs, TILE_M = rows of one m-tile
    pair p = t*k + j is token t's j-th routed expert, e = topk_ids[t, j].

    input
        topk_ids            [T, k]          expert of each pair (int32 or int64)
    outputs (MoeAlignment)
        sorted_pair_ids     [max_rows]      pair in each row of the expert-sorted layout; expert e
                                            owns rows padded_offsets[e] .. padded_offsets[e+1]-1,
                                            its pairs first in increasing p (stable), then padding
                                            rows holding the sentinel N
        pair_rows           [N]             inverse: the row of pair p (-1 if its id is not in [0, E))
        tile_expert_ids     [max_tiles]     expert of m-tile i (rows i*TILE_M .. i*TILE_M+TILE_M-1);
                                            -1 for tiles past the used ones
        window_first_tiles  [max_windows]   first m-tile of each window: up to window_tiles
                                            consecutive m-tiles of ONE expert, the rows one
                                            grouped-GEMM program multiplies at once; -1 past the used
        expert_counts       [E]             pairs routed to each expert
        expert_offsets      [E+1]           exclusive prefix sum of expert_counts (offsets[E] = N)
        padded_offsets      [E+1]           the same over counts rounded up to TILE_M
        used_tiles          [1]             m-tiles holding at least one pair's expert
        used_windows        [1]             windows in use
    scratch (multi-kernel path only; the fused path has none)
        rank_in_chunk       [N]             position of a pair among same-expert pairs of its chunk
        chunk_counts        [chunks, E]     per-chunk expert counts, then (in place) the exclusive
                                            prefix over chunks: where a chunk's pairs start

Host-known bounds (no device->host sync: every size below comes from N, E, TILE_M only, so the
whole alignment can be captured in a CUDA graph). With A = min(E, N) experts that can be woken:
    max_tiles   = (N + A*(TILE_M-1)) // TILE_M       sum_e ceil(count_e / TILE_M)  <= this
    max_rows    = max_tiles * TILE_M
    max_windows = A + (N - A) // (window_tiles*TILE_M)   sum_e ceil(count_e / window rows) <= this

Kernels. Up to FUSED_MAX_PAIRS pairs (512: 64 tokens at k <= 8, every decode batch the grouped
arm sees below its crossover) the alignment is ONE launch:
    _fused_kernel   grid (chunks + tile blocks + window blocks,), no program reads what another
                    writes: each reads all N ids, counts them per expert (tl.histogram) and scans
                    the counts, then places one chunk of FUSED_CHUNK_PAIRS pairs (counting the
                    earlier chunks' pairs per expert with a second histogram), or writes one block
                    of FUSED_BLOCK_TILES m-tiles (their expert, their padding sentinels), or one
                    block of windows; program 0 also writes the counts and offsets
Above that, three launches (the scan is skipped when all pairs fit one chunk):
    _count_kernel   grid (chunks,)  per chunk of CHUNK_PAIRS pairs: counts per expert, ranks
    _scan_kernel    grid (1,)       prefix over chunks -> chunk starts and expert totals
    _place_kernel   grid (programs,) every program derives the offsets from the totals (E values),
                                    then places one chunk's pairs, writes one block of tile and
                                    window entries and the padding sentinels of those tiles
The two paths give equal tensors, padding and unused entries included (the tests compare them
field by field); the multi-kernel path is the reference the fused one is held to.

Does not know what the rows are multiplied with; `kernels.moe_grouped` does.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels import launches, scratch
from kernels.moe_checks import check_triton_device

# Pairs per program in the count and place kernels. The rank of a pair inside its chunk is a
# [CHUNK, CHUNK] comparison and the expert histogram a [CHUNK, E_PAD] one-hot: 64 keeps both
# near 16K elements per program at E=256, 64 per thread at 8 warps. (An sm_90 compile without a
# GPU gave 116 / 133 / 205 registers for count / scan / place at 8 warps and no stack; at 4
# warps place needed 255 and spilled.)
CHUNK_PAIRS = 64
# Chunks the single-program scan handles per step: a [32, E_PAD] block, so n=8192, k=6
# (768 chunks) takes 24 steps.
SCAN_CHUNKS = 32
# Tiles (and windows) per program in the place kernel: again a [64, E_PAD] one-hot.
TILES_PER_PROGRAM = 64
NUM_WARPS = 8
MAX_EXPERTS = 1024
# Up to this many pairs the alignment is one launch (_fused_kernel): 512 covers 64 tokens at k <= 8.
# Every fused program reads all of them (MAX_PAIRS lanes, 2 per thread) and histograms them, a
# cost that grows with this bound; above it the multi-kernel path spreads the counting over N/64
# programs. The 10-bit packing of the running ends in _fused_kernel needs it below 1024.
FUSED_MAX_PAIRS = 512
# Pairs per chunk program and m-tiles (windows) per tile (window) program of the fused kernel, up
# to E=256: [E_PAD, 32] blocks, 32 values per thread at 8 warps (81 registers, no stack in an sm_90
# build). Past 256 experts both shrink with 1/E_PAD, so the blocks stay 8K values: at E=1024 and
# 32-wide blocks the build spilled (240 bytes of stack).
FUSED_CHUNK_PAIRS = 32
FUSED_BLOCK_TILES = 32


class MoeAlignment(NamedTuple):
    sorted_pair_ids: torch.Tensor  # [max_rows] int32, N marks a padding row
    pair_rows: torch.Tensor  # [N] int32
    tile_expert_ids: torch.Tensor  # [max_tiles] int32, -1 unused
    window_first_tiles: torch.Tensor  # [max_windows] int32, -1 unused
    expert_counts: torch.Tensor  # [E] int32
    expert_offsets: torch.Tensor  # [E+1] int32
    padded_offsets: torch.Tensor  # [E+1] int32
    used_tiles: torch.Tensor  # [1] int32
    used_windows: torch.Tensor  # [1] int32
    num_pairs: int
    tile_m: int
    window_tiles: int


@triton.jit
def _count_kernel(
    topk_ids_ptr,  # [N] expert of each pair
    rank_in_chunk_ptr,  # [N] out
    chunk_counts_ptr,  # [chunks, E] out
    num_pairs,
    num_experts,
    CHUNK: tl.constexpr,
    E_PAD: tl.constexpr,
):
    chunk = tl.program_id(0)
    lane = tl.arange(0, CHUNK)
    pair = chunk * CHUNK + lane
    in_range = pair < num_pairs
    expert = tl.load(topk_ids_ptr + pair, mask=in_range, other=-1).to(tl.int32)
    valid = in_range & (expert >= 0) & (expert < num_experts)
    expert = tl.where(valid, expert, -1)

    # rank = same-expert pairs earlier in this chunk; keeps the order stable (increasing p)
    earlier_same = (expert[:, None] == expert[None, :]) & (lane[None, :] < lane[:, None]) & valid[None, :]
    rank = tl.sum(earlier_same.to(tl.int32), axis=1)
    tl.store(rank_in_chunk_ptr + pair, rank, mask=in_range)

    expert_lane = tl.arange(0, E_PAD)
    one_hot = (expert[:, None] == expert_lane[None, :]).to(tl.int32)  # [CHUNK, E_PAD]
    counts = tl.sum(one_hot, axis=0)
    tl.store(chunk_counts_ptr + chunk * num_experts + expert_lane, counts, mask=expert_lane < num_experts)


@triton.jit
def _scan_kernel(
    chunk_counts_ptr,  # [chunks, E] in: counts, out: exclusive prefix over chunks
    expert_counts_ptr,  # [E] out
    num_chunks,
    num_experts,
    SCAN_BLOCK: tl.constexpr,
    E_PAD: tl.constexpr,
):
    expert_lane = tl.arange(0, E_PAD)
    expert_ok = expert_lane < num_experts
    running = tl.zeros([E_PAD], dtype=tl.int32)
    for first in range(0, num_chunks, SCAN_BLOCK):
        chunk = first + tl.arange(0, SCAN_BLOCK)
        offsets = chunk[:, None] * num_experts + expert_lane[None, :]
        mask = (chunk[:, None] < num_chunks) & expert_ok[None, :]
        block = tl.load(chunk_counts_ptr + offsets, mask=mask, other=0)  # [SCAN_BLOCK, E_PAD]
        inclusive = tl.cumsum(block, axis=0)
        tl.store(chunk_counts_ptr + offsets, inclusive - block + running[None, :], mask=mask)
        running += tl.sum(block, axis=0)
    tl.store(expert_counts_ptr + expert_lane, running, mask=expert_ok)


@triton.jit
def _place_kernel(
    topk_ids_ptr,  # [N]
    rank_in_chunk_ptr,  # [N]
    chunk_starts_ptr,  # [chunks, E] exclusive prefix over chunks (unused if SINGLE_CHUNK)
    expert_counts_ptr,  # [E]
    sorted_pair_ids_ptr,  # [max_rows] out
    pair_rows_ptr,  # [N] out
    tile_expert_ids_ptr,  # [max_tiles] out
    window_first_tiles_ptr,  # [max_windows] out
    expert_offsets_ptr,  # [E+1] out
    padded_offsets_ptr,  # [E+1] out
    used_tiles_ptr,  # [1] out
    used_windows_ptr,  # [1] out
    num_pairs,
    num_experts,
    num_chunks,
    max_tiles,
    max_windows,
    TILE_M: tl.constexpr,
    WINDOW_TILES: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_TILES: tl.constexpr,
    E_PAD: tl.constexpr,
    SINGLE_CHUNK: tl.constexpr,
):
    program = tl.program_id(0)
    expert_lane = tl.arange(0, E_PAD)
    expert_ok = expert_lane < num_experts
    counts = tl.load(expert_counts_ptr + expert_lane, mask=expert_ok, other=0)  # [E_PAD]
    tiles = (counts + TILE_M - 1) // TILE_M
    windows = (tiles + WINDOW_TILES - 1) // WINDOW_TILES
    pair_end = tl.cumsum(counts, axis=0)
    tile_end = tl.cumsum(tiles, axis=0)
    tile_start = tile_end - tiles
    window_end = tl.cumsum(windows, axis=0)
    window_start = window_end - windows

    if program == 0:
        tl.store(expert_offsets_ptr + expert_lane + 1, pair_end, mask=expert_ok)
        tl.store(padded_offsets_ptr + expert_lane + 1, tile_end * TILE_M, mask=expert_ok)
        tl.store(expert_offsets_ptr, 0)
        tl.store(padded_offsets_ptr, 0)
        tl.store(used_tiles_ptr, tl.sum(tiles, axis=0))
        tl.store(used_windows_ptr, tl.sum(windows, axis=0))

    # ---- one chunk of pairs -> their rows
    if program < num_chunks:
        pair = program * CHUNK + tl.arange(0, CHUNK)
        in_range = pair < num_pairs
        expert = tl.load(topk_ids_ptr + pair, mask=in_range, other=-1).to(tl.int32)
        valid = in_range & (expert >= 0) & (expert < num_experts)
        rank = tl.load(rank_in_chunk_ptr + pair, mask=in_range, other=0)
        is_expert = (expert[:, None] == expert_lane[None, :]).to(tl.int32)  # [CHUNK, E_PAD]
        expert_first_row = tl.sum(is_expert * (tile_start * TILE_M)[None, :], axis=1)
        if SINGLE_CHUNK:
            chunk_start = tl.zeros([CHUNK], dtype=tl.int32)
        else:
            chunk_start = tl.load(chunk_starts_ptr + program * num_experts + expert, mask=valid, other=0)
        row = expert_first_row + chunk_start + rank
        tl.store(sorted_pair_ids_ptr + row, pair, mask=valid)
        tl.store(pair_rows_ptr + pair, tl.where(valid, row, -1), mask=in_range)

    # ---- one block of m-tiles: their expert, and the sentinel in their padding rows
    tile = program * BLOCK_TILES + tl.arange(0, BLOCK_TILES)
    tile_ok = tile < max_tiles
    # expert of tile i = number of experts whose tiles end at or before i (empty experts skip)
    tile_expert = tl.sum(((tile_end[None, :] <= tile[:, None]) & expert_ok[None, :]).to(tl.int32), axis=1)
    tile_used = tile_expert < num_experts
    tl.store(tile_expert_ids_ptr + tile, tl.where(tile_used, tile_expert, -1), mask=tile_ok)
    is_tile_expert = (tile_expert[:, None] == expert_lane[None, :]).to(tl.int32)  # [BLOCK_TILES, E_PAD]
    expert_pairs = tl.sum(is_tile_expert * counts[None, :], axis=1)
    expert_first_tile = tl.sum(is_tile_expert * tile_start[None, :], axis=1)
    row_in_tile = tl.arange(0, TILE_M)
    row = tile[:, None] * TILE_M + row_in_tile[None, :]  # [BLOCK_TILES, TILE_M]
    row_in_expert = (tile - expert_first_tile)[:, None] * TILE_M + row_in_tile[None, :]
    padding = tile_ok[:, None] & ((~tile_used)[:, None] | (row_in_expert >= expert_pairs[:, None]))
    sentinel = tl.zeros([BLOCK_TILES, TILE_M], dtype=tl.int32) + num_pairs
    tl.store(sorted_pair_ids_ptr + row, sentinel, mask=padding)

    # ---- one block of windows: their first tile
    window = program * BLOCK_TILES + tl.arange(0, BLOCK_TILES)
    window_ok = window < max_windows
    window_expert = tl.sum(((window_end[None, :] <= window[:, None]) & expert_ok[None, :]).to(tl.int32), axis=1)
    is_window_expert = (window_expert[:, None] == expert_lane[None, :]).to(tl.int32)
    first_tile = tl.sum(is_window_expert * tile_start[None, :], axis=1) + \
        (window - tl.sum(is_window_expert * window_start[None, :], axis=1)) * WINDOW_TILES
    first_tile = tl.where(window_expert < num_experts, first_tile, -1)
    tl.store(window_first_tiles_ptr + window, first_tile, mask=window_ok)


# ---- single-launch path (N <= FUSED_MAX_PAIRS). The same tensors as count + scan + place, worked
# out another way (the tests hold the two paths to equality, field by field):
#   - expert totals, and how many pairs of each expert come before a program's chunk, by
#     tl.histogram over all N ids (ballots or shared-memory atomics per id, by release) instead
#     of [pairs, E] one-hots;
#   - every sum, min or max over experts laid out along axis 0 of an [E_PAD, block] tensor.
#     Triton puts lanes and warps of a [64, E_PAD] tensor along E, so the place kernel's sums
#     over axis 1 cost a warp reduction per row and 32 rounds of shared memory and bar.sync each
#     (its sm_90 build with triton 3.9: 894 REDUX, 248 BAR). Along axis 0 the same sum is adds
#     inside each thread and one exchange between warps.
#   - each program does ONE of: a chunk of pairs, a block of m-tiles, a block of windows, so the
#     longest program is the shared prologue plus the largest of the three, not their sum.

@triton.jit
def _load_experts(topk_ids_ptr, pair, num_pairs, num_experts):
    """Expert of each pair, -1 for a pair past N or an id outside [0, E) (it matches no lane)."""
    expert = tl.load(topk_ids_ptr + pair, mask=pair < num_pairs, other=-1).to(tl.int32)
    return tl.where((expert >= 0) & (expert < num_experts), expert, -1)


@triton.jit
def _expert_histogram(expert, take, E_PAD: tl.constexpr):
    """[E_PAD] number of the `take` pairs per expert (taken pairs have an expert in [0, E)).
    tl.histogram without its mask argument (not in every Triton release): the pairs not taken
    are counted into bin 0, then taken back out."""
    parked = tl.sum(tl.where(take, 0, 1), axis=0)
    counts = tl.histogram(tl.where(take, expert, 0), E_PAD)
    return counts - tl.where(tl.arange(0, E_PAD) == 0, parked, 0)


@triton.jit
def _fused_kernel(
    topk_ids_ptr,  # [N]
    sorted_pair_ids_ptr,  # [max_rows] out
    pair_rows_ptr,  # [N] out
    tile_expert_ids_ptr,  # [max_tiles] out
    window_first_tiles_ptr,  # [max_windows] out
    expert_counts_ptr,  # [E] out
    expert_offsets_ptr,  # [E+1] out
    padded_offsets_ptr,  # [E+1] out
    used_tiles_ptr,  # [1] out
    used_windows_ptr,  # [1] out
    num_pairs,
    num_experts,
    num_chunks,
    num_tile_blocks,
    max_tiles,
    max_windows,
    TILE_M: tl.constexpr,
    WINDOW_TILES: tl.constexpr,
    MAX_PAIRS: tl.constexpr,  # FUSED_MAX_PAIRS: every program reads all N <= MAX_PAIRS ids
    CHUNK: tl.constexpr,  # pairs per chunk program
    BLOCK: tl.constexpr,  # m-tiles per tile program, windows per window program
    E_PAD: tl.constexpr,
):
    """Grid: chunks of pairs, then blocks of m-tiles, then blocks of windows, one per program.
    Every program first works out the expert totals and their running ends from all N ids; no
    program reads what another writes."""
    tl.static_assert(MAX_PAIRS < 1024)
    program = tl.program_id(0)
    expert_lane = tl.arange(0, E_PAD)
    expert_ok = expert_lane < num_experts

    every_pair = tl.arange(0, MAX_PAIRS)
    every_expert = _load_experts(topk_ids_ptr, every_pair, num_pairs, num_experts)
    every_valid = every_expert >= 0
    counts = _expert_histogram(every_expert, every_valid, E_PAD)
    tiles = (counts + TILE_M - 1) // TILE_M
    windows = (tiles + WINDOW_TILES - 1) // WINDOW_TILES
    # one scan for the three running ends: each total is <= N < 1024 (tiles <= max_tiles <= N,
    # windows <= tiles), so they pack into 10-bit fields of one int32 without carries
    ends = tl.cumsum(counts | (tiles << 10) | (windows << 20), axis=0)
    pair_end = ends & 1023
    tile_end = (ends >> 10) & 1023
    window_end = ends >> 20
    tile_start = tile_end - tiles
    used_tiles = tl.sum(tiles, axis=0)
    used_windows = tl.sum(windows, axis=0)

    if program < num_chunks:
        if program == 0:
            tl.store(expert_counts_ptr + expert_lane, counts, mask=expert_ok)
            tl.store(expert_offsets_ptr + expert_lane + 1, pair_end, mask=expert_ok)
            tl.store(padded_offsets_ptr + expert_lane + 1, tile_end * TILE_M, mask=expert_ok)
            tl.store(expert_offsets_ptr, 0)
            tl.store(padded_offsets_ptr, 0)
            tl.store(used_tiles_ptr, used_tiles)
            tl.store(used_windows_ptr, used_windows)
        # ---- a chunk of pairs -> their rows: first row of the expert + its pairs in earlier
        # chunks + same-expert pairs earlier in this chunk
        first_pair = program * CHUNK
        earlier_chunks = _expert_histogram(every_expert, every_valid & (every_pair < first_pair), E_PAD)
        first_row = tile_start * TILE_M + earlier_chunks  # [E_PAD]
        lane = tl.arange(0, CHUNK)
        pair = first_pair + lane
        expert = _load_experts(topk_ids_ptr, pair, num_pairs, num_experts)
        valid = expert >= 0
        earlier_same = (expert[:, None] == expert[None, :]) & (lane[:, None] < lane[None, :]) & valid[:, None]
        rank = tl.sum(earlier_same.to(tl.int32), axis=0)  # [earlier j, pair i] summed over j
        row = tl.sum(tl.where(expert_lane[:, None] == expert[None, :], first_row[:, None], 0), axis=0) + rank
        tl.store(sorted_pair_ids_ptr + row, pair, mask=valid)
        tl.store(pair_rows_ptr + pair, tl.where(valid, row, -1), mask=pair < num_pairs)
    elif program < num_chunks + num_tile_blocks:
        # ---- a block of m-tiles. [E_PAD, BLOCK]: experts whose tiles all end at or before the
        # tile, a prefix of the experts (the ends only grow); the next one owns the tile
        tile = (program - num_chunks) * BLOCK + tl.arange(0, BLOCK)
        tile_used = tile < used_tiles
        ended = (tile_end[:, None] <= tile[None, :]) & expert_ok[:, None]
        tile_expert = tl.sum(ended.to(tl.int32), axis=0)
        tl.store(tile_expert_ids_ptr + tile, tl.where(tile_used, tile_expert, -1), mask=tile < max_tiles)
        # the owner's pairs end at the least (first row + count) over the experts not ended:
        # every later expert starts at or past the owner's padded end
        pairs_end_row = tl.min(tl.where(ended | ~expert_ok[:, None], 2**30, (tile_start * TILE_M + counts)[:, None]),
                               axis=0)
        row = tile[:, None] * TILE_M + tl.arange(0, TILE_M)[None, :]  # [BLOCK, TILE_M]
        padding = (tile < max_tiles)[:, None] & (~tile_used[:, None] | (row >= pairs_end_row[:, None]))
        tl.store(sorted_pair_ids_ptr + row, tl.zeros([BLOCK, TILE_M], dtype=tl.int32) + num_pairs, mask=padding)
    else:
        # ---- a block of windows: the owner starts where the last expert ended before it ends,
        # so its first tile and first window are that expert's tile and window ends (the packed
        # ends grow with the expert, so their max over the ended ones is the last one's)
        window = (program - num_chunks - num_tile_blocks) * BLOCK + tl.arange(0, BLOCK)
        window_ended = (window_end[:, None] <= window[None, :]) & expert_ok[:, None]
        owner_start = tl.max(tl.where(window_ended, ends[:, None], 0), axis=0)
        first_tile = ((owner_start >> 10) & 1023) + (window - (owner_start >> 20)) * WINDOW_TILES
        tl.store(window_first_tiles_ptr + window, tl.where(window < used_windows, first_tile, -1),
                 mask=window < max_windows)


def moe_align(
    topk_ids: torch.Tensor,  # [T, k] int32/int64
    num_experts: int,
    tile_m: int,
    *,
    window_rows: int = 64,
    fused: bool | None = None,
) -> MoeAlignment:
    """Sort the T*k (token, expert) pairs by expert and lay them out in m-tiles of `tile_m` rows.

    `window_rows` (a multiple of tile_m, or equal to it when tile_m is larger) is how many rows
    a consumer multiplies per program; the windows group that many rows of m-tiles of one expert.
    `fused`: None picks the path by size (one launch when T*k <= FUSED_MAX_PAIRS, else two or
    three); False forces the multi-kernel path, True the single launch (T*k <= FUSED_MAX_PAIRS
    only). Both give equal tensors. Never waits for the device.
    """
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [tokens, k], got shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"num_experts must be in 1..{MAX_EXPERTS}, got {num_experts}")
    if tile_m < 1 or tile_m & (tile_m - 1):
        raise ValueError(f"tile_m must be a power of two, got {tile_m}")
    window_tiles = max(1, window_rows // tile_m)
    if window_tiles * tile_m != max(window_rows, tile_m):
        raise ValueError(f"window_rows ({window_rows}) must be a multiple of tile_m ({tile_m})")
    check_triton_device(topk_ids, "moe_align")
    num_pairs = topk_ids.numel()
    if num_pairs == 0:
        raise ValueError("topk_ids holds no pairs: align needs at least one token")
    if fused is None:
        fused = num_pairs <= FUSED_MAX_PAIRS
    elif fused and num_pairs > FUSED_MAX_PAIRS:
        raise ValueError(f"fused alignment takes at most {FUSED_MAX_PAIRS} pairs, got {num_pairs}")

    device = topk_ids.device
    flat_ids = topk_ids.reshape(-1)
    if not flat_ids.is_contiguous():
        flat_ids = flat_ids.contiguous()
    active = min(num_experts, num_pairs)
    max_tiles = (num_pairs + active * (tile_m - 1)) // tile_m
    max_windows = active + (num_pairs - active) // (window_tiles * tile_m)
    e_pad = triton.next_power_of_2(num_experts)
    i32 = torch.int32

    sorted_pair_ids = scratch.empty((max_tiles * tile_m,), i32, device)
    pair_rows = scratch.empty((num_pairs,), i32, device)
    tile_expert_ids = scratch.empty((max_tiles,), i32, device)
    window_first_tiles = scratch.empty((max_windows,), i32, device)
    expert_counts = scratch.empty((num_experts,), i32, device)
    expert_offsets = scratch.empty((num_experts + 1,), i32, device)
    padded_offsets = scratch.empty((num_experts + 1,), i32, device)
    used = scratch.empty((2,), i32, device)
    if fused:
        # at least a warp's worth of expert lanes: tl.histogram's GPU lowering gives each of the
        # 32 lanes of a warp its own bins, and releases differ in how they pad fewer bins
        e_pad = max(e_pad, 32)
        # one program per chunk of pairs, per block of m-tiles and per block of windows
        shrink = max(1, e_pad // 256)
        chunk_pairs, block_tiles = FUSED_CHUNK_PAIRS // shrink, FUSED_BLOCK_TILES // shrink
        chunks = triton.cdiv(num_pairs, chunk_pairs)
        tile_blocks = triton.cdiv(max_tiles, block_tiles)
        window_blocks = triton.cdiv(max_windows, block_tiles)
        _fused_kernel[(chunks + tile_blocks + window_blocks,)](
            flat_ids, sorted_pair_ids, pair_rows, tile_expert_ids, window_first_tiles,
            expert_counts, expert_offsets, padded_offsets, used[0:1], used[1:2],
            num_pairs, num_experts, chunks, tile_blocks, max_tiles, max_windows,
            TILE_M=tile_m, WINDOW_TILES=window_tiles, MAX_PAIRS=FUSED_MAX_PAIRS, CHUNK=chunk_pairs,
            BLOCK=block_tiles, E_PAD=e_pad, num_warps=NUM_WARPS,
        )
        launches.record("moe_align.fused", kernel=_fused_kernel)
    else:
        _align_in_three(flat_ids, sorted_pair_ids, pair_rows, tile_expert_ids, window_first_tiles,
                        expert_counts, expert_offsets, padded_offsets, used, num_pairs, num_experts,
                        max_tiles, max_windows, tile_m, window_tiles, e_pad)
    return MoeAlignment(
        sorted_pair_ids=sorted_pair_ids,
        pair_rows=pair_rows,
        tile_expert_ids=tile_expert_ids,
        window_first_tiles=window_first_tiles,
        expert_counts=expert_counts,
        expert_offsets=expert_offsets,
        padded_offsets=padded_offsets,
        used_tiles=used[0:1],
        used_windows=used[1:2],
        num_pairs=num_pairs,
        tile_m=tile_m,
        window_tiles=window_tiles,
    )


def _align_in_three(flat_ids, sorted_pair_ids, pair_rows, tile_expert_ids, window_first_tiles,
                    expert_counts, expert_offsets, padded_offsets, used, num_pairs, num_experts,
                    max_tiles, max_windows, tile_m, window_tiles, e_pad) -> None:
    """count, scan (skipped for one chunk), place: the path above FUSED_MAX_PAIRS."""
    device, i32 = flat_ids.device, torch.int32
    num_chunks = triton.cdiv(num_pairs, CHUNK_PAIRS)
    single_chunk = num_chunks == 1
    rank_in_chunk = scratch.empty((num_pairs,), i32, device)
    # One chunk: its counts are the expert totals and every chunk start is 0, so no scan.
    chunk_counts = expert_counts if single_chunk else scratch.empty((num_chunks, num_experts), i32, device)

    _count_kernel[(num_chunks,)](
        flat_ids, rank_in_chunk, chunk_counts, num_pairs, num_experts,
        CHUNK=CHUNK_PAIRS, E_PAD=e_pad, num_warps=NUM_WARPS,
    )
    launches.record("moe_align.count", kernel=_count_kernel)
    if not single_chunk:
        _scan_kernel[(1,)](
            chunk_counts, expert_counts, num_chunks, num_experts,
            SCAN_BLOCK=SCAN_CHUNKS, E_PAD=e_pad, num_warps=NUM_WARPS,
        )
        launches.record("moe_align.scan", kernel=_scan_kernel)
    programs = max(num_chunks, triton.cdiv(max_tiles, TILES_PER_PROGRAM), triton.cdiv(max_windows, TILES_PER_PROGRAM))
    _place_kernel[(programs,)](
        flat_ids, rank_in_chunk, chunk_counts, expert_counts,
        sorted_pair_ids, pair_rows, tile_expert_ids, window_first_tiles,
        expert_offsets, padded_offsets, used[0:1], used[1:2],
        num_pairs, num_experts, num_chunks, max_tiles, max_windows,
        TILE_M=tile_m, WINDOW_TILES=window_tiles, CHUNK=CHUNK_PAIRS, BLOCK_TILES=TILES_PER_PROGRAM,
        E_PAD=e_pad, SINGLE_CHUNK=single_chunk, num_warps=NUM_WARPS,
    )
    launches.record("moe_align.place", kernel=_place_kernel)
