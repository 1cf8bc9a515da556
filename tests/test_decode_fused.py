"""The fused decode glue (kernels.gemv, kernels.rms_norm, kernels.rope_cache, kernels.router and
engine.decode_fused) against the torch expressions of engine.model they replace.

CPU: the kernels under the Triton interpreter at small, odd sizes, fp32 and fp16, on fresh random
inputs, each inside `poison_new_buffers()` so an unwritten element shows up as NaN. The decode
forward is compared with the torch forward on the tiny preset. GPU (`-m gpu`): bf16 at the
v4-shape widths, and the whole engine's decode logits fused vs torch.
"""

import functools
from dataclasses import replace

import pytest
import torch

from engine import decode_fused, flags
from engine.config import PRESETS
from engine.model import KVCache, StepLayout, apply_rope, forward, random_weights, rms_norm
from engine.runtime import Dispatcher, Engine
from kernels import scratch
from kernels.gemv import gemv
from kernels.rms_norm import rms_norm as fused_rms_norm
from kernels.rope_cache import rope_cache
from kernels.router import topk_softmax

TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _draw(*shape, dtype=torch.float32, device="cpu", seed=0):
    generator = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(*shape, generator=generator, device=device).to(dtype)


def _close(actual, expected, dtype):
    scale = expected.float().abs().max().clamp_min(1e-6)
    error = (actual.float() - expected.float()).abs().max() / scale
    assert torch.isfinite(actual.float()).all()
    assert error <= TOLERANCE[dtype], f"relative error {error:.2e} > {TOLERANCE[dtype]:.0e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows, n_out, k_in", [(1, 37, 70), (3, 64, 96), (8, 5, 33), (9, 40, 50), (32, 17, 64)])
@pytest.mark.parametrize("out_float", [False, True])
def test_gemv_matches_torch(dtype, rows, n_out, k_in, out_float):
    x, w = _draw(rows, k_in, dtype=dtype, seed=1), _draw(n_out, k_in, dtype=dtype, seed=2)
    with scratch.poison_new_buffers():
        out = gemv(x, w, torch.float32 if out_float else None)
    expected = x.float() @ w.float().t()
    assert out.dtype == (torch.float32 if out_float else dtype)
    _close(out, expected if out_float else expected.to(dtype), dtype)


def test_gemv_small_blocks_walk_every_column():
    x, w = _draw(2, 100, seed=3), _draw(9, 100, seed=4)
    with scratch.poison_new_buffers():
        out = gemv(x, w, block=(2, 16))  # 7 K steps with a ragged tail, 5 programs with a ragged last
    _close(out, x @ w.t(), torch.float32)


def test_gemv_rejects_bad_inputs():
    with pytest.raises(ValueError, match="same K"):
        gemv(torch.ones(1, 4), torch.ones(3, 5))
    with pytest.raises(ValueError, match="rows"):
        gemv(torch.ones(65, 4), torch.ones(3, 4))
    with pytest.raises(ValueError, match="tensor cores"):
        gemv(torch.ones(16, 4), torch.ones(3, 4), block=(8, 16))
    with pytest.raises(ValueError, match="dtype|float16"):
        gemv(torch.ones(1, 4), torch.ones(3, 4, dtype=torch.float16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hidden", [48, 100])
def test_rms_norm_residual_and_gather_match_torch(dtype, hidden):
    x, residual = _draw(3, hidden, dtype=dtype, seed=5), _draw(3, hidden, dtype=dtype, seed=6)
    weight = (1 + 0.1 * _draw(hidden, seed=7)).to(dtype)
    with scratch.poison_new_buffers():
        x_new, h = fused_rms_norm(x, weight, 1e-5, residual=residual)
    expected_x = x + residual
    assert torch.equal(x_new, expected_x)
    _close(h, rms_norm(expected_x, weight, 1e-5), dtype)

    table, index = _draw(11, hidden, dtype=dtype, seed=8), torch.tensor([4, 0, 10, 4])
    with scratch.poison_new_buffers():
        gathered, h = fused_rms_norm(None, weight, 1e-5, table=table, index=index)
    assert torch.equal(gathered, table[index])
    _close(h, rms_norm(table[index], weight, 1e-5), dtype)

    with scratch.poison_new_buffers():
        same, h = fused_rms_norm(x, weight, 1e-5)
    assert same is x
    _close(h, rms_norm(x, weight, 1e-5), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("widths", [(48, 24, 24), (100, 36, 20), (40, 40, 0)])  # odd parts; no v columns
@pytest.mark.parametrize("norm, clip", [(True, 0.9), (True, None), (False, 0.7)])
@pytest.mark.parametrize("rounds_once", [False, True])
def test_qk_norm_clip_matches_the_torch_forwards_norms_and_clamps(dtype, widths, norm, clip, rounds_once):
    """kernels.qk_norm: OLMoE's whole-projection q and k norms then clip_qkv, in place, as engine.model's
    rms_norm and clamp compute them (the clip bounds reached: some values sit on them, some inside)."""
    from kernels.qk_norm import qk_norm_clip

    q_width, k_width, v_width = widths
    qkv = 2 * _draw(3, q_width + k_width + v_width, dtype=dtype, seed=41)
    q_weight, k_weight = ((1 + 0.3 * _draw(width, seed=42 + width)).to(dtype) for width in (q_width, k_width))
    q, k, v = qkv.split([q_width, k_width, v_width], dim=1)
    if norm:
        q, k = rms_norm(q, q_weight, 1e-5, rounds_once), rms_norm(k, k_weight, 1e-5, rounds_once)
    expected = torch.cat([q, k, v], dim=1)
    if clip is not None:
        expected = expected.clamp(-clip, clip)
        assert (expected.abs() == torch.tensor(clip, dtype=dtype)).any() and (expected.abs() < clip).any()
    out = qk_norm_clip(qkv, q_width, k_width, q_weight if norm else None, k_weight if norm else None, 1e-5, clip,
                       rounds_once=rounds_once)
    assert out is qkv  # in place
    _close(out, expected, dtype)
    if clip is not None:
        assert out.abs().max() <= torch.tensor(clip, dtype=dtype)
    if not norm:  # a clamp is exact
        assert torch.equal(out, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3])
def test_gpu_qk_norm_clip_matches_torch_at_olmoe_width(rows):
    """bf16 on the device at OLMoE-1B-7B's widths (q, k and v of 2048 each), the clip bounds reached."""
    from kernels.qk_norm import qk_norm_clip

    qkv = 2 * _draw(rows, 3 * 2048, dtype=torch.bfloat16, device="cuda", seed=43)
    q_weight, k_weight = ((1 + 0.3 * _draw(2048, device="cuda", seed=seed)).to(torch.bfloat16) for seed in (44, 45))
    q, k, v = qkv.split([2048, 2048, 2048], dim=1)
    expected = torch.cat([rms_norm(q, q_weight, 1e-5), rms_norm(k, k_weight, 1e-5), v], dim=1).clamp(-0.9, 0.9)
    out = qk_norm_clip(qkv, 2048, 2048, q_weight, k_weight, 1e-5, 0.9)
    _close(out, expected, torch.bfloat16)
    assert torch.equal(out[:, 4096:], expected[:, 4096:])  # v: a clamp is exact


def test_qk_norm_clip_rejects_bad_inputs():
    from kernels.qk_norm import qk_norm_clip

    qkv = torch.ones(2, 12)
    with pytest.raises(ValueError, match="both"):
        qk_norm_clip(qkv, 4, 4, torch.ones(4), None, 1e-5)
    with pytest.raises(ValueError, match="do not fit"):
        qk_norm_clip(qkv, 8, 8, None, None, 1e-5, 1.0)
    with pytest.raises(ValueError, match="norm weights"):
        qk_norm_clip(qkv, 4, 4, torch.ones(5), torch.ones(4), 1e-5)
    with pytest.raises(ValueError, match="clip must be > 0"):
        qk_norm_clip(qkv, 4, 4, None, None, 1e-5, 0.0)
    with pytest.raises(ValueError, match="unit stride"):
        qk_norm_clip(qkv.t(), 1, 1, None, None, 1e-5, 1.0)
    assert torch.equal(qk_norm_clip(qkv, 4, 4, None, None, 1e-5), torch.ones(2, 12))  # nothing asked: untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_cache_rotates_q_and_k_and_writes_the_cache(dtype):
    batch, heads, kv_heads, head_dim, capacity = 3, 4, 2, 16, 40
    qkv = _draw(batch, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=9)
    positions, slots = torch.tensor([0, 17, 39]), torch.tensor([2, 0, 1])
    config = PRESETS["tiny"]
    half = head_dim // 2
    inv_freq = config.rope_theta ** (-torch.arange(half, dtype=torch.float32) / half)
    k_cache = _draw(3, capacity, kv_heads, head_dim, dtype=dtype, seed=10)
    v_cache = _draw(3, capacity, kv_heads, head_dim, dtype=dtype, seed=11)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    with scratch.poison_new_buffers():
        q, position32 = rope_cache(qkv, inv_freq, positions, slots, k_cache, v_cache, heads)
    assert position32.dtype == torch.int32 and torch.equal(position32.long(), positions)

    angles = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]  # [B, 1, hd/2]
    q_in, k_in, v_in = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    expected_q = apply_rope(q_in.view(batch, 1, heads, head_dim), cos, sin)[:, 0]
    expected_k = apply_rope(k_in.view(batch, 1, kv_heads, head_dim), cos, sin)[:, 0]
    _close(q, expected_q, dtype)
    k_before[slots, positions], v_before[slots, positions] = expected_k, v_in.view(batch, kv_heads, head_dim)
    _close(k_cache, k_before, dtype)
    assert torch.equal(v_cache, v_before)  # values are copied, not rotated


def test_topk_softmax_matches_route():
    logits = _draw(5, 40, seed=12)
    logits[3, 7] = logits[3, 9] = logits[3].max() + 1  # a tie: the lower id first
    with scratch.poison_new_buffers():
        ids, weights = topk_softmax(logits, 6, torch.float16)
    top_logits, top_ids = torch.topk(logits, 6, dim=-1)
    assert ids[3, 0] == 7 and ids[3, 1] == 9
    assert torch.equal(ids[[0, 1, 2, 4]].long(), top_ids[[0, 1, 2, 4]])
    _close(weights, torch.softmax(top_logits, dim=-1).half(), torch.float16)
    with pytest.raises(ValueError, match="k <= E"):
        topk_softmax(logits, 41, torch.float32)


def test_topk_softmax_orders_signs_infinities_and_ties_like_a_stable_sort():
    # One reduction per pick (a key of the value's bits above the reversed id): negative logits, -inf, NaN (never
    # chosen), -0.0 equal to 0.0, many ties, a row of -inf and a padded width (E = 37); the expected ids are a
    # stable sort by value, descending, NaN taken as -inf.
    generator = torch.Generator().manual_seed(31)
    logits = torch.randint(-3, 4, (6, 37), generator=generator).float() * 0.5  # many equal values, both signs
    logits[0, 5], logits[0, 2] = -0.0, 0.0
    logits[0, logits[0] > 0] = -1.0  # row 0's best is the zero pair: id 2 before id 5, whatever the sign
    logits[1, :30] = float("-inf")
    logits[2, 3], logits[2, 11] = float("nan"), float("inf")
    logits[3] = float("-inf")  # the lowest ids, in order
    logits[4] = -torch.rand(37, generator=generator) - 1e-3  # all negative, distinct
    logits[5, 36] = logits[5].max() + 2  # the last lane
    with scratch.poison_new_buffers():
        ids, weights = topk_softmax(logits, 6, torch.float32)
    cleaned = torch.where(torch.isnan(logits), float("-inf"), logits)
    order = torch.sort(-cleaned, dim=-1, stable=True).indices[:, :6]  # ties: the lower id first
    assert torch.equal(ids.long(), order)
    assert ids[0, 0] == 2 and ids[0, 1] == 5 and ids[2, 0] == 11 and ids[5, 0] == 36
    assert ids[3].tolist() == [0, 1, 2, 3, 4, 5]
    top = torch.gather(cleaned, 1, order)
    finite = ~torch.isinf(top).all(dim=-1) & ~torch.isinf(top[:, :1]).squeeze(1)
    expected = torch.softmax(top[finite], dim=-1)
    _close(weights[finite], expected, torch.float32)


def test_pack_qkv_keeps_values_and_makes_one_matrix():
    config = PRESETS["tiny"]
    weights = random_weights(config, 0, torch.device("cpu"), torch.float32)
    before = {name: weights[name].clone() for name in ("layers.0.wq", "layers.0.wk", "layers.0.wv")}
    assert decode_fused.packed_qkv(weights, "layers.0.") is None
    decode_fused.pack_qkv(config, weights)
    packed = decode_fused.packed_qkv(weights, "layers.0.")
    assert packed is not None
    assert torch.equal(packed, torch.cat(list(before.values())))
    for name, value in before.items():
        assert torch.equal(weights[name], value)


def _decode_logits(engine, fused: bool, tokens, start, slots=None):
    """Logits of one decode step of tokens' rows after a 5-token prefill of three cache rows, fused glue or
    torch forward."""
    config = engine.config
    cache = KVCache.allocate(config, 3, 24, engine.device, engine.dtype)
    prompt = torch.randint(0, config.vocab_size, (3, 5), generator=torch.Generator().manual_seed(13))
    dispatcher = Dispatcher(engine, flags.resolve(), timed=False)
    forward(config, engine.weights, prompt, 0, cache, dispatcher)
    layout = StepLayout(start, 24, slots)
    if fused:
        return decode_fused.forward_decode(config, engine.weights, tokens, start, 24, slots, cache, dispatcher), cache
    return forward(config, engine.weights, tokens, layout, cache, dispatcher), cache


@pytest.mark.parametrize("rows, slots, fold_wide, packed", [
    (3, None, False, True), (3, torch.tensor([2, 0, 1]), False, True), (1, None, False, True),
    (1, torch.tensor([2]), True, True), (1, torch.tensor([1]), False, False)])
def test_fused_decode_step_matches_the_torch_forward(rows, slots, fold_wide, packed, monkeypatch):
    """Three rows: cuBLAS-style torch products and rms_norm launches; one row: kernels.gemv and the glue
    folded into the GEMVs (kernels.gemv_fused), with fold_wide under any width; unpacked q/k/v: three
    GEMVs between rms_norm and rope_cache. Same tolerance: the fold's difference (two
    roundings of h per term) is fp32 rounding, far inside 2e-5."""
    if fold_wide:
        monkeypatch.setattr(decode_fused, "FOLD_RESIDUAL_MAX_N", 1 << 20)
    engine = Engine.load("tiny", "cpu", seed=0)
    if packed:
        decode_fused.pack_qkv(engine.config, engine.weights)
    tokens, start = torch.tensor([[3], [200], [77]])[:rows], torch.tensor([5, 5, 5])[:rows]
    fused, fused_cache = _decode_logits(engine, True, tokens, start, slots)
    torch_logits, torch_cache = _decode_logits(engine, False, tokens, start, slots)
    _close(fused, torch_logits, torch.float32)
    for layer in range(engine.config.n_layers):
        _close(fused_cache.k[layer], torch_cache.k[layer], torch.float32)
        _close(fused_cache.v[layer], torch_cache.v[layer], torch.float32)


@pytest.mark.parametrize("rows", [1, 3])
def test_fused_decode_step_of_a_qwen3_moe_architecture_matches_the_torch_forward(rows):
    """Per-head q/k RMSNorm (folded into rope_cache), softmax-then-top-k renormalised routing, no sinks, grouped
    queries: the fused glue computes what the torch forward does, to fp32 rounding."""
    from dataclasses import replace

    config = replace(PRESETS["tiny"], name="qwen3-like", qk_norm="per_head", router="softmax_topk",
                     norm_topk_prob=True, sinks=False, n_heads=4, n_kv_heads=2, head_dim=32, norm_eps=1e-6)
    weights = random_weights(config, 3, torch.device("cpu"), torch.float32)
    generator = torch.Generator().manual_seed(4)
    for layer in range(config.n_layers):  # norm weights off one, so the fold's weights matter
        for name in ("q_norm", "k_norm"):
            weights[f"layers.{layer}.{name}"] = 1 + 0.3 * torch.randn(config.head_dim, generator=generator)
    engine = Engine(config, torch.device("cpu"), 3, weights=weights)
    decode_fused.pack_qkv(config, engine.weights)
    tokens, start = torch.tensor([[3], [200], [77]])[:rows], torch.tensor([5, 5, 5])[:rows]
    fused, fused_cache = _decode_logits(engine, True, tokens, start)
    torch_logits, torch_cache = _decode_logits(engine, False, tokens, start)
    _close(fused, torch_logits, torch.float32)
    for layer in range(config.n_layers):
        _close(fused_cache.k[layer], torch_cache.k[layer], torch.float32)


def _gpt_oss_like():
    """tiny with gpt-oss's architecture: q/k/v/o biases, YaRN RoPE, a router bias, norms rounded once, clamped and
    biased experts, sinks, a sliding-window layer then a full one, grouped queries at head_dim 32."""
    from engine.config import LayerMask, YarnScaling

    return replace(PRESETS["tiny"], name="gpt-oss-like", attention_bias=True, router_bias=True,
                   norm_rounds_once=True, rope_scaling=YarnScaling(factor=32.0, original_max_position=64),
                   expert_activation="gpt_oss_clamped", expert_bias=True, n_heads=4, n_kv_heads=2, head_dim=32,
                   layer_masks=(LayerMask("window", 4), LayerMask("causal")))


def _olmoe_like():
    """tiny with OLMoE's architecture: RMSNorms over the whole q and k projections, q, k and v clipped (at 0.8 many
    of them are), softmax over every expert then top-k without renormalisation."""
    return replace(PRESETS["tiny"], name="olmoe-like", qk_norm="full", clip_qkv=0.8, router="softmax_topk",
                   norm_topk_prob=False)


FAMILY_LIKE = {"gpt-oss": _gpt_oss_like, "olmoe": _olmoe_like}


@pytest.mark.parametrize("family", list(FAMILY_LIKE))
@pytest.mark.parametrize("rows", [1, 3])
def test_fused_decode_step_of_a_family_architecture_matches_the_torch_forward(rows, family):
    """gpt-oss: biases in the products' epilogues, YaRN's attention factor in rope_cache, the router bias in the
    router's fold, the clamped experts handed to the hooks, sinks and a window shorter than the prefill. OLMoE: the
    whole-projection q/k norms and clip_qkv between the q/k/v GEMV and rope_cache. The fused glue computes what the
    torch forward does, to fp32 rounding (in fp32 one rounding of a norm is the same as two)."""
    config = FAMILY_LIKE[family]()
    assert decode_fused.ineligible(config) == ""
    weights = random_weights(config, 5, torch.device("cpu"), torch.float32)
    generator = torch.Generator().manual_seed(6)
    for name in [name for name in weights if name.endswith("norm")]:  # off one, so the norms' weights matter
        weights[name] = 1 + 0.3 * torch.randn(weights[name].shape, generator=generator)
    engine = Engine(config, torch.device("cpu"), 5, weights=weights)
    decode_fused.pack_qkv(config, engine.weights)
    assert decode_fused.packed_qkv(engine.weights, "layers.0.") is not None
    prompt = torch.randint(0, config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(7))
    tokens, start = torch.tensor([[3], [200], [77]])[:rows], torch.full((rows,), 12)
    logits, caches, records = [], [], []
    for fused in (True, False):
        cache = KVCache.allocate(config, 3, 24, engine.device, engine.dtype)
        dispatcher = Dispatcher(engine, flags.resolve(), timed=False)
        forward(config, engine.weights, prompt, 0, cache, dispatcher)
        dispatcher.moe_records.clear()
        if fused:
            logits.append(decode_fused.forward_decode(config, engine.weights, tokens, start, 24, None, cache,
                                                      dispatcher))
        else:
            logits.append(forward(config, engine.weights, tokens, StepLayout(start, 24), cache, dispatcher))
        caches.append(cache)
        records.append(list(dispatcher.moe_records))
    _close(logits[0], logits[1], torch.float32)
    for layer in range(config.n_layers):
        _close(caches[0].k[layer], caches[1].k[layer], torch.float32)
        _close(caches[0].v[layer], caches[1].v[layer], torch.float32)
    if family == "olmoe":  # the clip bit: the new token's values sit on the clip, some of them
        new_values = caches[0].v[0][torch.arange(rows), 12]
        assert new_values.abs().max() == config.clip_qkv and (new_values.abs() < config.clip_qkv).any()
        return
    # both steps handed the clamped experts to the hooks: their records say which arm computed them
    assert all("gpt-oss experts" in record["execution_note"] or record["executed_arm"] == "reference"
               for record in records[0]) and len(records[0]) == config.n_layers


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("out_float", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 9])  # 9: kernels.gemv's tensor-core tile, the fused GEMVs' widest
def test_gemv_bias_is_added_to_the_rounded_product_as_torch_adds_it(dtype, out_float, rows):
    """kernels.gemv's and the fused GEMVs' bias epilogue: the product rounded to the output dtype, then + bias in
    fp32, rounded again (what `x @ w.t() + b` gives); float32 logits take the plain fp32 sum."""
    from kernels.gemv_fused import MAX_ROWS, Norm, gemv_fused

    x, w = _draw(rows, 70, dtype=dtype, seed=31), _draw(37, 70, dtype=dtype, seed=32)
    bias = _draw(37, dtype=dtype, seed=33)
    out_dtype = torch.float32 if out_float else None
    product = x.float() @ w.float().t()
    expected = product + bias.float() if out_float else (product.to(dtype).float() + bias.float()).to(dtype)
    with scratch.poison_new_buffers():
        plain = gemv(x, w, out_dtype, bias=bias)
    _close(plain, expected, dtype)
    x, expected = x[:MAX_ROWS], expected[:MAX_ROWS]
    with scratch.poison_new_buffers():
        folded = gemv_fused(x, w, out_dtype, bias=bias).out
    _close(folded, expected, dtype)
    weight = (1 + 0.1 * _draw(70, seed=34)).to(dtype)
    with scratch.poison_new_buffers():
        normed = gemv_fused(x, w, out_dtype, norm=Norm(weight, 1e-5, exact=True), bias=bias).out
    product = rms_norm(x, weight, 1e-5).float() @ w.float().t()
    _close(normed, product + bias.float() if out_float else (product.to(dtype).float() + bias.float()).to(dtype),
           dtype)
    with pytest.raises(ValueError, match="bias must be"):
        gemv(x, w, bias=bias[:5])
    with pytest.raises(ValueError, match="bias must be"):
        gemv_fused(x, w, bias=bias[:5])


def test_norms_rounded_once_round_where_gpt_oss_rounds():
    """ROUND_ONCE (kernels.rms_norm, the fused GEMVs' exact norm and written h): h = (x * r * weight) rounded once.
    In fp16 it sits on engine.model.rms_norm(rounds_once=True) to the bit for almost every element (r's sum order
    may move one), and off the twice-rounded norm for many: the check tells the two apart."""
    from kernels.gemv_fused import Norm, gemv_fused

    x = _draw(3, 200, dtype=torch.float16, seed=41)
    weight = (1 + 0.5 * _draw(200, seed=42)).to(torch.float16)
    once, twice = rms_norm(x, weight, 1e-5, rounds_once=True), rms_norm(x, weight, 1e-5)
    assert (once != twice).float().mean() > 0.1  # the two roundings differ often enough to be told apart
    residual = torch.zeros_like(x)
    with scratch.poison_new_buffers():
        _, h_kernel = fused_rms_norm(x, weight, 1e-5, residual=residual, rounds_once=True)
        h_fold = gemv_fused(x, _draw(8, 200, dtype=torch.float16, seed=43),
                            norm=Norm(weight, 1e-5, residual=residual, write_h=True, exact=True,
                                      rounds_once=True)).h
    for h in (h_kernel, h_fold):
        assert (h == once).float().mean() > 0.99
        assert (h == twice).float().mean() < 0.9


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("norms, scale", [(True, 1.0), (False, 1.3466), (True, 1.3466)])
def test_rope_cache_norms_each_q_and_k_head_first_and_scales_by_yarn(dtype, norms, scale):
    """Qwen3-MoE's per-head q/k norms before RoPE; gpt-oss's YaRN attention factor on cos and sin (scale)."""
    batch, heads, kv_heads, head_dim = 2, 4, 2, 32
    qkv = _draw(batch, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=21)
    positions = torch.tensor([3, 11])
    half = head_dim // 2
    inv_freq = 10000.0 ** (-torch.arange(half, dtype=torch.float32) / half)
    q_weight, k_weight = (1 + 0.3 * _draw(head_dim, seed=22)).to(dtype), (1 + 0.3 * _draw(head_dim, seed=23)).to(dtype)
    k_cache = torch.zeros(batch, 16, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    qk_norm = (q_weight, k_weight, 1e-6) if norms else None
    with scratch.poison_new_buffers():
        q, _ = rope_cache(qkv, inv_freq, positions, None, k_cache, v_cache, heads, qk_norm, scale=scale)
    angles = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = (angles.cos() * scale)[:, None, :], (angles.sin() * scale)[:, None, :]
    q_in, k_in, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    q_in, k_in = q_in.view(batch, 1, heads, head_dim), k_in.view(batch, 1, kv_heads, head_dim)
    if norms:
        q_in, k_in = rms_norm(q_in, q_weight, 1e-6), rms_norm(k_in, k_weight, 1e-6)
    _close(q, apply_rope(q_in, cos, sin)[:, 0], dtype)
    _close(k_cache[torch.arange(batch), positions], apply_rope(k_in, cos, sin)[:, 0], dtype)
    with pytest.raises(ValueError, match="q/k norm weights must be"):
        rope_cache(qkv, inv_freq, positions, None, k_cache, v_cache, heads, (q_weight[:8], k_weight, 1e-6))


def _one_row_after_prefill():
    """tiny with its q/k/v packed, one cache row of 24 positions holding a 5-token prefill, and the
    dispatcher that ran it: what a one-row decode step at position 5 starts from."""
    engine = Engine.load("tiny", "cpu", seed=0)
    decode_fused.pack_qkv(engine.config, engine.weights)
    config = engine.config
    cache = KVCache.allocate(config, 1, 24, engine.device, engine.dtype)
    dispatcher = Dispatcher(engine, flags.resolve(), timed=False)
    forward(config, engine.weights, torch.tensor([[1, 2, 3, 4, 5]]), 0, cache, dispatcher)
    return engine, config, cache, dispatcher


@pytest.mark.parametrize("fold_qkv, fold_first", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("fold_wide", [False, True])
def test_fused_decode_step_at_one_row_folds_the_norms(fold_wide, fold_qkv, fold_first, monkeypatch):
    """What a one-row step launches (tiny: 2 layers, qkv N = 2048, router and head N <= 256; attention
    and experts take torch arms on a CPU): no topk_softmax, the norms in front of the router and the
    head folded; qkv as rms_norm, gemv, rope_cache (whatever the widest fold), or with the flag qkv_norm_fold
    the attention norm inside the q/k/v GEMV (gemv_norm), then rope_cache: the first layer's too where carry_norm
    is off (the dispatcher's fold_first_norm)."""
    from kernels import launches

    if fold_wide:
        monkeypatch.setattr(decode_fused, "FOLD_RESIDUAL_MAX_N", 1 << 20)
    engine, config, cache, dispatcher = _one_row_after_prefill()
    dispatcher.fold_qkv_norm, dispatcher.fold_first_norm = fold_qkv, fold_first
    before = launches.snapshot()
    decode_fused.forward_decode(config, engine.weights, torch.tensor([[3]]), torch.tensor([5]), 24, None, cache,
                                dispatcher)
    if fold_first:
        assert launches.since(before) == {"gemv": 2, "rope_cache": 2, "gemv_route": 2, "gemv_norm": 3}
    elif fold_qkv:
        assert launches.since(before) == {"rms_norm": 1, "gemv": 3, "rope_cache": 2, "gemv_route": 2,
                                          "gemv_norm": 2}
    else:
        assert launches.since(before) == {"rms_norm": 2, "gemv": 4, "rope_cache": 2, "gemv_route": 2,
                                          "gemv_norm": 1}


def test_fused_decode_step_writes_its_outputs_where_the_runner_asks():
    """With the hooks' `outputs` (engine.batch_runner's StepOutputs), a one-row step's router folds write each
    layer's woken count into the output buffer and the LM head's fold takes the argmax there and feeds the
    next replay: no next_tokens launch, the same logits."""
    from kernels import launches

    engine, config, cache, dispatcher = _one_row_after_prefill()
    plain = decode_fused.forward_decode(config, engine.weights, torch.tensor([[3]]), torch.tensor([5]), 24, None,
                                        cache, dispatcher)
    dispatcher.begin_step(1, "decode", 1)
    observed = torch.full((1 + config.n_layers,), -1, dtype=torch.int64)
    inputs = torch.tensor([[3], [5]])
    dispatcher.outputs = outputs = decode_fused.StepOutputs(observed, inputs)
    before = launches.snapshot()
    logits = decode_fused.forward_decode(config, engine.weights, torch.tensor([[3]]), torch.tensor([5]), 24, None,
                                         cache, dispatcher)
    counted = launches.since(before)
    # gemv_norm: the later layers' q/k/v GEMVs with their attention norms folded in (the flag qkv_norm_fold, on by
    # default; the first layer's norm is its own launch, as carry_norm is on), not the LM head
    assert counted["gemv_pick"] == 1 and counted.get("gemv_norm", 0) == config.n_layers - 1
    assert "next_tokens" not in counted and counted["rms_norm"] == 1
    assert outputs.picked and torch.equal(logits, plain)
    assert observed[0] == torch.argmax(logits[0]) and inputs.tolist() == [[observed[0].item()], [6]]
    woken = dispatcher.pending_woken
    assert len(woken) == config.n_layers and all(count.data_ptr() == observed[1 + layer].data_ptr()
                                                  for layer, count in enumerate(woken))
    assert all(1 <= observed[1 + layer] <= config.top_k for layer in range(config.n_layers))


def test_a_step_carries_the_next_steps_first_norm_and_the_next_step_uses_it():
    """StepOutputs.carry: the one-row step's LM head (gemv_pick_norm) also writes the next step's x and h (its
    picked token's embedding row, normed); the next step given them as `carried` launches no rms_norm and
    computes the logits (and cache) of a step that norms on its own, to the bit (the later layers' norms folded
    into their q/k/v GEMVs in both). With the first norm folded too (fold_first_norm: qkv_norm_fold on and
    carry_norm off; no launch to save) nothing is carried."""
    from kernels import launches

    engine, config, cache, dispatcher = _one_row_after_prefill()
    observed = torch.full((1 + config.n_layers,), -1, dtype=torch.int64)
    buffers = (torch.full((1, config.hidden), float("nan")), torch.full((1, config.hidden), float("nan")))
    dispatcher.outputs = outputs = decode_fused.StepOutputs(observed, torch.tensor([[3], [5]]), carry=buffers)
    dispatcher.fold_first_norm = True
    dispatcher.begin_step(5, "decode", 1)
    before = launches.snapshot()
    decode_fused.forward_decode(config, engine.weights, torch.tensor([[3]]), torch.tensor([5]), 24, None, cache,
                                dispatcher)
    dispatcher.outputs = None
    assert not outputs.carried_out and "gemv_pick_norm" not in launches.since(before)
    assert torch.isnan(buffers[0]).all()
    engine, config, cache, dispatcher = _one_row_after_prefill()
    assert dispatcher.fold_qkv_norm and not dispatcher.fold_first_norm  # the defaults

    def step(position, inputs, **chain):
        dispatcher.begin_step(position, "decode", 1)
        dispatcher.outputs = outputs = decode_fused.StepOutputs(observed, inputs, **chain)
        before = launches.snapshot()
        try:
            logits = decode_fused.forward_decode(config, engine.weights, inputs[0].view(1, 1).clone(),
                                                 inputs[1].clone(), 24, None, cache, dispatcher)
        finally:
            dispatcher.outputs = None
        return logits, launches.since(before), outputs

    buffers = (torch.full((1, config.hidden), float("nan")), torch.full((1, config.hidden), float("nan")))
    inputs = torch.tensor([[3], [5]])
    _, counted, first = step(5, inputs, carry=buffers)
    assert first.carried_out and counted["gemv_pick_norm"] == 1 and "gemv_pick" not in counted
    token = int(observed[0])
    assert inputs.tolist() == [[token], [6]]
    x_expected, h_expected = fused_rms_norm(None, engine.weights["layers.0.attn_norm"], config.norm_eps,
                                            table=engine.weights["embed"], index=torch.tensor([token]))
    assert torch.equal(buffers[0], x_expected) and torch.equal(buffers[1], h_expected)
    cache_before = (cache.k[0].clone(), cache.v[0].clone())
    plain, plain_counted, _ = step(6, inputs.clone())  # the next step, norming on its own
    assert plain_counted["rms_norm"] == 1 and plain_counted["gemv_pick"] == 1  # the first layer's norm
    plain_cache = (cache.k[0].clone(), cache.v[0].clone())
    cache.k[0].copy_(cache_before[0])
    cache.v[0].copy_(cache_before[1])
    carried, counted, second = step(6, inputs.clone(), carried=buffers)
    assert not second.carried_out
    assert counted == decode_fused.carried_launches(plain_counted, True, False)  # one rms_norm fewer
    assert torch.equal(carried, plain)
    assert torch.equal(cache.k[0], plain_cache[0]) and torch.equal(cache.v[0], plain_cache[1])


def test_eligibility():
    tiny = PRESETS["tiny"]
    one = torch.zeros(2, 1, dtype=torch.long)
    assert not decode_fused.eligible(tiny, one)  # a CPU tensor: the torch forward
    assert decode_fused.eligible(tiny, one, force=True)
    assert not decode_fused.eligible(tiny, torch.zeros(2, 3, dtype=torch.long), force=True)  # prefill
    from dataclasses import replace
    assert decode_fused.eligible(replace(tiny, attention_bias=True), one, force=True)  # biases in the epilogues
    # softmax over all E, top k, renormalised is top-k-then-softmax: fused; without the renormalisation the fold
    # divides by the sum over every expert (tests/test_decode_fused_mla.py)
    assert decode_fused.eligible(replace(tiny, router="softmax_topk"), one, force=True)
    assert decode_fused.eligible(replace(tiny, router="softmax_topk", norm_topk_prob=False), one, force=True)
    assert decode_fused.eligible(replace(tiny, qk_norm="per_head"), one, force=True)  # folded into rope_cache
    assert decode_fused.eligible(replace(tiny, qk_norm="full", clip_qkv=2.0), one, force=True)  # OLMoE's, between
    # rope_cache rotates heads whose half is a power of two: another head_dim keeps the torch forward, and says why
    odd = replace(tiny, head_dim=24)
    assert not decode_fused.eligible(odd, one, force=True)
    assert decode_fused.ineligible(odd) == "RoPE at head_dim 24 (rope_cache takes head_dim / 2 a power of two)"


# ------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3, 8, 32])
def test_gpu_gemv_bf16_v4_widths(rows):
    for n_out, k_in in [(5120, 4096), (4096, 4096), (256, 4096), (2047, 4093)]:  # one row: the whole K a tile
        x = _draw(rows, k_in, dtype=torch.bfloat16, device="cuda", seed=20)
        w = (_draw(n_out, k_in, dtype=torch.bfloat16, device="cuda", seed=21) / 64).to(torch.bfloat16)
        expected = x.float() @ w.float().t()
        _close(gemv(x, w, torch.float32), expected, torch.bfloat16)
        _close(gemv(x, w), expected.to(torch.bfloat16), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["demo", "v4-shape"])
@pytest.mark.parametrize("rows", [1, 2])
def test_gpu_fused_decode_matches_torch_forward(model, rows):
    """Two rows: cuBLAS products; one row: kernels.gemv with the norms, the routing and RoPE folded in.
    bf16: the fold's two skipped roundings of h are ~2^-8 relative per term, inside 2e-2."""
    engine = _v4_on_gpu() if model == "v4-shape" else Engine.load(model, "cuda", seed=0)
    assert decode_fused.packed_qkv(engine.weights, "layers.0.") is not None
    config = engine.config
    cache_fused = KVCache.allocate(config, rows, 64, engine.device, engine.dtype)
    cache_torch = KVCache.allocate(config, rows, 64, engine.device, engine.dtype)
    prompt = torch.randint(0, config.vocab_size, (rows, 20), generator=torch.Generator().manual_seed(5)).cuda()
    dispatcher = Dispatcher(engine, flags.resolve(), timed=False)
    with torch.inference_mode():
        forward(config, engine.weights, prompt, 0, cache_fused, dispatcher)
        forward(config, engine.weights, prompt, 0, cache_torch, dispatcher)
        tokens, start = prompt[:, -1:].contiguous(), torch.full((rows,), 20, device="cuda")
        fused = decode_fused.forward_decode(config, engine.weights, tokens, start, 64, None, cache_fused, dispatcher)
        # the torch glue: the ragged forward with the fused path switched off for this call
        reference = _torch_forward(config, engine.weights, tokens, StepLayout(start, 64), cache_torch, dispatcher)
    _close(fused, reference, torch.bfloat16)
    assert torch.equal(fused.argmax(-1), reference.argmax(-1)) or model == "v4-shape"


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(FAMILY_LIKE))
@pytest.mark.parametrize("rows", [1, 2])
def test_gpu_fused_decode_of_a_family_architecture_matches_torch_forward(rows, family):
    """gpt-oss's features on the device in bf16: the biases in the GEMV epilogues, YaRN in rope_cache, the router
    bias in its fold, norms rounded once (here the rounding differs from the twice-rounded kernels), the clamped
    experts on the GEMV arm, sinks and a window shorter than the prefill; OLMoE's whole-projection q/k norms and
    clip_qkv."""
    from engine.model import random_weights_on

    config = replace(FAMILY_LIKE[family](), hidden=256, intermediate=128, head_dim=64, max_seq_len=128)
    device = torch.device("cuda")
    engine = Engine(config, device, 0, weights=random_weights_on(config, 0, device, torch.bfloat16))
    assert decode_fused.packed_qkv(engine.weights, "layers.0.") is not None
    assert engine.decode_glue == "fused"
    caches = [KVCache.allocate(config, rows, 64, device, engine.dtype) for _ in range(2)]
    prompt = torch.randint(0, config.vocab_size, (rows, 20), generator=torch.Generator().manual_seed(9)).cuda()
    dispatcher = Dispatcher(engine, flags.resolve(environ={}), timed=False)
    with torch.inference_mode():
        for cache in caches:
            forward(config, engine.weights, prompt, 0, cache, dispatcher)
        tokens, start = prompt[:, -1:].contiguous(), torch.full((rows,), 20, device="cuda")
        dispatcher.moe_records.clear()
        fused = decode_fused.forward_decode(config, engine.weights, tokens, start, 64, None, caches[0], dispatcher)
        assert all(record["executed_arm"] == "gemv" for record in dispatcher.moe_records)
        reference = _torch_forward(config, engine.weights, tokens, StepLayout(start, 64), caches[1], dispatcher)
    _close(fused, reference, torch.bfloat16)
    assert torch.equal(fused.argmax(-1), reference.argmax(-1))


@functools.lru_cache(maxsize=1)
def _v4_on_gpu() -> Engine:
    """v4-shape with weights drawn on the GPU (engine.bench.device_random_weights): seconds, where the
    CPU-drawn 12.9 GB of experts took most of a GPU run's test budget; built once per session."""
    from engine.bench import device_random_weights

    config, device = PRESETS["v4-shape"], torch.device("cuda")
    return Engine(config, device, 0, weights=device_random_weights(config, 0, device, torch.bfloat16))


def _torch_forward(config, weights, tokens, layout, cache, hooks):
    from engine.model import _forward_ragged

    return _forward_ragged(config, weights, tokens, layout, cache, hooks)



@pytest.mark.parametrize("count, experts", [(6, 256), (192, 64), (150, 40)])
def test_count_distinct_matches_torch_unique(count, experts):
    from kernels.router import count_distinct

    generator = torch.Generator().manual_seed(count)
    ids = torch.randint(0, experts, (count,), generator=generator, dtype=torch.int32)
    ids[0] = experts + 3  # out of range: not an expert, not counted
    with scratch.poison_new_buffers():
        counted = count_distinct(ids.view(-1, 1) if count % 2 == 0 else ids, experts)
    assert counted.dim() == 0 and counted.item() == torch.unique(ids[1:]).numel()


@pytest.mark.parametrize("tokens", [1, 5])
def test_topk_softmax_counts_woken_experts_in_the_same_launch(tokens):
    from kernels import arrivals, launches

    logits = _draw(tokens, 24, seed=30 + tokens)
    before = launches.snapshot()
    with scratch.poison_new_buffers():
        ids, weights, woken = topk_softmax(logits, 3, torch.float32, woken=True)
    assert launches.since(before) == {"topk_softmax": 1}
    assert woken.dim() == 0 and woken.item() == torch.unique(torch.topk(logits, 3, dim=-1).indices).numel()
    plain_ids, plain_weights = topk_softmax(logits, 3, torch.float32)
    assert torch.equal(ids, plain_ids) and torch.equal(weights, plain_weights)
    assert int(arrivals.counters(logits.device, 1)[0]) == 0  # left at zero for the next launch


@pytest.mark.parametrize("vocab, columns", [(256, None), (5000, None), (5000, 1024), (70, 16)])
def test_next_tokens_is_argmax_and_moves_the_inputs_on(vocab, columns, monkeypatch):
    # columns: the row split over cdiv(V, columns) programs, the last of each row's picking (a large vocabulary)
    from kernels import arrivals, next_tokens as module
    from kernels.next_tokens import BLOCK, next_tokens

    if columns is not None:
        monkeypatch.setattr(module, "SPLIT_COLUMNS", columns)

    logits = _draw(3, vocab, seed=40)
    logits[1, 7] = logits[1, vocab - 3] = logits[1].max() + 1  # a tie across chunks: the lower id
    if vocab > BLOCK:
        logits[2, BLOCK + 5] = logits[2].max() + 2  # the best in a later chunk
    observed = torch.full((5,), -1, dtype=torch.int64)
    inputs = torch.tensor([[9, 9, 9], [4, 10, 20]])
    tokens = next_tokens(logits, observed, inputs)
    expected = torch.argmax(logits, dim=-1)
    assert torch.equal(tokens, expected) and tokens[1] == 7
    assert torch.equal(inputs, torch.stack([expected, torch.tensor([5, 11, 21])]))
    assert observed[3:].tolist() == [-1, -1]  # past the rows: untouched (the woken counts live there)
    assert int(arrivals.counters(logits.device, 3).abs().sum()) == 0  # left at zero for the next launch


@pytest.mark.parametrize("split", [False, True])
def test_argmax_rows_orders_signs_infinities_and_ties_like_torch(split, monkeypatch):
    # One key per lane (the value's bits above the reversed index): all-negative rows, -0.0 tied with 0.0 (the
    # lower index), a row of -inf (index 0), NaN ranking first, the best in the last lane of a later chunk;
    # split: each row over 3 programs (BLOCK columns each), so ties and NaN cross programs
    from kernels import next_tokens as module
    from kernels.next_tokens import BLOCK, argmax_rows

    if split:
        monkeypatch.setattr(module, "SPLIT_COLUMNS", BLOCK)

    vocab = BLOCK + 37
    generator = torch.Generator().manual_seed(44)
    logits = -torch.rand(6, vocab, generator=generator) - 1e-3
    logits[1, 9], logits[1, 4] = 0.0, -0.0
    logits[2] = float("-inf")
    logits[3, BLOCK + 20] = float("nan")
    logits[4, vocab - 1] = 5.0
    logits[5, 3] = logits[5, BLOCK + 3] = 1.0
    found = argmax_rows(logits)
    assert found.tolist()[1:] == [4, 0, BLOCK + 20, vocab - 1, 3]
    assert torch.equal(found, torch.argmax(logits, dim=-1))


# ------------------------------------------------------------------------- kernels.gemv_fused (CPU)
# The folded norm multiplies g * x unrounded and scales by r at the end, where the torch forward
# multiplies h = round(round(x * r) * g): the two differ by two roundings of each h element (2^-24
# relative in fp32, 2^-11 in fp16) spread over the K terms of each output, about one rounding of the
# output itself, so the GEMV's tolerances (TOLERANCE, relative to the largest output) still hold.


def _norm_inputs(mode, rows, k_in, dtype, seed):
    """(x, Norm, x_new): the kernel's inputs for `mode` and the norm's input x_new as torch computes it."""
    from kernels.gemv_fused import Norm

    weight = (1 + 0.1 * _draw(k_in, seed=seed)).to(dtype)
    x = _draw(rows, k_in, dtype=dtype, seed=seed + 1)
    if mode == "gather":
        table = _draw(rows + 7, k_in, dtype=dtype, seed=seed + 2)
        index = torch.randint(0, rows + 7, (rows,), generator=torch.Generator().manual_seed(seed))
        return None, Norm(weight, 1e-5, table=table, index=index, write_x=True, write_h=True), table[index]
    if mode == "residual":
        residual = _draw(rows, k_in, dtype=dtype, seed=seed + 3)
        return x, Norm(weight, 1e-5, residual=residual, write_x=True, write_h=True), x + residual
    return x, Norm(weight, 1e-5, write_h=True), x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mode", ["plain", "residual", "gather"])
@pytest.mark.parametrize("rows, n_out, k_in, block", [(1, 37, 70, None), (3, 45, 100, (4, 16)), (5, 9, 33, (2, 16))])
@pytest.mark.parametrize("out_float, exact", [(False, False), (True, False), (True, True)])
def test_gemv_fused_norm_matches_rms_norm_then_matmul(dtype, mode, rows, n_out, k_in, block, out_float, exact):
    from dataclasses import replace

    from kernels import launches
    from kernels.gemv_fused import gemv_fused

    x, norm, x_new = _norm_inputs(mode, rows, k_in, dtype, seed=50 + rows)
    norm = replace(norm, exact=exact)
    w = _draw(n_out, k_in, dtype=dtype, seed=60)
    out_dtype = torch.float32 if out_float else None
    before = launches.snapshot()
    with scratch.poison_new_buffers():
        result = gemv_fused(x, w, out_dtype, norm=norm, block=block)
    assert launches.since(before) == {"gemv_norm": 1}
    h = rms_norm(x_new, norm.weight, norm.eps)
    expected = h.float() @ w.float().t()
    _close(result.out, expected if out_float else expected.to(dtype), dtype)
    _close(result.h, h, dtype)  # what kernels.rms_norm is held to
    if exact:  # the product of the h it wrote, summed as kernels.gemv sums it
        assert torch.equal(result.out, gemv(result.h, w, out_dtype, block=block))
    if mode == "plain":
        assert result.x is None
    else:
        assert torch.equal(result.x, x_new)


def test_gemv_fused_without_norm_is_gemv():
    from kernels.gemv_fused import gemv_fused

    x, w = _draw(3, 70, seed=61), _draw(21, 70, seed=62)
    with scratch.poison_new_buffers():
        result = gemv_fused(x, w, block=(4, 16))
    assert torch.equal(result.out, gemv(x, w, block=(4, 16)))  # the same sums in the same order
    assert result.x is None and result.h is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows, experts, block", [(1, 37, None), (3, 40, (4, 16)), (6, 24, (2, 16))])
def test_gemv_fused_route_is_topk_softmax_of_its_logits(dtype, rows, experts, block):
    from kernels import arrivals, launches
    from kernels.gemv_fused import Route, gemv_fused

    k_in, top_k = 70, 6 if experts > 24 else 3
    x, norm, x_new = _norm_inputs("residual", rows, k_in, dtype, seed=70 + rows)
    w = _draw(experts, k_in, dtype=dtype, seed=71)
    before = launches.snapshot()
    with scratch.poison_new_buffers():
        result = gemv_fused(x, w, norm=norm, route=Route(top_k, dtype), block=block)
    assert launches.since(before) == {"gemv_route": 1}
    h = rms_norm(x_new, norm.weight, norm.eps)
    assert result.out.dtype == torch.float32
    _close(result.out, h.float() @ w.float().t(), dtype)
    assert torch.equal(result.x, x_new)
    _close(result.h, h, dtype)
    ids, weights, woken = topk_softmax(result.out, top_k, dtype, woken=True)  # the same logits, two launches
    assert torch.equal(result.ids, ids) and torch.equal(result.weights, weights)
    assert result.woken.dim() == 0 and result.woken.item() == woken.item() == torch.unique(ids).numel()
    assert torch.equal(result.ids.long(), torch.topk(result.out, top_k, dim=-1).indices)
    assert int(arrivals.counters(w.device, 1)[0]) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows, k_in, block", [(1, 50, None), (3, 37, (4, 16))])
@pytest.mark.parametrize("rounds_once", [False, True])
def test_gemv_fused_pick_norms_the_next_steps_embedding_rows_as_rms_norm_does(dtype, rows, k_in, block, rounds_once):
    """Pick.next_norm: the program that takes the argmax also gathers each picked token's embedding row and
    norms it, writing what kernels.rms_norm's gather writes for those tokens, to the bit (gpt-oss's norm rounded
    once as well); the launch is named gemv_pick_norm."""
    from kernels import launches
    from kernels.gemv_fused import NextNorm, Pick, gemv_fused

    vocab = 29
    x, norm, _ = _norm_inputs("residual", rows, k_in, dtype, seed=130 + rows)
    w = _draw(vocab, k_in, dtype=dtype, seed=131)
    table = _draw(vocab, k_in, dtype=dtype, seed=132)  # the embedding: never zeros
    weight = (1 + _draw(k_in, dtype=dtype, seed=133)).to(dtype)
    tokens = torch.full((rows,), -1, dtype=torch.int64)
    following = NextNorm(table, weight, 1e-5, torch.full((rows, k_in), float("nan"), dtype=dtype),
                         torch.full((rows, k_in), float("nan"), dtype=dtype), rounds_once=rounds_once)
    before = launches.snapshot()
    result = gemv_fused(x, w, torch.float32, norm=replace(norm, exact=True), pick=Pick(tokens, None, following),
                        block=block)
    assert launches.since(before) == {"gemv_pick_norm": 1}
    assert torch.equal(tokens, torch.argmax(result.out, dim=-1))
    x_expected, h_expected = fused_rms_norm(None, weight, 1e-5, table=table, index=tokens, rounds_once=rounds_once)
    assert torch.equal(following.x, x_expected) and torch.equal(following.h, h_expected)
    if rounds_once and dtype == torch.float16:  # the once-rounded bits, not the twice-rounded ones
        assert not torch.equal(h_expected, fused_rms_norm(None, weight, 1e-5, table=table, index=tokens)[1])
    assert torch.equal(following.x, table[tokens])


def test_gemv_fused_pick_refuses_a_next_norm_that_does_not_fit():
    from kernels.gemv_fused import NextNorm, Pick, gemv_fused

    x, w = _draw(1, 40, seed=134), _draw(9, 40, seed=135)
    tokens = torch.zeros(1, dtype=torch.int64)
    table, weight = _draw(9, 40, seed=136), _draw(40, seed=137)
    good = torch.empty(1, 40)
    for bad in (NextNorm(table[:, :20], weight, 1e-5, good, good),
                NextNorm(table, weight, 1e-5, torch.empty(2, 40), good),
                NextNorm(table, weight[:20], 1e-5, good, good)):
        with pytest.raises(ValueError, match="next_norm"):
            gemv_fused(x, w, torch.float32, pick=Pick(tokens, None, bad))


def test_gemv_fused_route_breaks_ties_like_topk_softmax():
    from kernels.gemv_fused import Route, gemv_fused

    x, w = _draw(2, 40, seed=72), _draw(30, 40, seed=73)
    w[9] = w[4]  # equal logits for experts 4 and 9
    w[4] += 5 * x[0] / x[0].norm()  # both the largest in row 0
    w[9] = w[4]
    result = gemv_fused(x, w, route=Route(4, torch.float32, woken=False), block=(4, 16))
    assert result.ids[0, 0] == 4 and result.ids[0, 1] == 9 and result.woken is None
    ids, weights = topk_softmax(result.out, 4, torch.float32)
    assert torch.equal(result.ids, ids) and torch.equal(result.weights, weights)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows, vocab, block, feed", [(1, 37, None, True), (3, 70, (4, 16), True),
                                                      (5, 2100, (64, 16), False), (2, 9, (2, 16), True)])
def test_gemv_fused_pick_takes_each_rows_argmax_and_feeds_the_next_replay(dtype, rows, vocab, block, feed):
    from kernels import arrivals, launches
    from kernels.gemv_fused import Pick, gemv_fused
    from kernels.next_tokens import BLOCK

    k_in = 50
    x, norm, x_new = _norm_inputs("residual", rows, k_in, dtype, seed=90 + rows)
    w = _draw(vocab, k_in, dtype=dtype, seed=91)
    if rows > 1:  # row 1's best two tie (the same weight row twice): the lower id, as torch.argmax
        w[vocab - 1] = w[1] = w[1] + 4 * _draw(k_in, dtype=dtype, seed=92).abs().to(dtype)
        x[1] = norm.residual[1] = 1  # a positive row, so those two are its largest logits
        x_new = (x.float() + norm.residual.float()).to(dtype)
    tokens = torch.full((rows + 2,), -1, dtype=torch.int64)
    inputs = torch.stack([torch.full((rows,), 7), torch.arange(rows) * 10]) if feed else None
    before = launches.snapshot()
    with scratch.poison_new_buffers():
        result = gemv_fused(x, w, torch.float32, norm=replace(norm, exact=True), pick=Pick(tokens, inputs),
                            block=block)
    assert launches.since(before) == {"gemv_pick": 1}
    h = rms_norm(x_new, norm.weight, norm.eps)
    _close(result.out, h.float() @ w.float().t(), dtype)
    expected = torch.argmax(result.out, dim=-1)  # the logits it wrote, as kernels.next_tokens takes them
    assert torch.equal(tokens[:rows], expected) and tokens[rows:].tolist() == [-1, -1]
    if rows > 1:
        assert tokens[1] == 1
    if vocab > BLOCK:
        assert expected.max() >= 0  # walked past the first chunk: every id is reachable
    if feed:
        assert torch.equal(inputs, torch.stack([expected, torch.arange(rows) * 10 + 1]))
    assert int(arrivals.counters(w.device, 1)[0]) == 0


def test_gemv_fused_route_into_writes_the_count_where_asked():
    from kernels.gemv_fused import Route, gemv_fused

    x, w = _draw(2, 40, seed=93), _draw(30, 40, seed=94)
    observed = torch.full((4,), -1, dtype=torch.int64)
    result = gemv_fused(x, w, route=Route(4, torch.float32, into=observed[2:3]), block=(4, 16))
    assert observed.tolist()[:2] == [-1, -1] and observed[3] == -1
    assert observed[2] == torch.unique(result.ids).numel() and result.woken.data_ptr() == observed[2].data_ptr()


@pytest.mark.parametrize("rows, n_out, k_in, block", [(1, 37, 70, None), (3, 45, 100, (4, 16)), (2, 9, 33, (2, 16))])
def test_gemv_preloaded_first_tile_gives_the_same_bits(rows, n_out, k_in, block):
    """kernels.pdl.preload (on by default on Hopper with PDL) loads the first weight tile before the PDL wait and
    runs the loop's first step on it: the same sums in the same order. The interpreter takes the peel with the
    wait itself left out (no PDL on a CPU)."""
    x, w = _draw(rows, k_in, dtype=torch.float16, seed=95), _draw(n_out, k_in, dtype=torch.float16, seed=96)
    assert torch.equal(gemv(x, w, block=block, preload=True), gemv(x, w, block=block, preload=False))


@pytest.mark.parametrize("mode, exact, epilogue", [
    ("plain", False, None), ("residual", True, "route"), ("gather", True, "pick"), ("residual", False, None)])
@pytest.mark.parametrize("rows, block", [(1, None), (3, (4, 16))])
def test_gemv_fused_preloaded_first_tile_gives_the_same_bits(mode, exact, epilogue, rows, block):
    from kernels.gemv_fused import Pick, Route, gemv_fused

    k_in, dtype = 70, torch.float16
    x, norm, _ = _norm_inputs(mode, rows, k_in, dtype, seed=97 + rows)
    norm = replace(norm, exact=exact)
    n_out = {"route": 40, "pick": 37, None: 45}[epilogue]
    w = _draw(n_out, k_in, dtype=dtype, seed=98)
    results = []
    for preload in (False, True):
        extra = {}
        if epilogue == "route":
            extra = {"route": Route(3, torch.float32)}
        elif epilogue == "pick":
            extra = {"pick": Pick(torch.full((rows,), -1, dtype=torch.int64), None)}
        out_dtype = torch.float32 if epilogue in ("route", "pick") else None
        with scratch.poison_new_buffers():
            result = gemv_fused(x, w, out_dtype, norm=norm, block=block, preload=preload, **extra)
        outputs = [result.out.clone()] + [value.clone() for value in (result.h, result.x, result.ids, result.weights)
                                          if value is not None]
        if epilogue == "pick":
            outputs.append(extra["pick"].tokens)
        results.append(outputs)
    for off, on in zip(*results):
        assert torch.equal(off, on)


def test_gemv_fused_rejects_bad_inputs():
    from kernels.gemv_fused import Norm, Pick, Route, gemv_fused

    x, w, weight = torch.ones(1, 8), torch.ones(4, 8), torch.ones(8)
    with pytest.raises(ValueError, match="rows"):
        gemv_fused(torch.ones(9, 8), w)
    with pytest.raises(ValueError, match="write_x"):
        gemv_fused(x, w, norm=Norm(weight, 1e-5, write_x=True))
    with pytest.raises(ValueError, match="gather"):
        gemv_fused(x, w, norm=Norm(weight, 1e-5, table=torch.ones(3, 8), index=torch.tensor([0])))
    with pytest.raises(ValueError, match="k <= E"):
        gemv_fused(x, w, route=Route(5, torch.float32))
    with pytest.raises(ValueError, match="one epilogue"):
        gemv_fused(x, w, torch.float32, route=Route(2, torch.float32), pick=Pick(torch.zeros(1, dtype=torch.int64)))
    with pytest.raises(ValueError, match="float32 logits"):
        gemv_fused(x, w, pick=Pick(torch.zeros(1, dtype=torch.int64)))
    with pytest.raises(ValueError, match="pick.tokens"):
        gemv_fused(x, w, torch.float32, pick=Pick(torch.zeros(1, dtype=torch.int32)))
    with pytest.raises(ValueError, match="pick.inputs"):
        gemv_fused(x, w, torch.float32,
                   pick=Pick(torch.zeros(1, dtype=torch.int64), torch.zeros(2, 2, dtype=torch.int64)))
    with pytest.raises(ValueError, match="route.into"):
        gemv_fused(x, w, route=Route(2, torch.float32, into=torch.zeros(2, dtype=torch.int64)))


@pytest.mark.gpu
def test_gpu_next_tokens_splits_a_large_vocabulary_and_replays_in_a_graph():
    """At Qwen3's 151936 tokens each row splits over 19 programs: argmax to torch's token (ties across programs,
    a NaN, the best in the last column), eager and replayed from a CUDA graph with the counters back at 0."""
    from kernels import arrivals
    from kernels.next_tokens import SPLIT_COLUMNS, next_tokens

    vocab, device = 151936, "cuda"
    logits = _draw(4, vocab, device=device, seed=150)
    logits[0, 3] = logits[0, vocab - 5] = logits[0].max() + 1  # tied across programs: the lower id
    logits[1, SPLIT_COLUMNS * 7 + 11] = float("nan")  # NaN ranks first
    logits[2, vocab - 1] = logits[2].max() + 1
    observed = torch.full((6,), -1, dtype=torch.int64, device=device)
    inputs = torch.zeros(2, 4, dtype=torch.int64, device=device)
    expected = torch.argmax(logits, dim=-1)
    assert torch.equal(next_tokens(logits, observed, inputs), expected)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        next_tokens(logits, observed, inputs)
    for seed in range(3):
        logits.copy_(_draw(4, vocab, device=device, seed=151 + seed))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(observed[:4], torch.argmax(logits, dim=-1)), seed
    assert inputs[1].tolist() == [4, 4, 4, 4] and observed[4:].tolist() == [-1, -1]
    assert int(arrivals.counters(torch.device(device), 4).abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [4096, 2880, 256])
def test_gpu_pick_norms_the_next_step_to_the_bit_of_rms_norm(hidden):
    """The LM head's pick with the next step's norm (one row, the block a step launches it with) writes the
    picked token's embedding row and its norm to the bit of kernels.rms_norm's gather launch: a graph of several
    steps whose later steps skip that launch computes the same tokens."""
    from kernels.gemv_fused import NextNorm, Norm, Pick, gemv_fused

    dtype, device = torch.bfloat16, "cuda"
    table = _draw(256, hidden, dtype=dtype, device=device, seed=140)
    weight = (1 + 0.1 * _draw(hidden, device=device, seed=141)).to(dtype)
    head = (_draw(256, hidden, dtype=dtype, device=device, seed=142) / 64).to(dtype)
    for seed in range(5):
        x, residual = (_draw(1, hidden, dtype=dtype, device=device, seed=143 + 2 * seed + i) for i in range(2))
        tokens = torch.full((1,), -1, dtype=torch.int64, device=device)
        following = NextNorm(table, weight, 1e-5, torch.empty(1, hidden, dtype=dtype, device=device),
                             torch.empty(1, hidden, dtype=dtype, device=device))
        logits = gemv_fused(x, head, torch.float32, norm=Norm(weight, 1e-5, residual=residual, exact=True),
                            pick=Pick(tokens, None, following)).out
        assert torch.equal(tokens, torch.argmax(logits, dim=-1))
        x_expected, h_expected = fused_rms_norm(None, weight, 1e-5, table=table, index=tokens)
        assert torch.equal(following.x, x_expected) and torch.equal(following.h, h_expected), seed


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3])
def test_gpu_gemv_fused_bf16_v4_widths(rows):
    """The two folds of a v4-shape step in bf16 at its widths: residual + router + top-k, residual + fp32
    LM head; against rms_norm then the torch product."""
    from kernels.gemv_fused import Norm, Route, gemv_fused

    dtype, device, hidden = torch.bfloat16, "cuda", 4096
    weight = (1 + 0.1 * _draw(hidden, device=device, seed=90)).to(dtype)
    table = _draw(300, hidden, dtype=dtype, device=device, seed=91)
    index = torch.tensor([5, 299, 0][:rows], device=device)
    x, residual = table[index], _draw(rows, hidden, dtype=dtype, device=device, seed=93)
    router = (_draw(256, hidden, dtype=dtype, device=device, seed=94) / 64).to(dtype)
    routed = gemv_fused(x, router, norm=Norm(weight, 1e-5, residual=residual, write_x=True, write_h=True),
                        route=Route(6, dtype))
    h = rms_norm(x + residual, weight, 1e-5)
    _close(routed.out, h.float() @ router.float().t(), dtype)
    assert torch.equal(routed.x, x + residual)
    _close(routed.h, h, dtype)
    ids, weights, woken = topk_softmax(routed.out, 6, dtype, woken=True)
    assert torch.equal(routed.ids, ids) and routed.woken.item() == woken.item()
    _close(routed.weights, weights, dtype)  # the sum of 6 exponentials may be ordered differently

    logits = gemv_fused(x, router, torch.float32, norm=Norm(weight, 1e-5, residual=residual)).out
    _close(logits, h.float() @ router.float().t(), dtype)
