"""The fused decode step of DeepSeek-V2/V3-family layers (engine.decode_fused_mla, kernels.mla_rope_cache,
kernels.mla_absorb, the routers' softmax-over-all and routed scaling) against the torch expressions of
engine.model and engine.mla they replace.

CPU: the kernels under the Triton interpreter at small, odd sizes, fp32 and fp16, on fresh random inputs,
inside `poison_new_buffers()` so an unwritten element shows up as NaN. The whole decode step is compared
with the torch forward (itself matched to transformers in tests/test_hf_deepseek.py) on tiny DeepSeek-V2
configs: logits, the latent cache, and greedy tokens over several steps, with either attention arm. GPU
(`-m gpu`): bf16 at DeepSeek-V2-Lite's widths (27 layers cut to 3), fused against torch.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_decode_fused import _close, _draw  # the other families' draws and tolerances

from engine import arms, decode_fused, decode_fused_mla, flags, mla
from engine.config import (
    LatentAttention,
    LayerMask,
    ModelConfig,
    SharedExperts,
    YarnScaling,
)
from engine.model import KVCache, StepLayout, forward, random_weights, route
from engine.rope import yarn_inverse_frequency
from engine.routing import group_limited_topk
from engine.runtime import Dispatcher, Engine
from kernels import launches, scratch
from kernels.gemv_fused import Norm, Route, gemv_fused
from kernels.mla_absorb import absorb, unabsorb
from kernels.mla_rope_cache import mla_rope_cache
from kernels.router import group_topk, topk_softmax


def _config(**changes) -> ModelConfig:
    """A DeepSeek-V2-Lite-shaped tiny model: latent attention with one q projection and interleaved YaRN RoPE,
    2 shared experts, a dense first layer, softmax-then-top-k routing without renormalisation."""
    base = ModelConfig(
        name="v2-lite-tiny", n_layers=3, hidden=64, intermediate=16, n_experts=8, top_k=2, n_heads=4, n_kv_heads=4,
        head_dim=28, vocab_size=300, max_seq_len=64, layer_masks=(LayerMask(),) * 3, norm_eps=1e-6, sinks=False,
        router="softmax_topk", norm_topk_prob=False,
        latent_attention=LatentAttention(kv_lora_rank=32, qk_nope_head_dim=12, qk_rope_head_dim=16, v_head_dim=12,
                                         softmax_scale=28 ** -0.5 * 1.2),
        shared_experts=SharedExperts(2, 32), dense_layers=(0,), dense_intermediate=40,
        rope_scaling=YarnScaling(factor=4.0, original_max_position=16, attention_factor=1.05))
    return dataclasses.replace(base, **changes)


V2_LITE = _config()
# q through its low-rank bottleneck, first/second-half RoPE, routed scaling, renormalised softmax-top-k, no dense
# layer, plain RoPE
V2_RANKED = _config(name="v2-ranked-tiny", latent_attention=dataclasses.replace(
    V2_LITE.latent_attention, q_lora_rank=24, rope_interleave=False), routed_scaling_factor=1.5, norm_topk_prob=True,
    dense_layers=(), dense_intermediate=0, rope_scaling=None)

# DeepSeek-V3's router: sigmoid scores, the correction bias, the best 2 of 4 groups, renormalised, x2.5
V3 = _config(name="v3-tiny", router="sigmoid_group_topk", n_group=4, topk_group=2, routed_scaling_factor=2.5,
             norm_topk_prob=True, shared_experts=SharedExperts(1, 16), latent_attention=dataclasses.replace(
                 V2_LITE.latent_attention, q_lora_rank=24))
# DeepSeek-V2's group_limited_greedy: softmax scores, a group's largest, x1.5
V2_GROUPED = _config(name="v2-grouped-tiny", router="softmax_group_topk", n_group=4, topk_group=2,
                     routed_scaling_factor=1.5, dense_layers=(), dense_intermediate=0)


def _weights(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Random weights with every norm weight off one, so each norm's weight matters."""
    weights = random_weights(config, seed, torch.device("cpu"), torch.float32)
    generator = torch.Generator().manual_seed(seed + 1)
    for name, tensor in weights.items():
        if name.endswith("norm"):
            weights[name] = 1 + 0.3 * torch.randn(tensor.shape, generator=generator)
    return weights


# ------------------------------------------------------------------------------------------------ kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("interleaved, rope_scale, latent_rank", [(True, 1.05, 32), (False, 1.0, 24)])
def test_mla_rope_cache_rotates_q_and_writes_the_normed_latent_and_key(dtype, interleaved, rope_scale, latent_rank):
    batch, heads, nope, rope, capacity = 3, 5, 12, 16, 20
    q = _draw(batch, heads * (nope + rope), dtype=dtype, seed=1)
    kv_wide = _draw(batch, latent_rank + rope + 7, dtype=dtype, seed=2)  # a view with a row stride of its own
    kv = kv_wide[:, :latent_rank + rope]
    norm = (1 + 0.3 * _draw(latent_rank, seed=3)).to(dtype)
    inv_freq = 0.5 ** torch.arange(rope // 2, dtype=torch.float32)
    positions, slots = torch.tensor([0, 13, 19]), torch.tensor([2, 0, 1])
    cache = _draw(3, capacity, 1, latent_rank + rope, dtype=dtype, seed=4)
    expected_cache = cache.clone()
    with scratch.poison_new_buffers():
        q_out, position32 = mla_rope_cache(q, kv, norm, 1e-6, inv_freq, rope_scale, positions, slots, cache,
                                           heads, nope, interleaved)
    assert position32.dtype == torch.int32 and torch.equal(position32.long(), positions)
    angles = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = (angles.cos() * rope_scale)[:, None, :], (angles.sin() * rope_scale)[:, None, :]  # [B, 1, r/2]
    q_heads = q.view(batch, 1, heads, nope + rope)
    expected_q = torch.cat([q_heads[..., :nope], mla._rope(q_heads[..., nope:], cos, sin, interleaved)], dim=-1)
    _close(q_out, expected_q[:, 0], dtype)
    latent = mla._rms_norm(kv[:, :latent_rank], norm, 1e-6)
    key = mla._rope(kv[:, None, None, latent_rank:], cos, sin, interleaved)[:, 0, 0]
    expected_cache[slots, positions, 0] = torch.cat([latent, key], dim=-1)
    _close(cache, expected_cache, dtype)


def test_mla_rope_cache_rejects_bad_inputs():
    cache = torch.zeros(1, 4, 1, 48)
    inv_freq = torch.ones(8)
    with pytest.raises(ValueError, match="q"):
        mla_rope_cache(torch.zeros(1, 10), torch.zeros(1, 48), torch.ones(32), 1e-6, inv_freq, 1.0, torch.tensor([0]),
                       None, cache, 4, 12, True)
    with pytest.raises(ValueError, match="kv"):
        mla_rope_cache(torch.zeros(1, 112), torch.zeros(1, 40), torch.ones(32), 1e-6, inv_freq, 1.0,
                       torch.tensor([0]), None, cache, 4, 12, True)
    with pytest.raises(ValueError, match="dtype"):
        mla_rope_cache(torch.zeros(1, 112, dtype=torch.float16), torch.zeros(1, 48), torch.ones(32), 1e-6, inv_freq,
                       1.0, torch.tensor([0]), None, cache, 4, 12, True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows, heads, nope, rope, value, latent_rank", [(1, 4, 12, 16, 12, 32), (5, 3, 20, 8, 9, 48)])
def test_absorb_and_unabsorb_are_engine_mlas_products(dtype, rows, heads, nope, rope, value, latent_rank):
    config = _config(n_heads=heads, n_kv_heads=heads, head_dim=nope + rope, latent_attention=LatentAttention(
        kv_lora_rank=latent_rank, qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=value))
    kv_b = (_draw(heads * (nope + value), latent_rank, dtype=torch.float32, seed=5) / nope ** 0.5).to(dtype)
    q = _draw(rows, heads, nope + rope, dtype=dtype, seed=6)
    with scratch.poison_new_buffers():
        absorbed = absorb(q, kv_b, nope, value)
    _close(absorbed, mla.absorb_query(config, q.float()[None], kv_b.float())[0], dtype)
    out_latent = _draw(rows, heads, latent_rank, dtype=dtype, seed=7)
    with scratch.poison_new_buffers():
        out = unabsorb(out_latent, kv_b, nope, value)
    _close(out, mla.unabsorb_output(config, out_latent.float()[None], kv_b.float())[0], dtype)
    with pytest.raises(ValueError, match="rows"):
        absorb(torch.zeros(65, heads, nope + rope, dtype=dtype), kv_b, nope, value)


def _unabsorb_of_splits_is_combine_then_unabsorb(device, dtype, batch, steps, heads, latent_rank, rope, splits):
    """mla_split's partials merged by unabsorb against the combine kernel's merge then unabsorb: the same bits,
    and the attention itself against its reference."""
    from kernels.attention_mla import combine, mla_split
    from kernels.reference import mla_latent_reference

    nope = value = 16
    generator = torch.Generator().manual_seed(batch * 100 + splits)
    draw = lambda *shape: torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)  # noqa: E731
    kv_b, cache = draw(heads * (nope + value), latent_rank) / nope ** 0.5, draw(batch, 300, 1, latent_rank + rope)
    q = draw(batch, steps, heads, latent_rank + rope)
    q_start = torch.tensor([299 - steps, 170, 41][:batch], device=device)
    with scratch.poison_new_buffers():
        split = mla_split(q, cache, latent_rank, 0.1, q_start, num_splits=splits)
        assert (split.partials is None) == (splits == 1)
        merged_here = unabsorb(split.out.view(batch * steps, heads, latent_rank), kv_b, nope, value, split)
        latent = split.out if splits == 1 else combine(split)
        merged_apart = unabsorb(latent.view(batch * steps, heads, latent_rank), kv_b, nope, value)
    assert torch.equal(merged_here, merged_apart)
    _close(latent.float(), mla_latent_reference(q.float(), cache.float(), latent_rank, 0.1, q_start), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("batch, steps, heads, splits", [(1, 1, 16, 3), (2, 1, 5, 2), (2, 3, 4, 4), (1, 1, 4, 1)])
def test_unabsorb_merges_the_splits_as_the_combine_kernel_does(dtype, batch, steps, heads, splits):
    _unabsorb_of_splits_is_combine_then_unabsorb("cpu", dtype, batch, steps, heads, 32, 16, splits)


@pytest.mark.gpu
@pytest.mark.parametrize("batch, splits", [(1, 1), (1, 5), (3, 8)])
def test_gpu_unabsorb_merges_the_splits_as_the_combine_kernel_does(batch, splits):
    _unabsorb_of_splits_is_combine_then_unabsorb("cuda", torch.bfloat16, batch, 1, 16, 512, 64, splits)


@pytest.mark.parametrize("over_all, scale, renormalise", [(True, 1.0, False), (True, 2.5, False), (False, 1.5, True)])
def test_router_weights_over_every_expert_and_scaled_are_engine_models(over_all, scale, renormalise):
    h, router = _draw(3, 40, seed=8), _draw(11, 40, seed=9)
    logits = h @ router.t()
    expected_ids, expected = route(h, router, 3, kind="softmax_topk", norm_topk_prob=renormalise)
    with scratch.poison_new_buffers():
        ids, weights = topk_softmax(logits, 3, torch.float32, over_all=over_all, scale=scale)
    assert torch.equal(ids, expected_ids)
    _close(weights, expected * scale, torch.float32)
    if not renormalise:
        assert weights.sum(-1).max() < scale  # the k chosen of all 11: less than the whole
    x, residual = _draw(1, 40, seed=10), _draw(1, 40, seed=11)
    with scratch.poison_new_buffers():
        folded = gemv_fused(x, router, norm=Norm(torch.ones(40), 1e-6, residual=residual, write_h=True, exact=True),
                            route=Route(3, torch.float32, over_all=over_all, scale=scale))
    ids, weights = topk_softmax(folded.out, 3, torch.float32, over_all=over_all, scale=scale)
    assert torch.equal(folded.ids, ids)
    _close(folded.weights, weights, torch.float32)


@pytest.mark.parametrize("kind, normalise, biased", [("softmax_group_topk", False, False),
                                                     ("sigmoid_group_topk", True, True),
                                                     ("sigmoid_group_topk", False, False)])
@pytest.mark.parametrize("experts, n_group, topk_group, k", [(16, 4, 2, 3), (24, 8, 3, 6)])
def test_group_topk_is_engine_routings_group_limited_router(kind, normalise, biased, experts, n_group, topk_group, k):
    h, router = _draw(7, 40, seed=15), _draw(experts, 40, seed=16) / 3
    bias = 0.3 * _draw(experts, seed=17) if biased else None
    logits = h @ router.t()
    group = experts // n_group
    logits[2, :group] = logits[2].max() + 0.5  # a tied group on top: ties to the lowest id
    expected_ids, expected = group_limited_topk(h, router, k, n_group, topk_group, kind, bias, normalise)
    with scratch.poison_new_buffers():
        ids, weights, woken = group_topk(logits, k, n_group, topk_group, kind, torch.float32, bias=bias,
                                         norm_topk_prob=normalise, scale=2.0, woken=True)
    # torch's top-k is unsorted: compare as sets, each id with its weight; row 2's tie is checked apart
    rows = [row for row in range(7) if row != 2]
    order, expected_order = ids.long().sort(-1), expected_ids.long().sort(-1)
    assert torch.equal(order.values[rows], expected_order.values[rows])
    _close(weights.gather(1, order.indices)[rows], 2.0 * expected.gather(1, expected_order.indices)[rows],
           torch.float32)
    group_of = ids.long() // group
    assert all(len(set(row.tolist())) <= topk_group for row in group_of)  # from the kept groups only
    assert int(woken) == len(set(ids.reshape(-1).tolist()))
    if not biased:  # the choice is the weight: descending, and the tie in lane order
        assert torch.all(weights[:, :-1] >= weights[:, 1:])
        assert ids[2, :min(k, group)].tolist() == list(range(min(k, group)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_swiglu_at_one_row_is_the_torch_mlp(dtype):
    h = _draw(1, 48, dtype=dtype, seed=12)
    gate_up, down = (_draw(2 * 40, 48, seed=13) / 7).to(dtype), (_draw(48, 40, seed=14) / 6).to(dtype)
    with scratch.poison_new_buffers():
        fused = decode_fused_mla.swiglu(h, gate_up, down, True)
    gate, up = (h.float() @ gate_up.float().t()).chunk(2, dim=-1)
    _close(fused, (torch.nn.functional.silu(gate) * up) @ down.float().t(), dtype)


def test_pack_latent_keeps_values_and_makes_one_matrix():
    for config in (V2_LITE, V2_RANKED):
        weights = _weights(config, 0)
        names = ["layers.1.wq" if config.latent_attention.q_lora_rank is None else "layers.1.wq_a", "layers.1.wkv_a"]
        before = [weights[name].clone() for name in names]
        assert decode_fused_mla.packed_rows(weights, names) is None
        decode_fused.pack_qkv(config, weights)
        assert torch.equal(decode_fused_mla.packed_rows(weights, names), torch.cat(before))
        assert all(torch.equal(weights[name], value) for name, value in zip(names, before))


# ------------------------------------------------------------------------------------------------ the step


def test_eligibility_of_the_deepseek_features():
    one = torch.zeros(1, 1, dtype=torch.long)
    assert decode_fused.ineligible(V2_LITE) == "" and decode_fused.eligible(V2_LITE, one, force=True)
    assert decode_fused.ineligible(V2_RANKED) == ""
    assert decode_fused.ineligible(V3) == "" and decode_fused.ineligible(V2_GROUPED) == ""
    gated = _config(shared_experts=SharedExperts(1, 32, gated=True))
    assert decode_fused.ineligible(gated) == ""  # the gate's sigmoid scale after the shared MLP, as SharedMLP
    plain = dataclasses.replace(_config(), latent_attention=None, head_dim=32, n_kv_heads=2, shared_experts=None,
                                dense_layers=(), dense_intermediate=0)
    assert decode_fused.ineligible(plain) == ""  # YaRN outside latent attention: its factor in rope_cache


def _engine(config: ModelConfig, packed: bool) -> Engine:
    engine = Engine(config, torch.device("cpu"), 0, weights=_weights(config, 3))
    if packed:
        decode_fused.pack_qkv(config, engine.weights)
    return engine


def _prefilled(engine: Engine, batch: int = 3, capacity: int = 24):
    """A cache of `batch` rows after a 5-token prefill of each, and the dispatcher that ran it."""
    cache = KVCache.allocate(engine.config, batch, capacity, engine.device, engine.dtype)
    prompt = torch.randint(0, engine.config.vocab_size, (batch, 5), generator=torch.Generator().manual_seed(13))
    dispatcher = Dispatcher(engine, flags.resolve(environ={}), timed=False)
    forward(engine.config, engine.weights, prompt, 0, cache, dispatcher)
    return cache, dispatcher


@pytest.fixture(params=["mla_reference", "mla_fused"])
def attention_arm(request, monkeypatch):
    """Which latent attention arm the dispatcher runs on this CPU: the reference, or the fused arm (mla_decode
    and kernels.mla_absorb) under the interpreter."""
    if request.param == "mla_fused":
        monkeypatch.setitem(arms.ARMS, "mla_fused", dataclasses.replace(arms.ARMS["mla_fused"],
                                                                        supports=lambda device: True))
    return request.param


@pytest.mark.parametrize("config, rows, slots, packed", [
    (V2_LITE, 1, None, True), (V2_LITE, 3, torch.tensor([2, 0, 1]), True), (V2_LITE, 1, torch.tensor([1]), False),
    (V2_RANKED, 1, None, True), (V2_RANKED, 3, None, False), (V3, 1, None, True), (V3, 3, torch.tensor([1, 2, 0]), True),
    (V2_GROUPED, 1, None, True)], ids=["lite-1", "lite-3-slots", "lite-1-unpacked", "ranked-1", "ranked-3-unpacked",
                                       "v3-1", "v3-3-slots", "v2-grouped-1"])
def test_fused_decode_step_of_deepseek_v2_matches_the_torch_forward(config, rows, slots, packed, attention_arm):
    """One row: GEMVs, the router's fold (softmax over every expert, or scaled), the shared experts and the dense
    layer through kernels.moe_gemv; three rows: torch products between the kernels. The same attention arm on
    both sides; the records say which ran."""
    engine = _engine(config, packed)
    tokens, start = torch.tensor([[3], [200], [77]])[:rows], torch.tensor([5, 5, 5])[:rows]
    fused_cache, fused_dispatcher = _prefilled(engine)
    torch_cache, torch_dispatcher = _prefilled(engine)
    fused_dispatcher.begin_step(1, "decode", rows)
    before = launches.snapshot()
    fused = decode_fused.forward_decode(config, engine.weights, tokens, start, 24, slots, fused_cache, fused_dispatcher)
    launched = launches.since(before)
    moe_layers, dense_layers = len(config.moe_layers), len(config.dense_layers)
    assert launched["mla_rope_cache"] == config.n_layers
    if config.router in ("softmax_group_topk", "sigmoid_group_topk"):  # unfolded: its own launch at any width
        assert launched["group_topk"] == moe_layers and "gemv_route" not in launched
    elif rows == 1:  # the router's fold per MoE layer
        assert launched["gemv_route"] == moe_layers and "topk_softmax" not in launched
    else:
        assert launched["topk_softmax"] == moe_layers and "gemv_route" not in launched
    if rows == 1:  # moe_gemv for the shared experts and the dense MLPs
        # the routed experts take the reference arm on a CPU: each gate-up launch is a shared or a dense MLP's
        assert launched["moe_gemv.gate_up"] == moe_layers + dense_layers
    from engine.model import _forward_ragged

    reference = _forward_ragged(config, engine.weights, tokens, StepLayout(start, 24, slots), torch_cache,
                                torch_dispatcher)
    _close(fused, reference, torch.float32)
    for layer in range(config.n_layers):
        _close(fused_cache.k[layer], torch_cache.k[layer], torch.float32)
    records = fused_dispatcher.attention_records
    assert [record["executed_arm"] for record in records] == [attention_arm] * config.n_layers
    assert [record["layer"] for record in fused_dispatcher.moe_records] == list(config.moe_layers)


def test_fused_decode_steps_give_the_torch_forwards_greedy_tokens(attention_arm):
    """Six greedy steps of one row, each a fused step against the torch forward's from the same cache state: the
    same tokens, the logits to fp32 rounding, with YaRN positions moving on."""
    config = V2_LITE
    engine = _engine(config, True)
    fused_cache, dispatcher = _prefilled(engine, 1)
    torch_cache, _ = _prefilled(engine, 1)
    fused_token = torch_token = torch.tensor([[7]])
    fused_tokens, torch_tokens = [], []
    for step in range(6):
        position = 5 + step
        start = torch.tensor([position])
        fused = decode_fused.forward_decode(config, engine.weights, fused_token, start, position + 1, None, fused_cache,
                                            dispatcher)
        reference = forward(config, engine.weights, torch_token, position, torch_cache, dispatcher)  # the CPU's torch
        _close(fused, reference, torch.float32)
        fused_token, torch_token = fused.argmax(-1, keepdim=True), reference.argmax(-1, keepdim=True)
        fused_tokens.append(int(fused_token))
        torch_tokens.append(int(torch_token))
    assert fused_tokens == torch_tokens


@pytest.fixture
def gemv_on_cpu(monkeypatch):
    """The routed experts on the GEMV arm, under the interpreter (a CPU dispatcher would run the reference arm):
    the arm the shared experts ride with shared_fold=on."""
    monkeypatch.setitem(arms.ARMS, "gemv", dataclasses.replace(arms.ARMS["gemv"], supports=lambda device: True))


# one shared expert of Fs = 24 over routed F = 16: two chunks, the second masked to 8 units
ODD_SHARED = _config(name="v2-odd-shared-tiny", shared_experts=SharedExperts(1, 24))


def _fold_flags(fold: bool) -> flags.ResolvedFlags:
    return flags.resolve([f"shared_fold={'on' if fold else 'off'}"], environ={})


@pytest.mark.parametrize("config", [V2_RANKED, V3, ODD_SHARED], ids=["ranked-x1.5", "v3-x2.5", "odd-Fs-24-of-F-16"])
def test_shared_fold_in_the_fused_step_matches_the_torch_forward(config, gemv_on_cpu):
    """One row, the routed experts on the GEMV arm: with shared_fold=on the shared experts ride its two launches
    (one gate-up and one down per MoE layer, no add), off they take two of their own; both match the torch
    forward (routed + shared(h), shared at weight 1 whatever routed_scaling_factor). The records say which path
    ran, and the decision and the woken count are the same either way: shared experts are not routed."""
    from engine.model import _forward_ragged

    engine = _engine(config, True)
    token, start = torch.tensor([[3]]), torch.tensor([5])
    runs = {}
    for fold in (True, False):
        cache, _ = _prefilled(engine, 1)
        dispatcher = Dispatcher(engine, _fold_flags(fold), timed=False)
        dispatcher.begin_step(1, "decode", 1)
        before = launches.snapshot()
        logits = decode_fused.forward_decode(config, engine.weights, token, start, 24, None, cache, dispatcher)
        launched = launches.since(before)
        dispatcher.end_step_batch(logits.argmax(-1))
        runs[fold] = (logits, launched, dispatcher.moe_records)
    torch_cache, torch_dispatcher = _prefilled(engine, 1)
    reference = _forward_ragged(config, engine.weights, token, StepLayout(start, 24), torch_cache, torch_dispatcher)
    moe_layers, dense_layers = len(config.moe_layers), len(config.dense_layers)
    for fold, (logits, launched, records) in runs.items():
        _close(logits, reference, torch.float32)
        for kernel in ("moe_gemv.gate_up", "moe_gemv.down"):
            assert launched[kernel] == (1 if fold else 2) * moe_layers + dense_layers, (fold, launched)
        assert [record["executed_arm"] for record in records] == ["gemv"] * moe_layers
        assert [record["shared_path"] for record in records] == ["routed launches" if fold else "apart"] * moe_layers
        assert all(record["shared_reason"].startswith(f"shared_fold={'on' if fold else 'off'}") for record in records)
        assert all(record["woken_observed"] == config.top_k for record in records)  # the k routed, no shared
    assert f"{-(-config.shared_experts.intermediate // config.intermediate)} extra pairs" in \
        runs[True][2][0]["shared_reason"]

    def routed_fields(record):
        return {key: value for key, value in record.items() if key not in ("shared_path", "shared_reason")}

    assert [routed_fields(record) for record in runs[True][2]] == [routed_fields(record) for record in runs[False][2]]


def test_greedy_tokens_with_the_shared_fold_are_the_torch_forwards(gemv_on_cpu):
    """Three greedy steps of one row with shared_fold=on (routed_scaling_factor 1.5: a shared term scaled with the
    routed weights, or dropped, moves the logits far outside fp32 rounding) against the torch forward's."""
    config = V2_RANKED
    engine = _engine(config, True)
    fused_cache, _ = _prefilled(engine, 1)
    torch_cache, torch_dispatcher = _prefilled(engine, 1)
    dispatcher = Dispatcher(engine, _fold_flags(True), timed=False)
    fused_token = torch_token = torch.tensor([[7]])
    fused_tokens, torch_tokens = [], []
    for step in range(3):
        position = 5 + step
        dispatcher.begin_step(step + 1, "decode", 1)
        fused = decode_fused.forward_decode(config, engine.weights, fused_token, torch.tensor([position]),
                                            position + 1, None, fused_cache, dispatcher)
        assert {record["shared_path"] for record in dispatcher.moe_records} == {"routed launches"}
        reference = forward(config, engine.weights, torch_token, position, torch_cache, torch_dispatcher)
        _close(fused, reference, torch.float32)
        fused_token, torch_token = fused.argmax(-1, keepdim=True), reference.argmax(-1, keepdim=True)
        fused_tokens.append(int(fused_token))
        torch_tokens.append(int(torch_token))
    assert fused_tokens == torch_tokens


def test_where_the_shared_experts_run_and_why():
    """Dispatcher._shared_path: the fold only for ungated shared experts, the plain GEMV arm, a one-row decode
    step and shared_fold=on; every other case keeps them apart and the reason names the first that does."""
    from engine.model import SharedMLP

    engine = _engine(V2_LITE, False)
    p = "layers.1."
    gate_up, down = engine.weights[p + "shared_gate_up"], engine.weights[p + "shared_down"]
    w13 = engine.weights[p + "w13"]
    shared = decode_fused_mla.SharedExpertsDecode(gate_up, down, True)
    gated = SharedMLP(SharedExperts(2, 32, gated=True), gate_up, down, torch.ones(1, V2_LITE.hidden))
    one, three = torch.zeros(1, V2_LITE.hidden), torch.zeros(3, V2_LITE.hidden)
    on, off = Dispatcher(engine, _fold_flags(True), timed=False), Dispatcher(engine, _fold_flags(False), timed=False)
    on.begin_step(1, "decode", 1)
    off.begin_step(1, "decode", 1)
    fold, why = on._shared_path(shared, "gemv", None, one, w13, False)
    assert fold and why.startswith("shared_fold=on") and "2 extra pairs of F=16 per row (Fs=32), weight 1" in why
    cases = [(off, shared, "gemv", one, False, "shared_fold=off"),
             (on, gated, "gemv", one, False, "sigmoid-gated"),
             (on, shared, "grouped", one, False, "the grouped arm runs the routed experts"),
             (on, shared, "trellis_gemv", one, False, "the trellis_gemv arm"),
             (on, shared, "gemv", three, False, "a decode step of 3 rows"),
             (on, None, "gemv", one, True, "expert parallel")]
    for dispatcher, handed, arm, rows, local, words in cases:
        fold, why = dispatcher._shared_path(handed, arm, None, rows, w13, local)
        assert not fold and words in why, (arm, why)
    on.begin_step(2, "prefill", 1)
    fold, why = on._shared_path(shared, "gemv", None, one, w13, False)
    assert not fold and "a prefill step of 1 rows" in why


def test_yarn_frequencies_reach_the_step():
    """The step's RoPE table is YaRN's (interpolated low frequencies), not plain RoPE's."""
    table = decode_fused._inverse_frequency(V2_LITE, torch.device("cpu"))
    assert torch.equal(table, yarn_inverse_frequency(V2_LITE, torch.device("cpu")))
    plain = decode_fused._inverse_frequency(V2_RANKED, torch.device("cpu"))
    assert not torch.equal(table, plain) and torch.equal(table[0], plain[0])  # the fastest dim is kept


# ------------------------------------------------------------------------------------------------ GPU


def _v2_lite_widths(variant: str) -> ModelConfig:
    """bench/configs/deepseek-v2-lite (hidden 2048, 16 heads, latent 512 + 64, 64 experts top-6, 2 shared, a dense
    first layer, YaRN) cut to 3 layers and a 4096-token vocabulary; `v3-routing`: DeepSeek-V3's router on it
    (sigmoid, correction bias, the best 4 of 8 groups, renormalised, x2.5) and a q bottleneck of rank 384."""
    from pathlib import Path

    from engine.hf_loader import read_config

    config, _ = read_config(Path(__file__).resolve().parents[1] / "bench" / "configs" / "deepseek-v2-lite")
    config = dataclasses.replace(config, n_layers=3, layer_masks=(LayerMask(),) * 3, vocab_size=4096)
    if variant == "v3-routing":
        config = dataclasses.replace(config, router="sigmoid_group_topk", n_group=8, topk_group=4,
                                     norm_topk_prob=True, routed_scaling_factor=2.5,
                                     latent_attention=dataclasses.replace(config.latent_attention, q_lora_rank=384))
    return config


def _gpu_engine(config: ModelConfig) -> Engine:
    from engine.bench import device_random_weights

    device = torch.device("cuda")
    return Engine(config, device, 0, weights=device_random_weights(config, 0, device, torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["v2-lite", "v3-routing"])
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("shared_fold", [False, True], ids=["apart", "fold"])
def test_gpu_fused_decode_of_deepseek_v2_lite_widths_matches_torch(variant, rows, shared_fold):
    """The fused step (GEMVs, folds, kernels.mla_rope_cache, the fused MLA arm, group_topk) against the torch glue
    with the same arms, bf16: a few roundings per term (moe_gemv's SwiGLU rounds its hidden once where torch
    rounds four times), inside 2e-2. shared_fold=on: at one row the shared experts ride the routed GEMV launches
    (the records say so); the reference keeps them apart."""
    from engine.model import _forward_ragged

    config = _v2_lite_widths(variant)
    engine = _gpu_engine(config)
    device = engine.device
    assert decode_fused.eligible(config, torch.zeros(rows, 1, dtype=torch.long, device=device))
    caches = [KVCache.allocate(config, rows, 64, device, engine.dtype) for _ in range(2)]
    prompt = torch.randint(0, config.vocab_size, (rows, 20), generator=torch.Generator().manual_seed(5)).cuda()
    dispatcher = Dispatcher(engine, _fold_flags(shared_fold), timed=False)
    apart = Dispatcher(engine, _fold_flags(False), timed=False)
    with torch.inference_mode():
        for cache in caches:
            forward(config, engine.weights, prompt, 0, cache, dispatcher)
        tokens, start = prompt[:, -1:].contiguous(), torch.full((rows,), 20, device="cuda")
        dispatcher.begin_step(1, "decode", rows)
        apart.begin_step(1, "decode", rows)
        fused = decode_fused.forward_decode(config, engine.weights, tokens, start, 64, None, caches[0], dispatcher)
        assert {record["executed_arm"] for record in dispatcher.attention_records} == {"mla_fused"}
        paths = {record["shared_path"] for record in dispatcher.moe_records}
        assert paths == ({"routed launches"} if shared_fold and rows == 1 else {"apart"}), paths
        reference = _forward_ragged(config, engine.weights, tokens, StepLayout(start, 64), caches[1], apart)
    _close(fused, reference, torch.bfloat16)
    for layer in range(config.n_layers):
        _close(caches[0].k[layer], caches[1].k[layer], torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("shared_fold", ["off", "on"])
def test_gpu_graphed_deepseek_decode_equals_eager_and_replays(shared_fold):
    """Through the runtime every entry point uses: decode steps replay CUDA graphs of the fused step, and give the
    eager run's tokens and logits to the bit; the footer's decode glue says fused. shared_fold=on: every decode
    record's shared experts rode the routed GEMV launches (2 kernels, not 4, in its arm)."""
    engine = _gpu_engine(_v2_lite_widths("v2-lite"))
    prompt = list(range(11, 31))
    graphed = engine.generate(prompt, 16, flags.resolve([f"shared_fold={shared_fold}"], environ={}))
    eager = engine.generate(prompt, 16, flags.resolve(["layer_timing=events", f"shared_fold={shared_fold}"],
                                                      environ={}))
    assert engine.decode_glue == "fused"
    assert graphed.graphs == "on" and eager.graphs.startswith("off")
    assert graphed.tokens == eager.tokens
    assert all(torch.equal(a, b) for a, b in zip(graphed.logits, eager.logits))
    decode = [step for step in graphed.steps if step["phase"] == "decode"]
    assert sum(step["graph"] == "replay" for step in decode) >= len(decode) - 2, \
        [(step["graph"], step.get("eager_reason")) for step in decode[:3]]
    assert all(record["executed_arm"] == "mla_fused" for step in decode for record in step["attention"])
    assert all(record["forward"].startswith("decode steps on a GPU") for step in decode for record in step["moe"])
    expected = "routed launches" if shared_fold == "on" else "apart"
    for run in (graphed, eager):
        moe = [record for step in run.steps if step["phase"] == "decode" for record in step["moe"]]
        assert {record["shared_path"] for record in moe} == {expected}
        assert {record["executed_arm"] for record in moe} == {"gemv"}
    if shared_fold == "on":  # the eager run's records list the arm's kernels: the routed launches, no more
        eager_moe = [record for step in eager.steps if step["phase"] == "decode" for record in step["moe"]]
        assert all(len(record["arm_kernels"]) == 2 for record in eager_moe), eager_moe[0]["arm_kernels"]
