"""The sweep's timing methods: the runtime's way (a CUDA-graph replay of back-to-back calls) by default, the
cold eager call on request, each row saying which, and the calibration `moe_gate=measured` reads taken only
from the runtime's way. The timing itself needs a GPU (tests marked gpu and bench/sweep_vs_runtime.py)."""

from __future__ import annotations

import json

import pytest

from engine import calibration
from engine.errors import UserError
from engine.sweep import SweepConfig
from inspector.commands.sweep import render_table


def entry(**changes) -> dict:
    base = {"device": "NVIDIA H200", "k": 6, "experts": 256, "hidden": 4096, "intermediate": 2048, "tile_m": 16,
            "crossover_tokens": 24, "measured_at": "2026-12-01T00:00:00+00:00", "commit": "abc"}
    return base | changes


def test_only_a_crossover_timed_the_runtimes_way_is_read(tmp_path):
    path = tmp_path / "calibration.json"
    calibration.save_entry(entry(), path)  # an older sweep's entry: no timing field, one cold call per arm
    assert calibration.find_crossover("NVIDIA H200", 6, 256, 4096, 2048, 16, path) is None
    # an older graph-timed entry: float32 routing weights, which compiled another down kernel than the runtime's
    calibration.save_entry(entry(timing="graph", crossover_tokens=18), path)
    assert calibration.find_crossover("NVIDIA H200", 6, 256, 4096, 2048, 16, path) is None
    calibration.save_entry(entry(timing="graph", routing_weights="bfloat16", crossover_tokens=20), path)
    assert calibration.find_crossover("NVIDIA H200", 6, 256, 4096, 2048, 16, path) == 20
    calibration.save_entry(entry(timing="cold", routing_weights="bfloat16", crossover_tokens=30), path)  # replaces it
    assert calibration.find_crossover("NVIDIA H200", 6, 256, 4096, 2048, 16, path) is None


def test_the_sweep_routes_its_arms_with_weights_in_the_activations_dtype():
    import torch

    from engine import sweep

    shape = sweep.MoeShape(experts=16, top_k=4, hidden=32, intermediate=16)
    ids, weights = sweep._routing(shape, 3, None, torch.device("cpu"), torch.Generator().manual_seed(0))
    assert weights.dtype == torch.bfloat16 == getattr(torch, calibration.TIMED_AS["routing_weights"])
    assert ids.dtype == torch.int32 and torch.allclose(weights.float().sum(-1), torch.ones(3), atol=1e-2)


def test_the_timing_method_is_checked():
    assert SweepConfig(model="tiny").timing == "graph"
    assert SweepConfig(model="tiny", timing="cold").timing == "cold"
    assert SweepConfig(model="tiny", timing="neighbours").timing == "neighbours"
    with pytest.raises(UserError, match="--timing 'warm': choose graph .*, neighbours .* or cold"):
        SweepConfig(model="tiny", timing="warm")


def test_the_table_says_how_each_arm_was_timed():
    result = {
        "device": "NVIDIA H200", "model": "tiny", "dtype": "bfloat16", "tile_m": 16, "skew": 0.0,
        "timing": {"method": "graph", "describe": "the runtime's way: calls back to back in one CUDA graph replay"},
        "shape": {"experts": 8, "top_k": 2, "hidden": 64, "intermediate": 32},
        "copy_bandwidth_gbs": 4200.0, "matmul_tflops": 790.0, "crossover_tokens": None,
        "calibration_note": "not every arm was timed the runtime's way", "check_tolerance": 1e-2,
        "check_failed": False, "commit": "abc", "versions": {"torch": "2.11", "triton": "3.6"},
        "rows": [{"tokens": 1, "woken_experts": 2.0, "pairs_per_woken_expert": 1.0, "bandwidth_bound_us": 1.5,
                  "tensor_core_bound_us": 0.1, "bound_us": 1.5, "align_us": 6.0,
                  "arms": {"gemv": {"us": 3.0, "ratio": 2.0, "rel_err": 0.004, "timing": "graph",
                                    "launches_per_call": {}},
                           "torch_grouped_mm": {"us": 9.0, "ratio": 6.0, "rel_err": 0.004, "timing": "cold",
                                                "timing_note": "graph capture failed", "launches_per_call": {}}}}],
    }
    table = render_table(json.loads(json.dumps(result)))
    assert "timing: graph: the runtime's way" in table
    assert "3.0 (2.00)  " in table or table.count("3.0 (2.00)") == 1
    assert "9.0 (6.00) cold" in table and "3.0 (2.00) cold" not in table
    assert "calibration not written: not every arm was timed the runtime's way" in table


def _gemv_case(device):
    """(x, w13, w2, ids, weights, generator): one token of a small MoE layer (E 64, D 2048, F 1024, top-6), bf16."""
    import torch

    generator = torch.Generator(device=device).manual_seed(0)
    E, D, F, k = 64, 2048, 1024, 6
    w13 = torch.randn(E, 2 * F, D, device=device, generator=generator, dtype=torch.bfloat16) / 45
    w2 = torch.randn(E, D, F, device=device, generator=generator, dtype=torch.bfloat16) / 32
    x = torch.randn(1, D, device=device, generator=generator, dtype=torch.bfloat16)
    ids = torch.randperm(E, device=device, generator=generator)[:k].view(1, k).int()
    weights = torch.softmax(torch.randn(1, k, device=device, generator=generator), -1)
    return x, w13, w2, ids, weights, generator


@pytest.mark.gpu
def test_graph_timing_is_the_runtimes_within_five_percent():
    """The GEMV arm at n = 1 on a small shape: graph-timed per call against the same calls replayed by
    engine.bench.graph_call_us (the bench's own graph timing), and the cold figure at least as slow. The two
    harnesses take turns, three rounds, and their median ratio is compared: one pair taken once failed once in a
    long GPU call (another process's or the clock's drift between the two figures)."""
    import statistics

    import torch

    from engine.bench import graph_call_us
    from engine.sweep import _Timer
    from kernels.moe_gemv import moe_gemv

    device = torch.device("cuda")
    x, w13, w2, ids, weights, generator = _gemv_case(device)
    timer = _Timer(device)
    pairs = [(timer.graph_us(lambda: moe_gemv(x, w13, w2, ids, weights)),
              graph_call_us(lambda: moe_gemv(x, w13, w2, ids, weights), calls=16)) for _ in range(3)]
    ratio = statistics.median(graph / peer for graph, peer in pairs)
    graph = statistics.median(graph for graph, _ in pairs)
    cold = timer.median_us(lambda: moe_gemv(x, w13, w2, ids, weights))
    assert abs(ratio - 1) < 0.05, pairs
    assert cold > 0.95 * graph, (cold, graph)


@pytest.mark.parametrize("tokens", [1, 3], ids=["folded-router", "unfolded-router"])
def test_the_neighbours_are_the_steps_router_and_next_norm(tokens):
    """engine.sweep_neighbours launches what engine.decode_fused launches around a MoE arm: at one row the router's
    fold (one launch), above it rms_norm, the logits' product and topk_softmax; then the next layer's rms_norm, or
    with fold_next (the flag qkv_norm_fold) at one row its q/k/v GEMV with that norm folded in."""
    import torch

    from engine.sweep_neighbours import runtime_neighbours
    from kernels import launches

    neighbours = runtime_neighbours(48, 8, 2, tokens, torch.float32, torch.device("cpu"),
                                    torch.Generator().manual_seed(tokens))
    before = launches.snapshot()
    neighbours.before()
    router = launches.since(before)
    before = launches.snapshot()
    neighbours.after(neighbours.stand_in)
    assert launches.since(before) == {"rms_norm": 1}
    if tokens == 1:
        assert router == {"gemv_route": 1} and "one launch" in neighbours.describe
    else:
        assert router.get("rms_norm") == 1 and router.get("topk_softmax") == 1, router
    assert neighbours.stand_in.shape == (tokens, 48)
    folding = runtime_neighbours(48, 8, 2, tokens, torch.float32, torch.device("cpu"),
                                 torch.Generator().manual_seed(tokens), fold_next=True)
    before = launches.snapshot()
    folding.after(folding.stand_in)  # qkv_norm_fold: at one row the norm inside the next q/k/v GEMV
    assert launches.since(before) == ({"gemv_norm": 1} if tokens == 1 else {"rms_norm": 1})
    assert ("q/k/v GEMV with its norm folded in" in folding.describe) == (tokens == 1)


@pytest.mark.gpu
def test_neighbours_timing_is_what_the_arm_adds_between_them():
    """The GEMV arm between the router and the next norm: more than nothing, less than the arm with the
    neighbours' own time added, and within reach of the arm's graph figure (it overlaps their tails)."""
    import torch

    from engine.sweep import _Timer
    from engine.sweep_neighbours import runtime_neighbours
    from kernels.moe_gemv import moe_gemv

    device = torch.device("cuda")
    x, w13, w2, ids, weights, generator = _gemv_case(device)
    weights = weights.bfloat16()
    timer = _Timer(device)
    neighbours = runtime_neighbours(w13.shape[2], w13.shape[0], ids.shape[1], 1, torch.bfloat16, device, generator)
    arm = timer.graph_us(lambda: moe_gemv(x, w13, w2, ids, weights))
    added = timer.between_us(lambda: moe_gemv(x, w13, w2, ids, weights), neighbours)
    assert 0.5 * arm < added < 1.5 * arm, (added, arm)
