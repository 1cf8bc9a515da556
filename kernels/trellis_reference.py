"""Trellis-coded weights (the QTIP family): the codes, the packed layout, the Hadamard rotations and
the torch reference decode that every trellis kernel must match bit for bit.

Shape legend: E = experts, N = output rows of a matrix (w13: 2F, w2: D), C = its input columns
(w13: D, w2: F), S = trellis steps per tile sequence (256 / V), W = 32-bit words per tile (8 K).

The code (`TrellisCode`). A bitshift trellis of L = 16 state bits walks a tile's 256 weights V at a
time; each step shifts K*V fresh bits into the state:

    s[t] = ((s[t-1] << K*V) | fresh[t]) mod 2^L,       t = 1 .. S-1

and the V weights of step t are the code function of s[t]. The trellis is tail-biting: the packed
stream of a tile is exactly 256*K bits, read circularly, and state t is the L-bit window that starts at
stream bit t*K*V (so the last states wrap onto the first bits: s[S-1]'s low L-K*V bits are s[0]'s high
ones). K = 2, 3, 4 bits per weight.

The code functions, exactly (integers are unsigned 32-bit, arithmetic mod 2^32; every float op is
named; nothing else rounds). Each returns the code *value*; the weight is value * scale (below).
    1mad  (V = 1)  x = s * 34038481 + 76625530
                   value = float32((x & 255) + ((x >> 8) & 255) + ((x >> 16) & 255) + (x >> 24) - 510)
                   an integer in [-510, 510], converted exactly (the paper divides by 147.8 here;
                   that constant lives in the scale instead, so no rounding happens in the decode)
    3inst (V = 1)  x = s * 89226354 + 64248484;  m = (x & 0x8FFF8FFF) ^ 0x3B603B60
                   value = float32(fp16_bits(m >> 16)) + float32(fp16_bits(m & 0xFFFF))
                   one fp32 add, which is exact: both halves are fp16 of magnitude in [2^-3, 2)
                   (the paper adds in fp16, which rounds)
    hyb   (V = 2)  x = s * (s + 1);  index = (x >> 6) & 511  (Q = 9 bits);  flip = (x >> 15) & 1
                   value = (table[index, 0] * (1 - 2 * flip), table[index, 1]): a 2-D vector of the
                   float32 table [512, 2] the checkpoint stores; the sign flip is exact

The packed layout of one tile (`pack_states`, `unpack_states`): W = 8 K int32 words holding the
256 K stream bits, most significant bit first: stream bit b is bit (31 - b % 32) of word b // 32 (read
as unsigned). State t, with p = t*K*V, j = p // 32, r = p % 32:

    window64 = (word[j] << 32) | word[(j + 1) % W]          s[t] = (window64 >> (48 - r)) & 0xFFFF
    in 32-bit ops: r == 0 ? word[j] >> 16 : ((word[j] << r) | (word[(j + 1) % W] >> (32 - r))) >> 16

(a shift by 32 is undefined in 32-bit ISAs: the r == 0 case must be its own branch).

Tiles. A matrix [N, C] (N, C multiples of 16) is cut into 16 x 16 tiles; tile (i, j) holds rows
16i..16i+15 and columns 16j..16j+15, and its weight (r, c) is sequence position 16 r + c (row-major),
weight 16 r + c of step (16 r + c) // V. The codes of a stack of E matrices are int32
[E, N/16, C/16, W]: tiles in row-major order, each tile's words contiguous.

The weight. The decoded (rotated) weight is `value * scale[e, n]` in one fp32 multiply (scales are
float32 [E, N], one per output row); a bf16 weight is that product rounded to nearest-even. The
matrix the model multiplies by is the rotated one turned back (Hadamard incoherence processing):

    W = T_L^T  W_rot  T_R,     T(x) = blockwise_hadamard(signs * x)

with T_L over the N rows and T_R over the C columns, each a diagonal of +-1 signs (drawn from a
recorded seed by splitmix64, `hadamard_signs`) followed by a normalised Walsh-Hadamard transform on
contiguous blocks. The block of a side is the largest power of two dividing its size, so a dimension
that is not a power of two (F = 48: blocks of 16; 2880 = 45 x 64: blocks of 64) is rotated within
blocks: an orthogonal transform, cheaper than the paper's Hadamard matrices of sizes 12, 20, ...,
weaker for the smallest blocks. w13's rows take the block of F, so no block straddles gate and up.
A kernel computes W x as unrotate_L(W_rot @ rotate_R(x)) and never forms W.

Does: codes, packing, decode, rotations, dequantize. Does not: choose codes (that is the Viterbi
search in engine.trellis_quantizer), read or write files, know models.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

STATE_BITS = 16  # L
TILE = 16  # a tile is TILE x TILE weights
SEQUENCE = TILE * TILE  # T = 256 weights per trellis sequence
HYB_INDEX_BITS = 9  # Q: the hyb table has 2^Q rows
BITS_PER_WEIGHT = (2, 3, 4)  # K
CODES = {"1mad": 1, "3inst": 1, "hyb": 2}  # code -> V, the weights one state decodes to

_MASK32 = (1 << 32) - 1


@dataclass(frozen=True)
class TrellisCode:
    """Which trellis code a matrix is in: the code function, K bits per weight, V weights per step and
    L state bits. Raises ValueError for a combination this module does not define."""

    code: str
    bits_per_weight: int  # K
    weights_per_step: int  # V
    state_bits: int = STATE_BITS  # L

    def __post_init__(self) -> None:
        if self.code not in CODES:
            raise ValueError(f"unknown trellis code {self.code!r}: choose one of {', '.join(CODES)}")
        if self.bits_per_weight not in BITS_PER_WEIGHT:
            raise ValueError(f"K={self.bits_per_weight} bits per weight is not one of "
                             f"{', '.join(map(str, BITS_PER_WEIGHT))}")
        if self.weights_per_step != CODES[self.code]:
            raise ValueError(f"code {self.code} decodes V={CODES[self.code]} weights per step, not "
                             f"V={self.weights_per_step}")
        if self.state_bits != STATE_BITS:
            raise ValueError(f"L={self.state_bits} state bits: only L={STATE_BITS} is defined")

    @classmethod
    def of(cls, code: str, bits_per_weight: int) -> "TrellisCode":
        """The code with its own V (a ValueError for an unknown code)."""
        if code not in CODES:
            raise ValueError(f"unknown trellis code {code!r}: choose one of {', '.join(CODES)}")
        return cls(code, bits_per_weight, CODES[code])

    @property
    def K(self) -> int:
        return self.bits_per_weight

    @property
    def V(self) -> int:
        return self.weights_per_step

    @property
    def L(self) -> int:
        return self.state_bits

    @property
    def step_bits(self) -> int:
        """K * V: the fresh bits each trellis step shifts in."""
        return self.bits_per_weight * self.weights_per_step

    @property
    def steps(self) -> int:
        """S: trellis steps per tile sequence."""
        return SEQUENCE // self.weights_per_step

    @property
    def words_per_tile(self) -> int:
        """W: int32 words of one tile's packed stream (256 K bits)."""
        return SEQUENCE * self.bits_per_weight // 32

    @property
    def needs_table(self) -> bool:
        return self.code == "hyb"

    def describe(self) -> str:
        return f"trellis {self.code} K={self.K} V={self.V} L={self.L}"


# --------------------------------------------------------------------------------------------
# Code functions: integer work on int64 tensors holding unsigned 32-bit values
# --------------------------------------------------------------------------------------------

def _fp16_bits_to_float32(bits: torch.Tensor) -> torch.Tensor:
    """int64 [...] holding 16-bit patterns -> their fp16 values as float32 (exact)."""
    signed = torch.where(bits >= 1 << 15, bits - (1 << 16), bits).to(torch.int16)
    return signed.view(torch.float16).to(torch.float32)


def code_values(code: str, states: torch.Tensor, table: torch.Tensor | None = None) -> torch.Tensor:
    """states (any int tensor of L-bit states) -> float32 [..., V], the code values of each state.

    `table` float32 [512, 2] is required for hyb and ignored otherwise."""
    s = states.to(torch.int64) & _MASK32
    if code == "1mad":
        x = (s * 34038481 + 76625530) & _MASK32
        total = (x & 255) + ((x >> 8) & 255) + ((x >> 16) & 255) + ((x >> 24) & 255) - 510
        return total.to(torch.float32).unsqueeze(-1)
    if code == "3inst":
        x = (s * 89226354 + 64248484) & _MASK32
        m = (x & 0x8FFF8FFF) ^ 0x3B603B60
        return (_fp16_bits_to_float32(m >> 16) + _fp16_bits_to_float32(m & 0xFFFF)).unsqueeze(-1)
    if code == "hyb":
        if table is None or tuple(table.shape) != (1 << HYB_INDEX_BITS, 2) or table.dtype != torch.float32:
            raise ValueError(f"code hyb needs a float32 table of shape [{1 << HYB_INDEX_BITS}, 2]")
        x = (s * (s + 1)) & _MASK32
        index = (x >> (15 - HYB_INDEX_BITS)) & ((1 << HYB_INDEX_BITS) - 1)
        flip = (x >> 15) & 1
        rows = table.to(states.device)[index]  # [..., 2]
        first = torch.where(flip.bool(), -rows[..., 0], rows[..., 0])
        return torch.stack([first, rows[..., 1]], dim=-1)
    raise ValueError(f"unknown trellis code {code!r}: choose one of {', '.join(CODES)}")


def state_values(code: TrellisCode, table: torch.Tensor | None = None,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 [2^L, V]: the code values of every state (the decoder's whole codebook)."""
    return code_values(code.code, torch.arange(1 << code.L, device=device), table)


def default_hyb_table() -> torch.Tensor:
    """float32 [512, 2]: the table a checkpoint stores when the quantizer is given none. A golden-angle
    spiral with Gaussian radii: row i at radius sqrt(-2 ln(1 - (i + 1/2) / 512)) (the 2-D standard
    normal's radius quantile) and angle i * pi (3 - sqrt 5), folded onto the half plane v0 >= 0 (the
    code's sign flip mirrors v0, completing a symmetric set of 1024 points). Closed form, computed in
    float64: on N(0, 1) data it measures 0.0695 per weight at K = 2 where a k-means table of the plane
    measured 0.0716 (bench/trellis_quality.py's setup, 48 sequences)."""
    index = torch.arange(1 << HYB_INDEX_BITS, dtype=torch.float64)
    radius = torch.sqrt(-2.0 * torch.log1p(-(index + 0.5) / (1 << HYB_INDEX_BITS)))
    angle = index * (math.pi * (3.0 - math.sqrt(5.0)))
    return torch.stack([(radius * torch.cos(angle)).abs(), radius * torch.sin(angle)], dim=1).to(torch.float32)


def code_rms(code: TrellisCode, table: torch.Tensor | None = None) -> float:
    """Root mean square of the code values over all 2^L states: what a unit-variance row's scale divides."""
    return float(state_values(code, table).double().pow(2).mean().sqrt())


# --------------------------------------------------------------------------------------------
# Packing: a tile's S states <-> its W int32 words
# --------------------------------------------------------------------------------------------

def _to_int32_bits(values: torch.Tensor) -> torch.Tensor:
    """int64 holding unsigned 32-bit values -> int32 with the same bits."""
    return torch.where(values >= 1 << 31, values - (1 << 32), values).to(torch.int32)


def unpack_states(words: torch.Tensor, code: TrellisCode) -> torch.Tensor:
    """int32 [..., W] -> int64 [..., S]: state t is the L-bit window at stream bit t*K*V (circular)."""
    if words.shape[-1] != code.words_per_tile:
        raise ValueError(f"{code.describe()}: a tile has {code.words_per_tile} words, got {words.shape[-1]}")
    w = words.to(torch.int64) & _MASK32
    offsets = torch.arange(code.steps, device=words.device) * code.step_bits  # [S]
    j, r = offsets // 32, offsets % 32
    high, low = w[..., j], w[..., (j + 1) % code.words_per_tile]  # [..., S]
    # (high << 32) may wrap the sign of int64; the bits kept (r .. r+L of the window) lie below bit 64
    window = (high << 32) | low
    return (window >> (64 - code.L - r)) & ((1 << code.L) - 1)


def pack_states(states: torch.Tensor, code: TrellisCode) -> torch.Tensor:
    """int [..., S] states of valid tail-biting paths -> int32 [..., W]. Raises ValueError when some
    state does not follow from the one before it (or the last does not wrap onto the first)."""
    if states.shape[-1] != code.steps:
        raise ValueError(f"{code.describe()}: a tile has {code.steps} steps, got {states.shape[-1]}")
    s = states.to(torch.int64)
    total = SEQUENCE * code.K
    b = torch.arange(total, device=states.device)
    # stream bit b comes from state 0 (its bit L-1-b) for b < L, else from the fresh bits of state t
    later = (b - code.L).clamp(min=0)
    step = torch.where(b < code.L, torch.zeros_like(b), later // code.step_bits + 1)
    bit = torch.where(b < code.L, code.L - 1 - b, code.step_bits - 1 - later % code.step_bits)
    bits = (s[..., step] >> bit) & 1  # [..., 256 K]
    weights = (1 << (31 - torch.arange(32, device=states.device)))  # [32]
    words = (bits.view(*bits.shape[:-1], code.words_per_tile, 32) * weights).sum(-1)
    packed = _to_int32_bits(words)
    if not torch.equal(unpack_states(packed, code), s):
        raise ValueError(f"{code.describe()}: the states are not a tail-biting bitshift path (a state does not "
                         f"shift in from the one before it)")
    return packed


def decode_tiles(words: torch.Tensor, code: TrellisCode, table: torch.Tensor | None = None) -> torch.Tensor:
    """int32 [..., W] -> float32 [..., 256]: each tile's code values in sequence order (row-major)."""
    values = code_values(code.code, unpack_states(words, code), table)  # [..., S, V]
    return values.reshape(*words.shape[:-1], SEQUENCE)


def tiles_to_matrix(tiles: torch.Tensor) -> torch.Tensor:
    """[..., N/16, C/16, 256] sequence-ordered tiles -> [..., N, C]."""
    *lead, row_tiles, column_tiles, _ = tiles.shape
    blocks = tiles.reshape(*lead, row_tiles, column_tiles, TILE, TILE)
    return blocks.transpose(-3, -2).reshape(*lead, row_tiles * TILE, column_tiles * TILE)


def matrix_to_tiles(matrix: torch.Tensor) -> torch.Tensor:
    """[..., N, C] (N, C multiples of 16) -> [..., N/16, C/16, 256] in sequence order."""
    *lead, rows, columns = matrix.shape
    if rows % TILE or columns % TILE:
        raise ValueError(f"a trellis matrix needs both sides multiples of {TILE}, got [{rows}, {columns}]")
    blocks = matrix.reshape(*lead, rows // TILE, TILE, columns // TILE, TILE).transpose(-3, -2)
    return blocks.reshape(*lead, rows // TILE, columns // TILE, SEQUENCE)


# --------------------------------------------------------------------------------------------
# Hadamard incoherence processing
# --------------------------------------------------------------------------------------------

def hadamard_block(size: int) -> int:
    """The rotation block of a side of `size`: the largest power of two dividing it."""
    if size < 1:
        raise ValueError(f"a rotated side needs size >= 1, got {size}")
    return size & -size


def hadamard_signs(seed: int, size: int) -> torch.Tensor:
    """float32 [size] of +-1: sign i is -1 when the top bit of splitmix64(seed + (i + 1) * golden) is set,
    with golden = 0x9E3779B97F4A7C15, all arithmetic mod 2^64. A pure function of (seed, i), so a
    checkpoint records only the seed."""
    with np.errstate(over="ignore"):
        z = np.uint64(seed & 0xFFFFFFFFFFFFFFFF) + (np.arange(size, dtype=np.uint64) + np.uint64(1)) \
            * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    negative = (z >> np.uint64(63)).astype(np.float32)
    return torch.from_numpy(1.0 - 2.0 * negative)


def _walsh_hadamard(x: torch.Tensor, block: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Normalised Walsh-Hadamard transform (Sylvester order) of each contiguous `block` of the last
    dimension, in `dtype` butterflies (float32; float64 for an error's ground truth); its own inverse."""
    if block & (block - 1) or x.shape[-1] % block:
        raise ValueError(f"hadamard block {block} must be a power of two dividing {x.shape[-1]}")
    lead, size = x.shape[:-1], x.shape[-1]
    y = x.to(dtype).reshape(-1, size // block, block)
    half = 1
    while half < block:
        pairs = y.view(y.shape[0], y.shape[1], block // (2 * half), 2, half)
        first, second = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack([first + second, first - second], dim=-2).reshape(y.shape)
        half *= 2
    return (y * (1.0 / math.sqrt(block))).reshape(*lead, size)


def rotate(x: torch.Tensor, signs: torch.Tensor, block: int) -> torch.Tensor:
    """T x along the last dimension: signs first, then the blockwise Hadamard. float32."""
    return _walsh_hadamard(x.to(torch.float32) * signs.to(x.device), block)


def unrotate(y: torch.Tensor, signs: torch.Tensor, block: int) -> torch.Tensor:
    """T^T y along the last dimension (the inverse of `rotate`): the Hadamard, then the signs. float32."""
    return _walsh_hadamard(y, block) * signs.to(y.device)


# --------------------------------------------------------------------------------------------
# A packed matrix stack
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TrellisMatrix:
    """One trellis-coded stack of E expert matrices [E, N, C] (the engine's w13 or w2 layout): what a
    trellis MoE arm receives where a bf16 arm receives the weight tensor.

    codes        int32 [E, N/16, C/16, W]  the packed tiles (module docstring)
    scales       float32 [E, N]            per output row of the rotated matrix
    table        float32 [512, 2] | None   hyb's code table (None for the computed codes)
    left_signs   float32 [N]  +-1          T_L's signs (from left_seed), shared by the E experts
    right_signs  float32 [C]  +-1          T_R's signs (from right_seed), shared by the E experts
    left_block, right_block                the Hadamard blocks of each side
    signed_table float32 [1024, 2] | None  hyb's table with the flip folded in (`signed_hyb_table`), made
                                           from `table` at construction (the unrolled GEMV reads it)

    The signs are shared along E so an arm rotates each token's input once for all its experts (and
    can sum w2's outputs in the rotated basis before one unrotation)."""

    code: TrellisCode
    codes: torch.Tensor
    scales: torch.Tensor
    table: torch.Tensor | None
    left_signs: torch.Tensor
    right_signs: torch.Tensor
    left_block: int
    right_block: int
    left_seed: int
    right_seed: int

    signed_table: torch.Tensor | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_matrix(self)
        # made once here, never inside a kernel launch (a CUDA-graph capture would leave it unwritten)
        object.__setattr__(self, "signed_table", None if self.table is None else signed_hyb_table(self.table))

    @property
    def shape(self) -> tuple[int, int, int]:
        """(E, N, C): the dense stack this decodes to."""
        experts, row_tiles, column_tiles, _ = self.codes.shape
        return experts, row_tiles * TILE, column_tiles * TILE

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def bits_per_weight(self) -> float:
        """Bits per weight including the scales (K + 32 / C)."""
        _, rows, columns = self.shape
        return 8 * packed_bytes_per_expert(self.code, rows, columns) / (rows * columns)

    @property
    def bytes_per_expert(self) -> int:
        _, rows, columns = self.shape
        return packed_bytes_per_expert(self.code, rows, columns)

    def to(self, device: torch.device | str) -> "TrellisMatrix":
        move = (lambda tensor: None if tensor is None else tensor.to(device))
        return TrellisMatrix(self.code, move(self.codes), move(self.scales), move(self.table), move(self.left_signs),
                             move(self.right_signs), self.left_block, self.right_block, self.left_seed,
                             self.right_seed)

    def expert(self, index: int) -> "TrellisMatrix":
        """The stack of the one expert `index` (views, E = 1)."""
        return TrellisMatrix(self.code, self.codes[index:index + 1], self.scales[index:index + 1], self.table,
                             self.left_signs, self.right_signs, self.left_block, self.right_block, self.left_seed,
                             self.right_seed)


def packed_bytes_per_expert(code: TrellisCode, rows: int, columns: int) -> int:
    """Bytes one expert's [rows, columns] matrix occupies and a kernel reads: K bits per weight of codes
    plus a float32 scale per row (signs and the hyb table are per layer, a few KB, not counted)."""
    return rows * columns * code.K // 8 + 4 * rows


def signed_hyb_table(table: torch.Tensor) -> torch.Tensor:
    """float32 [1024, 2] from hyb's [512, 2] table: row f * 512 + i is (table[i, 0] * (1 - 2 f), table[i, 1]),
    the code's sign flip taken ahead of time (exact), so a kernel reads a state's vector at the ten bits
    (flip, index) with no sign work. Lives beside `table` on a TrellisMatrix (`signed_table`)."""
    return torch.cat([table, table * torch.tensor([-1.0, 1.0], device=table.device)]).contiguous()


def check_matrix(matrix: TrellisMatrix) -> None:
    """ValueError naming the field when a TrellisMatrix's tensors do not fit its code and each other."""
    code = matrix.code
    codes = matrix.codes
    if codes.dtype != torch.int32 or codes.dim() != 4 or codes.shape[-1] != code.words_per_tile:
        raise ValueError(f"codes must be int32 [E, N/16, C/16, {code.words_per_tile}] for {code.describe()}, got "
                         f"{str(codes.dtype).removeprefix('torch.')} {list(codes.shape)}")
    experts, row_tiles, column_tiles, _ = codes.shape
    rows, columns = row_tiles * TILE, column_tiles * TILE
    expected = {"scales": ((experts, rows), torch.float32), "left_signs": ((rows,), torch.float32),
                "right_signs": ((columns,), torch.float32)}
    for name, (shape, dtype) in expected.items():
        tensor = getattr(matrix, name)
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise ValueError(f"{name} must be {str(dtype).removeprefix('torch.')} {list(shape)} for codes "
                             f"{list(codes.shape)}, got {str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}")
    if code.needs_table:
        table = matrix.table
        if table is None or tuple(table.shape) != (1 << HYB_INDEX_BITS, 2) or table.dtype != torch.float32:
            raise ValueError(f"code hyb needs table float32 [{1 << HYB_INDEX_BITS}, 2], got "
                             f"{None if table is None else (table.dtype, list(table.shape))}")
    for side, size, block in (("left", rows, matrix.left_block), ("right", columns, matrix.right_block)):
        if block < 1 or block & (block - 1) or size % block:
            raise ValueError(f"{side}_block {block} is not a power of two dividing {size}")


def dequantize_rotated(matrix: TrellisMatrix) -> torch.Tensor:
    """float32 [E, N, C]: the rotated weights value * scale (one fp32 multiply each): what a kernel's
    decode must reproduce bit for bit (rounded to bf16 where it feeds a bf16 product)."""
    values = tiles_to_matrix(decode_tiles(matrix.codes, matrix.code, matrix.table))  # [E, N, C]
    return values * matrix.scales.unsqueeze(-1)


def dequantize(matrix: TrellisMatrix, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[E, N, C] in `dtype`: the weights in the model's basis, W = T_L^T W_rot T_R (float32 rotations)."""
    rotated = dequantize_rotated(matrix)
    rows_back = unrotate(rotated, matrix.right_signs, matrix.right_block)  # W_rot T_R, row by row
    both = unrotate(rows_back.transpose(-1, -2), matrix.left_signs, matrix.left_block).transpose(-1, -2)
    return both.contiguous().to(dtype)


def trellis_linear_reference(x: torch.Tensor, matrix: TrellisMatrix, expert: int) -> torch.Tensor:
    """x [T, C] -> [T, N] = x @ W[expert]^T the way a kernel computes it: rotate x, multiply by the
    rotated weights, unrotate the outputs. float32."""
    rotated_x = rotate(x, matrix.right_signs, matrix.right_block)  # [T, C]
    weights = dequantize_rotated(matrix.expert(expert))[0]  # [N, C]
    return unrotate(rotated_x @ weights.t(), matrix.left_signs, matrix.left_block)


def moe_trellis_reference(
    x: torch.Tensor,  # [T, D]
    w13: TrellisMatrix,  # [E, 2F, D] rows 0..F-1 gate, F..2F-1 up
    w2: TrellisMatrix,  # [E, D, F]
    topk_ids: torch.Tensor,  # [T, k] int
    topk_weights: torch.Tensor,  # [T, k] float
) -> torch.Tensor:  # [T, D]
    """kernels.reference.moe_reference on the dequantized experts: each woken expert's w13 and w2 are
    decoded and turned back to the model's basis (`dequantize`, float32), then the same SwiGLU walk.
    What a trellis arm must sit on; slow (a decode per woken expert per call)."""
    T, D = x.shape
    f = w13.shape[1] // 2
    out = torch.zeros(T, D, dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1).long()  # [T*k]
    flat_weights = topk_weights.reshape(-1).float()  # [T*k]
    flat_tokens = torch.arange(T, device=x.device).repeat_interleave(topk_ids.shape[1])  # [T*k]
    for expert in torch.unique(flat_ids).tolist():
        pair = (flat_ids == expert).nonzero(as_tuple=True)[0]
        tokens = flat_tokens[pair]
        gate_up = x[tokens].float() @ dequantize(w13.expert(expert))[0].t()  # [P, 2F]
        hidden = torch.nn.functional.silu(gate_up[:, :f]) * gate_up[:, f:]  # [P, F]
        down = hidden @ dequantize(w2.expert(expert))[0].t()  # [P, D]
        out.index_add_(0, tokens, down * flat_weights[pair, None])
    return out.to(x.dtype)


def random_trellis_matrix(experts: int, rows: int, columns: int, code: TrellisCode, *, seed: int = 0,
                          device: torch.device | str = "cpu", row_block: int | None = None,
                          table: torch.Tensor | None = None) -> TrellisMatrix:
    """A random stack [E, rows, columns] for kernel tests and timing: every packed stream is a valid
    tail-biting path, so uniform random words are valid codes; scales make each decoded weight about
    N(0, 1/columns), like engine.model's random weights. Drawn on `device` (from a generator seeded by
    `seed`), so a v4-shape stack never passes through the host. `row_block`: the left Hadamard block
    (w13: hadamard_block(F)); default hadamard_block(rows)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    shape = (experts, rows // TILE, columns // TILE, code.words_per_tile)
    codes = torch.randint(-(1 << 31), (1 << 31) - 1, shape, generator=generator, device=device, dtype=torch.int64)
    table = (default_hyb_table() if table is None else table) if code.needs_table else None
    rms = code_rms(code, table)
    scales = torch.full((experts, rows), 1.0 / (rms * math.sqrt(columns)), dtype=torch.float32, device=device)
    left_seed, right_seed = 2 * seed + 1, 2 * seed + 2
    return TrellisMatrix(code, codes.to(torch.int32), scales, None if table is None else table.to(device),
                         hadamard_signs(left_seed, rows).to(device), hadamard_signs(right_seed, columns).to(device),
                         hadamard_block(rows) if row_block is None else row_block, hadamard_block(columns),
                         left_seed, right_seed)


def moe_trellis_rotated(
    x: torch.Tensor,  # [T, D]
    w13: TrellisMatrix,  # [E, 2F, D]
    w2: TrellisMatrix,  # [E, D, F]
    topk_ids: torch.Tensor,  # [T, k] int
    topk_weights: torch.Tensor,  # [T, k] float
) -> torch.Tensor:  # [T, D]
    """The same function as `moe_trellis_reference`, computed the way a trellis kernel computes it: each
    token's input rotated once (w13's signs and blocks are shared by the experts), the products taken with
    the rotated weights, w13's outputs unrotated before the SwiGLU, the hidden rotated for w2, the k
    weighted outputs summed in w2's rotated basis and unrotated once. float32 throughout; a second path to
    the reference's function, with other roundings (tests/test_trellis_codes.py bounds the difference)."""
    T, D = x.shape
    f = w13.shape[1] // 2
    rotated_x = rotate(x.float(), w13.right_signs, w13.right_block)  # [T, D] in w13's input basis
    out_rotated = torch.zeros(T, D, dtype=torch.float32, device=x.device)  # in w2's output basis
    flat_ids = topk_ids.reshape(-1).long()  # [T*k]
    flat_weights = topk_weights.reshape(-1).float()  # [T*k]
    flat_tokens = torch.arange(T, device=x.device).repeat_interleave(topk_ids.shape[1])  # [T*k]
    for expert in torch.unique(flat_ids).tolist():
        pair = (flat_ids == expert).nonzero(as_tuple=True)[0]
        tokens = flat_tokens[pair]
        gate_up_rotated = rotated_x[tokens] @ dequantize_rotated(w13.expert(expert))[0].t()  # [P, 2F]
        gate_up = unrotate(gate_up_rotated, w13.left_signs, w13.left_block)
        hidden = torch.nn.functional.silu(gate_up[:, :f]) * gate_up[:, f:]  # [P, F]
        down_rotated = rotate(hidden, w2.right_signs, w2.right_block) @ dequantize_rotated(w2.expert(expert))[0].t()
        out_rotated.index_add_(0, tokens, down_rotated * flat_weights[pair, None])
    return unrotate(out_rotated, w2.left_signs, w2.left_block).to(x.dtype)
