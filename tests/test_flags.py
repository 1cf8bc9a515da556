"""Flags: validation, the MOEI_ environment layer and precedence."""

import pytest

from engine import flags
from engine.errors import UserError


def test_defaults_match_the_design():
    resolved = flags.resolve(environ={})
    assert resolved.values == {"moe_gate": "measured", "decode_floor": 8, "moe_max_tokens": 0, "grouped_variant": 2,
                               "tile_m": 16, "flash_512": True, "fused_mask": "honor",
                               "prefill_chunk": 512, "nonfinite_weights": "refuse", "steps_per_graph": 8,
                               "mixed_steps": True, "layer_timing": "profile"}
    assert set(resolved.sources.values()) == {flags.DEFAULT}


def test_precedence_command_line_over_session_over_environment():
    environ = {"MOEI_DECODE_FLOOR": "3", "MOEI_TILE_M": "32", "MOEI_FUSED_MASK": "drop"}
    resolved = flags.resolve(["tile_m=64"], {"fused_mask": "decline"}, environ)
    assert resolved["decode_floor"] == 3 and resolved.sources["decode_floor"] == flags.ENVIRONMENT
    assert resolved["fused_mask"] == "decline" and resolved.sources["fused_mask"] == flags.SESSION
    assert resolved["tile_m"] == 64 and resolved.sources["tile_m"] == flags.COMMAND_LINE


def test_bad_environment_value_warns_and_keeps_the_default():
    with pytest.warns(UserWarning, match="MOEI_TILE_M"):
        resolved = flags.resolve(environ={"MOEI_TILE_M": "17"})
    assert resolved["tile_m"] == 16 and resolved.sources["tile_m"] == flags.DEFAULT


@pytest.mark.parametrize("assignment, fragment", [
    ("tile_m=17", "16, 32 or 64"),
    ("grouped_variant=3", "0, 1 or 2"),
    ("moe_gate=threshold:0", "threshold:N"),
    ("moe_gate=fastest", "floor, tile-fill"),
    ("decode_floor=-1", ">= 0"),
    ("flash_512=maybe", "on or off"),
    ("fused_mask=ignore", "honor, decline or drop"),
    ("prefill_chunk=8", ">= 16"),
    ("steps_per_graph=0", "from 1 to 64"),
    ("steps_per_graph=65", "from 1 to 64"),
    ("steps_per_graph=two", "from 1 to 64"),
    ("no_such_flag=1", "unknown flag"),
    ("tile_m", "FLAG=VALUE"),
])
def test_bad_command_line_values_name_the_flag_and_allowed_values(assignment, fragment):
    with pytest.raises(UserError, match=fragment):
        flags.resolve([assignment], environ={})


def test_parsing_normalises_values():
    parsed = flags.parse_assignments("moe_gate=threshold:016,flash_512=off,tile_m=32")
    assert parsed == {"moe_gate": "threshold:16", "flash_512": False, "tile_m": 32}


def test_tile_m_choices_match_the_kernel():
    grouped = pytest.importorskip("kernels.moe_grouped")
    assert flags.TILE_M_CHOICES == grouped.TILE_M_CHOICES
    assert flags.SPECS["tile_m"].default == grouped.DEFAULT_TILE_M


def test_the_attention_decision_knows_the_head_dims_the_fused_kernels_take():
    from engine import attention_dispatch
    from kernels import attention_common

    assert attention_dispatch.FUSED_HEAD_DIMS == attention_common.SUPPORTED_HEAD_DIMS
    decision = attention_dispatch.decide_attention(96, "causal", "causal", True, "honor")
    assert decision.arm == attention_dispatch.UNFUSED and "head_dim 96" in decision.reason
    assert attention_dispatch.decide_attention(128, "causal", "causal", True, "honor").arm == attention_dispatch.FUSED
