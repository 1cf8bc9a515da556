"""Routing inside the MoE GEMV arm (the flag route_in_arm, kernels.moe_gemv.Route): at a one-token decode step the
router's fold stops at its logits, gate-up's programs route the token from them (program (0, 0) writing the ids,
weights and woken count out) and down's programs pick their preload's experts from them. The result must be the
bits of routing first with kernels.router.topk_softmax and calling the arm without a route."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import decode_fused, flags
from engine.arms import ARMS
from engine.dispatcher import DECODE, Dispatcher
from engine.model import KVCache, forward
from engine.runtime import Engine
from kernels import moe_gemv as mg
from kernels import scratch
from kernels.router import topk_softmax


def _weights(experts: int, hidden: int, intermediate: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(1, hidden, generator=generator)
    w13 = torch.randn(experts, 2 * intermediate, hidden, generator=generator) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, intermediate, generator=generator) / intermediate ** 0.5
    return x, w13, w2, generator


def _routed_both_ways(x, w13, w2, logits, top_k, over_all=False, scale=1.0, shared=None, dtype=torch.float32):
    ids, weights, woken = topk_softmax(logits, top_k, dtype, woken=True, over_all=over_all, scale=scale)
    want = mg.moe_gemv(x, w13, w2, ids, weights, shared=shared)
    with scratch.poison_new_buffers():
        out_ids = scratch.empty((1, top_k), torch.int32, x.device)
        out_weights = scratch.empty((1, top_k), dtype, x.device)
        count = torch.full((1,), -5, dtype=torch.int64)
        got = mg.moe_gemv(x, w13, w2, out_ids, out_weights, shared=shared,
                          route=mg.Route(logits, over_all, scale, count))
    return (want, ids, weights, woken), (got, out_ids, out_weights, count)


@pytest.mark.parametrize("walk", ["narrow", "one tile"])
@pytest.mark.parametrize("preload", [False, True])
@pytest.mark.parametrize("experts, top_k, over_all, scale", [(16, 4, False, 1.0), (12, 3, True, 2.5), (8, 8, False, 1.0)])
def test_the_arm_routes_from_the_logits_to_the_bits_of_routing_first(walk, preload, experts, top_k, over_all, scale,
                                                                     monkeypatch):
    # narrow: D = 64 launches 8 down programs, the walk TILES at a time; one tile: the v4-shape code
    monkeypatch.setattr(mg, "MIN_DOWN_PROGRAMS", 512 if walk == "narrow" else 0)
    # preload: down's preload (on a GPU with PDL) picks its experts from the logits before its wait
    monkeypatch.setattr(mg.pdl, "preload", lambda device, kernel="", launch=None: preload)
    x, w13, w2, generator = _weights(experts, 64, 48, seed=experts)
    logits = torch.randn(1, experts, generator=generator)
    logits[0, 2] = logits[0, 5] = logits.max() + 1  # a tie: the lower id first, in both
    (want, ids, weights, woken), (got, out_ids, out_weights, count) = _routed_both_ways(
        x, w13, w2, logits, top_k, over_all, scale)
    assert torch.equal(out_ids, ids) and out_ids[0, 0] == 2 and out_ids[0, 1] == 5
    assert torch.equal(out_weights, weights)
    assert int(count) == int(woken) == top_k
    assert torch.equal(got, want)


def test_the_arm_routes_with_shared_experts_in_its_launches(monkeypatch):
    monkeypatch.setattr(mg.pdl, "preload", lambda device, kernel="", launch=None: True)
    x, w13, w2, generator = _weights(10, 64, 40, seed=3)
    shared = ((torch.randn(2 * 72, 64, generator=generator) / 8).contiguous(),
              (torch.randn(64, 72, generator=generator) / 8).contiguous())  # Fs = 72: two chunks of F = 40
    logits = torch.randn(1, 10, generator=generator)
    (want, ids, weights, _), (got, out_ids, out_weights, _) = _routed_both_ways(x, w13, w2, logits, 3, shared=shared)
    assert torch.equal(out_ids, ids) and torch.equal(out_weights, weights) and torch.equal(got, want)


def test_a_route_is_refused_where_the_arm_cannot_take_it():
    x, w13, w2, generator = _weights(8, 32, 16, seed=1)
    logits = torch.randn(1, 8, generator=generator)
    ids, weights = torch.zeros(1, 2, dtype=torch.int32), torch.zeros(1, 2)
    with pytest.raises(ValueError, match="one token"):
        mg.moe_gemv(x.repeat(2, 1), w13, w2, ids.repeat(2, 1), weights.repeat(2, 1), route=mg.Route(logits))
    with pytest.raises(ValueError, match=r"float32 \[1, 8\]"):
        mg.moe_gemv(x, w13, w2, ids, weights, route=mg.Route(logits[:, :4].contiguous()))
    with pytest.raises(ValueError, match="int32"):
        mg.moe_gemv(x, w13, w2, ids.long(), weights, route=mg.Route(logits))
    with pytest.raises(ValueError, match="one int64 element"):
        mg.moe_gemv(x, w13, w2, ids, weights, route=mg.Route(logits, woken=torch.zeros(2, dtype=torch.int64)))
    with pytest.raises(ValueError, match="plain SwiGLU"):
        mg._moe_gemv(x, w13, w2, ids, weights, clamped=(None, None, 1.0, 7.0), route=mg.Route(logits))


def _decode_step(engine, route_in_arm: bool, monkeypatch, gemv_runs: bool):
    """One fused one-row decode step of tiny after a 5-token prefill: (logits, the dispatcher, its launches)."""
    from kernels import launches

    if gemv_runs:  # the GEMV arm under the interpreter, as the step runs it on a GPU
        monkeypatch.setitem(ARMS, "gemv", dataclasses.replace(ARMS["gemv"], supports=lambda device: True))
    config = engine.config
    cache = KVCache.allocate(config, 1, 24, engine.device, engine.dtype)
    prompt = torch.randint(0, config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(13))
    dispatcher = Dispatcher(engine, flags.resolve(["moe_gate=gemv", f"route_in_arm={'on' if route_in_arm else 'off'}"],
                                                  environ={}), timed=False)
    forward(config, engine.weights, prompt, 0, cache, dispatcher)
    dispatcher.begin_step(1, DECODE, 1)
    before = launches.snapshot()
    logits = decode_fused.forward_decode(config, engine.weights, torch.tensor([[3]]), torch.tensor([5]), 24, None,
                                         cache, dispatcher)
    return logits, dispatcher, launches.since(before)


def test_a_decode_step_routing_in_the_arm_gives_the_bits_of_the_routers_fold(monkeypatch):
    engine = Engine.load("tiny", "cpu", seed=0)
    decode_fused.pack_qkv(engine.config, engine.weights)
    off, _, launched_off = _decode_step(engine, False, monkeypatch, gemv_runs=True)
    on, dispatcher, launched = _decode_step(engine, True, monkeypatch, gemv_runs=True)
    assert torch.equal(on, off)
    assert launched_off["gemv_route"] == engine.config.n_layers
    # the router's fold without its routing (gemv_norm) and no topk_softmax: the arm's launches routed
    assert launched.get("gemv_route", 0) == 0 and launched.get("topk_softmax", 0) == 0
    assert launched["moe_gemv.gate_up"] == engine.config.n_layers
    assert all("route_in_arm" not in record["execution_note"] for record in dispatcher.moe_records)
    assert [int(count) for count in dispatcher.pending_woken] == [engine.config.top_k] * engine.config.n_layers


@pytest.mark.parametrize("name", ["V2_LITE", "V2_RANKED"])
def test_deepseek_steps_routing_in_the_arm_give_the_routers_bits(name, monkeypatch):
    """V2-Lite's softmax over every expert, V2-ranked's renormalised x1.5 routing; shared experts folded into the
    same launches: route_in_arm on gives off's logits to the bit."""
    import test_decode_fused_mla as mla_tests

    config = getattr(mla_tests, name)
    monkeypatch.setitem(ARMS, "gemv", dataclasses.replace(ARMS["gemv"], supports=lambda device: True))
    engine = mla_tests._engine(config, True)
    logits = {}
    for value in ("off", "on"):
        cache, _ = mla_tests._prefilled(engine, 1)
        dispatcher = Dispatcher(engine, flags.resolve([f"route_in_arm={value}"], environ={}), timed=False)
        dispatcher.begin_step(1, DECODE, 1)
        logits[value] = decode_fused.forward_decode(config, engine.weights, torch.tensor([[3]]), torch.tensor([5]),
                                                    24, None, cache, dispatcher)
        assert all(record["shared_path"] == "routed launches" for record in dispatcher.moe_records)
    assert torch.equal(logits["on"], logits["off"])


def test_an_arm_that_takes_ids_gets_them_routed_first_and_says_so(monkeypatch):
    # on a CPU the GEMV arm is computed by the reference arm: the logits are routed by kernels.router first
    engine = Engine.load("tiny", "cpu", seed=0)
    off, _, _ = _decode_step(engine, False, monkeypatch, gemv_runs=False)
    on, dispatcher, launched = _decode_step(engine, True, monkeypatch, gemv_runs=False)
    assert launched["topk_softmax"] == engine.config.n_layers
    assert torch.equal(on, off)
    assert all("route_in_arm: the reference arm takes routed ids" in record["execution_note"]
               for record in dispatcher.moe_records)


# (experts, k, D, F, Fs, over_all): Qwen3-30B-A3B, DeepSeek-V2-Lite (its two shared experts folded), v4-shape
GPU_SHAPES = {"qwen3": (128, 8, 2048, 768, 0, False), "v2-lite": (64, 6, 2048, 1408, 2816, True),
              "v4": (256, 6, 4096, 2048, 0, False)}


@pytest.mark.gpu
@pytest.mark.parametrize("shape", sorted(GPU_SHAPES))
def test_gpu_route_in_arm_at_real_widths_in_a_cuda_graph(shape):
    """bf16 on the GPU, PDL and down's preload as the step runs them: the arm routing from the logits gives routing
    first's bits, eager and replayed from a CUDA graph on new logits each replay."""
    from test_moe_kernels import _capture

    experts, top_k, hidden, intermediate, shared_intermediate, over_all = GPU_SHAPES[shape]
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(experts)

    def draw(*size, scale=1.0):
        return (torch.randn(*size, generator=generator, device=device) * scale).to(torch.bfloat16)

    w13 = draw(experts, 2 * intermediate, hidden, scale=hidden ** -0.5)
    w2 = draw(experts, hidden, intermediate, scale=intermediate ** -0.5)
    shared = None
    if shared_intermediate:
        shared = (draw(2 * shared_intermediate, hidden, scale=hidden ** -0.5),
                  draw(hidden, shared_intermediate, scale=shared_intermediate ** -0.5))
    x = draw(1, hidden)
    logits = torch.randn(1, experts, generator=generator, device=device)
    ids, weights = torch.empty(1, top_k, dtype=torch.int32, device=device), torch.empty(1, top_k, dtype=torch.bfloat16,
                                                                                          device=device)
    count = torch.empty(1, dtype=torch.int64, device=device)

    def routed_first():
        first_ids, first_weights = topk_softmax(logits, top_k, torch.bfloat16, over_all=over_all)
        return mg.moe_gemv(x, w13, w2, first_ids, first_weights, shared=shared), first_ids, first_weights

    def in_arm():
        return mg.moe_gemv(x, w13, w2, ids, weights, shared=shared, route=mg.Route(logits, over_all, woken=count))

    want, want_ids, want_weights = routed_first()
    assert torch.equal(in_arm(), want) and torch.equal(ids, want_ids) and torch.equal(weights, want_weights)
    assert int(count) == top_k
    graph, static_out = _capture(in_arm)
    for replay in range(3):
        logits.copy_(torch.randn(1, experts, generator=generator, device=device))
        x.copy_(draw(1, hidden))
        graph.replay()
        want, want_ids, want_weights = routed_first()
        assert torch.equal(static_out, want), replay
        assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["demo", "v2-lite-tiny"])
def test_gpu_graphed_decode_with_route_in_arm_gives_the_same_tokens(model):
    """The graphed runtime with route_in_arm on and off: the same greedy tokens and woken counts (v2-lite-tiny:
    softmax over every expert, shared experts folded)."""
    from engine.model import random_weights_on
    from test_decode_fused_mla import V2_LITE

    device = torch.device("cuda")
    if model == "demo":
        engine = Engine.load("demo", "cuda", seed=0)
    else:
        engine = Engine(V2_LITE, device, 0, weights=random_weights_on(V2_LITE, 0, device, torch.bfloat16))
    prompts = [[7, 8, 9, 10, 11]]
    runs = {value: engine.generate_batch(prompts, 16, flags.resolve([f"route_in_arm={value}"], environ={}),
                                         graphs=True) for value in ("off", "on")}
    assert runs["on"].tokens == runs["off"].tokens
    woken = {value: [[record["woken_observed"] for record in step["moe"]] for step in run.steps
                     if step["phase"] == "decode"] for value, run in runs.items()}
    assert woken["on"] == woken["off"]
    decode = [step for step in runs["on"].steps if step["phase"] == "decode"]
    assert {step["graph"] for step in decode[1:]} == {"replay"}
