"""The trellis codes, packing, tiling and Hadamard rotations of kernels.trellis_reference, each against a
direct implementation written differently (scalar Python integers, bit strings, dense matrices)."""

from __future__ import annotations

import math
import random
import struct

import pytest
import torch

from kernels.reference import moe_reference
from kernels.trellis_reference import (BITS_PER_WEIGHT, CODES, SEQUENCE, TrellisCode, TrellisMatrix, check_matrix,
                                       code_values, decode_tiles, default_hyb_table, dequantize, dequantize_rotated,
                                       hadamard_block, hadamard_signs, matrix_to_tiles, moe_trellis_reference,
                                       moe_trellis_rotated,
                                       pack_states, packed_bytes_per_expert, random_trellis_matrix, rotate,
                                       tiles_to_matrix, trellis_linear_reference, unpack_states, unrotate)

ALL_CODES = [TrellisCode.of(code, bits) for code in CODES for bits in BITS_PER_WEIGHT]


def _scalar_code(code: str, state: int, table: list[tuple[float, float]] | None) -> tuple[float, ...]:
    """The code functions on Python integers, one state at a time (fp16 through struct)."""
    if code == "1mad":
        x = (state * 34038481 + 76625530) % 2**32
        return (float(sum(x.to_bytes(4, "little")) - 510),)
    if code == "3inst":
        x = (state * 89226354 + 64248484) % 2**32
        m = (x & 0x8FFF8FFF) ^ 0x3B603B60
        high = struct.unpack("<e", (m >> 16).to_bytes(2, "little"))[0]
        low = struct.unpack("<e", (m & 0xFFFF).to_bytes(2, "little"))[0]
        return (high + low,)  # python floats are doubles: the exact sum, which fp32 also holds
    x = (state * (state + 1)) % 2**32
    row = table[(x >> 6) % 512]
    return (-row[0] if (x >> 15) & 1 else row[0], row[1])


@pytest.mark.parametrize("code", list(CODES))
def test_code_values_match_scalar_python(code):
    table = default_hyb_table()
    rows = [tuple(row) for row in table.tolist()]
    rng = random.Random(7)
    states = [0, 1, 2, 65534, 65535, 32768, 32767] + [rng.randrange(1 << 16) for _ in range(400)]
    values = code_values(code, torch.tensor(states), table)
    assert values.dtype == torch.float32 and values.shape == (len(states), CODES[code])
    for state, got in zip(states, values.tolist()):
        assert tuple(got) == _scalar_code(code, state, rows), (code, state)


def test_computed_codes_cover_their_range_and_are_centred():
    # 1MAD: a sum of four bytes minus 510, std about 147.8 (the paper's divisor); 3INST: two fp16 halves
    one_mad = code_values("1mad", torch.arange(1 << 16))[:, 0]
    assert one_mad.min() >= -510 and one_mad.max() <= 510 and abs(float(one_mad.mean())) < 2
    assert abs(float(one_mad.std()) - 147.8) < 2
    three = code_values("3inst", torch.arange(1 << 16))[:, 0]
    assert three.abs().max() < 4 and abs(float(three.mean())) < 0.05


def _bit_string(words: list[int]) -> str:
    return "".join(format(word & 0xFFFFFFFF, "032b") for word in words)


@pytest.mark.parametrize("code", ALL_CODES, ids=lambda c: f"{c.code}-K{c.K}")
def test_unpack_reads_circular_windows_of_the_bit_string(code):
    words = torch.randint(-(1 << 31), (1 << 31) - 1, (3, code.words_per_tile), generator=torch.Generator().manual_seed(3),
                          dtype=torch.int64).to(torch.int32)
    states = unpack_states(words, code)
    assert states.shape == (3, code.steps)
    for tile in range(3):
        stream = _bit_string(words[tile].tolist())
        assert len(stream) == SEQUENCE * code.K
        doubled = stream + stream
        for step in (0, 1, 2, code.steps // 2, code.steps - 2, code.steps - 1):
            start = step * code.step_bits
            assert int(states[tile, step]) == int(doubled[start:start + 16], 2), (tile, step)


@pytest.mark.parametrize("code", ALL_CODES, ids=lambda c: f"{c.code}-K{c.K}")
def test_pack_round_trips_and_refuses_a_broken_path(code):
    words = torch.randint(-(1 << 31), (1 << 31) - 1, (2, 5, code.words_per_tile),
                          generator=torch.Generator().manual_seed(11), dtype=torch.int64).to(torch.int32)
    states = unpack_states(words, code)
    # every state shifts in from the one before it, the first from the last (tail-biting)
    shifted = ((states.roll(1, dims=-1) << code.step_bits) & 0xFFFF) >> code.step_bits
    assert torch.equal(shifted, states >> code.step_bits)
    assert torch.equal(pack_states(states, code), words)
    broken = states.clone()
    broken[1, 3, 7] ^= 1 << 15  # a top bit that did not shift in from step 6
    with pytest.raises(ValueError, match="not a tail-biting"):
        pack_states(broken, code)


def test_tiles_are_row_major_16x16_blocks():
    rows, columns = 48, 32
    matrix = torch.arange(rows * columns, dtype=torch.float32).view(rows, columns)
    tiles = matrix_to_tiles(matrix)
    assert tiles.shape == (3, 2, SEQUENCE)
    for i, j, r, c in ((0, 0, 0, 0), (2, 1, 15, 15), (1, 0, 3, 9), (0, 1, 7, 0)):
        assert tiles[i, j, 16 * r + c] == matrix[16 * i + r, 16 * j + c]
    assert torch.equal(tiles_to_matrix(tiles), matrix)
    with pytest.raises(ValueError, match="multiples of 16"):
        matrix_to_tiles(torch.zeros(40, 32))


def test_decode_places_step_values_in_sequence_order():
    code = TrellisCode.of("hyb", 2)
    table = default_hyb_table()
    words = torch.randint(-(1 << 31), (1 << 31) - 1, (1, code.words_per_tile), dtype=torch.int64).to(torch.int32)
    decoded = decode_tiles(words, code, table)[0]  # [256]
    states = unpack_states(words, code)[0]
    for step in (0, 5, 127):
        pair = code_values("hyb", states[step:step + 1], table)[0]
        assert torch.equal(decoded[2 * step:2 * step + 2], pair)


def _dense_rotation(signs: torch.Tensor, block: int) -> torch.Tensor:
    """T as a dense matrix: blockdiag(H_b / sqrt(b)) @ diag(signs), H_b by Sylvester's construction."""
    hadamard = torch.ones(1, 1, dtype=torch.float64)
    while hadamard.shape[0] < block:
        hadamard = torch.cat([torch.cat([hadamard, hadamard], 1), torch.cat([hadamard, -hadamard], 1)], 0)
    blocks = torch.block_diag(*[hadamard / math.sqrt(block)] * (signs.numel() // block))
    return blocks @ torch.diag(signs.double())


@pytest.mark.parametrize("size", [16, 48, 96, 256, 192])  # powers of two, F = 48 (blocks of 16), 3 x 64 (gpt-oss's
# 2880 = 45 x 64 rotates in the same blocks)
def test_rotation_is_orthogonal_and_matches_the_dense_matrix(size):
    block = hadamard_block(size)
    assert block == size & -size and size % block == 0
    signs = hadamard_signs(1234, size)
    dense = _dense_rotation(signs, block)
    assert torch.allclose(dense @ dense.t(), torch.eye(size, dtype=torch.float64), atol=1e-12)
    x = torch.randn(3, size)
    # fp32 butterflies against a float64 product: log2(block) roundings of order 1e-7 relative
    assert torch.allclose(rotate(x, signs, block).double(), x.double() @ dense.t(), atol=1e-5)
    assert torch.allclose(unrotate(rotate(x, signs, block), signs, block), x, atol=1e-5)


def test_signs_are_a_function_of_the_seed():
    first = hadamard_signs(5, 4096)
    assert torch.equal(first, hadamard_signs(5, 4096))
    assert torch.equal(first[:100], hadamard_signs(5, 100))  # sign i depends on (seed, i) alone
    assert set(first.unique().tolist()) == {-1.0, 1.0}
    assert abs(float(first.sum())) < 4 * math.sqrt(4096)  # balanced
    assert (first != hadamard_signs(6, 4096)).float().mean() > 0.3


def test_dequantize_is_the_rotated_weights_turned_back():
    code = TrellisCode.of("3inst", 3)
    matrix = random_trellis_matrix(2, 96, 48, code, seed=4, row_block=16)
    rotated = dequantize_rotated(matrix).double()  # [E, N, C]
    left = _dense_rotation(matrix.left_signs, matrix.left_block)
    right = _dense_rotation(matrix.right_signs, matrix.right_block)
    expected = left.t() @ rotated @ right
    assert torch.allclose(dequantize(matrix).double(), expected, atol=1e-6 * float(expected.abs().max()))
    x = torch.randn(5, 48)
    through_rotation = trellis_linear_reference(x, matrix, 1)
    assert torch.allclose(through_rotation, x @ dequantize(matrix)[1].t(), atol=1e-5, rtol=1e-4)


def test_rotated_weights_are_value_times_scale_exactly():
    code = TrellisCode.of("1mad", 2)
    matrix = random_trellis_matrix(1, 32, 16, code, seed=2)
    values = tiles_to_matrix(decode_tiles(matrix.codes, code))
    # integer-valued code values times a float32 scale: one rounding, the same in any order
    assert torch.equal(dequantize_rotated(matrix), values * matrix.scales.unsqueeze(-1))
    assert torch.equal(values, values.round())


def test_bytes_and_bits_per_weight():
    for code in ALL_CODES:
        assert packed_bytes_per_expert(code, 4096, 4096) == 4096 * 4096 * code.K // 8 + 4 * 4096
    matrix = random_trellis_matrix(3, 32, 64, TrellisCode.of("hyb", 2))
    assert matrix.shape == (3, 32, 64)
    assert matrix.bytes_per_expert == 32 * 64 * 2 // 8 + 4 * 32
    assert matrix.bits_per_weight == pytest.approx(2 + 32 / 64)


def test_check_matrix_names_the_bad_field():
    good = random_trellis_matrix(2, 32, 32, TrellisCode.of("hyb", 2))
    fields = dict(code=good.code, codes=good.codes, scales=good.scales, table=good.table, left_signs=good.left_signs,
                  right_signs=good.right_signs, left_block=good.left_block, right_block=good.right_block,
                  left_seed=good.left_seed, right_seed=good.right_seed)
    bad = {
        "codes must be int32": dict(codes=good.codes.to(torch.int64)),
        "codes must be": dict(codes=good.codes[..., :8]),
        "scales must be": dict(scales=good.scales[:, :16]),
        "right_signs must be": dict(right_signs=good.right_signs.double()),
        "needs table": dict(table=None),
        "left_block 3": dict(left_block=3),
    }
    for message, change in bad.items():
        with pytest.raises(ValueError, match=message):
            TrellisMatrix(**{**fields, **change})
    check_matrix(good)


@pytest.mark.parametrize("text, problem", [
    (("nope", 2, 1), "unknown trellis code"), (("1mad", 5, 1), "K=5"), (("1mad", 2, 2), "V=1 weights per step"),
    (("hyb", 2, 1), "V=2"),
])
def test_code_refuses_undefined_combinations(text, problem):
    with pytest.raises(ValueError, match=problem):
        TrellisCode(*text)


def test_moe_reference_on_dequantized_experts():
    torch.manual_seed(0)
    E, D, F, T, k = 5, 32, 16, 7, 2  # prime E, F = 16: one Hadamard block
    code = TrellisCode.of("hyb", 2)
    w13 = random_trellis_matrix(E, 2 * F, D, code, seed=1, row_block=hadamard_block(F))
    w2 = random_trellis_matrix(E, D, F, code, seed=2)
    x = torch.randn(T, D)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).to(torch.int32)
    weights = torch.softmax(torch.randn(T, k), dim=-1)
    expected = moe_reference(x, dequantize(w13), dequantize(w2), ids, weights)
    assert torch.allclose(moe_trellis_reference(x, w13, w2, ids, weights), expected, atol=1e-6, rtol=1e-5)


def test_the_rotated_path_computes_the_reference_function():
    torch.manual_seed(1)
    E, D, F, T, k = 3, 64, 48, 9, 2  # F = 48: w13's rows rotate in blocks of 16, w2's columns too
    code = TrellisCode.of("1mad", 3)
    w13 = random_trellis_matrix(E, 2 * F, D, code, seed=3, row_block=hadamard_block(F))
    w2 = random_trellis_matrix(E, D, F, code, seed=4)
    x = torch.randn(T, D)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).to(torch.int32)
    weights = torch.softmax(torch.randn(T, k), dim=-1)
    reference = moe_trellis_reference(x, w13, w2, ids, weights)
    rotated = moe_trellis_rotated(x, w13, w2, ids, weights)
    # float32 both; the Hadamard butterflies and the products' sums round in different orders
    assert (rotated - reference).norm() / reference.norm() < 1e-5
