"""The trellis decode every trellis kernel runs (states, code values, weights), and the decode-to-buffer arm.

Shape legend: E = experts, N = rows of a matrix (w13: 2F, w2: D), C = its columns (w13: D, w2: F),
K = bits per weight, V = weights per step. The packed layout is kernels.trellis_reference's: int32 codes
[E, N/16, C/16, W] with W = 8 K words per 16 x 16 tile, the tile's 256 K stream bits most significant
first, state t the 16-bit window at stream bit t K V (circular), weight (r, c) of a tile at sequence
position 16 r + c.

The unit. The kernels walk a tile in *units* of G whole rows whose bits fill whole words:

    K = 2   G = 1 row    WU = 1 word     16 weights
    K = 3   G = 2 rows   WU = 3 words    32 weights
    K = 4   G = 1 row    WU = 2 words    16 weights

so a tile is UT = 16 / G units, unit u holds words u WU .. u WU + WU - 1, and every state of a unit lies
in those words and the first word of the next unit (unit 0's, for the last: the stream is circular). A
kernel loads WU + 1 words per unit as [units, tile columns] tensors (`_unit_words`). Step i of a unit
holds the weights of elements V i .. V i + V - 1, element e sitting at row e // 16 and column e % 16 of
the unit. Two forms decode them:

- the tensor form: the steps as a third axis, each step's word and bit offset a compile-time pattern
  (`_unit_states`, one 64-bit funnel shift per state; the GEMV's `r` schedules, the grouped arm's
  `m64t` baseline);
- the unrolled form: every step a separate [units, tile columns] tensor at a compile-time bit, 32-bit
  integers only (`_step_state`'s shared funnel shifts, `_step_window` and `_hyb_hash_rows` with hyb's
  signed table, `_hyb_octet`'s one shared-memory gather for eight steps). The GEMV's `u` schedules
  accumulate the steps in place; `_decoded_tile` (the grouped arm's B tile, the dequantize kernel's
  blocks) joins them into a [rows, columns] block.

The arithmetic is the reference's, operation for operation (kernels/trellis_reference.py's docstring):
integer work in uint32; 1mad's integer sum converted exactly (the 2^23 bit trick, which is an exact
int -> float32 conversion for 0 <= y < 2^23, then one exact subtraction); 3inst's two fp16 halves
widened exactly and added once in fp32; hyb's table read and its sign flipped by xor. A weight is
value * scale in one fp32 multiply, rounded to the output dtype. So the decode is bit-identical to
`trellis_reference.dequantize_rotated` (tests/test_trellis_kernels.py compares with torch.equal).

Public: `dequantize_rotated`, the decode-to-buffer launcher (the dequantize arm's first launch, and the
decode test's window onto the unrolled decode). Knows nothing of MoE routing.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels import launches, scratch
from kernels.moe_checks import check_triton_device
from kernels.trellis_reference import TILE, TrellisCode, TrellisMatrix

CODE_IDS = {"1mad": 0, "3inst": 1, "hyb": 2}  # the CODE constexpr of every trellis kernel
DECODE_BLOCK_ROWS = 64  # rows per dequantize program (every column of them, DECODE_BLOCK_COLUMNS a step)
DECODE_BLOCK_COLUMNS = 128
DECODE_NUM_WARPS = 4


def compiled(device: torch.device) -> bool:
    """Whether kernels launched on `device` are compiled for a GPU (PTX allowed), not interpreted."""
    return device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"


def unit_geometry(bits_per_weight: int) -> tuple[int, int]:
    """(G rows per unit, WU words per unit) for K bits per weight (module docstring)."""
    return {2: (1, 1), 3: (2, 3), 4: (1, 2)}[bits_per_weight]


def code_id(code: TrellisCode) -> int:
    return CODE_IDS[code.code]


@triton.jit
def _unit_words(unit_ptrs, next_ptrs, mask, WU: tl.constexpr, WEIGHT_EVICTION: tl.constexpr):
    """The words a block of units decodes from: uint32 (w0, w1, w2, after), each [U, T].

    unit_ptrs [U, T]: each unit's first word; next_ptrs [U, T]: the first word of the unit after it in its
    tile (circularly); mask [U, T]: which units exist. w1 and w2 are the unit's second and third words
    where it has them (WU = 2, 3; else w0 again, unused)."""
    w0 = tl.load(unit_ptrs, mask=mask, other=0, eviction_policy=WEIGHT_EVICTION).to(tl.uint32, bitcast=True)
    after = tl.load(next_ptrs, mask=mask, other=0, eviction_policy=WEIGHT_EVICTION).to(tl.uint32, bitcast=True)
    w1 = w0
    w2 = w0
    if WU >= 2:
        w1 = tl.load(unit_ptrs + 1, mask=mask, other=0, eviction_policy=WEIGHT_EVICTION).to(tl.uint32, bitcast=True)
    if WU == 3:
        w2 = tl.load(unit_ptrs + 2, mask=mask, other=0, eviction_policy=WEIGHT_EVICTION).to(tl.uint32, bitcast=True)
    return w0, w1, w2, after


@triton.jit
def _states_of(w0, w1, w2, after, K: tl.constexpr, V: tl.constexpr, G: tl.constexpr, WU: tl.constexpr):
    """The 16-bit states of every step of a block of units: uint32 [U, T, S] with S = 16 G / V steps, from
    `_unit_words`. Step i starts at bit p = K V i of the unit: the window of words (p // 32, p // 32 + 1),
    shifted right by 48 - p % 32."""
    S: tl.constexpr = 16 * G // V
    bit = tl.arange(0, S) * (K * V)  # [S]
    word = (bit // 32)[None, None, :]
    shift = (48 - bit % 32).to(tl.uint64)[None, None, :]
    if WU == 1:
        high = w0[:, :, None]
        low = after[:, :, None]
    elif WU == 2:
        high = tl.where(word == 0, w0[:, :, None], w1[:, :, None])
        low = tl.where(word == 0, w1[:, :, None], after[:, :, None])
    else:  # WU == 3
        high = tl.where(word == 0, w0[:, :, None], tl.where(word == 1, w1[:, :, None], w2[:, :, None]))
        low = tl.where(word == 0, w1[:, :, None], tl.where(word == 1, w2[:, :, None], after[:, :, None]))
    window = (high.to(tl.uint64) << 32) | low.to(tl.uint64)
    return (window >> shift).to(tl.uint32) & 0xFFFF


@triton.jit
def _unit_states(unit_ptrs, next_ptrs, mask, K: tl.constexpr, V: tl.constexpr, G: tl.constexpr,
                 WU: tl.constexpr, WEIGHT_EVICTION: tl.constexpr):
    """`_states_of(_unit_words(...))`: uint32 [U, T, S] states of a block of units."""
    w0, w1, w2, after = _unit_words(unit_ptrs, next_ptrs, mask, WU, WEIGHT_EVICTION)
    return _states_of(w0, w1, w2, after, K, V, G, WU)


@triton.jit
def _code_values(s, table_ptr, CODE: tl.constexpr, PTX: tl.constexpr):
    """uint32 states -> (first value, second value) float32: the code function of each state (the second
    is hyb's; the computed codes return their one value twice, and V = 1 callers ignore it).

    PTX (compiled kernels only; the interpreter runs no PTX): 1mad's byte sum as one dp4a, the same
    integer, so the same bits (the GPU decode test compares both with the reference)."""
    if CODE == 0:  # 1mad: the byte sum of an LCG step, less 510, exactly
        x = s * 34038481 + 76625530
        # (2^23 + byte sum) as float32 bits, less 2^23 + 510: both steps exact (the sum is 0 .. 1020)
        if PTX:
            biased = tl.inline_asm_elementwise("dp4a.u32.u32 $0, $1, 16843009, 1258291200;", "=r,r", [x],
                                               dtype=tl.uint32, is_pure=True, pack=1)
        else:
            biased = ((x & 255) + ((x >> 8) & 255) + ((x >> 16) & 255) + (x >> 24)) | 0x4B000000
        value = biased.to(tl.float32, bitcast=True) - 8389118.0
        return value, value
    elif CODE == 1:  # 3inst: two fp16 halves of a masked LCG step, widened and added once in fp32
        x = s * 89226354 + 64248484
        if PTX:  # the halves read in place (no shifts to split them), one lop3 for the mask and the xor
            value = tl.inline_asm_elementwise(
                "{ .reg .b32 m; .reg .b16 lo, hi; .reg .f32 a, b;\n"
                "lop3.b32 m, $1, 0x8FFF8FFF, 0x3B603B60, 0x6A;\n"
                "mov.b32 {lo, hi}, m;\n"
                "cvt.f32.f16 a, hi;\n"
                "cvt.f32.f16 b, lo;\n"
                "add.rn.f32 $0, a, b; }",
                "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
        else:
            m = (x & 0x8FFF8FFF) ^ 0x3B603B60
            high = (m >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
            low = (m & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
            value = high + low
        return value, value
    else:  # hyb: a 9-bit hash index into the [512, 2] table, the first coordinate's sign flipped by bit 15
        x = s * (s + 1)
        # one 8-byte load per state: the row's two float32 values, first in the low word (little-endian)
        pair = tl.load(table_ptr.to(tl.pointer_type(tl.uint64)) + ((x >> 6) & 511))
        first = pair.to(tl.uint32) ^ ((x << 16) & 0x80000000)
        return first.to(tl.float32, bitcast=True), (pair >> 32).to(tl.uint32).to(tl.float32, bitcast=True)


@triton.jit
def _unit_word(w0, w1, w2, after, J: tl.constexpr, WU: tl.constexpr):
    """Word J of a unit (J = WU: the first word of the next unit), from `_unit_words`."""
    if J == WU:
        return after
    elif J == 0:
        return w0
    elif J == 1:
        return w1
    else:
        return w2


@triton.jit
def _step_window(w0, w1, w2, after, P: tl.constexpr, WU: tl.constexpr):
    """uint32, any shape: the unit's stream from bit P (a compile-time offset) with the state of that step in
    the low 16 bits and earlier stream bits above it (not masked off: hyb's hash does not see them, the
    computed codes mask). One shift, or one funnel shift where the state straddles two words."""
    R: tl.constexpr = P % 32
    high = _unit_word(w0, w1, w2, after, P // 32, WU)
    if R <= 16:
        return high >> (16 - R)
    else:
        low = _unit_word(w0, w1, w2, after, P // 32 + 1, WU)
        return (high << (R - 16)) | (low >> (48 - R))  # LLVM's funnel shift: one SHF.L.W


@triton.jit
def _step_state(w0, w1, w2, after, P: tl.constexpr, WU: tl.constexpr, PTX: tl.constexpr):
    """uint32, any shape: the 16-bit state at stream bit P of the unit (masked), for the computed codes. A
    state at bit 8 B + k of word j (k < 8) is bytes (B, B + 1) of the word funnel-shifted left by k, which
    the states with the same j and k share (one funnel shift each k): B = 0 one shift, B = 1 one byte
    permute (PTX's prmt, zero bytes above), B = 2 one mask; only B = 3 (the state's second byte in the next
    word) takes a funnel shift and a mask of its own. K = 2: 23 instructions for 16 states, not 32."""
    R: tl.constexpr = P % 32
    B: tl.constexpr = R // 8
    SHIFT: tl.constexpr = R % 8
    high = _unit_word(w0, w1, w2, after, P // 32, WU)
    if B == 3:
        return _step_window(w0, w1, w2, after, P, WU) & 0xFFFF
    if SHIFT == 0:
        word = high
    else:
        word = (high << SHIFT) | (_unit_word(w0, w1, w2, after, P // 32 + 1, WU) >> (32 - SHIFT))
    if B == 0:
        return word >> 16
    elif B == 1:
        if PTX:
            return tl.inline_asm_elementwise("prmt.b32 $0, $1, 0, 0x4421;", "=r,r", [word], dtype=tl.uint32,
                                             is_pure=True, pack=1)
        else:
            return (word >> 8) & 0xFFFF
    else:
        return word & 0xFFFF


@triton.jit
def _window_values(t, table_ptr, CODE: tl.constexpr, PTX: tl.constexpr):
    """`_step_window` words -> (first value, second value) float32 of their states, as `_code_values` but
    in 32-bit integer work only; for hyb, table_ptr is `trellis_reference.signed_hyb_table` ([1024, 2]) and
    the row is `_hyb_hash_rows`."""
    if CODE == 2:
        return _hyb_values_of_rows(tl.load(table_ptr.to(tl.pointer_type(tl.uint64)) + _hyb_hash_rows(t)))
    else:
        return _code_values(t & 0xFFFF, table_ptr, CODE, PTX)


@triton.jit
def _hyb_hash_rows(t):
    """hyb: `_step_window` words -> int32 rows of the signed table ([1024, 2]: rows 512.. the first 512 with
    v0 negated). x = t * (t + 1) mod 2^32 agrees with s * (s + 1) in its low 16 bits (the bits of t above
    its state only reach bits 16 and up), and those hold both the flip (bit 15) and the index (bits
    6..14): the signed row is (x >> 6) & 1023. One IMAD (t * t + t), and the shift and mask fold into
    the row's address."""
    x = t * t + t
    return ((x >> 6) & 1023).to(tl.int32)


@triton.jit
def _hyb_values_of_rows(pair):
    """uint64 signed-table rows (v1 in the high word) -> (first, second) float32."""
    return pair.to(tl.uint32).to(tl.float32, bitcast=True), (pair >> 32).to(tl.uint32).to(tl.float32, bitcast=True)


@triton.jit
def _hyb_gather8(table, a, b, c, d, e, f, g, h):
    """Eight equal-shape int32 tensors of signed-table rows -> their uint64 rows, from `table` ([1024] uint64
    in registers) in ONE tl.gather. A gather goes through shared memory (the table written, a barrier, the
    reads: 32-bit addresses, no L1 gathers), so eight steps share one copy of the table."""
    rows = tl.join(tl.join(tl.join(a, b), tl.join(c, d)), tl.join(tl.join(e, f), tl.join(g, h)))
    pairs = tl.reshape(tl.gather(table, tl.reshape(rows, [rows.numel]), 0), rows.shape)
    abcd, efgh = tl.split(pairs)
    ab, cd = tl.split(abcd)
    ef, gh = tl.split(efgh)
    pa, pb = tl.split(ab)
    pc, pd = tl.split(cd)
    pe, pf = tl.split(ef)
    pg, ph = tl.split(gh)
    return pa, pb, pc, pd, pe, pf, pg, ph


@triton.jit
def _opaque(x):
    """x itself (int32), through an asm move the compiler's pointer analysis cannot see into (PTX only)."""
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _hyb_rows_at(w0, w1, w2, after, P: tl.constexpr, WU: tl.constexpr):
    """hyb: the signed-table rows of the step at stream bit P of a block of units."""
    return _hyb_hash_rows(_step_window(w0, w1, w2, after, P, WU))


@triton.jit
def _hyb_octet(table, w0, w1, w2, after, FIRST: tl.constexpr, STEP_BITS: tl.constexpr, WU: tl.constexpr):
    """hyb: the table pairs of the eight steps FIRST..FIRST + 7 (STEP_BITS = K V stream bits each), one gather."""
    return _hyb_gather8(table, _hyb_rows_at(w0, w1, w2, after, STEP_BITS * FIRST, WU),
                        _hyb_rows_at(w0, w1, w2, after, STEP_BITS * (FIRST + 1), WU),
                        _hyb_rows_at(w0, w1, w2, after, STEP_BITS * (FIRST + 2), WU),
                        _hyb_rows_at(w0, w1, w2, after, STEP_BITS * (FIRST + 3), WU),
                        _hyb_rows_at(w0, w1, w2, after, STEP_BITS * (FIRST + 4), WU),
                        _hyb_rows_at(w0, w1, w2, after, STEP_BITS * (FIRST + 5), WU),
                        _hyb_rows_at(w0, w1, w2, after, STEP_BITS * (FIRST + 6), WU),
                        _hyb_rows_at(w0, w1, w2, after, STEP_BITS * (FIRST + 7), WU))


# --------------------------------------------------------------------------------------------------
# Whole blocks of tiles: the unrolled decode of [units, tile columns] words into [rows, columns] weights,
# the grouped arm's B operand and the dequantize kernel's output (one decode, both callers)
# --------------------------------------------------------------------------------------------------

@triton.jit
def _hyb_table(table_ptr):
    """uint64 [1024]: `trellis_reference.signed_hyb_table` in registers, once per program (`_hyb_gather8`'s source)."""
    return tl.load(table_ptr.to(tl.pointer_type(tl.uint64)) + tl.arange(0, 1024))


@triton.jit
def _in_order8(a0, a1, a2, a3, a4, a5, a6, a7):
    """Eight equal-shape tensors stacked on three new last axes [..., 2, 2, 2] whose flattening holds a_i at i.
    tl.join adds its axis last, which is the fastest of the flattened index, so the outermost join must pick
    between the even and the odd i: the leaves go in bit-reversed order. A join only stacks registers a
    thread already holds: no data moves."""
    return tl.join(tl.join(tl.join(a0, a4), tl.join(a2, a6)), tl.join(tl.join(a1, a5), tl.join(a3, a7)))


@triton.jit
def _in_order16(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15):
    """`_in_order8` for sixteen tensors: [..., 2, 2, 2, 2], a_i at flattened index i (evens and odds joined last)."""
    return tl.join(_in_order8(a0, a2, a4, a6, a8, a10, a12, a14), _in_order8(a1, a3, a5, a7, a9, a11, a13, a15))


@triton.jit
def _computed_value(w0, w1, w2, after, P: tl.constexpr, WU: tl.constexpr, CODE: tl.constexpr, PTX: tl.constexpr):
    """float32: the computed code's value of the state at stream bit P of the units (`_step_state`'s shared
    funnel shifts, then `_code_values`; no table)."""
    value, _ = _code_values(_step_state(w0, w1, w2, after, P, WU, PTX), w0, CODE, PTX)
    return value


@triton.jit
def _unit_row_values(w0, w1, w2, after, table, ROW: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                     WU: tl.constexpr, CODE: tl.constexpr, PTX: tl.constexpr):
    """float32 [U, T, 16]: the code values of row ROW of every unit (its 16 elements 16 ROW .. 16 ROW + 15, in
    column order), from `_unit_words` [U, T]. Every state's shift is a compile-time constant. hyb (V = 2): the
    row's eight steps in one `_hyb_octet` gather from `table` (`_hyb_table`); the computed codes (V = 1): its
    sixteen states through `_step_state`."""
    if CODE == 2:
        p0, p1, p2, p3, p4, p5, p6, p7 = _hyb_octet(table, w0, w1, w2, after, 8 * ROW, K * V, WU)
        pairs = tl.reshape(_in_order8(p0, p1, p2, p3, p4, p5, p6, p7), [w0.shape[0], w0.shape[1], 8])
        first, second = _hyb_values_of_rows(pairs)
        values = tl.join(first, second)  # element 2 step + v
    else:
        FIRST: tl.constexpr = K * 16 * ROW
        values = _in_order16(
            _computed_value(w0, w1, w2, after, FIRST, WU, CODE, PTX),
            _computed_value(w0, w1, w2, after, FIRST + K, WU, CODE, PTX),
            _computed_value(w0, w1, w2, after, FIRST + 2 * K, WU, CODE, PTX),
            _computed_value(w0, w1, w2, after, FIRST + 3 * K, WU, CODE, PTX),
            _computed_value(w0, w1, w2, after, FIRST + 4 * K, WU, CODE, PTX),
            _computed_value(w0, w1, w2, after, FIRST + 5 * K, WU, CODE, PTX),
            _computed_value(w0, w1, w2, after, FIRST + 6 * K, WU, CODE, PTX),
            _computed_value(w0, w1, w2, after, FIRST + 7 * K, WU, CODE, PTX),
            _computed_value(w0, w1, w2, after, FIRST + 8 * K, WU, CODE, PTX),
            _computed_value(w0, w1, w2, after, FIRST + 9 * K, WU, CODE, PTX),
            _computed_value(w0, w1, w2, after, FIRST + 10 * K, WU, CODE, PTX),
            _computed_value(w0, w1, w2, after, FIRST + 11 * K, WU, CODE, PTX),
            _computed_value(w0, w1, w2, after, FIRST + 12 * K, WU, CODE, PTX),
            _computed_value(w0, w1, w2, after, FIRST + 13 * K, WU, CODE, PTX),
            _computed_value(w0, w1, w2, after, FIRST + 14 * K, WU, CODE, PTX),
            _computed_value(w0, w1, w2, after, FIRST + 15 * K, WU, CODE, PTX))
    return tl.reshape(values, [w0.shape[0], w0.shape[1], 16])


@triton.jit
def _tile_words(codes_ptr, expert, row0, column0, num_row_tiles, num_column_tiles, stride_ce, K: tl.constexpr,
                G: tl.constexpr, WU: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                INSIDE: tl.constexpr, WEIGHT_EVICTION: tl.constexpr):
    """`_unit_words` [U, T] (U = BLOCK_N / G units, T = BLOCK_K / 16 tile columns) of the weights
    [row0, row0 + BLOCK_N) x [column0, column0 + BLOCK_K) of one expert (both multiples of 16); zero words
    outside the matrix. INSIDE: the caller knows the block lies inside it (no masks: the loads' predicates
    cost about half an instruction a weight in the grouped loop)."""
    UT: tl.constexpr = 16 // G
    unit = tl.arange(0, BLOCK_N // G)
    tile_row = row0 // 16 + unit // UT  # [U]
    in_tile = unit % UT
    tile_col = column0 // 16 + tl.arange(0, BLOCK_K // 16)  # [T]
    if INSIDE:  # a constant mask: the loads' canonicalization drops it
        mask = tl.full([BLOCK_N // G, BLOCK_K // 16], 1, tl.int1)
    else:
        mask = (tile_row < num_row_tiles)[:, None] & (tile_col < num_column_tiles)[None, :]
    tiles = codes_ptr + expert.to(tl.int64) * stride_ce \
        + (tile_row * num_column_tiles * (8 * K))[:, None] + tile_col[None, :] * (8 * K)
    return _unit_words(tiles + (in_tile * WU)[:, None], tiles + (((in_tile + 1) % UT) * WU)[:, None], mask, WU,
                       WEIGHT_EVICTION)


@triton.jit
def _tile_values(w0, w1, w2, after, table, K: tl.constexpr, V: tl.constexpr, G: tl.constexpr, WU: tl.constexpr,
                 CODE: tl.constexpr, PTX: tl.constexpr):
    """float32 [U G, 16 T]: the code values of `_tile_words`' block, in matrix order (unit u's row r is block
    row u G + r; tile column t's column c is block column 16 t + c)."""
    values = _unit_row_values(w0, w1, w2, after, table, 0, K, V, WU, CODE, PTX)
    if G == 2:  # [U, 2, T, 16]: the unit's two rows, each across the tile columns
        values = tl.permute(tl.join(values, _unit_row_values(w0, w1, w2, after, table, 1, K, V, WU, CODE, PTX)),
                            [0, 3, 1, 2])
    return tl.reshape(values, [w0.shape[0] * G, w0.shape[1] * 16])


@triton.jit
def _row_scales(scales_ptr, expert, row0, num_rows, stride_se, BLOCK_N: tl.constexpr):
    """float32 [BLOCK_N]: the scales of rows row0 .. row0 + BLOCK_N - 1 of one expert, 0 past the matrix."""
    rows = row0 + tl.arange(0, BLOCK_N)
    return tl.load(scales_ptr + expert.to(tl.int64) * stride_se + rows, mask=rows < num_rows, other=0.0)


@triton.jit
def _decoded_tile(codes_ptr, scales_ptr, table, expert, row0, column0, num_row_tiles, num_column_tiles, stride_ce,
                  stride_se, K: tl.constexpr, V: tl.constexpr, G: tl.constexpr, WU: tl.constexpr, CODE: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INSIDE: tl.constexpr, PTX: tl.constexpr,
                  OUT_DTYPE: tl.constexpr):
    """[BLOCK_N, BLOCK_K] W_rot[expert, row0 + n, column0 + k] in OUT_DTYPE (value * scale in fp32, rounded
    once), zero on rows past the matrix (columns past it hold the decode of zero words: callers mask them).
    INSIDE: `_tile_words`'."""
    w0, w1, w2, after = _tile_words(codes_ptr, expert, row0, column0, num_row_tiles, num_column_tiles, stride_ce,
                                    K, G, WU, BLOCK_N, BLOCK_K, INSIDE, "")
    scale = _row_scales(scales_ptr, expert, row0, num_row_tiles * 16, stride_se, BLOCK_N)
    return (_tile_values(w0, w1, w2, after, table, K, V, G, WU, CODE, PTX) * scale[:, None]).to(OUT_DTYPE)


@triton.jit
def _trellis_dequantize_kernel(
    codes_ptr,  # [E, N/16, C/16, W] int32
    scales_ptr,  # [E, N] float32
    table_ptr,  # [1024, 2] float32 (hyb: trellis_reference.signed_hyb_table) or any pointer
    experts_ptr,  # [E] int32: nonzero = decode this expert (e.g. moe_align's expert_counts)
    out_ptr,  # [E, N, C] out (x's dtype or float32)
    num_row_tiles,
    num_column_tiles,
    stride_ce,
    stride_se,
    stride_oe,
    stride_on,
    K: tl.constexpr, V: tl.constexpr, G: tl.constexpr, WU: tl.constexpr, CODE: tl.constexpr,
    BLOCK_N: tl.constexpr,  # rows per program
    BLOCK_K: tl.constexpr,  # columns per step of the walk
    SELECTED: tl.constexpr,  # read experts_ptr (else every expert is decoded)
    PTX: tl.constexpr,  # compiled for a GPU (not the interpreter): the decode's PTX forms
):
    """Grid (E, row blocks): BLOCK_N rows of one expert, walked BLOCK_K columns a step (`_tile_values`); the
    next step's words are loaded before this step decodes, and hyb's table is loaded once per program."""
    expert = tl.program_id(0)
    if SELECTED:
        wanted = tl.load(experts_ptr + expert) != 0
    else:
        wanted = True
    if wanted:
        row0 = tl.program_id(1) * BLOCK_N
        table = table_ptr
        if CODE == 2:
            table = _hyb_table(table_ptr)
        scale = _row_scales(scales_ptr, expert, row0, num_row_tiles * 16, stride_se, BLOCK_N)[:, None]
        rows = row0 + tl.arange(0, BLOCK_N)
        columns = tl.arange(0, BLOCK_K)
        out = out_ptr + expert.to(tl.int64) * stride_oe + rows.to(tl.int64)[:, None] * stride_on + columns[None, :]
        w0, w1, w2, after = _tile_words(codes_ptr, expert, row0, 0, num_row_tiles, num_column_tiles, stride_ce, K, G,
                                        WU, BLOCK_N, BLOCK_K, False, "")
        for column0 in range(0, num_column_tiles * 16, BLOCK_K):
            n0, n1, n2, n_after = _tile_words(codes_ptr, expert, row0, column0 + BLOCK_K, num_row_tiles,
                                              num_column_tiles, stride_ce, K, G, WU, BLOCK_N, BLOCK_K, False, "")
            weights = (_tile_values(w0, w1, w2, after, table, K, V, G, WU, CODE, PTX) * scale).to(out_ptr.dtype.element_ty)
            tl.store(out + column0, weights,
                     mask=(rows < num_row_tiles * 16)[:, None] & (columns < num_column_tiles * 16 - column0)[None, :])
            w0, w1, w2, after = n0, n1, n2, n_after


def dequantize_rotated(matrix: TrellisMatrix, dtype: torch.dtype = torch.float32,
                       experts: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """[E, N, C] rotated weights value * scale in `dtype` (one fp32 multiply, rounded to nearest even), as
    `trellis_reference.dequantize_rotated` computes them, through the kernels' decode.

    experts: int [E] on the device, nonzero where an expert is to be decoded (the others' rows are left as
    they are: the dequantize arm decodes the woken experts only, with no host sync); None = all.
    out: a [E, N, C] buffer of `dtype` to write into (default: a new one)."""
    check_triton_device(matrix.codes, "trellis dequantize")
    count, rows, columns = matrix.shape
    if out is None:
        out = scratch.empty((count, rows, columns), dtype, matrix.device)
    elif tuple(out.shape) != (count, rows, columns) or out.dtype != dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {dtype} [{count}, {rows}, {columns}] with unit column stride, got "
                         f"{out.dtype} {list(out.shape)}")
    if experts is not None and (experts.shape != (count,) or experts.device != matrix.device):
        raise ValueError(f"experts must be [{count}] on {matrix.device}, got {list(experts.shape)} on {experts.device}")
    code = matrix.code
    group, words = unit_geometry(code.K)
    table = matrix.signed_table if matrix.signed_table is not None else matrix.scales
    row_tiles, column_tiles = rows // TILE, columns // TILE
    _trellis_dequantize_kernel[(count, triton.cdiv(rows, DECODE_BLOCK_ROWS))](
        matrix.codes, matrix.scales, table, matrix.codes if experts is None else experts, out,
        row_tiles, column_tiles, matrix.codes.stride(0), matrix.scales.stride(0), out.stride(0), out.stride(1),
        K=code.K, V=code.V, G=group, WU=words, CODE=code_id(code),
        BLOCK_N=DECODE_BLOCK_ROWS, BLOCK_K=DECODE_BLOCK_COLUMNS, SELECTED=experts is not None,
        PTX=compiled(matrix.device),
        num_warps=DECODE_NUM_WARPS,
    )
    launches.record("trellis.dequantize", kernel=_trellis_dequantize_kernel)
    return out


def check_trellis_moe_inputs(x, w13: TrellisMatrix, w2: TrellisMatrix, topk_ids, topk_weights
                             ) -> tuple[int, int, int, int, int]:
    """What every trellis MoE arm needs (the `moe_reference` contract with w13 and w2 trellis stacks);
    returns (T, D, E, F, k). ValueError naming the argument otherwise; never reads tensor values."""
    if not isinstance(w13, TrellisMatrix) or not isinstance(w2, TrellisMatrix):
        raise ValueError(f"w13 and w2 must be TrellisMatrix stacks, got {type(w13).__name__} and {type(w2).__name__}")
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, hidden], got shape {tuple(x.shape)}")
    tokens, hidden = x.shape
    experts, two_f, columns = w13.shape
    if columns != hidden or two_f % 32:
        raise ValueError(f"w13 must be [E, 2F, D={hidden}] with F a multiple of 16, got {list(w13.shape)}")
    intermediate = two_f // 2
    if w2.shape != (experts, hidden, intermediate):
        raise ValueError(f"w2 must be [E={experts}, D={hidden}, F={intermediate}], got {list(w2.shape)}")
    if w13.left_block != w2.right_block or intermediate % w13.left_block:
        raise ValueError(f"w13's row block ({w13.left_block}) and w2's column block ({w2.right_block}) must be one "
                         f"block dividing F={intermediate}: the hidden is turned back and rotated block by block")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != tokens:
        raise ValueError(f"topk_ids must be [T={tokens}, k], got shape {tuple(topk_ids.shape)}")
    top_k = topk_ids.shape[1]
    if tuple(topk_weights.shape) != (tokens, top_k):
        raise ValueError(f"topk_weights must be [T={tokens}, k={top_k}] like topk_ids, got {tuple(topk_weights.shape)}")
    if not 1 <= top_k <= experts:
        raise ValueError(f"k (topk_ids.shape[1]) must be in 1..E={experts}, got {top_k}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be bfloat16, float16 or float32, got {x.dtype}")
    devices = {t.device for t in (x, w13.codes, w2.codes, topk_ids, topk_weights)}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")
    for name, matrix in (("w13", w13), ("w2", w2)):
        if not matrix.codes.is_contiguous() or not matrix.scales.is_contiguous():
            raise ValueError(f"{name}'s codes and scales must be contiguous")
    if x.numel() and x.stride(-1) != 1:
        raise ValueError(f"x must be contiguous along its last dimension (stride {x.stride()})")
    return tokens, hidden, experts, intermediate, top_k
