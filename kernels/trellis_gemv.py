"""Trellis GEMV MoE arm: every (token, expert) pair decodes its expert's packed tiles in registers and
multiplies them with its vector; no dequantized copy, no alignment.

Shapes: T tokens, k experts per token, E experts, D hidden, F expert intermediate, N = T*k pairs.

    x             [T, D]        activations
    w13, w2       TrellisMatrix [E, 2F, D] and [E, D, F] (kernels/trellis_reference.py)
    topk_ids      [T, k]        expert of pair p = t*k + j (ids outside [0, E) contribute nothing)
    topk_weights  [T, k]
    x_rot         [T, D]   f32  T_R13 x
    y_rot         [N, 2F]  f32  scale13 * (W13_rot x_rot) per pair
    h_rot         [N, F]   f32  T_R2 (silu(g) * u), (g, u) = T_L13^T y_rot
    z_rot         [N, D]   f32  w_p * scale2 * (W2_rot h_rot) per pair
    out           [T, D]        T_L2^T (sum over j = 0..k-1 of z_rot[t*k + j])

Launches (five): trellis.rotate, trellis_gemv.gate_up, trellis.swiglu_between, trellis_gemv.down,
trellis.unrotate_sum. Both products are `_trellis_gemv_kernel`, grid (N, row blocks): one pair and BLOCK_TR tile
rows (16 BLOCK_TR output rows) per program, walking the columns BLOCK_TC tiles at a time. A step of the
walk loads each unit's WU + 1 words (kernels/trellis_decode.py), decodes every state of the block as one
[units, BLOCK_TC, steps] tensor, and accumulates value * vector in fp32 (the vector's matching columns
loaded as [1, BLOCK_TC, steps]); the row scale and the routing weight are applied once at the end. The
rotations are the arm's own launches (kernels/trellis_rotate.py); the down product writes one row per
pair so that the last launch sums a token's k rows in a fixed order before turning them back (no float
atomics: bit-reproducible).

Why registers and fp32 FMAs rather than tensor cores at n = 1: one token's product reuses no decoded
weight, so an MMA would save only the FMA (one instruction per weight) while a Triton kernel can hand
it the weights only through shared memory: 4 bytes of shared traffic per weight (the write and the read),
a second bound of about 18 us for the six experts of a v4-shape token on an H200, beside a decode that
stays the same. docs/trellis-kernels.md derives the loop's instruction count per weight from its SASS.

Two kernels run that walk. `_trellis_gemv_kernel` (the `r` schedules) decodes [units, BLOCK_TC, steps]
tensors. `_trellis_gemv_steps_kernel` (the `u` schedules, the default) unrolls the steps at compile time
over [units, BLOCK_TC] tensors: no layout change of the words per step, a constant shift per state, hyb's
signed table read through shared memory. docs/trellis-kernels.md counts both.

Block shapes are not autotuned (the autotuner times inside CUDA-graph capture); `SCHEDULES` holds the
few a GPU run compares (bench/trellis_bench.py), `default_schedule` the one the arm uses for a code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import launches, pdl, scratch, streaming
from kernels.moe_checks import check_triton_device
from kernels.trellis_decode import (_code_values, _hyb_octet, _hyb_values_of_rows, _opaque, _states_of, _step_state,
                                    _step_window, _unit_words, _window_values, check_trellis_moe_inputs, code_id,
                                    compiled, unit_geometry)
from kernels.trellis_reference import TILE, TrellisMatrix
from kernels.trellis_rotate import rotate_rows, swiglu_between, unrotate_sum


@dataclass(frozen=True)
class GemvSchedule:
    block_tile_rows: int  # BLOCK_TR: tile rows (16 output rows each) per program
    block_tile_columns: int  # BLOCK_TC: tile columns per step of the walk
    num_warps: int
    unrolled: bool = False  # `_trellis_gemv_steps_kernel` (steps unrolled, [units, tile columns] tensors)
    hyb_table: str = "shared"  # unrolled hyb: the signed table through shared memory, or "global" (L1 gathers)
    max_registers: int | None = None  # ptxas's cap per thread (Triton's maxnreg); None: as many as it takes


# Per program and step at K = 2: BLOCK_TR x BLOCK_TC tiles of 64 bytes (the words) and 16 BLOCK_TC fp32
# vector values; 4 warps. At v4-shape, n = 1: 6 x 256 / BLOCK_TR programs of each product. The sm_90 build
# (bench/trellis_sm90_compile.py, triton 3.9) gives, for hyb / 3inst / 1mad, the main loop's instructions
# per weight and the registers (programs per SM by registers, of 128 threads):
#   "r1c8"   16 rows x 128 columns a step: 8.6 / 10.6 / 8.6, 40-56 registers (8 programs a SM)
#   "r1c16"  16 x 256: 7.1 / 9.7 / 7.6, 72-80 registers (6 programs): the loop overhead (the words' layout
#            conversion, the walk's bookkeeping) spread over twice the weights
#   "r2c8"   32 x 128: each vector value loaded once for twice the rows, half the programs
#   "r1c32"  16 x 512: 6.6 / 8.9 / 6.9, 128 registers (4 programs: fewer warps to hide a DRAM round trip)
# The unrolled kernel (`_trellis_gemv_steps_kernel`), hyb / 3inst / 1mad:
#   "u1c16"  16 x 256: 4.8 / 8.7 / 6.7, 40-56 registers
#   "u2c16"  32 x 256: 4.4 / 8.4 / 6.4, 80-96 registers (5-6 programs): 768 programs a product at v4-shape
#   "u2c16g" u2c16 with hyb's table read through L1 (5.5 for hyb), to time against the shared-memory reads
#   "u1c32"  16 x 512: 4.4 / 8.3 / 6.3, 80-96 registers, half the steps per program of u2c16
#   "u2c32", "u4c16"  4.2 / 8.2 / 6.2, 128 registers (4 programs)
SCHEDULES = {
    "r1c8": GemvSchedule(block_tile_rows=1, block_tile_columns=8, num_warps=4),
    "r1c16": GemvSchedule(block_tile_rows=1, block_tile_columns=16, num_warps=4),
    "r2c8": GemvSchedule(block_tile_rows=2, block_tile_columns=8, num_warps=4),
    "r1c32": GemvSchedule(block_tile_rows=1, block_tile_columns=32, num_warps=4),
    "u1c16": GemvSchedule(block_tile_rows=1, block_tile_columns=16, num_warps=4, unrolled=True),
    "u2c16": GemvSchedule(block_tile_rows=2, block_tile_columns=16, num_warps=4, unrolled=True),
    "u2c16g": GemvSchedule(block_tile_rows=2, block_tile_columns=16, num_warps=4, unrolled=True, hyb_table="global"),
    "u1c32": GemvSchedule(block_tile_rows=1, block_tile_columns=32, num_warps=4, unrolled=True),
    "u2c32": GemvSchedule(block_tile_rows=2, block_tile_columns=32, num_warps=4, unrolled=True),
    "u4c16": GemvSchedule(block_tile_rows=4, block_tile_columns=16, num_warps=4, unrolled=True),
    # u2c16 at 80 registers: the computed codes take 96, 5 programs a SM, so v4-shape's 768 a product ran in
    # 1.16 waves (ncu, run 89); at 80, 6 fit (one wave), for 56-72 bytes of stack a thread
    "u2c16r80": GemvSchedule(block_tile_rows=2, block_tile_columns=16, num_warps=4, unrolled=True, max_registers=80),
}
# The defaults, per code (run 90, v4-shape, n = 1, the whole arm): the computed codes at u1c16, 1536 programs
# of 40-59 registers a product (1mad 68.8 us against u2c16's 81.1, 3inst 75.7 against 80.3: more warps a
# SM and a shorter tail than u2c16's 768 programs at 96 registers, 1.16 waves); hyb at u2c16 (110.2 against
# u1c16's 121.3: each program copies the 8 KB table into shared memory, so fewer programs copy less).
TABLE_SCHEDULE = "u2c16"
COMPUTED_SCHEDULE = "u1c16"
BASELINE_SCHEDULE = "r1c16"  # the tensor-form kernel's default before the unrolled one: the bench times both


def default_schedule(code) -> str:
    """The schedule the arm runs `code` (a TrellisCode) with when the caller names none."""
    return TABLE_SCHEDULE if code.needs_table else COMPUTED_SCHEDULE


@triton.jit
def _trellis_gemv_kernel(
    codes_ptr,  # [E, N/16, C/16, W] int32
    scales_ptr,  # [E, N] float32
    table_ptr,  # [512, 2] float32 (hyb)
    vec_ptr,  # [rows of vectors, C] float32: x_rot (per token) or h_rot (per pair)
    ids_ptr,  # [P] expert of each pair
    weights_ptr,  # [P] routing weight of each pair (ROUTED)
    out_ptr,  # [P, N] float32 out
    num_experts,
    num_row_tiles,  # N / 16
    num_column_tiles,  # C / 16
    stride_ce,
    stride_se,
    stride_v,
    stride_o,
    VECTOR_PER_TOKEN: tl.constexpr,  # vec row = pair // TOP_K (gate-up) or pair (down)
    TOP_K: tl.constexpr,
    ROUTED: tl.constexpr,  # multiply by the pair's routing weight (down)
    K: tl.constexpr, V: tl.constexpr, G: tl.constexpr, WU: tl.constexpr, CODE: tl.constexpr,
    BLOCK_TR: tl.constexpr, BLOCK_TC: tl.constexpr,
    PTX: tl.constexpr,
    USE_GDC: tl.constexpr,
    WEIGHT_EVICTION: tl.constexpr,
):
    """Grid (P, row blocks): out[p, rows] = scale[e, rows] * (routing weight) * sum_c W_rot[e, rows, c] vec[c]."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair).to(tl.int32)
    if (expert >= 0) & (expert < num_experts):  # an unknown id writes nothing; the sum leaves its row out
        UT: tl.constexpr = 16 // G
        U: tl.constexpr = BLOCK_TR * UT
        S: tl.constexpr = 16 * G // V
        unit = tl.arange(0, U)
        tile_row = tl.program_id(1) * BLOCK_TR + unit // UT  # [U]
        in_tile = unit % UT
        row_ok = tile_row < num_row_tiles
        tile_col = tl.arange(0, BLOCK_TC)  # [T]
        words_per_tile: tl.constexpr = 8 * K
        row_base = codes_ptr + expert.to(tl.int64) * stride_ce + (tile_row * num_column_tiles * words_per_tile)[:, None]
        unit_ptrs = row_base + (in_tile * WU)[:, None] + tile_col[None, :] * words_per_tile  # [U, T]
        next_ptrs = row_base + (((in_tile + 1) % UT) * WU)[:, None] + tile_col[None, :] * words_per_tile
        step = tl.arange(0, S)
        if VECTOR_PER_TOKEN:
            vector = vec_ptr + (pair // TOP_K).to(tl.int64) * stride_v
        else:
            vector = vec_ptr + pair.to(tl.int64) * stride_v
        vec_ptrs = vector + tile_col[None, :, None] * 16 + ((V * step) % 16)[None, None, :]  # [1, T, S]
        first_sum = tl.zeros([U, BLOCK_TC, S], dtype=tl.float32)
        second_sum = tl.zeros([U, BLOCK_TC, S], dtype=tl.float32)
        # the next step's words are loaded before this step decodes (a few registers): the DRAM round trip
        # overlaps a step's decode instead of stalling every program at the top of each step
        w0, w1, w2, after = _unit_words(unit_ptrs, next_ptrs, row_ok[:, None] & (tile_col < num_column_tiles)[None, :],
                                        WU, WEIGHT_EVICTION)
        for column0 in range(0, num_column_tiles, BLOCK_TC):
            column_ok = tile_col < num_column_tiles - column0
            unit_ptrs += BLOCK_TC * words_per_tile
            next_ptrs += BLOCK_TC * words_per_tile
            ahead = row_ok[:, None] & (tile_col < num_column_tiles - column0 - BLOCK_TC)[None, :]
            n0, n1, n2, n_after = _unit_words(unit_ptrs, next_ptrs, ahead, WU, WEIGHT_EVICTION)
            states = _states_of(w0, w1, w2, after, K, V, G, WU)
            first, second = _code_values(states, table_ptr, CODE, PTX)
            vec_ok = column_ok[None, :, None]
            first_sum += first * tl.load(vec_ptrs, mask=vec_ok, other=0.0)
            if V == 2:
                second_sum += second * tl.load(vec_ptrs + 1, mask=vec_ok, other=0.0)
            vec_ptrs += BLOCK_TC * 16
            w0, w1, w2, after = n0, n1, n2, n_after
        if USE_GDC:
            tl.extra.cuda.gdc_launch_dependents()
        if V == 2:
            first_sum += second_sum
        # unit u's element e sits on row u G + e // 16 of the block: steps [0, S/G) are its first row
        per_row = tl.reshape(tl.sum(tl.reshape(tl.sum(first_sum, axis=1), [U, G, S // G]), axis=2), [U * G])
        rows = tl.program_id(1) * (BLOCK_TR * 16) + tl.arange(0, U * G)
        rows_ok = rows < num_row_tiles * 16
        result = per_row * tl.load(scales_ptr + expert.to(tl.int64) * stride_se + rows, mask=rows_ok, other=0.0)
        if ROUTED:
            result = result * tl.load(weights_ptr + pair).to(tl.float32)
        tl.store(out_ptr + pair.to(tl.int64) * stride_o + rows, result, mask=rows_ok)


@triton.jit
def _vector_pair(vec_ptrs, COLUMN: tl.constexpr, column_ok, EVEN_COLUMNS: tl.constexpr):
    """The vector's columns COLUMN and COLUMN + 1 (COLUMN even) of each tile column, float32 [1, T] each, in
    one 8-byte load (a vector row starts 64-byte aligned: C is a multiple of 16)."""
    pointers = (vec_ptrs + COLUMN).to(tl.pointer_type(tl.uint64))
    if EVEN_COLUMNS:
        both = tl.load(pointers)
    else:
        both = tl.load(pointers, mask=column_ok, other=0)
    return both.to(tl.uint32).to(tl.float32, bitcast=True), (both >> 32).to(tl.uint32).to(tl.float32, bitcast=True)


@triton.jit
def _accumulate_pair(sum0, sum1, pair, vec_ptrs, STEP: tl.constexpr, column_ok, EVEN_COLUMNS: tl.constexpr):
    """hyb step STEP of a unit (elements 2 STEP, 2 STEP + 1): its signed-table rows times the vector, into
    the sum of its row (the unit's first for STEP < 8, else its second)."""
    first, second = _hyb_values_of_rows(pair)
    x_first, x_second = _vector_pair(vec_ptrs, (2 * STEP) % 16, column_ok, EVEN_COLUMNS)
    if STEP < 8:
        sum0 += first * x_first
        sum0 += second * x_second
    else:
        sum1 += first * x_first
        sum1 += second * x_second
    return sum0, sum1


@triton.jit
def _trellis_gemv_steps_kernel(
    codes_ptr,  # [E, N/16, C/16, W] int32
    scales_ptr,  # [E, N] float32
    table_ptr,  # [1024, 2] float32 (hyb: trellis_reference.signed_hyb_table) or any pointer
    vec_ptr,  # [rows of vectors, C] float32: x_rot (per token) or h_rot (per pair)
    ids_ptr,  # [P] expert of each pair
    weights_ptr,  # [P] routing weight of each pair (ROUTED)
    out_ptr,  # [P, N] float32 out
    num_experts,
    num_row_tiles,  # N / 16
    num_column_tiles,  # C / 16
    stride_ce,
    stride_se,
    stride_v,
    stride_o,
    VECTOR_PER_TOKEN: tl.constexpr,
    TOP_K: tl.constexpr,
    ROUTED: tl.constexpr,
    K: tl.constexpr, V: tl.constexpr, G: tl.constexpr, WU: tl.constexpr, CODE: tl.constexpr,
    BLOCK_TR: tl.constexpr, BLOCK_TC: tl.constexpr,
    PTX: tl.constexpr,
    USE_GDC: tl.constexpr,
    WEIGHT_EVICTION: tl.constexpr,
    TABLE_IN_SHARED: tl.constexpr,  # hyb: the signed table read through shared memory (tl.gather), not L1
    EVEN_COLUMNS: tl.constexpr,  # num_column_tiles % BLOCK_TC == 0: no column masks
    PRELOAD: tl.constexpr = False,  # with USE_GDC: the id, the first step's words and the table before the wait
):
    """`_trellis_gemv_kernel`'s contract, with the steps of a unit unrolled at compile time: every tensor is
    [units, tile columns], so each thread decodes every state of its own units from its own words (no
    layout change of the words, a constant shift per state: `_step_window`), and reads each vector value
    once for all of its units. PRELOAD: the codes and the ids do not depend on the grid before (the ids are
    the router's, complete two grids back: kernels.pdl), so their first loads overlap its tail; only the
    vector waits."""
    if USE_GDC and not PRELOAD:
        tl.extra.cuda.gdc_wait()
    pair = tl.program_id(0)
    if PRELOAD:
        expert = tl.load(ids_ptr + pair, cache_modifier=".cg").to(tl.int32)
    else:
        expert = tl.load(ids_ptr + pair).to(tl.int32)
    if (expert < 0) | (expert >= num_experts):
        if USE_GDC and PRELOAD:  # every program waits before it exits (kernels.pdl: completion stays transitive)
            tl.extra.cuda.gdc_wait()
    else:
        UT: tl.constexpr = 16 // G
        U: tl.constexpr = BLOCK_TR * UT
        S: tl.constexpr = 16 * G // V
        unit = tl.arange(0, U)
        tile_row = tl.program_id(1) * BLOCK_TR + unit // UT  # [U]
        in_tile = unit % UT
        row_ok = tile_row < num_row_tiles
        tile_col = tl.arange(0, BLOCK_TC)  # [T]
        words_per_tile: tl.constexpr = 8 * K
        row_base = codes_ptr + expert.to(tl.int64) * stride_ce + (tile_row * num_column_tiles * words_per_tile)[:, None]
        unit_offsets = (in_tile * WU)[:, None] + tile_col[None, :] * words_per_tile  # [U, T]
        next_offsets = (((in_tile + 1) % UT) * WU)[:, None] + tile_col[None, :] * words_per_tile
        if PTX:
            # hide the units' contiguity from the coalescing pass: a thread's words then come in the layout of
            # the vector's [1, T] loads (one per tile column), not in runs of units that must change layout
            unit_offsets = _opaque(unit_offsets)
            next_offsets = _opaque(next_offsets)
        unit_ptrs = row_base + unit_offsets
        next_ptrs = row_base + next_offsets
        if VECTOR_PER_TOKEN:
            vector = vec_ptr + (pair // TOP_K).to(tl.int64) * stride_v
        else:
            vector = vec_ptr + pair.to(tl.int64) * stride_v
        vec_ptrs = vector + tile_col[None, :] * 16  # [1, T]: each tile column's first column
        sum0 = tl.zeros([U, BLOCK_TC], dtype=tl.float32)  # the unit's first row
        sum1 = tl.zeros([U, BLOCK_TC], dtype=tl.float32)  # its second row (G = 2)
        w0, w1, w2, after = _unit_words(unit_ptrs, next_ptrs, row_ok[:, None] & (tile_col < num_column_tiles)[None, :],
                                        WU, WEIGHT_EVICTION)
        table = table_ptr
        if TABLE_IN_SHARED:
            table = tl.load(table_ptr.to(tl.pointer_type(tl.uint64)) + tl.arange(0, 1024))
        if USE_GDC and PRELOAD:
            tl.extra.cuda.gdc_wait()
        for column0 in range(0, num_column_tiles, BLOCK_TC):
            unit_ptrs += BLOCK_TC * words_per_tile
            next_ptrs += BLOCK_TC * words_per_tile
            if EVEN_COLUMNS:
                column_ok = tile_col[None, :] >= 0
                ahead = row_ok[:, None] & (tile_col * 0 + (column0 + BLOCK_TC) < num_column_tiles)[None, :]
            else:
                column_ok = (tile_col < num_column_tiles - column0)[None, :]
                ahead = row_ok[:, None] & (tile_col < num_column_tiles - column0 - BLOCK_TC)[None, :]
            n0, n1, n2, n_after = _unit_words(unit_ptrs, next_ptrs, ahead, WU, WEIGHT_EVICTION)
            if TABLE_IN_SHARED:  # hyb: eight steps a gather (S is 8 or 16)
                for octet in tl.static_range(S // 8):
                    p0, p1, p2, p3, p4, p5, p6, p7 = _hyb_octet(table, w0, w1, w2, after, 8 * octet, K * V, WU)
                    sum0, sum1 = _accumulate_pair(sum0, sum1, p0, vec_ptrs, 8 * octet, column_ok, EVEN_COLUMNS)
                    sum0, sum1 = _accumulate_pair(sum0, sum1, p1, vec_ptrs, 8 * octet + 1, column_ok, EVEN_COLUMNS)
                    sum0, sum1 = _accumulate_pair(sum0, sum1, p2, vec_ptrs, 8 * octet + 2, column_ok, EVEN_COLUMNS)
                    sum0, sum1 = _accumulate_pair(sum0, sum1, p3, vec_ptrs, 8 * octet + 3, column_ok, EVEN_COLUMNS)
                    sum0, sum1 = _accumulate_pair(sum0, sum1, p4, vec_ptrs, 8 * octet + 4, column_ok, EVEN_COLUMNS)
                    sum0, sum1 = _accumulate_pair(sum0, sum1, p5, vec_ptrs, 8 * octet + 5, column_ok, EVEN_COLUMNS)
                    sum0, sum1 = _accumulate_pair(sum0, sum1, p6, vec_ptrs, 8 * octet + 6, column_ok, EVEN_COLUMNS)
                    sum0, sum1 = _accumulate_pair(sum0, sum1, p7, vec_ptrs, 8 * octet + 7, column_ok, EVEN_COLUMNS)
            else:
                for step in tl.static_range(S):
                    # step's first element of the unit: row (V step) // 16, column (V step) % 16
                    if CODE == 2:
                        window = _step_window(w0, w1, w2, after, K * V * step, WU)
                        first, second = _window_values(window, table, CODE, PTX)
                    else:
                        state = _step_state(w0, w1, w2, after, K * step, WU, PTX)
                        first, second = _code_values(state, table, CODE, PTX)
                    if V == 2:
                        x_first, x_second = _vector_pair(vec_ptrs, (2 * step) % 16, column_ok, EVEN_COLUMNS)
                    elif step % 2 == 0:  # V = 1: this step's column and the next step's, in one load
                        x_first, x_next = _vector_pair(vec_ptrs, step % 16, column_ok, EVEN_COLUMNS)
                        x_second = x_first
                    else:
                        x_first = x_next
                        x_second = x_first
                    if (V * step) // 16 == 0:  # one FFMA per weight into its row's sum
                        sum0 += first * x_first
                        if V == 2:
                            sum0 += second * x_second
                    else:
                        sum1 += first * x_first
                        if V == 2:
                            sum1 += second * x_second
            vec_ptrs += BLOCK_TC * 16
            w0, w1, w2, after = n0, n1, n2, n_after
        if USE_GDC:
            tl.extra.cuda.gdc_launch_dependents()
        rows = tile_row * 16 + in_tile * G  # [U]: each unit's first row
        scale_row = scales_ptr + expert.to(tl.int64) * stride_se + rows
        result = tl.sum(sum0, axis=1) * tl.load(scale_row, mask=row_ok, other=0.0)
        if ROUTED:
            result = result * tl.load(weights_ptr + pair).to(tl.float32)
        tl.store(out_ptr + pair.to(tl.int64) * stride_o + rows, result, mask=row_ok)
        if G == 2:
            result = tl.sum(sum1, axis=1) * tl.load(scale_row + 1, mask=row_ok, other=0.0)
            if ROUTED:
                result = result * tl.load(weights_ptr + pair).to(tl.float32)
            tl.store(out_ptr + pair.to(tl.int64) * stride_o + rows + 1, result, mask=row_ok)


def _product(vectors: torch.Tensor, matrix: TrellisMatrix, flat_ids: torch.Tensor, flat_weights: torch.Tensor,
             top_k: int, per_token: bool, routed: bool, schedule: GemvSchedule, name: str) -> torch.Tensor:
    """[P, N] float32: one GEMV launch of `matrix` for every pair (module docstring)."""
    experts, rows, columns = matrix.shape
    pairs = flat_ids.numel()
    out = scratch.empty((pairs, rows), torch.float32, vectors.device)
    code = matrix.code
    group, words = unit_geometry(code.K)
    table = matrix.table if matrix.table is not None else matrix.scales
    row_tiles, column_tiles = rows // TILE, columns // TILE
    kernel, extra = _trellis_gemv_kernel, {}
    if schedule.unrolled:
        if vectors.data_ptr() % 8 or vectors.stride(0) % 2:  # _vector_pair's 8-byte loads
            raise ValueError(f"the unrolled GEMV reads its vectors 8 bytes at a time: they must start 8-byte aligned "
                             f"with an even row stride, got stride {vectors.stride(0)}")
        kernel = _trellis_gemv_steps_kernel
        if code.needs_table:
            table = matrix.signed_table
        extra = dict(TABLE_IN_SHARED=code.needs_table and schedule.hyb_table == "shared",
                     EVEN_COLUMNS=column_tiles % schedule.block_tile_columns == 0,
                     PRELOAD=pdl.preload(vectors.device, "trellis"))
    if schedule.max_registers is not None and compiled(vectors.device):
        extra["maxnreg"] = schedule.max_registers
    kernel[(pairs, triton.cdiv(row_tiles, schedule.block_tile_rows))](
        matrix.codes, matrix.scales, table, vectors, flat_ids, flat_weights, out,
        experts, row_tiles, column_tiles, matrix.codes.stride(0), matrix.scales.stride(0),
        vectors.stride(0), out.stride(0),
        VECTOR_PER_TOKEN=per_token, TOP_K=top_k, ROUTED=routed,
        K=code.K, V=code.V, G=group, WU=words, CODE=code_id(code),
        BLOCK_TR=schedule.block_tile_rows, BLOCK_TC=schedule.block_tile_columns, num_warps=schedule.num_warps,
        PTX=compiled(vectors.device),
        **pdl.launch_options(vectors.device), WEIGHT_EVICTION=streaming.weight_eviction(vectors.device), **extra,
    )
    launches.record(name, kernel=kernel)
    return out


def moe_trellis_gemv(
    x: torch.Tensor,  # [T, D]
    w13: TrellisMatrix,  # [E, 2F, D]
    w2: TrellisMatrix,  # [E, D, F]
    topk_ids: torch.Tensor,  # [T, k]
    topk_weights: torch.Tensor,  # [T, k]
    *,
    schedule: str | None = None,
) -> torch.Tensor:  # [T, D]
    """The trellis GEMV arm; the contract of `kernels.reference.moe_reference` over the dequantized stacks
    (`trellis_reference.dequantize`). Never waits for the device (CUDA-graph capturable). `schedule`: a
    SCHEDULES name; None runs `default_schedule(w13.code)`."""
    tokens, hidden, experts, intermediate, top_k = check_trellis_moe_inputs(x, w13, w2, topk_ids, topk_weights)
    check_triton_device(x, "moe_trellis_gemv")
    if schedule is None:
        schedule = default_schedule(w13.code)
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    chosen = SCHEDULES[schedule]
    out = scratch.empty((tokens, hidden), x.dtype, x.device)
    if tokens == 0:
        return out
    options = pdl.launch_options(x.device)
    flat_ids = topk_ids.reshape(-1).contiguous()  # [N]
    flat_weights = topk_weights.reshape(-1).contiguous()  # [N]
    x_rot = rotate_rows(x, w13.right_signs, w13.right_block, scratch.empty((tokens, hidden), torch.float32, x.device),
                        options)
    y_rot = _product(x_rot, w13, flat_ids, flat_weights, top_k, True, False, chosen, "trellis_gemv.gate_up")
    h_rot = swiglu_between(y_rot, w13.left_signs, w2.right_signs, w13.left_block,
                           scratch.empty((flat_ids.numel(), intermediate), torch.float32, x.device), options)
    z_rot = _product(h_rot, w2, flat_ids, flat_weights, top_k, False, True, chosen, "trellis_gemv.down")
    return unrotate_sum(z_rot, flat_ids, experts, top_k, w2.left_signs, w2.left_block, out, options)
