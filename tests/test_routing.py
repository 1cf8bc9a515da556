"""The group-limited routers (engine.routing) against transformers' own, the woken-expert prediction under
group-limited routing (engine.dispatch.RoutingShape) against the routers on random logits, and
`check-attention --mla` through the CLI."""

from __future__ import annotations

import json

import pytest
import torch

from engine import dispatch, routing
from inspector import cli


def _transformers_router(kind: str, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int,
                         groups: int, kept: int, norm: bool, scale: float):
    transformers = pytest.importorskip("transformers")
    common = dict(hidden_size=weight.shape[1], num_attention_heads=4, num_experts_per_tok=k, n_group=groups, topk_group=kept,
                  routed_scaling_factor=scale, n_routed_experts=weight.shape[0])
    if kind == "sigmoid_group_topk":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

        router = DeepseekV3TopkRouter(transformers.DeepseekV3Config(**common, norm_topk_prob=norm))
        router.e_score_correction_bias.copy_(bias)
    else:
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

        router = DeepseekV2TopkRouter(transformers.DeepseekV2Config(**common, topk_method="group_limited_greedy"))
    with torch.no_grad():
        router.weight.copy_(weight)
        _, weights, ids = router(hidden)
    return ids, weights


@pytest.mark.parametrize("kind, norm", [("sigmoid_group_topk", True), ("sigmoid_group_topk", False),
                                        ("softmax_group_topk", False)])
def test_group_limited_routers_choose_and_weigh_as_transformers(kind, norm):
    generator = torch.Generator().manual_seed(4)
    tokens, hidden, experts, k, groups, kept, scale = 57, 24, 32, 6, 8, 3, 2.5
    h = torch.randn(tokens, hidden, generator=generator)
    weight = torch.randn(experts, hidden, generator=generator)
    bias = 0.3 * torch.randn(experts, generator=generator)
    ids, weights = routing.group_limited_topk(h, weight, k, groups, kept, kind, bias, norm)
    theirs_ids, theirs_weights = _transformers_router(kind, h, weight, bias, k, groups, kept, norm, scale)
    order, theirs_order = ids.long().sort(dim=-1), theirs_ids.sort(dim=-1)
    assert torch.equal(order.values, theirs_order.values)  # the same experts (their order is topk's, unsorted)
    ours = (weights * scale).gather(1, order.indices)
    assert torch.allclose(ours, theirs_weights.gather(1, theirs_order.indices), rtol=1e-6, atol=0)
    per_group = experts // groups
    assert all(len(set((ids[t].long() // per_group).tolist())) <= kept for t in range(tokens))


@pytest.mark.parametrize("kind", ["sigmoid_group_topk", "softmax_group_topk"])
def test_group_limited_routing_wakes_the_uniform_number_of_experts(kind):
    """Exchangeable scores (i.i.d. logits): the mean distinct experts of n tokens is E (1 - (1 - k/E)^n) and
    the mean distinct groups G (1 - (1 - topk_group/G)^n), whatever the grouping (engine.dispatch's docstring).
    Within 3 standard errors over 400 trials."""
    shape = dispatch.RoutingShape(k=6, n_experts=64, n_group=8, topk_group=2)
    generator = torch.Generator().manual_seed(9)
    trials = 400
    for n in (1, 4, 16):
        logits = torch.randn(trials * n, 64, generator=generator)
        ids, _ = routing.group_limited_topk(logits, torch.eye(64), 6, 8, 2, kind)  # h @ I = the logits
        ids = ids.long().view(trials, n * 6)
        woken = torch.zeros(trials, 64).scatter_(1, ids, 1.0).sum(1)  # [trials] distinct experts
        groups = torch.zeros(trials, 8).scatter_(1, ids // 8, 1.0).sum(1)  # [trials] distinct groups
        for observed, predicted in ((woken, shape.woken(n)), (groups, shape.woken_groups(n))):
            spread = observed.std().item() / trials ** 0.5
            assert abs(observed.mean().item() - predicted) <= 3 * spread + 1e-9, (kind, n, observed.mean(), predicted)
    assert shape.woken(1) == pytest.approx(6.0) and shape.woken_groups(1) == pytest.approx(2.0)


def test_routing_shape_validates_and_describes():
    assert dispatch.RoutingShape(8, 256, 8, 4, shared=1).describe() == \
        "top-8 of 256 experts within the best 4 of 8 groups of 32, + 1 shared (always on, not routed)"
    assert dispatch.RoutingShape(6, 64).describe() == "top-6 of 64 experts"
    for bad in (dict(k=9, n_experts=8), dict(k=2, n_experts=10, n_group=3), dict(k=5, n_experts=8, n_group=4,
                                                                                  topk_group=2)):
        with pytest.raises(ValueError):
            dispatch.RoutingShape(**bad)
    row = dispatch.curve_row(32, 8, 256, 16, dispatch.RoutingShape(8, 256, 8, 4))
    assert row["woken"] == pytest.approx(dispatch.woken_experts(32, 8, 256)) and "woken_groups" in row


def test_check_attention_mla_cli_passes_honor_and_catches_drop(capsys):
    assert cli.main(["check-attention", "--mla", "--device", "cpu", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["verdict"] == "causal" and result["discrimination"]["fires"]
    assert result["errors"]["causal"] <= result["sits_on_multiple"] * result["control"]
    assert result["cache_bytes_per_token"] == {"latent": (64 + 16) * 4, "decompressed": 4 * (32 + 16 + 32) * 4}
    assert result["launches"] == {"mla_split": 1}
    assert cli.main(["check-attention", "--mla", "--device", "cpu", "--mode", "drop", "--dtype", "fp16"]) == 1
    out = capsys.readouterr().out
    assert "verdict: unmasked" in out and "causality is lost" in out


@pytest.mark.parametrize("arguments, words", [
    (["--mla", "--window", "4"], "--window is an option of the sinks check"),
    (["--kv-lora-rank", "64"], "--kv-lora-rank is an option of the latent (--mla) check"),
    (["--mla", "--kv-lora-rank", "48"], "kv_lora_rank 48 is not a power of two"),
    (["--mla", "--rope-dim", "8"], "qk_rope_head_dim 8"),
    (["--mla", "--seq-len", "1"], "--seq-len must be >= 2"),
])
def test_check_attention_mla_bad_options_exit_2(arguments, words, capsys):
    assert cli.main(["check-attention", "--device", "cpu", *arguments]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err
