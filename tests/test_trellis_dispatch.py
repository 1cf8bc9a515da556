"""The gate on trellis-coded experts: every policy's decision names one of the trellis arms, and the
boundaries it reports leave no token count where dispatch falls through to an arm nobody chose.

The property is checked against a restatement of the policies (`expected_arm`), written from the
dispatch docstring and not from its code: for n in 1..100000 drawn by hypothesis, for every policy,
mode and pin, and exhaustively at every reported boundary and its neighbours.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import dispatch
from engine.arms import ARMS
from engine.dispatch import GateInputs, decide

MAX_TOKENS = 100_000
# v4-shape experts (E = 256, k = 6, D = 4096, F = 2048): packed at K = 2 (codes only) against bf16
V4 = dict(k=6, n_experts=256, expert_bytes=3 * 4096 * 2048 * 2 // 8, dense_expert_bytes=3 * 4096 * 2048 * 2)
POLICIES = ("floor", "tile-fill", "threshold:16", "threshold:700", "threshold:99999", "measured", "gemv", "grouped",
            "reference", "dequant")


def expected_arm(g: GateInputs) -> str:
    """Which arm a trellis layer must get, restated from the policies' definitions."""
    name = g.policy.split(":", 1)[0]
    if name == "reference":
        return dispatch.REFERENCE
    if g.moe_max_tokens and g.n_tokens <= g.moe_max_tokens:
        grouped_side = False
    elif name in ("gemv", "grouped", "dequant"):
        grouped_side = name != "gemv"
    else:
        if name == "floor":
            boundary = g.decode_floor + 1
        elif name == "tile-fill":
            boundary = dispatch.min_tokens(g.k, g.n_experts, g.tile_m)
        elif name == "threshold":
            boundary = int(g.policy.split(":", 1)[1])
        else:
            boundary = dispatch.FALLBACK_THRESHOLD if g.measured_crossover is None else g.measured_crossover
        grouped_side = g.n_tokens > g.decode_floor and g.n_tokens >= boundary
    if not grouped_side:
        return dispatch.TRELLIS_GEMV
    if name == "dequant":
        return dispatch.TRELLIS_DEQUANT
    crossover = g.measured_dequant_crossover
    if name == "measured" and crossover is not None and g.n_tokens >= crossover:
        return dispatch.TRELLIS_DEQUANT
    return dispatch.TRELLIS_GROUPED


def check(g: GateInputs) -> dispatch.Decision:
    decision = decide(g)
    assert decision.arm in dispatch.TRELLIS_ARMS, f"{g}: a trellis layer got {decision.arm}"
    assert decision.arm == expected_arm(g), f"{g}: decided {decision.arm} ({decision.reason})"
    assert decision.reason and "trellis" in decision.reason or decision.arm == dispatch.REFERENCE
    if decision.arm != dispatch.REFERENCE:
        assert decision.variant is None  # the bf16 grouped variants are not the trellis arms'
        assert ARMS[decision.arm].weight_format == dispatch.TRELLIS
    return decision


gates = st.builds(
    GateInputs,
    n_tokens=st.integers(1, MAX_TOKENS),
    k=st.just(V4["k"]),
    n_experts=st.just(V4["n_experts"]),
    tile_m=st.sampled_from((16, 32, 64)),
    policy=st.sampled_from(POLICIES) | st.integers(1, MAX_TOKENS).map(lambda n: f"threshold:{n}"),
    decode_floor=st.integers(0, 64),
    moe_max_tokens=st.sampled_from((0, 0, 1, 8, 4096)),
    grouped_variant=st.sampled_from((0, 1, 2)),
    measured_crossover=st.none() | st.integers(1, MAX_TOKENS),
    weight_format=st.just(dispatch.TRELLIS),
    expert_bytes=st.just(V4["expert_bytes"]),
    dense_expert_bytes=st.just(V4["dense_expert_bytes"]),
    measured_dequant_crossover=st.none() | st.integers(1, MAX_TOKENS),
)


@settings(max_examples=1000, deadline=None)
@given(gates)
def test_every_token_count_and_policy_gets_the_arm_its_boundaries_say(g):
    check(g)


def _scan_points(boundaries) -> list[int]:
    points = {1, 2, MAX_TOKENS - 1, MAX_TOKENS}
    for boundary in boundaries:
        if boundary is not None:
            points.update(n for n in (boundary - 1, boundary, boundary + 1) if 1 <= n <= MAX_TOKENS)
    return sorted(points)


@pytest.mark.parametrize("policy", POLICIES)
def test_the_arm_changes_only_at_the_reported_boundaries(policy):
    """Between two neighbouring reported boundaries the arm is constant, so checking each boundary, its
    neighbours and the ends covers every n in 1..100000 (the arm is a step function of n: each policy
    compares n with fixed numbers)."""
    base = dict(V4, tile_m=16, policy=policy, weight_format=dispatch.TRELLIS,
                measured_crossover=24, measured_dequant_crossover=30000)
    probe = decide(GateInputs(n_tokens=1, **base))
    boundaries = [probe.boundary, probe.dequant_boundary, 30000, 24, 8, 9]
    previous, arms = None, []
    for n in _scan_points(boundaries):
        decision = check(GateInputs(n_tokens=n, **base))
        if decision.arm != previous:
            arms.append((n, decision.arm))
            previous = decision.arm
    order = [dispatch.TRELLIS_GEMV, dispatch.TRELLIS_GROUPED, dispatch.TRELLIS_DEQUANT]
    ranks = [order.index(arm) if arm in order else -1 for _, arm in arms]
    assert ranks == sorted(ranks), f"{policy}: the arms go back as n grows: {arms}"


def test_tile_fill_on_v4_trellis_flips_where_bf16_does():
    """The m-tile arithmetic is about pairs per woken expert, which the weight format does not change: the
    same 683 tokens, now naming trellis arms, with the bytes each moves in the reason."""
    below = decide(GateInputs(n_tokens=682, tile_m=16, policy="tile-fill", weight_format="trellis", **V4))
    at = decide(GateInputs(n_tokens=683, tile_m=16, policy="tile-fill", weight_format="trellis", **V4))
    assert (below.arm, at.arm, at.boundary) == ("trellis_gemv", "trellis_grouped", 683)
    # 682 x 6 pairs x 6.3 MB against 256 woken experts x 6.3 MB
    assert "25,744.6 MB" in below.reason and "1,610.6 MB" in at.reason


def test_a_tiny_models_moved_bytes_read_in_kilobytes():
    """Below 0.1 MB the reason says KB, not "0.0 MB" (the tiny and demo models' trellis experts)."""
    assert dispatch._megabytes(48_640) == "48.6 KB" and dispatch._megabytes(100_000) == "0.1 MB"
    tiny = dict(V4, expert_bytes=2_048, dense_expert_bytes=16_384)
    assert "moves 12.3 KB of weights" in decide(GateInputs(n_tokens=1, tile_m=16, policy="floor",
                                                           weight_format="trellis", **tiny)).reason


def test_measured_dequant_crossover_applies_on_the_grouped_side_only():
    base = dict(V4, tile_m=16, policy="measured", weight_format="trellis", measured_crossover=64,
                measured_dequant_crossover=8)
    assert decide(GateInputs(n_tokens=32, **base)).arm == "trellis_gemv"  # below the GEMV crossover
    decision = decide(GateInputs(n_tokens=64, **base))
    assert decision.arm == "trellis_dequant" and decision.dequant_boundary == 8
    assert "measured trellis_dequant faster from 8 tokens" in decision.reason


def test_dequantize_is_never_chosen_by_the_byte_arithmetic():
    for policy in ("floor", "tile-fill", "threshold:16"):
        for n in (16, 683, 8192, MAX_TOKENS):
            decision = decide(GateInputs(n_tokens=n, tile_m=16, policy=policy, weight_format="trellis",
                                         measured_dequant_crossover=1, **V4))
            assert decision.arm != "trellis_dequant"
    # the bytes say why: dequantizing adds the bf16 copy written and read back
    for n in (683, 8192):
        fused = dispatch.moved_bytes("trellis_grouped", n, 6, 256, V4["expert_bytes"], V4["dense_expert_bytes"])
        dequant = dispatch.moved_bytes("trellis_dequant", n, 6, 256, V4["expert_bytes"], V4["dense_expert_bytes"])
        assert dequant == pytest.approx(fused * 17)  # P + 2 * 8P at 2 bits per weight


def test_bf16_layers_never_get_a_trellis_arm():
    for policy in POLICIES:
        for n in (1, 16, 683, 8192):
            decision = decide(GateInputs(n_tokens=n, k=6, n_experts=256, tile_m=16, policy=policy,
                                         measured_dequant_crossover=1))
            assert decision.arm in dispatch.MOE_ARMS and ARMS[decision.arm].weight_format == "bf16"
    forced = decide(GateInputs(n_tokens=4, k=6, n_experts=256, tile_m=16, policy="dequant"))
    assert forced.arm == "grouped" and "nothing to dequantize" in forced.reason


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="weight_format"):
        decide(GateInputs(n_tokens=1, k=6, n_experts=256, tile_m=16, policy="floor", weight_format="int4"))


def test_the_flag_accepts_the_dequant_policy():
    from engine import flags

    assert flags.SPECS["moe_gate"].parse("dequant") == "dequant" and "dequant" in dispatch.POLICIES


# --------------------------------------------------------------------------------------------------
# The engine's dispatcher on trellis stacks (CPU: the decided trellis arm, the reference executed)
# --------------------------------------------------------------------------------------------------

def test_the_dispatcher_names_trellis_arms_and_records_the_format(tmp_path, monkeypatch):
    import torch

    from engine import calibration, flags
    from engine.dispatcher import Dispatcher
    from engine.runtime import Engine
    from kernels.trellis_reference import TrellisCode, hadamard_block, moe_trellis_reference, random_trellis_matrix

    engine = Engine.load("tiny", device="cpu", weights="random")
    config = engine.config
    code = TrellisCode.of("hyb", 2)
    w13 = random_trellis_matrix(config.n_experts, 2 * config.intermediate, config.hidden, code, seed=1,
                                row_block=hadamard_block(config.intermediate))
    w2 = random_trellis_matrix(config.n_experts, config.hidden, config.intermediate, code, seed=2)
    path = tmp_path / "calibration.json"
    monkeypatch.setenv("MOEI_CALIBRATION", str(path))
    calibration.save_entry({"device": "cpu", "k": config.top_k, "experts": config.n_experts, "hidden": config.hidden,
                            "intermediate": config.intermediate, "tile_m": 16, "crossover_tokens": 3,
                            "dequant_crossover_tokens": 5, "weight_format": calibration.trellis_format("hyb", 2),
                            "measured_at": "now", "commit": None, "timing": "graph",
                            "routing_weights": "bfloat16"})
    dispatcher = Dispatcher(engine, flags.resolve(session={"decode_floor": 0}, environ={}), timed=False)
    assert dispatcher.crossover is None  # the bf16 experts of this shape have no entry: only the trellis one
    generator = torch.Generator().manual_seed(0)
    for n, arm in ((2, "trellis_gemv"), (4, "trellis_grouped"), (6, "trellis_dequant")):
        h = torch.randn(n, config.hidden, generator=generator)
        ids = torch.stack([torch.randperm(config.n_experts, generator=generator)[:config.top_k] for _ in range(n)])
        weights = torch.softmax(torch.randn(n, config.top_k, generator=generator), dim=1)
        dispatcher.begin_step(1, "prefill", n)
        out = dispatcher.moe(0, h, w13, w2, ids, weights)
        record = dispatcher.moe_records[-1]
        assert (record["decided_arm"], record["executed_arm"]) == (arm, "reference")  # no GPU here
        packed_bits = 8 * (w13.bytes_per_expert + w2.bytes_per_expert) / (3 * config.hidden * config.intermediate)
        assert record["weight_format"] == "trellis hyb K=2 V=2 L=16"
        assert record["bits_per_weight"] == pytest.approx(packed_bits, abs=1e-4) and packed_bits > 2
        woken = dispatch.woken_experts(n, config.top_k, config.n_experts)
        stored = w13.bytes_per_expert + w2.bytes_per_expert  # the decided arm's traffic, as its reason says
        moved = dispatch.moved_bytes(arm, n, config.top_k, config.n_experts, stored,
                                     6 * config.hidden * config.intermediate)
        assert record["bytes_moved"] == round(moved) and moved >= woken * stored
        assert f"moves {dispatch._megabytes(moved)} of weights" in record["reason"]
        assert torch.equal(out, moe_trellis_reference(h, w13, w2, ids, weights))
    assert dispatcher.counters.to_json()["arms"]["reference"] == 3
