"""Trellis grouped-GEMM MoE arms: expert-sorted windows multiplied on tensor cores, the weight tiles either
decoded from the packed codes per K step (`moe_trellis_grouped`, fused decode) or read from a bf16 copy
the step decoded first (`moe_trellis_dequant`, dequantize-then-grouped).

Shapes: T tokens, k experts per token, E experts, D hidden, F expert intermediate, N = T*k pairs, R rows
of the alignment (kernels/moe_align.py lists every routing tensor), BM the rows of one window.

    x             [T, D]        activations
    w13, w2       TrellisMatrix [E, 2F, D] and [E, D, F] (kernels/trellis_reference.py)
    topk_ids      [T, k]        ids outside [0, E) contribute nothing
    topk_weights  [T, k]
    x_rot         [T, D]        T_R13 x, x's dtype (the gate-up product's A rows, gathered by pair)
    y_rot         [R, 2F]       W13_rot x_rot per row of the expert-sorted layout, x's dtype
    h_rot         [R, F]        T_R2 (silu(g) * u), (g, u) = T_L13^T y_rot
    pair_out      [N, D]        w_p * (W2_rot h_rot) per pair, in pair order, x's dtype
    out           [T, D]        T_L2^T (sum over j of pair_out[t*k + j]), in fp32, then x's dtype
    dense13/dense2 [E, 2F, D] / [E, D, F]   (dequantize arm) the woken experts' rotated weights, x's dtype

Launches: moe_align (one, or up to three above 512 pairs), trellis.rotate, trellis_grouped.gate_up,
trellis.swiglu_between, trellis_grouped.down, trellis.unrotate_sum; the dequantize arm adds two
trellis.dequantize launches (w13 and w2, the experts with a pair only: the alignment's counts) and names
its products trellis_dequant.gate_up / .down.

One program multiplies one window (up to BM rows of ONE expert, the alignment's consecutive m-tiles of
it) by one BLOCK_N-wide slice of the expert's rows: per K step of BLOCK_K columns the B tile
[BLOCK_K, BLOCK_N] is decoded in registers (kernels/trellis_decode.py `_decoded_tile`, the dequantize
kernel's decode: BLOCK_N / 16 x BLOCK_K / 16 packed tiles), multiplied by the row scales, rounded to x's
dtype -- exactly the weights the reference dequantizes -- and handed to tl.dot, which stages it in shared
memory for the tensor cores (wgmma on Hopper); A is the window's gathered rows. So a weight is decoded once per window, and its packed bytes
are read once per window (consecutive windows of an expert share them through L2: the walk takes
`group_windows` windows together). The dequantize arm runs the same kernels with the tile loaded from
the bf16 copy instead: the same weights, tiles, K order and MMAs, so the two arms' outputs are equal
bit for bit (the tests check it) and differ only in where the weights come from.

Why not the bf16 grouped arm (kernels/moe_grouped.py) after dequantizing: its gate-up epilogue fuses
SiLU, and a trellis stack multiplies in its rotated basis, so the gate and up rows must be turned back
(T_L13^T) before the SiLU; turning the weights back instead would cost two Hadamard passes over every
woken expert's weights per step. Its schedule (64-row windows, grouped walk, BLOCK_K = 64) is kept.

Block shapes are not autotuned; `SCHEDULES` holds the few a GPU run compares (bench/trellis_bench.py), and
"auto" picks one of them from the routing's shape (`resolve_schedule`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import launches, pdl, scratch
from kernels.moe_align import moe_align
from kernels.moe_checks import check_triton_device
from kernels.moe_grouped import TILE_M_CHOICES, _window_rows, _work_item
from kernels.trellis_decode import (_code_values, _decoded_tile, _hyb_table, _unit_states, check_trellis_moe_inputs,
                                    code_id, compiled, dequantize_rotated, unit_geometry)
from kernels.trellis_reference import TILE, TrellisMatrix
from kernels.trellis_rotate import rotate_rows, swiglu_between, unrotate_sum

DEFAULT_TILE_M = 16


@dataclass(frozen=True)
class GroupedSchedule:
    block_m: int  # rows per program: the window (a multiple of 64, the wgmma M of a warpgroup)
    gate_up_block_n: int  # gate rows (and as many up rows) of w13 per program
    down_block_n: int  # rows of w2 (outputs) per program
    block_k: int  # columns per K step (a multiple of 16: whole packed tiles)
    num_warps: int
    num_stages: int
    group_windows: int  # windows walked together per n-block (their weight tiles shared through L2)
    decode: str = "steps"  # "steps": the unrolled decode (trellis_decode._decoded_tile); "tensor": the old form
    max_registers: int | None = None  # ptxas's cap per thread (Triton's maxnreg); None: as many as it takes
    fuse_gate_up: bool = False  # gate-up: one dot of N = 2 BLOCK_N on the two tiles' columns interleaved
    gate_up_from: str | None = None  # gate-up at this SCHEDULES entry's shapes, on parts of these windows

    def __post_init__(self) -> None:
        if self.decode not in ("steps", "tensor"):
            raise ValueError(f"decode must be 'steps' or 'tensor', got {self.decode!r}")


# Registers per thread at 8 warps: the accumulators (BM x BN fp32, twice for gate-up) and one decoded
# tile (BN x BK, twice for gate-up) at a time. Decoding is paid once per window, so at large n the
# 128-row windows cut it (n = 8192, v4-shape: about 192 pairs per expert, 2 windows of 128 against 3-4
# of 64). docs/trellis-kernels.md counts each one's loop (bench/trellis_sm90_compile.py).
#   "m64"    64-row windows, the bf16 arm's BLOCK_N 128 / 128 and BLOCK_K 64, 8 warps, 3 stages, at most
#            128 registers: two programs (16 warps) a SM, so one's decode runs while the other waits on
#            its wgmma (uncapped, the gate-up takes 128-150 and one program fills the SM)
#   "m64x"   m64 uncapped, to time the cap against
#   "m128"   128-row windows (two warpgroups of 64 rows), BLOCK_N 64 / 128
#   "m128f"  m128 with the gate-up's gate and up tiles in one dot of 128 columns (fuse_gate_up): each warpgroup
#            reads its A rows from shared memory once for both
#   "m64f"   m64 so fused (256 columns)
#   "m256f"  256-row windows, fused: an expert's weights decoded once up to 256 pairs. 16 warps (four warpgroups
#            of 64 rows) at most 128 registers, BLOCK_K 128 so that a gate-up block of 64 rows still has a
#            16-column run for every thread, 2 stages (168 KB of shared memory): one program a SM
#   "m256h"  m256f's windows and down; the gate-up at m128f's shapes on each window's two halves (run 98: the
#            computed codes' gate-up fastest at m128f, their down at m256f)
#   "m64t"   m64 (uncapped) with the tensor-form decode the unrolled one replaced: the bench's baseline
SCHEDULES = {
    "m64": GroupedSchedule(block_m=64, gate_up_block_n=128, down_block_n=128, block_k=64, num_warps=8,
                           num_stages=3, group_windows=4, max_registers=128),
    "m64x": GroupedSchedule(block_m=64, gate_up_block_n=128, down_block_n=128, block_k=64, num_warps=8,
                            num_stages=3, group_windows=4),
    "m128": GroupedSchedule(block_m=128, gate_up_block_n=64, down_block_n=128, block_k=64, num_warps=8,
                            num_stages=3, group_windows=4),
    "m128f": GroupedSchedule(block_m=128, gate_up_block_n=64, down_block_n=128, block_k=64, num_warps=8,
                             num_stages=3, group_windows=4, fuse_gate_up=True),
    "m64f": GroupedSchedule(block_m=64, gate_up_block_n=128, down_block_n=128, block_k=64, num_warps=8,
                            num_stages=3, group_windows=4, max_registers=128, fuse_gate_up=True),
    "m256f": GroupedSchedule(block_m=256, gate_up_block_n=64, down_block_n=128, block_k=128, num_warps=16,
                             num_stages=2, group_windows=4, max_registers=128, fuse_gate_up=True),
    "m256h": GroupedSchedule(block_m=256, gate_up_block_n=64, down_block_n=128, block_k=128, num_warps=16,
                             num_stages=2, group_windows=4, max_registers=128, fuse_gate_up=True,
                             gate_up_from="m128f"),
    "m64t": GroupedSchedule(block_m=64, gate_up_block_n=128, down_block_n=128, block_k=64, num_warps=8,
                            num_stages=3, group_windows=4, decode="tensor"),
}
DEFAULT_SCHEDULE = "m64"  # auto's pick up to AUTO_WIDE_ABOVE_PAIRS pairs an expert, for hyb and at K = 3
BASELINE_SCHEDULE = "m64t"  # the tensor-form decode the unrolled one replaced: the bench times both
# "auto", by the routing's mean pairs per expert (n k / E) and the code (run 98, v4-shape experts, K = 2,
# bench/experiments/grouped_candidates.py; 1mad / 3inst / hyb, ms):
#   up to 64 pairs: m64f for the computed codes, m64 for hyb (n = 2048, 48 pairs: m64f 4.33 / 4.72 / 7.40,
#     m64 4.48 / 4.94 / 7.15; the 128-row windows pad 48 rows to 128: m128f 5.99 / 6.01 / 9.47)
#   above 64: m128f, one 128-row window where two 64-row ones decode every weight twice (per window m128's loop
#     counts about 1.3x m64's, docs/trellis-kernels.md); above 128 pairs m256f for hyb, whose gather bound
#     decode once an expert pays for its single program a SM, and m256h for the computed codes, whose gate-up
#     ran fastest at m128f and down at m256f (n = 8192, 192 pairs: m128f 11.47 / 12.10 / 18.23, m256f
#     11.84 / 12.73 / 14.31, m64f 12.76 / 13.94 / 23.13; gate-up 5735 / 5900 us at m128f, down 3152 / 3351 at
#     m256f)
# Not at K = 3: m128's 64-row gate-up block is 32 two-row units by 4 tile columns, fewer than its 256
# threads, so threads decode the same states twice (20.7 instructions a weight against m64's 6.6); m256f's
# is 32 by 8 for 512 threads. K = 3 runs m64 throughout.
# Chosen from the shapes alone (no device read), so a CUDA graph captures one schedule per n.
AUTO_SCHEDULE = "auto"
AUTO_WIDE_ABOVE_PAIRS = 64
AUTO_WIDEST_ABOVE_PAIRS = 128
SCHEDULE_NAMES = (*SCHEDULES, AUTO_SCHEDULE)


def gate_up_shapes(schedule: GroupedSchedule) -> GroupedSchedule:
    """The shapes a schedule's gate-up runs at: its own, or for `gate_up_from` that entry's, on parts of the
    schedule's windows."""
    return SCHEDULES[schedule.gate_up_from] if schedule.gate_up_from else schedule


def product_schedules(name: str) -> tuple[GroupedSchedule, GroupedSchedule]:
    """(the gate-up's shapes, the down's) of a `SCHEDULES` entry."""
    chosen = SCHEDULES[name]
    return gate_up_shapes(chosen), chosen


def resolve_schedule(schedule: str, tokens: int, top_k: int, experts: int, bits: int, table: bool = False) -> str:
    """The `SCHEDULES` key a launch runs: `schedule` itself, or for "auto" the one its routing shape, the
    code's K bits per weight and whether it reads a table (hyb) pick."""
    if schedule != AUTO_SCHEDULE:
        return schedule
    if unit_geometry(bits)[0] != 1:
        return DEFAULT_SCHEDULE
    pairs = tokens * top_k
    if pairs > AUTO_WIDEST_ABOVE_PAIRS * experts:
        return "m256f" if table else "m256h"
    if pairs > AUTO_WIDE_ABOVE_PAIRS * experts:
        return "m128f"
    return DEFAULT_SCHEDULE if table else "m64f"


@triton.jit
def _weight_tile(
    codes_ptr,  # [E, N/16, C/16, W] int32 (decode) or the dense [E, N, C] copy (DENSE)
    scales_ptr,  # [E, N] float32
    table,  # hyb: the signed table in registers (STEPS, `_hyb_table`) or the [512, 2] table's pointer; else unused
    expert,
    row0,  # first of the BLOCK_N rows
    column0,  # first of the BLOCK_K columns
    num_row_tiles,
    num_column_tiles,
    stride_we,  # codes: per expert (words); dense: per expert (elements)
    stride_wn,  # dense only: per row
    stride_se,
    K: tl.constexpr, V: tl.constexpr, G: tl.constexpr, WU: tl.constexpr, CODE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DENSE: tl.constexpr, STEPS: tl.constexpr, INSIDE: tl.constexpr,
    PTX: tl.constexpr, OUT_DTYPE: tl.constexpr,
):
    """The B operand [BLOCK_K, BLOCK_N]: W_rot[expert, row0 + n, column0 + k] in OUT_DTYPE (value * scale
    rounded once). STEPS: the unrolled decode the dequantize kernel runs too (kernels/trellis_decode.py
    `_decoded_tile`); else the [units, tile columns, steps] tensor form it replaced (the bench's baseline).
    INSIDE: the block lies inside the matrix (the unrolled decode's loads then take no masks)."""
    if DENSE:
        offs_n = row0 + tl.arange(0, BLOCK_N)
        offs_k = column0 + tl.arange(0, BLOCK_K)
        mask = (offs_n < num_row_tiles * 16)[None, :] & (offs_k < num_column_tiles * 16)[:, None]
        pointers = codes_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wn \
            + offs_k[:, None]
        return tl.load(pointers, mask=mask, other=0.0)
    elif STEPS:
        return tl.trans(_decoded_tile(codes_ptr, scales_ptr, table, expert, row0, column0, num_row_tiles,
                                      num_column_tiles, stride_we, stride_se, K, V, G, WU, CODE, BLOCK_N, BLOCK_K,
                                      INSIDE, PTX, OUT_DTYPE))
    else:
        UT: tl.constexpr = 16 // G
        U: tl.constexpr = BLOCK_N // 16 * UT
        S: tl.constexpr = 16 * G // V
        T: tl.constexpr = BLOCK_K // 16
        unit = tl.arange(0, U)
        tile_row = row0 // 16 + unit // UT  # [U]
        in_tile = unit % UT
        tile_col = column0 // 16 + tl.arange(0, T)  # [T]
        mask = (tile_row < num_row_tiles)[:, None] & (tile_col < num_column_tiles)[None, :]
        words_per_tile: tl.constexpr = 8 * K
        tiles = codes_ptr + expert.to(tl.int64) * stride_we \
            + (tile_row * num_column_tiles * words_per_tile)[:, None] + tile_col[None, :] * words_per_tile
        states = _unit_states(tiles + (in_tile * WU)[:, None], tiles + (((in_tile + 1) % UT) * WU)[:, None], mask,
                              K, V, G, WU, "")
        first, second = _code_values(states, table, CODE, PTX)  # [U, T, S]
        if V == 2:
            values = tl.reshape(tl.join(first, second), [U, T, 16 * G])  # element e = V step + v
        else:
            values = first
        if G == 2:  # a unit is two rows: element e on row e // 16, column e % 16
            values = tl.reshape(tl.permute(tl.reshape(values, [U, T, 2, 16]), [0, 2, 1, 3]), [BLOCK_N, BLOCK_K])
        else:
            values = tl.reshape(values, [BLOCK_N, BLOCK_K])
        offs_n = row0 + tl.arange(0, BLOCK_N)
        scale = tl.load(scales_ptr + expert.to(tl.int64) * stride_se + offs_n, mask=offs_n < num_row_tiles * 16,
                        other=0.0)
        return tl.trans((values * scale[:, None]).to(OUT_DTYPE))


@triton.jit
def _product_table(table_ptr, CODE: tl.constexpr, DENSE: tl.constexpr, STEPS: tl.constexpr):
    """What `_weight_tile` reads hyb's table from: the signed table in registers for the unrolled decode (loaded
    once per program, before the K loop), else the pointer."""
    if (CODE == 2) and STEPS and not DENSE:
        return _hyb_table(table_ptr)
    else:
        return table_ptr


@triton.jit
def _trellis_gate_up_kernel(
    x_ptr,  # [T, D] x_rot
    codes_ptr,  # w13 codes or dense copy
    scales_ptr,  # [E, 2F]
    table_ptr,
    y_ptr,  # [R, 2F] out
    sorted_pair_ids_ptr, tile_expert_ids_ptr, window_first_tiles_ptr, padded_offsets_ptr,
    num_pairs, hidden_size, intermediate_size, max_windows,
    stride_xt, stride_we, stride_wn, stride_se, stride_yr,
    TOP_K: tl.constexpr, TILE_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_WINDOWS: tl.constexpr,
    K: tl.constexpr, V: tl.constexpr, G: tl.constexpr, WU: tl.constexpr, CODE: tl.constexpr,
    DENSE: tl.constexpr, STEPS: tl.constexpr, PTX: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_GDC: tl.constexpr,
    EVEN: tl.constexpr,  # BLOCK_K divides D and BLOCK_N divides F: no K masks, weight blocks inside the matrix
    FUSED: tl.constexpr,  # one dot a K step on [gate | up] interleaved by column (N = 2 BLOCK_N)
    PARTS: tl.constexpr,  # programs a window and n-block, each BLOCK_M of its rows (the windows PARTS BLOCK_M)
):
    """Grid (max_windows * PARTS * F / BLOCK_N,): y_rot[rows, n] and y_rot[rows, F + n] of one window's part and
    n-block.
    FUSED halves the wgmma's shared-memory reads of A per flop (each warpgroup reads its rows once for both)."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
    num_n_blocks = tl.cdiv(intermediate_size, BLOCK_N)
    part_item, n_block = _work_item(tl.program_id(0), max_windows * PARTS, num_n_blocks, GROUP_WINDOWS)
    if PARTS == 1:
        window = part_item
        present = tl.load(window_first_tiles_ptr + window) >= 0
    else:
        window, part = part_item // PARTS, part_item % PARTS
        window_tile = tl.load(window_first_tiles_ptr + window)
        first_row = (tl.maximum(window_tile, 0) * TILE_M) + part * BLOCK_M
        expert_end = tl.load(padded_offsets_ptr + tl.load(tile_expert_ids_ptr + tl.maximum(window_tile, 0)) + 1)
        present = (window_tile >= 0) & (first_row < expert_end)
    if present:
        if PARTS == 1:
            expert, rows, pair, row_ok = _window_rows(
                sorted_pair_ids_ptr, tile_expert_ids_ptr, window_first_tiles_ptr, padded_offsets_ptr,
                window, num_pairs, TILE_M, BLOCK_M, BLOCK_M)
        else:
            expert = tl.load(tile_expert_ids_ptr + window_tile)
            rows = first_row + tl.arange(0, BLOCK_M)
            pair = tl.load(sorted_pair_ids_ptr + rows, mask=rows < expert_end, other=num_pairs)
            row_ok = (pair >= 0) & (pair < num_pairs)
        token = pair // TOP_K
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = x_ptr + token.to(tl.int64)[:, None] * stride_xt + offs_k[None, :]
        n0 = n_block * BLOCK_N
        if FUSED:
            acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        else:
            gate_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            up_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        row_tiles = 2 * intermediate_size // 16
        column_tiles = hidden_size // 16
        table = _product_table(table_ptr, CODE, DENSE, STEPS)
        for k0 in range(0, hidden_size, BLOCK_K):
            if EVEN:
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            else:
                a = tl.load(a_ptrs, mask=row_ok[:, None] & (offs_k < hidden_size - k0)[None, :], other=0.0)
            gate = _weight_tile(codes_ptr, scales_ptr, table, expert, n0, k0, row_tiles, column_tiles,
                                stride_we, stride_wn, stride_se, K, V, G, WU, CODE, BLOCK_N, BLOCK_K, DENSE, STEPS,
                                EVEN, PTX, x_ptr.dtype.element_ty)
            up = _weight_tile(codes_ptr, scales_ptr, table, expert, intermediate_size + n0, k0, row_tiles,
                              column_tiles, stride_we, stride_wn, stride_se, K, V, G, WU, CODE, BLOCK_N, BLOCK_K,
                              DENSE, STEPS, EVEN, PTX, x_ptr.dtype.element_ty)
            if FUSED:  # column 2 j is gate row n0 + j, column 2 j + 1 up's
                acc = tl.dot(a, tl.reshape(tl.join(gate, up), [BLOCK_K, 2 * BLOCK_N]), acc,
                             input_precision=DOT_PRECISION)
            else:
                gate_acc = tl.dot(a, gate, gate_acc, input_precision=DOT_PRECISION)
                up_acc = tl.dot(a, up, up_acc, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K
        if USE_GDC:
            tl.extra.cuda.gdc_launch_dependents()
        if FUSED:
            gate_acc, up_acc = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))
        offs_n = n0 + tl.arange(0, BLOCK_N)
        store_ok = row_ok[:, None] & (offs_n < intermediate_size)[None, :]
        y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * stride_yr + offs_n[None, :]
        tl.store(y_ptrs, gate_acc.to(y_ptr.dtype.element_ty), mask=store_ok)
        tl.store(y_ptrs + intermediate_size, up_acc.to(y_ptr.dtype.element_ty), mask=store_ok)


@triton.jit
def _trellis_down_kernel(
    h_ptr,  # [R, F] h_rot
    codes_ptr,  # w2 codes or dense copy
    scales_ptr,  # [E, D]
    table_ptr,
    topk_weights_ptr,  # [N]
    pair_out_ptr,  # [N, D] out
    sorted_pair_ids_ptr, tile_expert_ids_ptr, window_first_tiles_ptr, padded_offsets_ptr,
    num_pairs, hidden_size, intermediate_size, max_windows,
    stride_hr, stride_we, stride_wn, stride_se, stride_pp,
    TILE_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_WINDOWS: tl.constexpr,
    K: tl.constexpr, V: tl.constexpr, G: tl.constexpr, WU: tl.constexpr, CODE: tl.constexpr,
    DENSE: tl.constexpr, STEPS: tl.constexpr, PTX: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_GDC: tl.constexpr,
    EVEN: tl.constexpr,  # BLOCK_K divides F and BLOCK_N divides D
):
    """Grid (max_windows * D / BLOCK_N,): pair_out[pair, n] = w_pair * (W2_rot h_rot)[row, n]."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
    num_n_blocks = tl.cdiv(hidden_size, BLOCK_N)
    window, n_block = _work_item(tl.program_id(0), max_windows, num_n_blocks, GROUP_WINDOWS)
    if tl.load(window_first_tiles_ptr + window) >= 0:
        expert, rows, pair, row_ok = _window_rows(
            sorted_pair_ids_ptr, tile_expert_ids_ptr, window_first_tiles_ptr, padded_offsets_ptr,
            window, num_pairs, TILE_M, BLOCK_M, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = h_ptr + rows.to(tl.int64)[:, None] * stride_hr + offs_k[None, :]
        n0 = n_block * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        table = _product_table(table_ptr, CODE, DENSE, STEPS)
        for k0 in range(0, intermediate_size, BLOCK_K):
            if EVEN:
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            else:
                a = tl.load(a_ptrs, mask=row_ok[:, None] & (offs_k < intermediate_size - k0)[None, :], other=0.0)
            w = _weight_tile(codes_ptr, scales_ptr, table, expert, n0, k0, hidden_size // 16,
                             intermediate_size // 16, stride_we, stride_wn, stride_se, K, V, G, WU, CODE, BLOCK_N,
                             BLOCK_K, DENSE, STEPS, EVEN, PTX, h_ptr.dtype.element_ty)
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K
        if USE_GDC:
            tl.extra.cuda.gdc_launch_dependents()
        routing_weight = tl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        out_ptrs = pair_out_ptr + pair.to(tl.int64)[:, None] * stride_pp + offs_n[None, :]
        tl.store(out_ptrs, (acc * routing_weight[:, None]).to(pair_out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (offs_n < hidden_size)[None, :])


def _weight_args(matrix: TrellisMatrix, dense: torch.Tensor | None, steps: bool) -> tuple:
    """(weights pointer, per-expert stride, per-row stride, table, K, V, G, WU, CODE) of a product; the table is
    hyb's signed one for the unrolled decode (`steps`), its [512, 2] one for the tensor form."""
    code = matrix.code
    group, words = unit_geometry(code.K)
    table = (matrix.signed_table if steps else matrix.table) if code.needs_table else matrix.scales
    if dense is None:
        return matrix.codes, matrix.codes.stride(0), 0, table, code.K, code.V, group, words, code_id(code)
    return dense, dense.stride(0), dense.stride(1), table, code.K, code.V, group, words, code_id(code)


def _run(x, w13, w2, topk_ids, topk_weights, tile_m, schedule, dense_copies: bool, label: str) -> torch.Tensor:
    tokens, hidden, experts, intermediate, top_k = check_trellis_moe_inputs(x, w13, w2, topk_ids, topk_weights)
    check_triton_device(x, label)
    if tile_m not in TILE_M_CHOICES:
        raise ValueError(f"tile_m must be one of {TILE_M_CHOICES}, got {tile_m!r}")
    if schedule not in SCHEDULE_NAMES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULE_NAMES)}, got {schedule!r}")
    schedule = resolve_schedule(schedule, tokens, top_k, experts, w13.code.K, w13.code.needs_table)
    gate, chosen = product_schedules(schedule)
    parts = chosen.block_m // gate.block_m
    if gate.block_m < tile_m:
        raise ValueError(f"schedule {schedule}'s {gate.block_m}-row windows cannot hold {tile_m}-row m-tiles")
    out = scratch.empty((tokens, hidden), x.dtype, x.device)
    if tokens == 0:
        return out
    options = pdl.launch_options(x.device)
    num_pairs = tokens * top_k
    align = moe_align(topk_ids, experts, tile_m, window_rows=chosen.block_m)
    max_windows = align.window_first_tiles.numel()
    flat_ids = topk_ids.reshape(-1).contiguous()  # [N]
    flat_weights = topk_weights.reshape(-1).contiguous()  # [N]
    dense13 = dense2 = None
    if dense_copies:  # the experts with a pair, decoded once: the alignment's counts, no host sync
        dense13 = dequantize_rotated(w13, x.dtype, experts=align.expert_counts)
        dense2 = dequantize_rotated(w2, x.dtype, experts=align.expert_counts)
    x_rot = rotate_rows(x, w13.right_signs, w13.right_block, scratch.empty((tokens, hidden), x.dtype, x.device),
                        options)
    rows = align.sorted_pair_ids.numel()
    y_rot = scratch.empty((rows, 2 * intermediate), x.dtype, x.device)  # [R, 2F]
    dot_precision = "ieee" if x.dtype == torch.float32 else "tf32"
    ptx = compiled(x.device)
    steps = chosen.decode == "steps"
    meta = dict(num_warps=chosen.num_warps, num_stages=chosen.num_stages)
    if chosen.max_registers is not None and ptx:
        meta["maxnreg"] = chosen.max_registers
    gate_meta = dict(num_warps=gate.num_warps, num_stages=gate.num_stages)
    if gate.max_registers is not None and ptx:
        gate_meta["maxnreg"] = gate.max_registers
    gate_up_block_n = max(16, min(gate.gate_up_block_n, triton.next_power_of_2(intermediate)))
    down_block_n = max(16, min(chosen.down_block_n, triton.next_power_of_2(hidden)))
    weights, stride_we, stride_wn, table, bits, per_step, group, words, code = _weight_args(
        w13, dense13, gate.decode == "steps")
    _trellis_gate_up_kernel[(max_windows * parts * triton.cdiv(intermediate, gate_up_block_n),)](
        x_rot, weights, w13.scales, table, y_rot,
        align.sorted_pair_ids, align.tile_expert_ids, align.window_first_tiles, align.padded_offsets,
        num_pairs, hidden, intermediate, max_windows,
        x_rot.stride(0), stride_we, stride_wn, w13.scales.stride(0), y_rot.stride(0),
        TOP_K=top_k, TILE_M=tile_m, BLOCK_M=gate.block_m, BLOCK_N=gate_up_block_n, BLOCK_K=gate.block_k,
        GROUP_WINDOWS=gate.group_windows, K=bits, V=per_step, G=group, WU=words, CODE=code,
        DENSE=dense13 is not None, STEPS=gate.decode == "steps", PTX=ptx, DOT_PRECISION=dot_precision,
        EVEN=hidden % gate.block_k == 0 and intermediate % gate_up_block_n == 0, FUSED=gate.fuse_gate_up,
        PARTS=parts, **options, **gate_meta,
    )
    launches.record(f"{label}.gate_up", kernel=_trellis_gate_up_kernel)
    h_rot = swiglu_between(y_rot, w13.left_signs, w2.right_signs, w13.left_block,
                           scratch.empty((rows, intermediate), x.dtype, x.device), options)
    pair_out = scratch.empty((num_pairs, hidden), x.dtype, x.device)  # [N, D]
    weights, stride_we, stride_wn, table, bits, per_step, group, words, code = _weight_args(w2, dense2, steps)
    _trellis_down_kernel[(max_windows * triton.cdiv(hidden, down_block_n),)](
        h_rot, weights, w2.scales, table, flat_weights, pair_out,
        align.sorted_pair_ids, align.tile_expert_ids, align.window_first_tiles, align.padded_offsets,
        num_pairs, hidden, intermediate, max_windows,
        h_rot.stride(0), stride_we, stride_wn, w2.scales.stride(0), pair_out.stride(0),
        TILE_M=tile_m, BLOCK_M=chosen.block_m, BLOCK_N=down_block_n, BLOCK_K=chosen.block_k,
        GROUP_WINDOWS=chosen.group_windows, K=bits, V=per_step, G=group, WU=words, CODE=code,
        DENSE=dense2 is not None, STEPS=steps, PTX=ptx, DOT_PRECISION=dot_precision,
        EVEN=intermediate % chosen.block_k == 0 and hidden % down_block_n == 0, **options, **meta,
    )
    launches.record(f"{label}.down", kernel=_trellis_down_kernel)
    return unrotate_sum(pair_out, flat_ids, experts, top_k, w2.left_signs, w2.left_block, out, options)


def moe_trellis_grouped(x: torch.Tensor, w13: TrellisMatrix, w2: TrellisMatrix, topk_ids: torch.Tensor,
                        topk_weights: torch.Tensor, *, tile_m: int = DEFAULT_TILE_M,
                        schedule: str = AUTO_SCHEDULE) -> torch.Tensor:
    """The fused-decode grouped arm; the contract of `kernels.reference.moe_reference` over the dequantized
    stacks. Never waits for the device (CUDA-graph capturable)."""
    return _run(x, w13, w2, topk_ids, topk_weights, tile_m, schedule, False, "trellis_grouped")


def moe_trellis_dequant(x: torch.Tensor, w13: TrellisMatrix, w2: TrellisMatrix, topk_ids: torch.Tensor,
                        topk_weights: torch.Tensor, *, tile_m: int = DEFAULT_TILE_M,
                        schedule: str = AUTO_SCHEDULE) -> torch.Tensor:
    """The dequantize-then-grouped arm: the woken experts decoded to x's dtype, then the same grouped
    products. Equal to `moe_trellis_grouped` bit for bit (same weights, tiles and K order)."""
    return _run(x, w13, w2, topk_ids, topk_weights, tile_m, schedule, True, "trellis_dequant")
