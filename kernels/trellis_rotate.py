"""The Hadamard rotations around a trellis MoE layer's two products, on tensor cores.

Shape legend: T tokens, k experts per token, N = T k pairs, R rows of an arm's pair layout (N, or the
grouped arm's padded rows), D hidden, F expert intermediate, B a side's Hadamard block.

A trellis matrix multiplies in its rotated basis (kernels/trellis_reference.py): W x = T_L^T (W_rot (T_R x)),
T(v) = blockwise_hadamard(signs * v), with signs shared by the E experts of a stack. So an arm runs

    rotate_rows        x [T, D]           -> x_rot = T_R13 x               once per token
    (gate-up product)  x_rot              -> y_rot [R, 2F]
    swiglu_between     y_rot              -> h_rot = T_R2 (silu(g) * u),   (g, u) = T_L13^T y_rot
    (down product)     h_rot              -> per pair, or per token summed over its k pairs
    unrotate_sum       [T k, D] or [T, D] -> out [T, D] = T_L2^T (sum over the token's pairs)

The last is linear and its signs are shared, so the k pairs of a token are summed in the rotated basis
and turned back once. Each block of B values is a normalised Walsh-Hadamard transform in Sylvester
order, H_B v / sqrt(B), H_B[i, j] = (-1)^popcount(i & j). For B <= 128 a program multiplies BLOCK_ROWS
blocks at once by H_B (one tl.dot); for 256 <= B <= 16384 it views one block as an [A, C] matrix (row-major,
A C = B, both in 16..128) and computes H_A X H_C (two tl.dots), which is H_B's Kronecker form. H is +-1,
exact in tf32, so only the fp32 operand is split: x = high + low, high rounded to tf32's 11 bits (exact, and
so is the difference), and each product is two tf32 dots (`_times_hadamard`). That is tf32x3's arithmetic
(its third dot multiplies by H's low part, which is zero) in two thirds of the MMAs and half the registers:
tf32x3 took 255 registers and spilled 1 KB a thread, which made the one-program rotation of a 4096-wide
token 13.5 us on an H200. The interpreter's dot is exact to one rounding. The results equal the reference's
butterflies to fp32 rounding, not bit for bit.

Knows nothing of experts or routing beyond the validity of a pair's id.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import launches

MAX_BLOCK = 16384
BLOCK_ROWS = 32  # blocks per program when B <= 128 (tl.dot's M)
NUM_WARPS = 8  # a one-program rotation (one token) runs on its warps alone: eight halve its chain a thread


def split(block: int) -> tuple[int, int]:
    """(A, C) of a block of B values: (1, B) for B <= 128, else an [A, C] view with A C = B, 16 <= A <= C <= 128."""
    if block < 16 or block & (block - 1) or block > MAX_BLOCK:
        raise ValueError(f"Hadamard block {block}: the trellis arms rotate blocks that are powers of two "
                         f"from 16 to {MAX_BLOCK}")
    if block <= 128:
        return 1, block
    columns = min(128, 1 << ((block.bit_length() - 1 + 1) // 2))
    return block // columns, columns


def dot_precision(dtype: torch.dtype) -> str:
    """float32: "split" (`_times_hadamard`'s two tf32 dots); narrower inputs are widened before any dot."""
    return "split" if dtype == torch.float32 else "ieee"


@triton.jit
def _sylvester(SIZE: tl.constexpr):
    """float32 [SIZE, SIZE] of +-1: (-1)^popcount(i & j), SIZE <= 128 (the parity of 8 bits)."""
    bits = tl.arange(0, SIZE)[:, None] & tl.arange(0, SIZE)[None, :]
    bits = bits ^ (bits >> 4)
    bits = bits ^ (bits >> 2)
    bits = bits ^ (bits >> 1)
    return 1.0 - 2.0 * (bits & 1).to(tl.float32)


@triton.jit
def _tf32_high(x):
    """float32 x rounded (half away from zero) to tf32's 11 significant bits: exact in tf32, and x - high is
    exact in float32, with at most 12 significant bits."""
    bits = x.to(tl.uint32, bitcast=True)
    return ((bits + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)


@triton.jit
def _times_hadamard(x, hadamard, X_FIRST: tl.constexpr, PRECISION: tl.constexpr):
    """x @ hadamard (X_FIRST) or hadamard @ x, float32, hadamard +-1. "split": x = high + low + (under
    2^-23 of x), both parts rounded to tf32, one tf32 dot each, the low part's first: the tensor cores
    truncate their fp32 accumulator at every k step, so the small products are summed before the large
    ones join them (high first, with the low part truncated by the MMA, measured 5x tf32x3's error)."""
    if PRECISION == "split":
        high = _tf32_high(x)
        low = _tf32_high(x - high)
        if X_FIRST:
            y = tl.dot(low, hadamard, input_precision="tf32")
            y = tl.dot(high, hadamard, y, input_precision="tf32")
        else:
            y = tl.dot(hadamard, low, input_precision="tf32")
            y = tl.dot(hadamard, high, y, input_precision="tf32")
    elif X_FIRST:
        y = tl.dot(x, hadamard, input_precision=PRECISION)
    else:
        y = tl.dot(hadamard, x, input_precision=PRECISION)
    return y


@triton.jit
def _walsh(x, A: tl.constexpr, C: tl.constexpr, RB: tl.constexpr, PRECISION: tl.constexpr):
    """x float32 [M, C] (A == 1: M blocks of C values, each transformed) or [RB A, C] (A > 1: RB blocks of A C
    values, each row-major, stacked): the normalised Walsh-Hadamard transform, float32."""
    y = _times_hadamard(x, _sylvester(C), True, PRECISION)
    if A > 1:
        if RB == 1:
            y = _times_hadamard(y, _sylvester(A), False, PRECISION)
        else:  # each block's H_A on the left: the RB blocks side by side, [A, RB C], one dot
            side = tl.reshape(tl.permute(tl.reshape(y, [RB, A, C]), (1, 0, 2)), [A, RB * C])
            side = _times_hadamard(side, _sylvester(A), False, PRECISION)
            y = tl.reshape(tl.permute(tl.reshape(side, [A, RB, C]), (1, 0, 2)), [RB * A, C])
    return y * (1.0 / tl.sqrt(float(A * C)))


@triton.jit
def _block_offsets(program, blocks_per_vector, num_blocks_total, A: tl.constexpr, C: tl.constexpr,
                   BLOCK_ROWS: tl.constexpr, RB: tl.constexpr):
    """For this program: (row [M], in-row offset of each value [M, C], which rows exist [M]), where a vector
    of the input is `blocks_per_vector` blocks. A == 1: BLOCK_ROWS consecutive blocks; A > 1: blocks
    `program` RB .. + RB - 1, each viewed as [A, C] and stacked (M = RB A)."""
    if A == 1:
        block = program * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # [M]
        offset = (block % blocks_per_vector)[:, None] * C + tl.arange(0, C)[None, :]
        return block // blocks_per_vector, offset, block < num_blocks_total
    elif RB == 1:
        row = program // blocks_per_vector + tl.zeros([A], dtype=tl.int32)
        offset = (program % blocks_per_vector) * (A * C) + tl.arange(0, A)[:, None] * C + tl.arange(0, C)[None, :]
        return row, offset, (program + tl.zeros([A], dtype=tl.int32)) < num_blocks_total
    else:
        block = program * RB + tl.arange(0, RB * A) // A  # [M]
        offset = (block % blocks_per_vector)[:, None] * (A * C) + (tl.arange(0, RB * A) % A)[:, None] * C \
            + tl.arange(0, C)[None, :]
        return block // blocks_per_vector, offset, block < num_blocks_total


@triton.jit
def _rotate_kernel(
    x_ptr,  # [T, n]
    signs_ptr,  # [n] float32
    out_ptr,  # [T, n] out
    size,  # n
    num_blocks_total,  # T n / B
    stride_x,
    stride_o,
    A: tl.constexpr, C: tl.constexpr, BLOCK_ROWS: tl.constexpr, RB: tl.constexpr, PRECISION: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    """out = H(signs * x) blockwise. Grid: (blocks / BLOCK_ROWS,) for B <= 128, else (blocks,)."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()  # early: the product after it preloads its codes meanwhile
    row, offset, row_ok = _block_offsets(tl.program_id(0), size // (A * C), num_blocks_total, A, C, BLOCK_ROWS, RB)
    valid = row_ok[:, None] & (offset >= 0)
    x = tl.load(x_ptr + row.to(tl.int64)[:, None] * stride_x + offset, mask=valid, other=0.0).to(tl.float32)
    y = _walsh(x * tl.load(signs_ptr + offset, mask=valid, other=0.0), A, C, RB, PRECISION)
    tl.store(out_ptr + row.to(tl.int64)[:, None] * stride_o + offset, y.to(out_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _swiglu_between_kernel(
    y_ptr,  # [R, 2F] rotated gate (0..F-1) and up (F..2F-1)
    left_signs_ptr,  # [2F] w13's row signs
    right_signs_ptr,  # [F] w2's column signs
    out_ptr,  # [R, F] out: the rotated hidden
    intermediate,  # F
    num_blocks_total,  # R F / B
    stride_y,
    stride_o,
    A: tl.constexpr, C: tl.constexpr, BLOCK_ROWS: tl.constexpr, RB: tl.constexpr, PRECISION: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    """out = T_R2(silu(g) * u), (g, u) = T_L13^T y, block by block (gate block i and up block i, then hidden
    block i: the rotations never cross a block, and no block straddles gate and up)."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()  # early: the down product preloads its codes meanwhile
    row, offset, row_ok = _block_offsets(tl.program_id(0), intermediate // (A * C), num_blocks_total, A, C,
                                         BLOCK_ROWS, RB)
    valid = row_ok[:, None] & (offset >= 0)
    base = y_ptr + row.to(tl.int64)[:, None] * stride_y + offset
    gate = _walsh(tl.load(base, mask=valid, other=0.0).to(tl.float32), A, C, RB, PRECISION)
    up = _walsh(tl.load(base + intermediate, mask=valid, other=0.0).to(tl.float32), A, C, RB, PRECISION)
    gate = gate * tl.load(left_signs_ptr + offset, mask=valid, other=0.0)
    up = up * tl.load(left_signs_ptr + intermediate + offset, mask=valid, other=0.0)
    hidden = gate * tl.sigmoid(gate) * up
    hidden = _walsh(hidden * tl.load(right_signs_ptr + offset, mask=valid, other=0.0), A, C, RB, PRECISION)
    tl.store(out_ptr + row.to(tl.int64)[:, None] * stride_o + offset, hidden.to(out_ptr.dtype.element_ty),
             mask=valid)


@triton.jit
def _unrotate_sum_kernel(
    z_ptr,  # [T * TOP_K, n]: each token's TOP_K rows, in pair order
    ids_ptr,  # [T * TOP_K] expert ids (HAS_IDS): a row whose id is outside [0, E) is left out
    signs_ptr,  # [n] float32
    out_ptr,  # [T, n] out
    num_experts,
    size,  # n
    num_blocks_total,  # T n / B
    stride_z,
    stride_o,
    TOP_K: tl.constexpr, HAS_IDS: tl.constexpr,
    A: tl.constexpr, C: tl.constexpr, BLOCK_ROWS: tl.constexpr, RB: tl.constexpr, PRECISION: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    """out[t] = signs * H(sum over j = 0..TOP_K-1, in that order, of z[t TOP_K + j]) blockwise, in fp32."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
    token, offset, row_ok = _block_offsets(tl.program_id(0), size // (A * C), num_blocks_total, A, C, BLOCK_ROWS, RB)
    valid = row_ok[:, None] & (offset >= 0)
    total = tl.zeros(offset.shape, dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pair = token * TOP_K + j
        # the row is loaded whatever its id (it exists, written or not) and dropped by a select: the id's load
        # and the row's then make one round trip, not two
        z = tl.load(z_ptr + pair.to(tl.int64)[:, None] * stride_z + offset, mask=valid, other=0.0).to(tl.float32)
        if HAS_IDS:
            expert = tl.load(ids_ptr + pair, mask=row_ok, other=-1)
            z = tl.where(((expert >= 0) & (expert < num_experts))[:, None], z, 0.0)
        total += z
    y = _walsh(total, A, C, RB, PRECISION) * tl.load(signs_ptr + offset, mask=valid, other=0.0)
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(out_ptr + token.to(tl.int64)[:, None] * stride_o + offset, y.to(out_ptr.dtype.element_ty), mask=valid)


# Blocks stacked per program (RB) and warps, per kernel, where a launch has at least STACK_FROM_BLOCKS blocks
# of more than 128 values: a program then builds its Hadamard matrices once for RB blocks and multiplies them
# in dots of RB times the rows. Fewer blocks (a decode step's few rows) keep one block a program, whose chain
# is shorter. Run 97 (bench/experiments/rotation_stacks.py, 8192 tokens of v4-shape, against one block a
# program at 8 warps): rotate 114 against 203 us, swiglu_between 948 against 1306, unrotate_sum 189 against 240.
STACKED = {"rotate": (2, 4), "swiglu_between": (2, 4), "unrotate_sum": (2, 8)}
STACK_FROM_BLOCKS = 1024


def _grid_and_meta(rows: int, size: int, block: int, kind: str) -> tuple[tuple[int], dict]:
    first, second = split(block)
    blocks = rows * size // block
    stacked, warps = STACKED[kind] if first > 1 and blocks >= STACK_FROM_BLOCKS else (1, NUM_WARPS)
    programs = triton.cdiv(blocks, BLOCK_ROWS) if first == 1 else triton.cdiv(blocks, stacked)
    return (max(programs, 1),), dict(A=first, C=second, BLOCK_ROWS=BLOCK_ROWS, RB=stacked,
                                     PRECISION=dot_precision(torch.float32), num_warps=warps)


def rotate_rows(x: torch.Tensor, signs: torch.Tensor, block: int, out: torch.Tensor, pdl: dict) -> torch.Tensor:
    """out [T, n] = T(x) = blockwise Hadamard of signs * x, row by row (one launch)."""
    rows, size = x.shape
    if rows:
        grid, meta = _grid_and_meta(rows, size, block, "rotate")
        _rotate_kernel[grid](x, signs, out, size, rows * size // block, x.stride(0), out.stride(0), **meta, **pdl)
        launches.record("trellis.rotate", kernel=_rotate_kernel)
    return out


def swiglu_between(y: torch.Tensor, left_signs: torch.Tensor, right_signs: torch.Tensor, block: int,
                   out: torch.Tensor, pdl: dict) -> torch.Tensor:
    """out [R, F] = T_R2(silu(g) * u) with (g, u) = T_L13^T y, y [R, 2F] (one launch)."""
    rows, intermediate = out.shape
    if rows:
        grid, meta = _grid_and_meta(rows, intermediate, block, "swiglu_between")
        _swiglu_between_kernel[grid](y, left_signs, right_signs, out, intermediate, rows * intermediate // block,
                                     y.stride(0), out.stride(0), **meta, **pdl)
        launches.record("trellis.swiglu_between", kernel=_swiglu_between_kernel)
    return out


def unrotate_sum(z: torch.Tensor, ids: torch.Tensor | None, num_experts: int, top_k: int, signs: torch.Tensor,
                 block: int, out: torch.Tensor, pdl: dict) -> torch.Tensor:
    """out [T, n] = T^T(sum of each token's top_k rows of z [T top_k, n]), rows with an id outside [0, E)
    left out (ids None: every row counts). One launch."""
    tokens, size = out.shape
    if tokens:
        grid, meta = _grid_and_meta(tokens, size, block, "unrotate_sum")
        _unrotate_sum_kernel[grid](z, z if ids is None else ids, signs, out, num_experts, size, tokens * size // block,
                                   z.stride(0), out.stride(0), TOP_K=top_k, HAS_IDS=ids is not None, **meta, **pdl)
        launches.record("trellis.unrotate_sum", kernel=_unrotate_sum_kernel)
    return out
