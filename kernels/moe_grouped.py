"""Grouped-GEMM MoE arm: expert-sorted m-tiles multiplied on tensor cores, variants 0 / 1 / 2.

Shapes: T tokens, k experts per token, E experts, D hidden, F expert intermediate, N = T*k pairs,
R = max padded rows of the alignment (see kernels/moe_align.py for every routing tensor).

    x             [T, D]        activations
    w13           [E, 2F, D]    rows 0..F-1 gate, F..2F-1 up
    w2            [E, D, F]
    topk_ids      [T, k]        ids outside [0, E) contribute nothing
    topk_weights  [T, k]
    hidden        [R, F]        silu(gate x) * (up x) per row of the expert-sorted layout, x's dtype
    pair_out      [N, D]        w * (w2_e @ hidden) per pair, in pair order, x's dtype
    out           [T, D]        sum over j = 0..k-1 of pair_out[t*k + j], in that order, in fp32

Launches (after moe_align's one, or three above 512 pairs):
    _gate_up_kernel   one program per (window, n-block) work item, or a persistent grid walking
                      them: a window is up to 64 rows = 64/TILE_M consecutive m-tiles of ONE
                      expert, gathered from x by pair id; gate and up tiles of w13 in one K loop,
                      SiLU·mul fused in the epilogue.
    _down_kernel      the same walk over windows with w2; the epilogue scales each row by its
                      routing weight and writes it to that pair's row of pair_out.
    _reduce_kernel    grid (T, D / 1024): the k rows of each token summed in a fixed order.

Why the MMA is 64 rows whatever TILE_M is: wgmma (Hopper tensor cores through tl.dot) works on
64-row blocks per warpgroup, and one program reading an expert's weight tile once for all of that
expert's rows (up to 64) is what keeps the arm at the bandwidth bound. Variants 1 and 2 give each
program a window of up to 64/TILE_M m-tiles of one expert; variant 0, the plain baseline, gives
each program one m-tile (its other rows masked), so an expert with several m-tiles has its weights
fetched once per m-tile, as the tile-fill reasoning of the dispatch gate assumes. TILE_M sets the
padding granularity and the m-tile schedule; masked rows cost tensor-core work, no memory traffic.

Bit-identical variants: every variant multiplies the same 64-row windows with BLOCK_K = 64 and the
same K-loop order through the same `_gate_up_tile` / `_down_tile` bodies, so each output element
goes through the same instruction sequence; variants differ only in BLOCK_N, pipeline depth,
warps, the order work items are walked and whether the grid is persistent. The reduction over
the k experts of a token never uses float atomics (their order would change run to run).

Block shapes are fixed per variant, not autotuned: autotuning times inside CUDA-graph capture,
and its choice may differ between runs, which would break both bit-identity and replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import launches, scratch
from kernels.moe_align import moe_align
from kernels.moe_checks import check_moe_inputs, check_triton_device

TILE_M_CHOICES = (16, 32, 64)
DEFAULT_TILE_M = 16
GROUPED_VARIANTS = (0, 1, 2)

# Rows one program multiplies at once (the tl.dot M): a wgmma warpgroup tile. Fixed across
# variants and tile sizes, so every variant runs the same MMA instruction per element.
ROWS_PER_PROGRAM = 64
# The K step of both GEMMs in every variant: changing it would change the accumulation order.
BLOCK_K = 64
REDUCE_BLOCK_D = 1024
# Programs of the persistent grid when there is no GPU to ask (interpreter runs only).
_CPU_PROGRAMS = 4


@dataclass(frozen=True)
class _Schedule:
    gate_up_block_n: int  # gate columns (and as many up columns) per program
    down_block_n: int  # output columns per program
    num_stages: int
    num_warps: int
    group_windows: int  # windows walked together per n-block (1 = plain order, n-block fastest)
    persistent: bool  # one program per SM looping over the work items
    one_tile_per_program: bool  # a window is one m-tile (masked to TILE_M of the 64 rows)


# Shared memory per pipeline stage at bf16 (A = 64 x 64 rows of x or hidden, 8 KB):
#   gate-up  A + 2 x (64 x BLOCK_N) weights: 24 KB at 64, 40 KB at 128
#   down     A + 64 x BLOCK_N weights:       16 KB at 64, 24 KB at 128, 40 KB at 256
# so 4 stages of the widest tile are 160 KB, inside the 227 KB a Hopper block may use.
_SCHEDULES = {
    # plain baseline, the schedule the tile-fill gate reasons about: one program per (m-tile,
    # n-block), so an expert's weight tile is fetched once per m-tile of it; narrow N tiles,
    # double buffering, row-major order
    0: _Schedule(gate_up_block_n=64, down_block_n=64, num_stages=2, num_warps=4, group_windows=1,
                 persistent=False, one_tile_per_program=True),
    # all of an expert's m-tiles up to 64 rows in one program (its weight tile fetched once for
    # them), wider N tiles (twice the MMA work per byte of A), a 4-deep pipeline, and windows walked
    # in groups of 4 so consecutive windows of one expert share each weight tile through L2
    1: _Schedule(gate_up_block_n=128, down_block_n=128, num_stages=4, num_warps=8, group_windows=4,
                 persistent=False, one_tile_per_program=False),
    # as 1, plus a persistent grid (one program per SM: no block scheduling gaps, no tail of
    # tiny programs) and 256-wide down tiles
    2: _Schedule(gate_up_block_n=128, down_block_n=256, num_stages=4, num_warps=8, group_windows=4,
                 persistent=True, one_tile_per_program=False),
}


@triton.jit
def _work_item(item, num_windows, num_n_blocks, GROUP_WINDOWS: tl.constexpr):
    """Work item -> (window, n-block): groups of GROUP_WINDOWS windows, windows fastest inside a
    group; with GROUP_WINDOWS = 1 this is plain row-major order (n-block fastest)."""
    items_per_group = GROUP_WINDOWS * num_n_blocks
    group = item // items_per_group
    first_window = group * GROUP_WINDOWS
    group_size = tl.minimum(num_windows - first_window, GROUP_WINDOWS)
    in_group = item % items_per_group
    return first_window + in_group % group_size, in_group // group_size


@triton.jit
def _window_rows(
    sorted_pair_ids_ptr, tile_expert_ids_ptr, window_first_tiles_ptr, padded_offsets_ptr,
    window, num_pairs,
    TILE_M: tl.constexpr, WINDOW_ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """Expert, rows [BLOCK_M], pair of each row and which rows hold a pair, for one window:
    rows of the expert (before padded_offsets[e+1]) and of the window (its first WINDOW_ROWS)."""
    first_tile = tl.maximum(tl.load(window_first_tiles_ptr + window), 0)
    expert = tl.load(tile_expert_ids_ptr + first_tile)
    rows_end = tl.load(padded_offsets_ptr + expert + 1)
    row_in_window = tl.arange(0, BLOCK_M)
    rows = first_tile * TILE_M + row_in_window
    pair = tl.load(sorted_pair_ids_ptr + rows, mask=(rows < rows_end) & (row_in_window < WINDOW_ROWS), other=num_pairs)
    return expert, rows, pair, (pair >= 0) & (pair < num_pairs)


@triton.jit
def _gate_up_tile(
    x_ptr,  # [T, D]
    w13_ptr,  # [E, 2F, D]
    hidden_ptr,  # [R, F] out
    sorted_pair_ids_ptr,  # [R]
    tile_expert_ids_ptr,  # [max_tiles]
    window_first_tiles_ptr,  # [max_windows]
    padded_offsets_ptr,  # [E+1]
    window,
    n_block,
    num_pairs,
    hidden_size,  # D: the K of this GEMM
    intermediate_size,  # F: the N of this GEMM (gate and up each)
    stride_xt,
    stride_we,
    stride_wr,
    stride_hr,
    TOP_K: tl.constexpr,
    TILE_M: tl.constexpr,
    WINDOW_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    if tl.load(window_first_tiles_ptr + window) >= 0:
        expert, rows, pair, row_ok = _window_rows(
            sorted_pair_ids_ptr, tile_expert_ids_ptr, window_first_tiles_ptr, padded_offsets_ptr,
            window, num_pairs, TILE_M, WINDOW_ROWS, BLOCK_M)
        token = pair // TOP_K
        offs_k = tl.arange(0, BLOCK_K)
        offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < intermediate_size
        a_ptrs = x_ptr + token.to(tl.int64)[:, None] * stride_xt + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
        # expert * stride_we reaches E*2F*D = 4.3e9 elements at v4-shape: int64
        w_base = w13_ptr + expert.to(tl.int64) * stride_we
        gate_ptrs = w_base + offs_n[None, :] * stride_wr + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
        up_ptrs = gate_ptrs + intermediate_size * stride_wr
        gate_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden_size, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                gate = tl.load(gate_ptrs, mask=n_ok[None, :], other=0.0)
                up = tl.load(up_ptrs, mask=n_ok[None, :], other=0.0)
            else:
                k_ok = offs_k < hidden_size - k0
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                gate = tl.load(gate_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                up = tl.load(up_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            gate_acc = tl.dot(a, gate, gate_acc, input_precision=DOT_PRECISION)
            up_acc = tl.dot(a, up, up_acc, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K
            gate_ptrs += BLOCK_K
            up_ptrs += BLOCK_K
        hidden = gate_acc * tl.sigmoid(gate_acc) * up_acc
        h_ptrs = hidden_ptr + rows.to(tl.int64)[:, None] * stride_hr + offs_n[None, :]
        tl.store(h_ptrs, hidden.to(hidden_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _gate_up_kernel(
    x_ptr, w13_ptr, hidden_ptr,
    sorted_pair_ids_ptr, tile_expert_ids_ptr, window_first_tiles_ptr, padded_offsets_ptr,
    num_pairs, hidden_size, intermediate_size, max_windows, num_programs,
    stride_xt, stride_we, stride_wr, stride_hr,
    TOP_K: tl.constexpr, TILE_M: tl.constexpr, WINDOW_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_WINDOWS: tl.constexpr, PERSISTENT: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Grid: (max_windows * n_blocks,) or, persistent, (num_programs,)."""
    num_n_blocks = tl.cdiv(intermediate_size, BLOCK_N)
    if PERSISTENT:
        for item in range(tl.program_id(0), max_windows * num_n_blocks, num_programs):
            window, n_block = _work_item(item, max_windows, num_n_blocks, GROUP_WINDOWS)
            _gate_up_tile(x_ptr, w13_ptr, hidden_ptr, sorted_pair_ids_ptr, tile_expert_ids_ptr,
                          window_first_tiles_ptr, padded_offsets_ptr, window, n_block, num_pairs,
                          hidden_size, intermediate_size, stride_xt, stride_we, stride_wr, stride_hr,
                          TOP_K, TILE_M, WINDOW_ROWS, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_PRECISION)
    else:
        window, n_block = _work_item(tl.program_id(0), max_windows, num_n_blocks, GROUP_WINDOWS)
        _gate_up_tile(x_ptr, w13_ptr, hidden_ptr, sorted_pair_ids_ptr, tile_expert_ids_ptr,
                      window_first_tiles_ptr, padded_offsets_ptr, window, n_block, num_pairs,
                      hidden_size, intermediate_size, stride_xt, stride_we, stride_wr, stride_hr,
                      TOP_K, TILE_M, WINDOW_ROWS, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_PRECISION)


@triton.jit
def _down_tile(
    hidden_ptr,  # [R, F]
    w2_ptr,  # [E, D, F]
    topk_weights_ptr,  # [N]
    pair_out_ptr,  # [N, D] out
    sorted_pair_ids_ptr,  # [R]
    tile_expert_ids_ptr,  # [max_tiles]
    window_first_tiles_ptr,  # [max_windows]
    padded_offsets_ptr,  # [E+1]
    window,
    n_block,
    num_pairs,
    hidden_size,  # D: the N of this GEMM
    intermediate_size,  # F: the K of this GEMM
    stride_hr,
    stride_we,
    stride_wr,
    stride_pp,
    TILE_M: tl.constexpr,
    WINDOW_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    if tl.load(window_first_tiles_ptr + window) >= 0:
        expert, rows, pair, row_ok = _window_rows(
            sorted_pair_ids_ptr, tile_expert_ids_ptr, window_first_tiles_ptr, padded_offsets_ptr,
            window, num_pairs, TILE_M, WINDOW_ROWS, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hidden_size
        a_ptrs = hidden_ptr + rows.to(tl.int64)[:, None] * stride_hr + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
        w_ptrs = w2_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wr + offs_k[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, intermediate_size, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                w = tl.load(w_ptrs, mask=n_ok[None, :], other=0.0)
            else:
                k_ok = offs_k < intermediate_size - k0
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        routing_weight = tl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
        scaled = acc * routing_weight[:, None]
        out_ptrs = pair_out_ptr + pair.to(tl.int64)[:, None] * stride_pp + offs_n[None, :]
        tl.store(out_ptrs, scaled.to(pair_out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(
    hidden_ptr, w2_ptr, topk_weights_ptr, pair_out_ptr,
    sorted_pair_ids_ptr, tile_expert_ids_ptr, window_first_tiles_ptr, padded_offsets_ptr,
    num_pairs, hidden_size, intermediate_size, max_windows, num_programs,
    stride_hr, stride_we, stride_wr, stride_pp,
    TILE_M: tl.constexpr, WINDOW_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_WINDOWS: tl.constexpr, PERSISTENT: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Grid: (max_windows * n_blocks,) or, persistent, (num_programs,)."""
    num_n_blocks = tl.cdiv(hidden_size, BLOCK_N)
    if PERSISTENT:
        for item in range(tl.program_id(0), max_windows * num_n_blocks, num_programs):
            window, n_block = _work_item(item, max_windows, num_n_blocks, GROUP_WINDOWS)
            _down_tile(hidden_ptr, w2_ptr, topk_weights_ptr, pair_out_ptr, sorted_pair_ids_ptr,
                       tile_expert_ids_ptr, window_first_tiles_ptr, padded_offsets_ptr, window, n_block,
                       num_pairs, hidden_size, intermediate_size, stride_hr, stride_we, stride_wr, stride_pp,
                       TILE_M, WINDOW_ROWS, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_PRECISION)
    else:
        window, n_block = _work_item(tl.program_id(0), max_windows, num_n_blocks, GROUP_WINDOWS)
        _down_tile(hidden_ptr, w2_ptr, topk_weights_ptr, pair_out_ptr, sorted_pair_ids_ptr,
                   tile_expert_ids_ptr, window_first_tiles_ptr, padded_offsets_ptr, window, n_block,
                   num_pairs, hidden_size, intermediate_size, stride_hr, stride_we, stride_wr, stride_pp,
                   TILE_M, WINDOW_ROWS, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_PRECISION)


@triton.jit
def _reduce_kernel(
    pair_out_ptr,  # [N, D]
    topk_ids_ptr,  # [N]
    out_ptr,  # [T, D] out
    num_experts,
    hidden_size,
    stride_pp,
    stride_ot,
    TOP_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Grid: (T, D / BLOCK_D). out[t] = sum_j pair_out[t*k + j] for j = 0..k-1, in that order."""
    token = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < hidden_size
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pair = token * TOP_K + j
        expert_lanes = tl.zeros([BLOCK_D], dtype=tl.int32) + tl.load(topk_ids_ptr + pair).to(tl.int32)
        valid = (expert_lanes >= 0) & (expert_lanes < num_experts)  # pairs never placed stay out
        acc += tl.load(pair_out_ptr + pair.to(tl.int64) * stride_pp + offs_d, mask=d_ok & valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + token.to(tl.int64) * stride_ot + offs_d, acc.to(out_ptr.dtype.element_ty), mask=d_ok)


_SM_COUNT: dict[int, int] = {}


def _persistent_programs(device: torch.device) -> int:
    if device.type != "cuda":
        return _CPU_PROGRAMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def moe_grouped(
    x: torch.Tensor,  # [T, D]
    w13: torch.Tensor,  # [E, 2F, D]
    w2: torch.Tensor,  # [E, D, F]
    topk_ids: torch.Tensor,  # [T, k]
    topk_weights: torch.Tensor,  # [T, k]
    *,
    tile_m: int = DEFAULT_TILE_M,
    variant: int = 2,
) -> torch.Tensor:  # [T, D]
    """The grouped-GEMM arm; same contract as `kernels.reference.moe_reference`.

    Aligns the pairs on the device (moe_align), then launches gate-up, down and the reduction.
    Never waits for the device, so it can be captured in a CUDA graph.
    """
    tokens, hidden_size, experts, intermediate, top_k = check_moe_inputs(x, w13, w2, topk_ids, topk_weights)
    check_triton_device(x, "moe_grouped")
    if tile_m not in TILE_M_CHOICES:
        raise ValueError(f"tile_m must be one of {TILE_M_CHOICES}, got {tile_m!r}")
    if variant not in _SCHEDULES:
        raise ValueError(f"variant must be one of {GROUPED_VARIANTS}, got {variant!r}")
    schedule = _SCHEDULES[variant]
    out = scratch.empty((tokens, hidden_size), x.dtype, x.device)
    if tokens == 0:
        return out
    num_pairs = tokens * top_k
    window_rows = tile_m if schedule.one_tile_per_program else ROWS_PER_PROGRAM
    align = moe_align(topk_ids, experts, tile_m, window_rows=window_rows)
    max_windows = align.window_first_tiles.numel()
    flat_ids = topk_ids.reshape(-1).contiguous()  # [N]
    flat_weights = topk_weights.reshape(-1).contiguous()  # [N]
    hidden = scratch.empty((align.sorted_pair_ids.numel(), intermediate), x.dtype, x.device)  # [R, F]
    pair_out = scratch.empty((num_pairs, hidden_size), x.dtype, x.device)  # [N, D]
    # fp32 inputs would go through tf32 by default; ieee keeps the fp32 path exact to the reference
    dot_precision = "ieee" if x.dtype == torch.float32 else "tf32"
    programs = _persistent_programs(x.device)
    meta = dict(num_stages=schedule.num_stages, num_warps=schedule.num_warps)
    # N tiles never wider than the matrix (small shapes waste no lanes), never below tl.dot's 16
    gate_up_block_n = max(16, min(schedule.gate_up_block_n, triton.next_power_of_2(intermediate)))
    down_block_n = max(16, min(schedule.down_block_n, triton.next_power_of_2(hidden_size)))
    reduce_block_d = min(REDUCE_BLOCK_D, triton.next_power_of_2(hidden_size))

    gate_up_items = max_windows * triton.cdiv(intermediate, gate_up_block_n)
    _gate_up_kernel[(min(gate_up_items, programs) if schedule.persistent else gate_up_items,)](
        x, w13, hidden,
        align.sorted_pair_ids, align.tile_expert_ids, align.window_first_tiles, align.padded_offsets,
        num_pairs, hidden_size, intermediate, max_windows, programs,
        x.stride(0), w13.stride(0), w13.stride(1), hidden.stride(0),
        TOP_K=top_k, TILE_M=tile_m, WINDOW_ROWS=window_rows, BLOCK_M=ROWS_PER_PROGRAM, BLOCK_N=gate_up_block_n, BLOCK_K=BLOCK_K,
        GROUP_WINDOWS=schedule.group_windows, PERSISTENT=schedule.persistent,
        EVEN_K=hidden_size % BLOCK_K == 0, DOT_PRECISION=dot_precision, **meta,
    )
    launches.record(f"moe_grouped.gate_up.v{variant}", kernel=_gate_up_kernel)

    down_items = max_windows * triton.cdiv(hidden_size, down_block_n)
    _down_kernel[(min(down_items, programs) if schedule.persistent else down_items,)](
        hidden, w2, flat_weights, pair_out,
        align.sorted_pair_ids, align.tile_expert_ids, align.window_first_tiles, align.padded_offsets,
        num_pairs, hidden_size, intermediate, max_windows, programs,
        hidden.stride(0), w2.stride(0), w2.stride(1), pair_out.stride(0),
        TILE_M=tile_m, WINDOW_ROWS=window_rows, BLOCK_M=ROWS_PER_PROGRAM, BLOCK_N=down_block_n, BLOCK_K=BLOCK_K,
        GROUP_WINDOWS=schedule.group_windows, PERSISTENT=schedule.persistent,
        EVEN_K=intermediate % BLOCK_K == 0, DOT_PRECISION=dot_precision, **meta,
    )
    launches.record(f"moe_grouped.down.v{variant}", kernel=_down_kernel)

    _reduce_kernel[(tokens, triton.cdiv(hidden_size, reduce_block_d))](
        pair_out, flat_ids, out, experts, hidden_size, pair_out.stride(0), out.stride(0),
        TOP_K=top_k, BLOCK_D=reduce_block_d, num_warps=4,
    )
    launches.record("moe_grouped.reduce", kernel=_reduce_kernel)
    return out
