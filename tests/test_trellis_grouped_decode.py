"""The unrolled tile decode the grouped arm and the dequantize kernel share (kernels/trellis_decode.py
`_decoded_tile`, `_tile_values`): bit for bit against the reference, the grouped arm's schedules equal to the
dequantize arm bit for bit (the unrolled decode and the tensor form it replaced), the "auto" schedule's pick,
and the sm_90 build's loop (wgmma on decoded tiles, registers, no layout change of the decoded tile).

CPU: the interpreter (conftest), the decode's plain forms. GPU (`-m gpu`): the PTX forms (dp4a, lop3, prmt,
the shared-memory gather), wgmma on the decoded tiles at K = 3 and 4 (bench/trellis_bench.py runs K = 2
at v4-shape), the register cap, and a CUDA-graph replay of the "auto" pick.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from kernels import scratch
from kernels import trellis_grouped as grouped_module
from kernels import trellis_reference as reference
from kernels.trellis_decode import _decoded_tile, _hyb_table, code_id, compiled, unit_geometry
from kernels.trellis_grouped import moe_trellis_dequant, moe_trellis_grouped, resolve_schedule
from kernels.trellis_reference import TrellisCode, random_trellis_matrix

from test_trellis_kernels import TOLERANCE, expected, make_routing, make_stacks, relative_error

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import sass_loops  # noqa: E402
import trellis_bench  # noqa: E402

EVERY_K = [("1mad", 2), ("3inst", 2), ("hyb", 2), ("1mad", 3), ("3inst", 3), ("hyb", 3), ("1mad", 4),
           ("3inst", 4), ("hyb", 4)]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@triton.jit
def _tile_kernel(codes_ptr, scales_ptr, table_ptr, out_ptr, num_row_tiles, num_column_tiles, stride_ce, stride_se,
                 K: tl.constexpr, V: tl.constexpr, G: tl.constexpr, WU: tl.constexpr, CODE: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INSIDE: tl.constexpr, PTX: tl.constexpr):
    """Grid (E, row blocks, column blocks): out[e, block] = `_decoded_tile` of the block, as the grouped arm
    takes it (the table in registers once per program; INSIDE: no masks on the words)."""
    expert = tl.program_id(0)
    row0 = tl.program_id(1) * BLOCK_N
    column0 = tl.program_id(2) * BLOCK_K
    table = table_ptr
    if CODE == 2:
        table = _hyb_table(table_ptr)
    tile = _decoded_tile(codes_ptr, scales_ptr, table, expert, row0, column0, num_row_tiles, num_column_tiles,
                         stride_ce, stride_se, K, V, G, WU, CODE, BLOCK_N, BLOCK_K, INSIDE, PTX,
                         out_ptr.dtype.element_ty)
    rows = row0 + tl.arange(0, BLOCK_N)
    columns = column0 + tl.arange(0, BLOCK_K)
    out = out_ptr + expert * (num_row_tiles * 16 * num_column_tiles * 16) + rows[:, None] * (num_column_tiles * 16) \
        + columns[None, :]
    tl.store(out, tile, mask=(rows < num_row_tiles * 16)[:, None] & (columns < num_column_tiles * 16)[None, :])


def decode_blocks(matrix, dtype, block_rows: int, block_columns: int, inside: bool) -> torch.Tensor:
    experts, rows, columns = matrix.shape
    code = matrix.code
    group, words = unit_geometry(code.K)
    out = scratch.empty((experts, rows, columns), dtype, matrix.device)
    table = matrix.signed_table if code.needs_table else matrix.scales
    grid = (experts, triton.cdiv(rows, block_rows), triton.cdiv(columns, block_columns))
    _tile_kernel[grid](matrix.codes, matrix.scales, table, out, rows // 16, columns // 16, matrix.codes.stride(0),
                       matrix.scales.stride(0), K=code.K, V=code.V, G=group, WU=words, CODE=code_id(code),
                       BLOCK_N=block_rows, BLOCK_K=block_columns, INSIDE=inside, PTX=compiled(matrix.device))
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("code_name, bits", EVERY_K)
def test_tile_decode_equals_reference_bit_for_bit(code_name, bits, device):
    """Blocks inside the matrix (INSIDE: the words loaded with no masks) and, on the GPU, blocks that cross its
    edges (masked), at the grouped arm's m64 gate-up block on the GPU and a small one here."""
    code = TrellisCode.of(code_name, bits)
    if device == "cpu":  # the interpreter's plain forms, at a small block (it pays per op)
        matrix = random_trellis_matrix(2, 64, 96, code, seed=3 * bits + len(code_name))
        matrix.scales.mul_(torch.rand(matrix.scales.shape) + 0.5)
        with scratch.poison_new_buffers():
            got = decode_blocks(matrix, torch.float32, 32, 32, inside=True)
        assert torch.equal(got, reference.dequantize_rotated(matrix))
    else:  # the PTX forms, the register-held table's gather, bf16 rounding, the masked edge
        big = random_trellis_matrix(3, 272, 208, code, seed=bits, device=device)
        big.scales.mul_(torch.rand(big.scales.shape, device=device) + 0.5)
        want = reference.dequantize_rotated(big)
        with scratch.poison_new_buffers():
            edges = decode_blocks(big, torch.bfloat16, 128, 64, inside=False)
        assert torch.equal(edges, want.to(torch.bfloat16))
        inner = random_trellis_matrix(3, 256, 192, code, seed=bits + 1, device=device)
        inner.scales.mul_(torch.rand(inner.scales.shape, device=device) + 0.5)
        with scratch.poison_new_buffers():
            got = decode_blocks(inner, torch.bfloat16, 128, 64, inside=True)
        assert torch.equal(got, reference.dequantize_rotated(inner).to(torch.bfloat16))


# (name, D, F): EVEN (every block inside the matrix: no masks) for both products, and for neither
FUSED_SHAPES = [("even-D-64-F-64", 64, 64), ("uneven-D-48-F-32", 48, 32)]
FUSED_CASES = ([pytest.param("m64", code, bits, *FUSED_SHAPES[0][1:], id=f"m64-{code}-K{bits}-even")
                for code, bits in [("hyb", 2), ("1mad", 2)]]
               + [pytest.param("m64", "3inst", 3, *FUSED_SHAPES[1][1:], id="m64-3inst-K3-uneven"),
                  pytest.param("m64", "hyb", 4, *FUSED_SHAPES[1][1:], id="m64-hyb-K4-uneven"),
                  pytest.param("m64t", "hyb", 2, *FUSED_SHAPES[1][1:], id="m64t-tensor-form-hyb-K2-uneven"),
                  pytest.param("m64t", "1mad", 3, *FUSED_SHAPES[0][1:], id="m64t-tensor-form-1mad-K3-even"),
                  # gate and up in one dot: the same bits as two
                  pytest.param("m64f", "1mad", 2, *FUSED_SHAPES[0][1:], id="m64f-fused-gate-up-1mad-K2-even"),
                  pytest.param("m128f", "3inst", 2, *FUSED_SHAPES[1][1:], id="m128f-fused-gate-up-3inst-K2-uneven"),
                  pytest.param("m256f", "hyb", 2, *FUSED_SHAPES[1][1:], id="m256f-fused-gate-up-hyb-K2-uneven"),
                  pytest.param("m256h", "1mad", 2, *FUSED_SHAPES[1][1:], id="m256h-gate-up-in-halves-1mad-K2-uneven")])


@pytest.mark.parametrize("schedule, code_name, bits, hidden, intermediate", FUSED_CASES)
def test_fused_schedules_equal_the_dequantize_arm_bit_for_bit(schedule, code_name, bits, hidden, intermediate):
    """The fused arm (its tile decode, either form) against the dequantize arm (the dequantize kernel's decode,
    which the decode test holds to the reference): the same weights, tiles and K order, so the same bits."""
    w13, w2 = make_stacks(TrellisCode.of(code_name, bits), 5, hidden, intermediate, seed=hidden + bits)
    ids, weights = make_routing(9, 2, 5, seed=bits, dropped=True)
    x = torch.randn(9, hidden, generator=torch.Generator().manual_seed(bits)).to(torch.float16)
    with scratch.poison_new_buffers():
        fused = moe_trellis_grouped(x, w13, w2, ids, weights.half(), schedule=schedule)
        dequantized = moe_trellis_dequant(x, w13, w2, ids, weights.half(), schedule="m64")
    assert torch.equal(fused, dequantized)
    assert relative_error(fused, expected(x, w13, w2, ids, weights)) < TOLERANCE[torch.float16]


def test_auto_picks_wide_windows_above_64_pairs_per_expert():
    assert resolve_schedule("auto", 2048, 6, 256, 2) == "m64f"  # 48 pairs an expert: one 64-row window each
    assert resolve_schedule("auto", 2048, 6, 256, 2, table=True) == "m64"  # hyb: the fused dot lost (run 98)
    assert resolve_schedule("auto", 8192, 6, 256, 2) == "m256h"  # 192: one 256-row window, gate-up in halves
    assert resolve_schedule("auto", 8192, 6, 256, 2, table=True) == "m256f"  # hyb: one 256-row window
    assert resolve_schedule("auto", 5462, 6, 256, 2, table=True) == "m256f"  # 128.02
    assert resolve_schedule("auto", 5461, 6, 256, 2, table=True) == "m128f"  # 127.99: one 128-row window
    assert resolve_schedule("auto", 2731, 6, 256, 4) == "m128f"  # 64.01: two 64-row windows or one of 128
    assert resolve_schedule("auto", 2730, 6, 256, 2) == "m64f"  # 63.98
    assert resolve_schedule("auto", 5462, 6, 256, 2) == "m256h"
    assert resolve_schedule("auto", 8192, 6, 256, 3) == "m64"  # K = 3: m128's and m256f's gate-up would decode twice
    assert resolve_schedule("auto", 8192, 6, 256, 3, table=True) == "m64"
    for launcher in (grouped_module.moe_trellis_grouped, grouped_module.moe_trellis_dequant):  # the arms run auto
        assert inspect.signature(launcher).parameters["schedule"].default == "auto"
    assert resolve_schedule("m64t", 8192, 6, 256, 2) == "m64t"  # a named schedule is itself
    assert all(resolve_schedule(name, 1, 1, 1, 2) in grouped_module.SCHEDULES
               for name in grouped_module.SCHEDULE_NAMES)
    with pytest.raises(ValueError, match="schedule must be one of"):
        moe_trellis_grouped(torch.randn(1, 32), *make_stacks(TrellisCode.of("hyb", 2), 2, 32, 16, seed=1),
                            *make_routing(1, 1, 2, seed=1), schedule="m64n64")


def test_the_default_schedule_is_the_unrolled_decode_with_two_programs_a_sm():
    """The arm users run is the one the counts in docs/trellis-kernels.md describe and the bench times as default."""
    default = grouped_module.SCHEDULES[grouped_module.DEFAULT_SCHEDULE]
    assert default.decode == "steps" and default.max_registers == 128 and default.num_warps == 8
    assert grouped_module.SCHEDULES[grouped_module.BASELINE_SCHEDULE].decode == "tensor"
    with pytest.raises(ValueError, match="decode must be"):
        grouped_module.GroupedSchedule(64, 128, 128, 64, 8, 3, 4, decode="fast")


_COMPILE = """
import json, re, sys
sys.path.insert(0, "bench")
import sass_loops, trellis_sm90_compile as report
from kernels import trellis_grouped
found = {}
for name in ("m64", "m64t"):
    schedule = trellis_grouped.SCHEDULES[name]
    (label, fn, constants, weights), _ = report.grouped_kernels(schedule, "hyb", 2)
    kernel = report.compile_sm90(fn, dict(constants, USE_GDC=False), schedule.num_warps, schedule.num_stages,
                                 schedule.max_registers)
    loop = sass_loops.main_loop(sass_loops.sass_of(kernel.asm["cubin"]))
    body = kernel.asm["ttgir"].split("scf.for", 1)[1].split("scf.yield", 1)[0]
    big = [m.group(0) for m in re.finditer(r"convert_layout [^\\n]*tensor<(\\d+)x(\\d+)x", body)]
    found[name] = dict(per_weight=sass_loops.per_weight(loop, weights), usage=report.usage(kernel),
                       wgmma=kernel.asm["ptx"].count("wgmma.mma_async"), conversions=big)
print(json.dumps(found))
"""


@pytest.mark.slow  # two sm_90 builds of the grouped gate-up in a child process, about 30 s here
def test_the_sm90_grouped_decode_loop():
    """The m64 gate-up on hyb K = 2 as ptxas builds it (bench/trellis_sm90_compile.py, no GPU): wgmma on the
    decoded tiles, at most 128 registers, no layout conversion of a 2-D tensor inside the K loop (the tensor
    form converted its states through shared memory), and fewer instructions a weight than the tensor form."""
    pytest.importorskip("triton")
    if sass_loops.cuobjdump() is None:
        pytest.skip("no cuobjdump in this Triton")
    found = sass_loops.compiled_in_child(_COMPILE)
    new, old = found["m64"], found["m64t"]
    assert new["wgmma"] == 8 and old["wgmma"] == 8  # two tiles of four k16 steps a warpgroup
    assert int(new["usage"].split("regs=")[1].split()[0]) <= 128, new["usage"]
    assert new["conversions"] == [], new["conversions"]
    # docs/trellis-kernels.md: 6.2-6.3 against 10.0-10.3 (triton 3.6 and 3.9); lsu 1.0-1.1 against 2.5-2.6
    assert new["per_weight"]["issue"] < 0.75 * old["per_weight"]["issue"], (new, old)
    assert new["per_weight"]["lsu"] < 0.6 * old["per_weight"]["lsu"], (new, old)


# --------------------------------------------------------------------------------------------------
# GPU: wgmma on tiles of every K, the register cap, the PTX forms in the build, a graph of the auto pick
# --------------------------------------------------------------------------------------------------

# the PTX form each computed code's decode must show in its build (the interpreter never runs them)
PTX_FORMS = {"1mad": ("dp4a.u32.u32", "prmt.b32"), "3inst": ("0x8FFF8FFF", "prmt.b32"), "hyb": ()}


@pytest.mark.gpu
@pytest.mark.parametrize("code_name, bits", [("1mad", 3), ("3inst", 4), ("hyb", 3), ("hyb", 4)])
def test_gpu_grouped_decode_of_every_k_matches_dequantize_and_reference(code_name, bits):
    """bench/trellis_bench.py checks K = 2 at v4-shape; here K = 3 (two-row units) and 4 (two-word units) run
    through wgmma at the default schedule (capped at 128 registers) on EVEN blocks, fused == dequantize."""
    w13, w2 = make_stacks(TrellisCode.of(code_name, bits), 61, 1024, 512, seed=bits, device="cuda")
    ids, weights = make_routing(33, 6, 61, seed=bits, device="cuda", dropped=True)
    x = torch.randn(33, 1024, device="cuda").bfloat16()
    products = (grouped_module._trellis_gate_up_kernel, grouped_module._trellis_down_kernel)
    before = {product: trellis_bench.cache_keys(product) for product in products}
    with scratch.poison_new_buffers():
        fused = moe_trellis_grouped(x, w13, w2, ids, weights.bfloat16())
    new = [kernel for product in products for kernel in trellis_bench.compiled_since(product, before[product])]
    with scratch.poison_new_buffers():
        dequantized = moe_trellis_dequant(x, w13, w2, ids, weights.bfloat16())
    assert torch.equal(fused, dequantized)
    assert relative_error(fused, expected(x, w13, w2, ids, weights)) < TOLERANCE[torch.bfloat16]
    if new:  # built by this call (else an earlier test of this session built them: their checks ran there)
        assert all("wgmma.mma_async" in kernel.asm["ptx"] for kernel in new)
        assert all(form in kernel.asm["ptx"] for kernel in new for form in PTX_FORMS[code_name])
        # the default schedule's cap: two programs of 8 warps a SM; spills are reported, not refused
        assert all(kernel.n_regs <= 128 for kernel in new), [(kernel.n_regs, kernel.n_spills) for kernel in new]


@pytest.mark.gpu
@pytest.mark.parametrize("code_name, tokens, schedule", [("1mad", 300, "m128f"), ("1mad", 700, "m256h"),
                                                         ("hyb", 700, "m256f")])
def test_gpu_graph_replay_of_the_auto_pick_equals_eager(code_name, tokens, schedule):
    """75 pairs an expert: "auto" runs m128f (two warpgroups of 64 rows); hyb at 175: m256f (four warpgroups, 16
    warps); replays read the same bits."""
    w13, w2 = make_stacks(TrellisCode.of(code_name, 2), 16, 512, 1024, seed=12, device="cuda")
    ids, weights = make_routing(tokens, 4, 16, seed=12, device="cuda")
    x = torch.randn(tokens, 512, device="cuda").bfloat16()
    weights = weights.bfloat16()
    assert resolve_schedule("auto", tokens, 4, 16, 2, w13.code.needs_table) == schedule
    eager = moe_trellis_grouped(x, w13, w2, ids, weights, schedule="auto").clone()
    assert relative_error(eager, expected(x, w13, w2, ids, weights)) < TOLERANCE[torch.bfloat16]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe_trellis_grouped(x, w13, w2, ids, weights, schedule="auto")
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)
