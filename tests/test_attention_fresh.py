"""The decode kernel's fresh token (kernels.attention_decode.flash_decode given a kernels.rope_cache.FreshToken,
the flag rope_in_attention): the split kernel norms and rotates q and the new key itself and writes the key and
value into the cache, against rope_cache then flash_decode on the same inputs, and the step that uses it.

CPU: the Triton interpreter in fp32 and fp16 at small odd sizes; GPU (-m gpu): bf16 at the shapes the step runs
(Qwen3-30B-A3B's 32 / 4 heads of 128 with the per-head norms, v4-shape's 8 / 1 of 512, gpt-oss-like sinks and a
window at 64). Every input is fresh random data; the two sides' caches start equal and differ only where a side
writes.
"""

from __future__ import annotations

import pytest
import torch

from kernels import launches
from kernels.attention_decode import flash_decode
from kernels.reference import MaskSpec, attention_reference
from kernels.rope_cache import FreshToken, rope_cache

# The norm's fp32 mean sums a head in another order than rope_cache's halves (kernels.rope_cache.rope_rows): a
# normed element may round one unit the other way, so q, the written key and the output are held to a few units of
# the dtype rather than to the bit; without the norm RoPE is the same arithmetic.
ULPS = {torch.float32: 2.0 ** -20, torch.float16: 2.0 ** -8, torch.bfloat16: 2.0 ** -5}


def _draw(generator, *shape, dtype, device, scale=1.0):
    return (torch.randn(*shape, generator=generator, device=device) * scale).to(dtype)


def _token(batch, heads, kv_heads, head_dim, capacity, dtype, seed, norm, device="cpu"):
    """(qkv, inv_freq, positions, k_cache, v_cache, qk_norm): positions spread over the cache, distinct a row."""
    generator = torch.Generator(device=device).manual_seed(seed)
    qkv = _draw(generator, batch, (heads + 2 * kv_heads) * head_dim, dtype=dtype, device=device)
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    positions = torch.randint(0, capacity, (batch,), generator=generator, device=device)
    positions[0] = capacity - 1  # the last position of the cache, whose tile is the walk's last
    k_cache = _draw(generator, batch, capacity, kv_heads, head_dim, dtype=dtype, device=device)
    v_cache = _draw(generator, batch, capacity, kv_heads, head_dim, dtype=dtype, device=device)
    qk_norm = None
    if norm:
        qk_norm = (1 + _draw(generator, head_dim, dtype=dtype, device=device, scale=0.2),
                   1 + _draw(generator, head_dim, dtype=dtype, device=device, scale=0.2), 1e-6)
    return qkv, inv_freq, positions, k_cache, v_cache, qk_norm


def _both(batch, heads, kv_heads, head_dim, capacity, dtype, spec, norm, sinks, seed, device="cpu", **options):
    """(expected, got, caches before/after for each side): rope_cache + flash_decode against the fresh token."""
    qkv, inv_freq, positions, k_cache, v_cache, qk_norm = _token(batch, heads, kv_heads, head_dim, capacity, dtype,
                                                                 seed, norm, device)
    sink_values = torch.randn(heads, device=device) if sinks else None
    k_fresh, v_fresh = k_cache.clone(), v_cache.clone()
    q, position32 = rope_cache(qkv, inv_freq, positions, None, k_cache, v_cache, heads, qk_norm)
    expected = flash_decode(q.view(batch, 1, heads, head_dim), k_cache, v_cache, sink_values, spec, position32,
                            **options)
    token = FreshToken(qkv, inv_freq, positions, k_fresh, v_fresh, heads, qk_norm)
    before = launches.snapshot()
    got = flash_decode(token, k_fresh, v_fresh, sink_values, spec, token.position, **options)
    assert "rope_cache" not in launches.since(before)
    reference = attention_reference(q.view(batch, 1, heads, head_dim).float(), k_cache.float(), v_cache.float(),
                                    sink_values, spec, position32)
    return expected, got, reference, (k_cache, v_cache), (k_fresh, v_fresh), positions


def _check(expected, got, reference, caches, fresh_caches, positions, dtype, norm):
    units = ULPS[dtype] if norm else 0.0
    for side, fresh in zip(caches, fresh_caches):
        assert torch.isfinite(fresh.float()).all()
        rows = torch.arange(positions.shape[0], device=positions.device)
        untouched = torch.ones(fresh.shape[:2], dtype=torch.bool, device=fresh.device)
        untouched[rows, positions] = False
        assert torch.equal(fresh[untouched], side[untouched])  # only the token's own slot is written
        written, wanted = fresh[rows, positions].float(), side[rows, positions].float()
        assert ((written - wanted).abs() <= units * wanted.abs().clamp_min(1.0)).all(), (written - wanted).abs().max()
    scale = reference.norm()
    assert (got.float() - reference).norm() / scale <= 2 * (expected.float() - reference).norm() / scale + 4 * units
    if not norm:
        assert torch.equal(got, expected)  # RoPE without the norm is the same arithmetic: the same bits


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("mask, sinks", [("causal", False), ("window", True)])
@pytest.mark.parametrize("batch, heads, kv_heads, head_dim, capacity, splits", [
    (2, 8, 2, 64, 37, 3),  # GQA groups of 4, odd capacity, the newest key in a split's short last tile
    (3, 3, 3, 64, 19, 1),  # one row a group, one split: "direct"
])
def test_fresh_token_attends_as_rope_cache_then_flash_decode(batch, heads, kv_heads, head_dim, capacity, splits,
                                                             mask, sinks, norm, dtype):
    spec = MaskSpec("causal") if mask == "causal" else MaskSpec("window", window=7)
    results = _both(batch, heads, kv_heads, head_dim, capacity, dtype, spec, norm, sinks, seed=capacity + heads,
                    num_splits=splits)
    _check(*results, dtype, norm)


def test_fresh_token_with_the_combine_kernel_and_the_last_split_merging():
    for combine in ("kernel", "last"):
        results = _both(2, 4, 1, 64, 29, torch.float32, MaskSpec("causal"), True, False, seed=7, num_splits=4,
                        combine=combine)
        _check(*results, torch.float32, True)


def test_fresh_token_refuses_what_it_cannot_write():
    qkv, inv_freq, positions, k_cache, v_cache, qk_norm = _token(2, 4, 2, 64, 16, torch.float32, 3, True)
    token = FreshToken(qkv, inv_freq, positions, k_cache, v_cache, 4, qk_norm)
    with pytest.raises(ValueError, match="k must be a view of its cache"):
        flash_decode(token, k_cache.clone(), v_cache, None, MaskSpec("causal"), token.position)
    with pytest.raises(ValueError, match="q_start must be the token's positions"):
        flash_decode(token, k_cache, v_cache, None, MaskSpec("causal"), positions.clone())
    wrong = FreshToken(qkv[:, :-64], inv_freq, positions, k_cache, v_cache, 4, qk_norm)
    with pytest.raises(ValueError, match="qkv"):
        flash_decode(wrong, k_cache, v_cache, None, MaskSpec("causal"), wrong.position)
    short_norm = FreshToken(qkv, inv_freq, positions, k_cache, v_cache, 4, (qk_norm[0][:8], qk_norm[1], 1e-6))
    with pytest.raises(ValueError, match="norm weights"):
        flash_decode(short_norm, k_cache, v_cache, None, MaskSpec("causal"), short_norm.position)
    assert torch.equal(token.materialize()[0], rope_cache(qkv, inv_freq, positions, None, k_cache.clone(),
                                                          v_cache.clone(), 4, qk_norm)[0].view(2, 1, 4, 64))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["qwen3-30b-a3b", "v4-shape", "sinks-window"])
def test_gpu_fresh_token_at_the_step_shapes(shape):
    heads, kv_heads, head_dim, norm, spec, sinks = {
        "qwen3-30b-a3b": (32, 4, 128, True, MaskSpec("causal"), False),
        "v4-shape": (8, 1, 512, False, MaskSpec("causal"), True),
        "sinks-window": (64, 8, 64, False, MaskSpec("window", window=128), True),
    }[shape]
    for batch, capacity in ((1, 200), (5, 1031)):
        results = _both(batch, heads, kv_heads, head_dim, capacity, torch.bfloat16, spec, norm, sinks,
                        seed=batch + capacity, device="cuda")
        _check(*results, torch.bfloat16, norm)
