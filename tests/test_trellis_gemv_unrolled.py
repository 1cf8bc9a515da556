"""The unrolled-steps trellis GEMV (kernels/trellis_gemv.py `_trellis_gemv_steps_kernel`): its 32-bit decode
(kernels/trellis_decode.py `_step_state`, `_step_window`, `_window_values`, `_hyb_hash_rows`;
kernels/trellis_gemv.py `_hyb_octet`) bit for bit against the reference, the signed hyb table, and the arm on both of its column
paths (masked, and the EVEN_COLUMNS walk with no masks) and both hyb table paths (shared memory, L1).

CPU: the interpreter (conftest), which runs the decode's plain forms; GPU (`-m gpu`): the same checks through
the PTX forms (dp4a, lop3, prmt) and the compiled gather.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from kernels import scratch
from kernels import trellis_gemv as gemv_module
from kernels import trellis_reference as reference
from kernels.trellis_decode import (_code_values, _hyb_values_of_rows, _step_state, _step_window,
                                    _unit_words, _window_values, code_id, compiled, unit_geometry)
from kernels.trellis_gemv import GemvSchedule, _hyb_octet, moe_trellis_gemv
from kernels.trellis_reference import TrellisCode, random_trellis_matrix

from test_trellis_kernels import TOLERANCE, expected, make_routing, make_stacks, relative_error

CODES = ("1mad", "3inst", "hyb")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@triton.jit
def _store_pair(out, rows):
    first, second = _hyb_values_of_rows(rows)
    tl.store(out, first)
    tl.store(out + 1, second)


@triton.jit
def _decode_tiles_kernel(codes_ptr, table_ptr, out_ptr, K: tl.constexpr, V: tl.constexpr, G: tl.constexpr,
                         WU: tl.constexpr, CODE: tl.constexpr, PTX: tl.constexpr, GATHER: tl.constexpr):
    """One tile a program: out[tile, 256] = the code values in sequence order, through the unrolled GEMV's
    decode (GATHER: hyb's eight-steps-a-gather path)."""
    tile = tl.program_id(0)
    UT: tl.constexpr = 16 // G
    S: tl.constexpr = 16 * G // V
    unit = tl.arange(0, UT)
    words = codes_ptr + tile * (8 * K)
    w0, w1, w2, after = _unit_words(words + unit * WU, words + ((unit + 1) % UT) * WU, unit >= 0, WU, "")
    out = out_ptr + tile * 256 + unit * (16 * G)  # element e of unit u sits at sequence position 16 G u + e
    if GATHER:
        table = tl.load(table_ptr.to(tl.pointer_type(tl.uint64)) + tl.arange(0, 1024))
        for octet in tl.static_range(S // 8):
            p0, p1, p2, p3, p4, p5, p6, p7 = _hyb_octet(table, w0, w1, w2, after, 8 * octet, K * V, WU)
            _store_pair(out + 16 * octet, p0)
            _store_pair(out + 16 * octet + 2, p1)
            _store_pair(out + 16 * octet + 4, p2)
            _store_pair(out + 16 * octet + 6, p3)
            _store_pair(out + 16 * octet + 8, p4)
            _store_pair(out + 16 * octet + 10, p5)
            _store_pair(out + 16 * octet + 12, p6)
            _store_pair(out + 16 * octet + 14, p7)
    else:
        for step in tl.static_range(S):
            if CODE == 2:  # the L1 path (hyb_table="global")
                first, second = _window_values(_step_window(w0, w1, w2, after, K * V * step, WU), table_ptr, CODE,
                                               PTX)
            else:  # the computed codes: the shared funnel shifts of `_step_state`
                first, second = _code_values(_step_state(w0, w1, w2, after, K * step, WU, PTX), table_ptr, CODE, PTX)
            tl.store(out + V * step, first)
            if V == 2:
                tl.store(out + V * step + 1, second)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("code_name, gather", [("1mad", False), ("3inst", False), ("hyb", False), ("hyb", True)])
def test_unrolled_decode_equals_reference_bit_for_bit(code_name, gather, bits, device):
    code = TrellisCode.of(code_name, bits)
    matrix = random_trellis_matrix(2, 32, 48, code, seed=7 * bits + len(code_name), device=device)
    tiles = matrix.codes.reshape(-1, code.words_per_tile)
    want = reference.decode_tiles(tiles.cpu(), code, None if matrix.table is None else matrix.table.cpu())
    group, words = unit_geometry(bits)
    with scratch.poison_new_buffers():
        got = scratch.empty((tiles.shape[0], 256), torch.float32, device)
        table = matrix.signed_table if code.needs_table else matrix.scales
        _decode_tiles_kernel[(tiles.shape[0],)](tiles, table, got, K=bits, V=code.V, G=group, WU=words,
                                                CODE=code_id(code), PTX=compiled(torch.device(device)), GATHER=gather)
    assert torch.equal(got.cpu(), want)


def test_the_signed_table_folds_the_flip_in_exactly():
    table = reference.default_hyb_table()
    signed = reference.signed_hyb_table(table)
    assert signed.shape == (1024, 2) and signed.dtype == torch.float32
    assert torch.equal(signed[:512], table)
    assert torch.equal(signed[512:, 0], -table[:, 0]) and torch.equal(signed[512:, 1], table[:, 1])
    matrix = random_trellis_matrix(1, 16, 16, TrellisCode.of("hyb", 2), seed=1)
    assert torch.equal(matrix.signed_table, reference.signed_hyb_table(matrix.table))
    assert random_trellis_matrix(1, 16, 16, TrellisCode.of("1mad", 2), seed=1).signed_table is None


# A schedule whose step (2 tile columns) divides D = 64 and F = 32: the EVEN_COLUMNS walk over several steps
SMALL = {"test-u1c2": GemvSchedule(block_tile_rows=1, block_tile_columns=2, num_warps=4, unrolled=True),
         "test-u2c2g": GemvSchedule(block_tile_rows=2, block_tile_columns=2, num_warps=4, unrolled=True,
                                    hyb_table="global")}


@pytest.mark.parametrize("schedule", ["test-u1c2", "test-u2c2g", "u2c16"])  # u2c16 at D = 64: masked columns
@pytest.mark.parametrize("code_name, bits", [("hyb", 2), ("1mad", 2), ("3inst", 2), ("hyb", 3), ("1mad", 4)])
def test_unrolled_gemv_matches_the_moe_over_dequantized_experts(code_name, bits, schedule, monkeypatch):
    for name, chosen in SMALL.items():
        monkeypatch.setitem(gemv_module.SCHEDULES, name, chosen)
    seed = 40 + bits
    w13, w2 = make_stacks(TrellisCode.of(code_name, bits), 5, 64, 32, seed)
    ids, weights = make_routing(2, 2, 5, seed, dropped=True)  # one pair of each token dropped
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(seed))
    with scratch.poison_new_buffers():
        out = moe_trellis_gemv(x, w13, w2, ids, weights, schedule=schedule)
    assert out.shape == (2, 64)
    assert relative_error(out, expected(x, w13, w2, ids, weights)) < TOLERANCE[torch.float32]


def test_the_default_schedule_is_the_unrolled_kernel():
    """The arm users run is the one the bench times as the default (and the sm_90 counts describe)."""
    assert gemv_module.SCHEDULES[gemv_module.TABLE_SCHEDULE].unrolled
    assert gemv_module.SCHEDULES[gemv_module.COMPUTED_SCHEDULE].unrolled
    assert gemv_module.default_schedule(TrellisCode.of("hyb", 2)) == gemv_module.TABLE_SCHEDULE
    assert gemv_module.default_schedule(TrellisCode.of("1mad", 2)) == gemv_module.COMPUTED_SCHEDULE
    assert not gemv_module.SCHEDULES[gemv_module.BASELINE_SCHEDULE].unrolled
    assert all(s.hyb_table in ("shared", "global") for s in gemv_module.SCHEDULES.values())
