"""The trellis arms against the reference: the kernels' decode bit for bit, the rotations, and the three
MoE arms (GEMV, fused-decode grouped, dequantize-then-grouped) against the MoE over dequantized experts.

CPU: Triton under TRITON_INTERPRET=1 (conftest) at small shapes, fp32 and fp16 (the interpreter's bf16
conversions and dots are not the GPU's). GPU (`-m gpu`): bf16, the PTX forms of the decode, v4-like
widths, CUDA-graph replay. Every check draws fresh random codes, scales and activations (never zeros)
and runs inside `poison_new_buffers()`, so an element a kernel forgot to write is NaN.
"""

from __future__ import annotations

import pytest
import torch

from kernels import launches, scratch, trellis_rotate
from kernels import trellis_gemv as gemv_module
from kernels import trellis_grouped as grouped_module
from kernels import trellis_reference as reference
from kernels.reference import moe_reference
from kernels.trellis_decode import dequantize_rotated
from kernels.trellis_gemv import moe_trellis_gemv
from kernels.trellis_grouped import moe_trellis_dequant, moe_trellis_grouped
from kernels.trellis_reference import (
    TrellisCode,
    dequantize,
    hadamard_block,
    random_trellis_matrix,
    rotate,
    unrotate,
)
from kernels.trellis_rotate import rotate_rows, swiglu_between, unrotate_sum

HAS_CUDA = torch.cuda.is_available()

# ‖out − ref‖ / ‖ref‖ per activation dtype. The reference decodes the same weights exactly and runs the
# SwiGLU walk in fp32 on the model-basis weights; the arms rotate the activations instead (fp32, or
# tf32x3 on the GPU: about fp32), so the difference is the summation order in fp32 (seen ~5e-7), plus,
# below fp32, the rounding of the weights and of each intermediate (x_rot, y_rot, h_rot, pair_out) to
# the dtype: fp16 (11-bit mantissa, seen ~8e-4), bf16 (8 bits, four extra roundings).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
CODES = ("1mad", "3inst", "hyb")


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def make_stacks(code: TrellisCode, experts: int, hidden: int, intermediate: int, seed: int, device="cpu"):
    """w13 [E, 2F, D] and w2 [E, D, F] with random codes and random per-row scales (so a row read with
    another row's scale shows)."""
    generator = torch.Generator().manual_seed(seed)
    w13 = random_trellis_matrix(experts, 2 * intermediate, hidden, code, seed=seed, device=device,
                                row_block=hadamard_block(intermediate))
    w2 = random_trellis_matrix(experts, hidden, intermediate, code, seed=seed + 1, device=device)
    for stack in (w13, w2):
        stack.scales.mul_((torch.rand(stack.scales.shape, generator=generator) + 0.5).to(device))
    return w13, w2


def make_routing(tokens: int, top_k: int, experts: int, seed: int, device="cpu", *, dropped: bool = False):
    """topk_ids [T, k] (k distinct experts per token; `dropped`: two ids outside [0, E)) and weights [T, k]."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)]).to(torch.int32)
    if dropped:
        ids[0, -1] = -1
        ids[tokens // 2, 0] = experts
    weights = torch.softmax(torch.randn(tokens, top_k, generator=generator), dim=1)
    return ids.to(device), weights.to(device)


def expected(x, w13, w2, ids, weights) -> torch.Tensor:
    """The MoE over the dequantized experts (fp32), ids outside [0, E) contributing nothing."""
    experts = w13.shape[0]
    known = (ids >= 0) & (ids < experts)
    return moe_reference(x.float(), dequantize(w13), dequantize(w2), torch.where(known, ids, 0),
                         weights.float() * known).float()


# --------------------------------------------------------------------------------------------------
# The decode, bit for bit
# --------------------------------------------------------------------------------------------------

# (E, N, C): prime E, sides that are odd multiples of 16, one tile of each
DECODE_SHAPES = [pytest.param(3, 48, 80, id="prime-E-3-N-48-C-80"), pytest.param(1, 16, 16, id="one-tile")]


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("code_name", CODES)
@pytest.mark.parametrize("experts, rows, columns", DECODE_SHAPES)
def test_kernel_decode_equals_reference_bit_for_bit(code_name, bits, experts, rows, columns):
    code = TrellisCode.of(code_name, bits)
    matrix = random_trellis_matrix(experts, rows, columns, code, seed=bits * 10 + len(code_name))
    matrix.scales.mul_(torch.rand(matrix.scales.shape) + 0.5)
    want = reference.dequantize_rotated(matrix)
    with scratch.poison_new_buffers():
        got = dequantize_rotated(matrix)
        half = dequantize_rotated(matrix, torch.float16)
    assert torch.equal(got, want)
    assert torch.equal(half, want.to(torch.float16))  # value * scale rounded once, to nearest even


def test_decode_of_selected_experts_leaves_the_others_alone():
    code = TrellisCode.of("hyb", 2)
    matrix = random_trellis_matrix(5, 32, 48, code, seed=3)
    selected = torch.tensor([0, 2, 0, 0, 1], dtype=torch.int32)  # counts: nonzero = decode
    with scratch.poison_new_buffers():
        got = dequantize_rotated(matrix, experts=selected)
    want = reference.dequantize_rotated(matrix)
    assert torch.equal(got[[1, 4]], want[[1, 4]])
    assert torch.isnan(got[[0, 2, 3]]).all()


# --------------------------------------------------------------------------------------------------
# Rotations
# --------------------------------------------------------------------------------------------------

PDL_OFF = {"USE_GDC": False}


@pytest.mark.parametrize("size", [48, 256, 2048], ids=["blocks-of-16", "one-block-of-256-two-dots", "block-2048"])
def test_rotations_match_the_reference(size):
    check_rotations(size, "cpu")


@pytest.mark.parametrize("size", [256, 2048], ids=["blocks-of-256", "block-2048"])
def test_stacked_rotations_match_the_reference(size, monkeypatch):
    # several blocks a program (as a wide launch stacks them), their count not a multiple of the stack
    monkeypatch.setattr(trellis_rotate, "STACK_FROM_BLOCKS", 1)
    check_rotations(size, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("size", [48, 384, 2048, 4096])
@pytest.mark.parametrize("stacked", [False, True], ids=["a-block-a-program", "stacked"])
def test_gpu_rotations_match_the_reference(size, stacked, monkeypatch):
    # the tensor cores' tf32 dots of x's high part and its rest: fp32's accuracy, not tf32's (about 1e-3)
    if stacked:
        monkeypatch.setattr(trellis_rotate, "STACK_FROM_BLOCKS", 1)
    check_rotations(size, "cuda")


def check_rotations(size, device):
    generator = torch.Generator().manual_seed(size)
    block = hadamard_block(size)
    signs = reference.hadamard_signs(7, size).to(device)
    x = torch.randn(5, size, generator=generator).to(device)
    with scratch.poison_new_buffers():
        rotated = rotate_rows(x, signs, block, scratch.empty((5, size), torch.float32, x.device), PDL_OFF)
    assert relative_error(rotated, rotate(x, signs, block)) < 1e-6
    # swiglu between: y [R, 2F] -> T_R2(silu(g) * u) with (g, u) = T_L^T y
    y = torch.randn(6, 2 * size, generator=generator).to(device)
    left, right = reference.hadamard_signs(8, 2 * size).to(device), reference.hadamard_signs(9, size).to(device)
    with scratch.poison_new_buffers():
        hidden = swiglu_between(y, left, right, block, scratch.empty((6, size), torch.float32, x.device), PDL_OFF)
    back = unrotate(y.view(6, 2, size), left.view(2, size), block)
    want = rotate(torch.nn.functional.silu(back[:, 0]) * back[:, 1], right, block)
    assert relative_error(hidden, want) < 1e-6
    # unrotate the sum of each token's k rows, a row with an id outside [0, E) left out
    z = torch.randn(4 * 3, size, generator=generator).to(device)
    ids = torch.tensor([0, 1, 9, 2, -1, 3, 4, 5, 6, 7, 7, 1], dtype=torch.int32, device=device)
    with scratch.poison_new_buffers():
        out = unrotate_sum(z, ids, 8, 3, signs, block, scratch.empty((4, size), torch.float32, x.device), PDL_OFF)
    keep = ((ids >= 0) & (ids < 8)).float()[:, None]
    assert relative_error(out, unrotate((z * keep).view(4, 3, size).sum(1), signs, block)) < 1e-6


# --------------------------------------------------------------------------------------------------
# The arms
# --------------------------------------------------------------------------------------------------

ARMS = {
    # the interpreter pays per program: two tile rows a program halves the GEMV's (same kernel, same walk)
    "gemv": lambda *args: moe_trellis_gemv(*args, schedule="r2c8"),
    "grouped": lambda *args: moe_trellis_grouped(*args, schedule="m64"),
    "dequant": lambda *args: moe_trellis_dequant(*args, schedule="m64"),
}
# (T, k, E, D, F, code, K, dtypes): each named for the edge it covers; small D and F (the interpreter pays per
# op and per program, so the GEMV's 66-pair case runs in one dtype)
ARM_SHAPES = [
    ("33-tokens-prime-E-13-hyb-K2", 33, 2, 13, 32, 32, "hyb", 2, {"gemv": ("fp32",), "grouped": ("fp32", "fp16"),
                                                                   "dequant": ("fp16",)}),
    ("odd-D-48-F-16-1mad-K2", 5, 2, 7, 48, 16, "1mad", 2, {"gemv": ("fp16",), "grouped": ("fp32",),
                                                            "dequant": ("fp16",)}),
    ("F-48-blocks-of-16-3inst-K3", 4, 3, 5, 32, 48, "3inst", 3, {"gemv": ("fp32",), "grouped": ("fp16",),
                                                                  "dequant": ("fp32",)}),
    ("one-token-hyb-K4", 1, 2, 3, 32, 32, "hyb", 4, {"gemv": ("fp16",), "grouped": ("fp32",), "dequant": ("fp32",)}),
]
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
ARM_CASES = [pytest.param(arm, *shape[1:8], DTYPES[dtype], id=f"{arm}-{shape[0]}-{dtype}")
             for shape in ARM_SHAPES for arm in ARMS for dtype in shape[8][arm]]


@pytest.mark.parametrize("arm, tokens, top_k, experts, hidden, intermediate, code_name, bits, dtype", ARM_CASES)
def test_arms_match_the_moe_over_dequantized_experts(arm, tokens, top_k, experts, hidden, intermediate, code_name,
                                                     bits, dtype):
    seed = tokens * 100 + experts
    w13, w2 = make_stacks(TrellisCode.of(code_name, bits), experts, hidden, intermediate, seed)
    ids, weights = make_routing(tokens, top_k, experts, seed, dropped=tokens > 2)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed)).to(dtype)
    with scratch.poison_new_buffers():
        out = ARMS[arm](x, w13, w2, ids, weights.to(dtype))
    assert out.dtype == dtype and out.shape == (tokens, hidden)
    assert relative_error(out, expected(x, w13, w2, ids, weights)) < TOLERANCE[dtype]


def test_fused_and_dequantize_arms_are_bit_identical():
    """The same bf16-rounded weights, tiles and K order: only where the weights come from differs."""
    w13, w2 = make_stacks(TrellisCode.of("hyb", 2), 7, 32, 32, seed=5)
    ids, weights = make_routing(20, 2, 7, seed=5)
    x = torch.randn(20, 32, generator=torch.Generator().manual_seed(5)).to(torch.float16)
    with scratch.poison_new_buffers():
        fused = moe_trellis_grouped(x, w13, w2, ids, weights.half(), schedule="m64")
        dequantized = moe_trellis_dequant(x, w13, w2, ids, weights.half(), schedule="m64")
    assert torch.equal(fused, dequantized)


def test_launches_are_counted_per_kernel():
    w13, w2 = make_stacks(TrellisCode.of("1mad", 2), 5, 32, 16, seed=2)
    ids, weights = make_routing(3, 2, 5, seed=2)
    x = torch.randn(3, 32)
    before = launches.snapshot()
    moe_trellis_gemv(x, w13, w2, ids, weights)
    assert launches.since(before) == {"trellis.rotate": 1, "trellis_gemv.gate_up": 1, "trellis.swiglu_between": 1,
                                      "trellis_gemv.down": 1, "trellis.unrotate_sum": 1}
    before = launches.snapshot()
    moe_trellis_dequant(x, w13, w2, ids, weights, schedule="m64")
    counted = launches.since(before)
    assert counted.pop("trellis.dequantize") == 2 and counted.pop("moe_align.fused") == 1
    assert counted == {"trellis.rotate": 1, "trellis_dequant.gate_up": 1, "trellis.swiglu_between": 1,
                       "trellis_dequant.down": 1, "trellis.unrotate_sum": 1}


def test_bad_inputs_are_refused_naming_the_argument():
    w13, w2 = make_stacks(TrellisCode.of("hyb", 2), 3, 32, 16, seed=1)
    ids, weights = make_routing(2, 2, 3, seed=1)
    x = torch.randn(2, 32)
    with pytest.raises(ValueError, match="TrellisMatrix"):
        moe_trellis_gemv(x, torch.zeros(3, 32, 32), w2, ids, weights)
    with pytest.raises(ValueError, match="w2 must be"):
        moe_trellis_grouped(x, w13, w13, ids, weights)
    with pytest.raises(ValueError, match="schedule"):
        moe_trellis_grouped(x, w13, w2, ids, weights, schedule="m512")
    with pytest.raises(ValueError, match="schedule"):
        moe_trellis_gemv(x, w13, w2, ids, weights, schedule="fast")


def test_every_schedule_is_well_formed():
    for schedule in gemv_module.SCHEDULES.values():
        assert schedule.block_tile_rows >= 1 and schedule.block_tile_columns & (schedule.block_tile_columns - 1) == 0
    for schedule in grouped_module.SCHEDULES.values():
        assert schedule.block_m % 64 == 0 and schedule.block_k % 16 == 0
        assert schedule.gate_up_block_n % 16 == 0 and schedule.down_block_n % 16 == 0
        if schedule.gate_up_from is not None:  # its gate-up runs whole parts of these windows
            part = grouped_module.SCHEDULES[schedule.gate_up_from]
            assert part.gate_up_from is None and schedule.block_m % part.block_m == 0
    assert {gemv_module.TABLE_SCHEDULE, gemv_module.COMPUTED_SCHEDULE} <= set(gemv_module.SCHEDULES)
    assert grouped_module.DEFAULT_SCHEDULE in grouped_module.SCHEDULES


# --------------------------------------------------------------------------------------------------
# GPU: the compiled kernels (PTX decode forms), bf16, v4-like widths, graphs
# --------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("code_name", CODES)
def test_gpu_decode_equals_reference_bit_for_bit(code_name, bits):
    code = TrellisCode.of(code_name, bits)
    matrix = random_trellis_matrix(5, 512, 272, code, seed=bits, device="cuda")
    matrix.scales.mul_(torch.rand(matrix.scales.shape, device="cuda") + 0.5)
    want = reference.dequantize_rotated(matrix)
    with scratch.poison_new_buffers():
        got = dequantize_rotated(matrix)
        bf16 = dequantize_rotated(matrix, torch.bfloat16)
    assert torch.equal(got, want)
    assert torch.equal(bf16, want.to(torch.bfloat16))


GPU_SHAPES = [
    pytest.param(1, 6, 64, 1024, 512, id="one-token-E-64"),
    pytest.param(33, 6, 61, 1024, 512, id="33-tokens-prime-E-61"),
    pytest.param(300, 4, 16, 512, 1024, id="300-tokens-several-windows-per-expert"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("code_name, bits", [("hyb", 2), ("3inst", 2), ("1mad", 2), ("hyb", 3), ("1mad", 4)])
@pytest.mark.parametrize("tokens, top_k, experts, hidden, intermediate", GPU_SHAPES)
def test_gpu_arms_match_the_reference_bf16(tokens, top_k, experts, hidden, intermediate, code_name, bits):
    seed = tokens + bits
    w13, w2 = make_stacks(TrellisCode.of(code_name, bits), experts, hidden, intermediate, seed, device="cuda")
    ids, weights = make_routing(tokens, top_k, experts, seed, device="cuda", dropped=tokens > 2)
    x = torch.randn(tokens, hidden, device="cuda").bfloat16()
    want = expected(x, w13, w2, ids, weights)
    # every schedule on hyb K = 2 (the bench times them all), the defaults on the other codes (compile time)
    everything = (code_name, bits) == ("hyb", 2)
    gemv_schedules = (list(gemv_module.SCHEDULES) if everything
                      else [gemv_module.default_schedule(w13.code), gemv_module.BASELINE_SCHEDULE])
    grouped_schedules = list(grouped_module.SCHEDULES) if everything else [grouped_module.DEFAULT_SCHEDULE]
    outputs = {}
    args = (x, w13, w2, ids, weights.bfloat16())
    with scratch.poison_new_buffers():
        for schedule in gemv_schedules:
            outputs[f"gemv/{schedule}"] = moe_trellis_gemv(*args, schedule=schedule)
        for schedule in grouped_schedules:
            for tile_m in (16, 64):
                outputs[f"grouped/{schedule}/{tile_m}"] = moe_trellis_grouped(*args, schedule=schedule, tile_m=tile_m)
                outputs[f"dequant/{schedule}/{tile_m}"] = moe_trellis_dequant(*args, schedule=schedule, tile_m=tile_m)
    errors = {name: relative_error(out, want) for name, out in outputs.items()}
    assert all(error < TOLERANCE[torch.bfloat16] for error in errors.values()), errors
    for schedule in grouped_schedules:  # same weights, tiles and K order
        for tile_m in (16, 64):
            assert torch.equal(outputs[f"grouped/{schedule}/{tile_m}"], outputs[f"dequant/{schedule}/{tile_m}"])


@pytest.mark.gpu
@pytest.mark.parametrize("arm", ["gemv", "grouped", "dequant"])
def test_gpu_graph_replay_equals_eager(arm):
    functions = {"gemv": moe_trellis_gemv, "grouped": moe_trellis_grouped, "dequant": moe_trellis_dequant}
    w13, w2 = make_stacks(TrellisCode.of("hyb", 2), 64, 1024, 512, seed=11, device="cuda")
    ids, weights = make_routing(8, 6, 64, seed=11, device="cuda")
    x = torch.randn(8, 1024, device="cuda").bfloat16()
    weights = weights.bfloat16()
    eager = functions[arm](x, w13, w2, ids, weights).clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = functions[arm](x, w13, w2, ids, weights)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)
