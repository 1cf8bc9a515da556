"""Dispatch math and gate policies: pinned values of the closed forms and the exact flip point."""

import itertools

import pytest

from engine import dispatch
from engine.dispatch import GateInputs, decide


@pytest.mark.parametrize("n, woken, pairs, fill", [
    (32, 136.1, 1.41, 0.088),
    (128, None, 3.15, 0.197),
    (512, None, 12.00, 0.750),
    (683, None, 16.01, 1.000),
    (1024, None, 24.0, 1.500),
])
def test_pinned_curve_at_top6_of_256(n, woken, pairs, fill):
    row = dispatch.curve_row(n, 6, 256, 16)
    if woken is not None:
        assert row["woken"] == pytest.approx(woken, abs=0.05)
    assert row["pairs_per_woken"] == pytest.approx(pairs, abs=0.005)
    assert row["fill"] == pytest.approx(fill, abs=0.0006)


def test_min_tokens_pinned():
    assert dispatch.min_tokens(6, 256, 16) == 683
    assert dispatch.min_tokens(6, 64, 16) == 171  # the demo preset's boundary


def test_same_token_count_flips_the_other_way_under_other_routing():
    # 32 tokens x top-6 of 8 experts: every expert woken, 24 pairs each.
    assert dispatch.tiles_amortize(32, 6, 8, 16)
    assert dispatch.pairs_per_woken_expert(32, 6, 8) == pytest.approx(24.0)
    assert not dispatch.tiles_amortize(32, 6, 256, 16)


SHAPES = [(k, experts, tile_m) for k, experts, tile_m in itertools.product(
    (1, 2, 4, 6, 8), (8, 16, 61, 64, 128, 256, 384), (16, 32, 64)) if k <= experts]


@pytest.mark.parametrize("k, experts, tile_m", SHAPES)
def test_min_tokens_is_the_exact_flip_point(k, experts, tile_m):
    boundary = dispatch.min_tokens(k, experts, tile_m)
    assert dispatch.tiles_amortize(boundary, k, experts, tile_m)
    assert boundary == 1 or not dispatch.tiles_amortize(boundary - 1, k, experts, tile_m)


def test_at_least_thirty_routing_shapes_checked():
    assert len(SHAPES) >= 30


def gate(policy, n, **kwargs):
    return decide(GateInputs(n_tokens=n, k=6, n_experts=64, tile_m=16, policy=policy, **kwargs))


def test_tile_fill_policy_on_demo_routing():
    prefill = gate("tile-fill", 300)
    assert (prefill.arm, prefill.variant, prefill.boundary) == ("grouped", 2, 171)
    assert "pairs per woken expert" in prefill.reason and "171" in prefill.reason
    assert gate("tile-fill", 170).arm == "gemv"
    assert gate("tile-fill", 171).arm == "grouped"
    decode = gate("tile-fill", 1)
    assert decode.arm == "gemv" and "decode_floor" in decode.reason


def test_floor_policy_flips_after_the_floor():
    assert gate("floor", 8).arm == "gemv"
    assert gate("floor", 9).arm == "grouped"
    assert gate("floor", 4, decode_floor=3).arm == "grouped"


def test_threshold_policy():
    assert gate("threshold:16", 15).arm == "gemv"
    assert gate("threshold:16", 16).arm == "grouped"
    assert gate("threshold:16", 300, grouped_variant=0).variant == 0


def test_measured_falls_back_visibly_and_uses_the_calibration():
    fallback = gate("measured", 20)
    assert fallback.arm == "grouped" and fallback.boundary == 16
    assert "no calibration" in fallback.reason and "threshold:16" in fallback.reason
    calibrated = gate("measured", 20, measured_crossover=64)
    assert calibrated.arm == "gemv" and "64" in calibrated.reason
    assert gate("measured", 64, measured_crossover=64).arm == "grouped"


@pytest.mark.parametrize("policy", ["gemv", "grouped", "reference"])
def test_forced_arms_ignore_the_floor(policy):
    for n in (1, 9, 5000):
        decision = gate(policy, n)
        assert decision.arm == policy and "forced" in decision.reason


@pytest.mark.parametrize("policy", ["floor", "tile-fill", "threshold:16", "measured", "grouped", "gemv"])
def test_moe_max_tokens_pins_gemv_under_every_policy(policy):
    decision = gate(policy, 4096, moe_max_tokens=4096)
    assert decision.arm == "gemv" and "moe_max_tokens=4096" in decision.reason
    assert gate(policy, 4097, moe_max_tokens=4096).arm == (
        "gemv" if policy == "gemv" else "grouped")


def test_moe_max_tokens_leaves_the_reference_arm_alone():
    assert gate("reference", 10, moe_max_tokens=4096).arm == "reference"


def test_decisions_carry_their_inputs():
    decision = gate("tile-fill", 300, decode_floor=4)
    assert decision.inputs["n_tokens"] == 300 and decision.inputs["decode_floor"] == 4
