"""kernels.moe_gemv's down walk loading TILES tiles at once (the narrow schedule, below MIN_DOWN_PROGRAMS programs):
against the torch references with ids outside [0, E), masked F tails, walks whose length is not a multiple of
TILES, the preloaded first group (as under PDL), the gpt-oss biases and the shared experts' fold; bit-reproducible
from call to call.

CPU: Triton's interpreter (no tl.dot in the arm: fp32 and fp16 exact to their rounding), small odd shapes, fresh
random inputs inside `poison_new_buffers()`. GPU (`-m gpu`): bf16 at Qwen3-30B-A3B's and DeepSeek-V2-Lite's
widths at one token, eager and replayed in a CUDA graph, against the reference and against TILES = 1.
"""

from __future__ import annotations

import pytest
import torch
from test_moe_gemv_shared import _routed, _shared_weights, _swiglu
from test_moe_kernels import TOLERANCE, make_layer, make_routing, relative_error

from kernels import moe_gemv as moe_gemv_module
from kernels import scratch
from kernels.moe_gemv import moe_gemv, moe_gemv_clamped
from kernels.reference import moe_reference_gpt_oss


def _walk(monkeypatch, tiles, preload, block_f=16, block_d=4):
    """Down at `tiles` tiles per load of `block_d` outputs whatever the shape, F walked in tiles of `block_f`."""
    monkeypatch.setattr(moe_gemv_module, "DOWN_TILES", tiles)
    monkeypatch.setattr(moe_gemv_module, "NARROW_DOWN_BLOCK_D", block_d)
    monkeypatch.setattr(moe_gemv_module, "MIN_DOWN_PROGRAMS", 1 << 30)
    monkeypatch.setattr(moe_gemv_module, "DOWN_BLOCK_F", block_f)
    monkeypatch.setattr(moe_gemv_module.pdl, "preload", lambda device, kernel: preload)


def _case(tokens, top_k, experts, hidden, intermediate, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    ids, weights = make_routing(tokens, top_k, experts, generator)
    ids[0, top_k - 1] = experts  # ids outside [0, E): they add nothing
    if tokens > 1:
        ids[1, 0] = -1
    x, w13, w2 = make_layer(tokens, hidden, intermediate, experts, dtype, generator)
    return x, w13, w2, ids, weights.to(dtype), generator


# (T, k, E, D, F): walks of k x cdiv(F, 16) steps: 3 x 2 = 6 (not a multiple of 4), 5 x 1 = 5 (odd), 2 x 3 = 6
WALKS = [
    pytest.param(1, 3, 7, 45, 20, id="one-row-6-steps-odd-D"),
    pytest.param(3, 5, 11, 24, 9, id="3-rows-5-steps-F-below-a-tile"),
    pytest.param(2, 2, 5, 33, 40, id="2-rows-6-steps-masked-F-tail"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("tiles", [2, 4])
@pytest.mark.parametrize("preload", [False, True], ids=["no-preload", "preload"])
@pytest.mark.parametrize("tokens, top_k, experts, hidden, intermediate", WALKS)
def test_walk_of_several_tiles_matches_reference(tokens, top_k, experts, hidden, intermediate, tiles, preload,
                                                 dtype, monkeypatch):
    _walk(monkeypatch, tiles, preload)
    x, w13, w2, ids, weights, _ = _case(tokens, top_k, experts, hidden, intermediate, dtype, seed=hidden + tiles)
    reference = _routed(x, w13, w2, ids, weights)
    with scratch.poison_new_buffers():
        out = moe_gemv(x, w13, w2, ids, weights)
        again = moe_gemv(x, w13, w2, ids, weights)
    assert relative_error(out, reference) <= TOLERANCE[dtype]
    assert torch.equal(out, again)


@pytest.mark.parametrize("tiles", [2, 4])
@pytest.mark.parametrize("preload", [False, True], ids=["no-preload", "preload"])
def test_walk_of_several_tiles_adds_each_pairs_bias_once(tiles, preload, monkeypatch):
    """gpt-oss: a pair's down bias, weighted, after its last tile, wherever that tile falls in a group."""
    _walk(monkeypatch, tiles, preload)
    x, w13, w2, ids, weights, generator = _case(2, 3, 6, 28, 40, torch.float32, seed=5)
    b13 = 0.5 * torch.randn(6, 80, generator=generator)
    b2 = 0.5 * torch.randn(6, 28, generator=generator)
    valid = (ids >= 0) & (ids < 6)
    reference = moe_reference_gpt_oss(x, w13, w2, torch.where(valid, ids, 0), torch.where(valid, weights, 0.0),
                                      b13, b2, 1.702, 1.5)
    with scratch.poison_new_buffers():
        out = moe_gemv_clamped(x, w13, w2, ids, weights, b13, b2, 1.702, 1.5)
    assert relative_error(out, reference) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("tiles", [2, 4])
def test_walk_of_several_tiles_with_the_shared_fold(tiles, monkeypatch):
    _walk(monkeypatch, tiles, preload=True)
    x, w13, w2, ids, weights, generator = _case(1, 3, 7, 40, 16, torch.float32, seed=9)
    gate_up, down = _shared_weights(40, 32, torch.float32, generator)
    reference = _routed(x, w13, w2, ids, weights) + _swiglu(x, gate_up, down)
    with scratch.poison_new_buffers():
        out = moe_gemv(x, w13, w2, ids, weights, shared=(gate_up, down))
    assert relative_error(out, reference) <= TOLERANCE[torch.float32]


def test_the_narrow_schedule_only_below_the_program_count():
    module = moe_gemv_module
    below = (module.MIN_DOWN_PROGRAMS - 1) * module.DOWN_BLOCK_D  # one program short at DOWN_BLOCK_D
    narrow = (module.NARROW_DOWN_BLOCK_D, module.DOWN_TILES, module.NARROW_DOWN_WARPS)
    wide = (module.DOWN_BLOCK_D, 1, module.NUM_WARPS)
    assert module.DOWN_TILES > 1
    assert module.down_schedule(1, below) == narrow
    assert module.down_schedule(1, below + module.DOWN_BLOCK_D) == wide
    assert module.down_schedule(2, below) == wide
    assert module.down_schedule(1, 2048) == narrow  # Qwen3-30B-A3B and DeepSeek-V2-Lite at one token
    assert module.down_schedule(1, 4096) == wide  # v4-shape


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2048, 768, 128, 8), (2048, 1408, 64, 6), (4096, 2048, 256, 6)],
                         ids=["qwen3-30b-a3b", "deepseek-v2-lite", "v4-shape"])
@pytest.mark.parametrize("tiles", [2, 4])
def test_gpu_walk_of_several_tiles_in_bf16_and_a_graph(shape, tiles, monkeypatch):
    hidden, intermediate, experts, top_k = shape
    generator = torch.Generator(device="cuda").manual_seed(tiles)
    ids = torch.randperm(experts, generator=generator, device="cuda")[:top_k].int()[None]
    weights = torch.softmax(torch.randn(1, top_k, generator=generator, device="cuda"), -1).bfloat16()
    x = torch.randn(1, hidden, generator=generator, device="cuda").bfloat16()
    w13 = torch.randn(experts, 2 * intermediate, hidden, generator=generator, device="cuda") / hidden ** 0.5
    w2 = torch.randn(experts, hidden, intermediate, generator=generator, device="cuda") / intermediate ** 0.5
    w13, w2 = w13.bfloat16(), w2.bfloat16()
    reference = _routed(x, w13, w2, ids, weights)
    monkeypatch.setattr(moe_gemv_module, "MIN_DOWN_PROGRAMS", 0)  # one tile at a time at every shape
    one = moe_gemv(x, w13, w2, ids, weights)
    monkeypatch.setattr(moe_gemv_module, "DOWN_TILES", tiles)
    monkeypatch.setattr(moe_gemv_module, "MIN_DOWN_PROGRAMS", 1 << 30)
    eager = moe_gemv(x, w13, w2, ids, weights)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe_gemv(x, w13, w2, ids, weights)
    captured.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert relative_error(eager, reference) <= TOLERANCE[torch.bfloat16]
    assert torch.equal(captured, eager)
    # the same products summed in another grouping: a few bf16 ulps of the output at most
    assert relative_error(eager, one) <= 1e-2
