"""The engine on a GPU: the executed arm is the decided arm, and the counters prove it."""

import pytest
import torch

from engine import flags
from engine.config import PRESETS
from engine.model import random_weights, tensor_shapes
from engine.runtime import Engine
from engine.sidebyside import compare

pytestmark = pytest.mark.gpu

LONG_PROMPT = "The fused path must honour the composite mask, not just causality. " * 4


def resolved(*settings):
    return flags.resolve(list(settings), environ={})


@pytest.fixture(scope="module")
def demo():
    # Random weights: the thresholds below are about kernels and dispatch, not about what the
    # shipped checkpoint learned (its logits move less when the mask is dropped at step 0).
    return Engine.load("demo", "cuda", seed=0, weights="random")


def test_weights_drawn_on_cpu_then_moved_are_bit_identical():
    on_gpu = random_weights(PRESETS["tiny"], 3, torch.device("cuda"), torch.bfloat16)
    on_cpu = random_weights(PRESETS["tiny"], 3, torch.device("cpu"), torch.bfloat16)
    assert all(torch.equal(on_gpu[name].cpu(), on_cpu[name]) for name in on_cpu)


@pytest.mark.parametrize("setting, prefill_arm, decode_arm", [
    ("moe_gate=tile-fill", "grouped_v2", "gemv"),
    ("moe_gate=grouped", "grouped_v2", "grouped_v2"),
    ("moe_gate=reference", "reference", "reference"),
    ("moe_max_tokens=4096", "gemv", "gemv"),
])
def test_executed_arm_is_the_decided_arm(demo, setting, prefill_arm, decode_arm):
    result = demo.generate(LONG_PROMPT, 4, resolved(setting, "grouped_variant=2"))
    for step in result.steps:
        for record in step["moe"]:
            assert record["executed_arm"] == record["decided_arm"], record
    arms = result.counters["arms"]
    layers = demo.config.n_layers
    expected = {prefill_arm: layers}
    expected[decode_arm] = expected.get(decode_arm, 0) + 3 * layers
    for arm in ("gemv", "grouped_v0", "grouped_v1", "grouped_v2", "reference", "torch_grouped_mm"):
        assert arms[arm] == expected.get(arm, 0), (arm, arms)
    assert arms["fused"] == 4 * layers and arms["unfused"] == 0


@pytest.mark.parametrize("variant", [0, 1, 2])
def test_variant_counters_advance_only_on_the_variant_run(demo, variant):
    result = demo.generate(LONG_PROMPT, 2, resolved("moe_gate=grouped", f"grouped_variant={variant}"))
    arms = result.counters["arms"]
    assert arms[f"grouped_v{variant}"] == 2 * demo.config.n_layers
    assert sum(arms[f"grouped_v{other}"] for other in (0, 1, 2) if other != variant) == 0


def test_grouped_variants_give_identical_tokens(demo):
    outputs = [demo.generate(LONG_PROMPT, 6, resolved("moe_gate=grouped", f"grouped_variant={v}")) for v in (0, 1, 2)]
    assert outputs[0].tokens == outputs[1].tokens == outputs[2].tokens
    assert all(torch.equal(outputs[0].logits[i], outputs[2].logits[i]) for i in range(6))


def test_fused_arms_track_the_reference(demo):
    fused = demo.generate(LONG_PROMPT, 6, resolved("moe_gate=grouped"))
    reference = demo.generate(LONG_PROMPT, 6, resolved("moe_gate=reference", "flash_512=off"))
    summary = compare(fused, reference)
    assert summary["logit_rel_err"][0] < 5e-2, summary


def test_drop_is_visible_against_honor_on_the_gpu(demo):
    dropped = demo.generate(LONG_PROMPT, 6, resolved("fused_mask=drop"))
    honored = demo.generate(LONG_PROMPT, 6, resolved("fused_mask=honor"))
    summary = compare(dropped, honored)
    assert summary["first_divergence"] is not None or max(summary["logit_rel_err"]) > 0.05, summary
    assert dropped.steps[0]["attention"][0]["executed_arm"] == "fused"


def test_v4_shape_prefill_runs_grouped_kernels_only():
    config = PRESETS["v4-shape"]
    generator = torch.Generator(device="cuda").manual_seed(0)
    weights = {}
    for name, shape in tensor_shapes(config).items():
        if name.endswith("norm"):
            weights[name] = torch.ones(shape, device="cuda", dtype=torch.bfloat16)
        else:
            scale = 1.0 if name in ("embed",) or name.endswith("sinks") else shape[-1] ** -0.5
            weights[name] = (torch.randn(shape, device="cuda", generator=generator, dtype=torch.bfloat16) * scale)
    engine = Engine(config, torch.device("cuda"), weights=weights)
    # one prefill step of the whole 1140-token prompt (the runtime would chunk it at the default 512)
    result = engine.generate(bytes(range(32, 127)).decode() * 12, 1, resolved("moe_gate=tile-fill", "prefill_chunk=2048"))
    record = result.steps[0]["moe"][0]
    assert record["decided_arm"] == record["executed_arm"] == "grouped"
    counters = result.counters
    assert counters["arms"]["grouped_v2"] == 1 and counters["arms"]["gemv"] == 0
    kernels = counters["kernels"]
    assert not any("gemv" in name for name in kernels), kernels
    assert any("grouped" in name for name in kernels), kernels
    del weights, engine
    torch.cuda.empty_cache()
