"""Flags: validation, the MOEI_ environment layer and precedence."""

import pytest

from engine import flags
from engine.errors import UserError


def test_defaults_match_the_design():
    resolved = flags.resolve(environ={})
    assert resolved.values == {"moe_gate": "measured", "decode_floor": 8, "moe_max_tokens": 0, "grouped_variant": 2,
                               "tile_m": 16, "flash_512": True, "fused_mask": "honor", "shared_fold": True,
                               "qkv_norm_fold": True,
                               "prefill_chunk": 512, "nonfinite_weights": "refuse", "steps_per_graph": 8,
                               "mixed_steps": True, "layer_timing": "profile", "run_ahead": True, "carry_norm": True,
                               "pdl": True, "pdl_preload": "on", "stream_weights": True, "l2_prefetch": "off",
                               "record_routing": False, "routing_cap_mb": 256}
    assert set(resolved.sources.values()) == {flags.DEFAULT}


def test_precedence_command_line_over_session_over_environment():
    environ = {"MOEI_DECODE_FLOOR": "3", "MOEI_TILE_M": "32", "MOEI_FUSED_MASK": "drop"}
    resolved = flags.resolve(["tile_m=64"], {"fused_mask": "decline"}, environ)
    assert resolved["decode_floor"] == 3 and resolved.sources["decode_floor"] == flags.ENVIRONMENT
    assert resolved["fused_mask"] == "decline" and resolved.sources["fused_mask"] == flags.SESSION
    assert resolved["tile_m"] == 64 and resolved.sources["tile_m"] == flags.COMMAND_LINE


def test_bad_environment_value_warns_once_in_one_line_and_keeps_the_default(capsys, recwarn, monkeypatch):
    monkeypatch.setattr(flags, "_WARNED", set())  # what earlier tests in this process were told
    environ = {"MOEI_TILE_M": "17", "MOEI_DECODE_FLOOR": "3"}
    resolved = flags.resolve(environ=environ)
    flags.resolve(environ=environ)  # read again (every command reads it several times): not said again
    assert resolved["tile_m"] == 16 and resolved.sources["tile_m"] == flags.DEFAULT
    assert resolved["decode_floor"] == 3 and resolved.sources["decode_floor"] == flags.ENVIRONMENT
    error = capsys.readouterr().err
    assert error == ("moe-inspector: warning: MOEI_TILE_M='17' is not allowed (16, 32 or 64); "
                     "keeping the default 16\n")
    assert not recwarn.list  # not Python's warning machinery, whose two lines name engine/flags.py
    assert flags.environment_problems(environ) == [error.removeprefix("moe-inspector: warning: ").strip()]


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
    ("run_ahead=sometimes", "on or off"),
    ("pdl_preload=gemv+rope", "joined by +"),
    ("pdl_preload=", "joined by +"),
    ("no_such_flag=1", "unknown flag"),
    ("tile_m", "FLAG=VALUE"),
])
def test_bad_command_line_values_name_the_flag_and_allowed_values(assignment, fragment):
    with pytest.raises(UserError, match=fragment):
        flags.resolve([assignment], environ={})


def test_parsing_normalises_values():
    parsed = flags.parse_assignments(["moe_gate=threshold:016", "flash_512=off", "tile_m=32"])
    assert parsed == {"moe_gate": "threshold:16", "flash_512": False, "tile_m": 32}


def test_a_comma_list_splits_strictly_and_blank_is_no_items():
    from engine.comma_list import parse_flag_list, split_items

    assert split_items("  ", "--a") == [] and parse_flag_list("", "--a") == {}
    assert split_items(" flash_512=off , tile_m=32 ", "--a") == ["flash_512=off", "tile_m=32"]
    for text, place in (("pdl=off,", "after the last comma"), (",pdl=off", "before the first comma"),
                        ("a=1,,b=2", "between commas 1 and 2"), ("a=1, ,b=2", "between commas 1 and 2")):
        with pytest.raises(UserError, match=f"nothing {place}"):
            parse_flag_list(text, "--a")


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


def test_the_launch_switches_reach_the_kernels_settings():
    from kernels.settings import PRELOADERS, LaunchSettings

    assert flags.launch_settings(flags.resolve(environ={})) == LaunchSettings()
    resolved = flags.resolve(["pdl=off", "pdl_preload=down+gemv", "stream_weights=off"], environ={})
    assert resolved["pdl_preload"] == "gemv+down"  # kept in the kernels' order
    assert flags.launch_settings(resolved) == LaunchSettings(False, frozenset({"gemv", "down"}), False)
    assert flags.launch_settings(flags.resolve(["pdl_preload=off"], environ={})).pdl_preload == frozenset()
    assert flags.parse_value("pdl_preload", "+".join(PRELOADERS), "x") == "on"
    # every value the TUI offers parses to itself
    assert all(flags.parse_value("pdl_preload", choice, "x") == choice for choice in flags.SPECS["pdl_preload"].choices)


def test_the_environment_names_the_launch_switches_as_before():
    """MOEI_RUN_AHEAD=0 and the others, which the GPU scripts set, now go through the registry."""
    resolved = flags.resolve(environ={"MOEI_RUN_AHEAD": "0", "MOEI_PDL": "0", "MOEI_PDL_PRELOAD": "gemv,down",
                                      "MOEI_CARRY_NORM": "0", "MOEI_STREAM_WEIGHTS": "0"})
    assert resolved.values["run_ahead"] is resolved.values["pdl"] is resolved.values["carry_norm"] is False
    assert resolved["stream_weights"] is False and resolved["pdl_preload"] == "gemv+down"
    assert {resolved.sources[name] for name in ("run_ahead", "pdl", "pdl_preload", "carry_norm", "stream_weights")} \
        == {flags.ENVIRONMENT}
    assert "pdl_preload=gemv+down (environment)" in resolved.describe()
    assert "run_ahead=off (environment)" in resolved.describe()
    # a value left at its default names no source; a command line's says so
    assert "moe_gate=" in resolved.describe() and "moe_gate=measured (" not in resolved.describe()
    overridden = resolved.with_overrides({"moe_gate": "grouped"}, flags.COMMAND_LINE)
    assert "moe_gate=grouped (command line)" in overridden.describe()


def test_every_variable_read_by_hand_is_a_flag_or_says_why_it_is_not():
    """A MOEI_ name in engine/, kernels/ or inspector/ is a flag's (the registry reads it) or in ENVIRONMENT_ONLY
    with its reason; kernels/ reads no environment variable but Triton's own."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    flag_variables = {f"MOEI_{name.upper()}" for name in flags.SPECS}
    assert not flag_variables & set(flags.ENVIRONMENT_ONLY)
    for package in ("engine", "kernels", "inspector"):
        for path in sorted((root / package).rglob("*.py")):
            text = path.read_text()
            for name in set(re.findall(r"MOEI_[A-Z0-9_]+", text)) - {"MOEI_"}:
                assert name in flag_variables or name in flags.ENVIRONMENT_ONLY, f"{path.relative_to(root)}: {name}"
            for name in re.findall(r"os\.environ(?:\.get)?\(?\[?\s*[\"']([A-Z0-9_]+)", text):
                assert name in flags.ENVIRONMENT_ONLY, f"{path.relative_to(root)} reads {name} by hand"
            if package == "kernels":
                assert "os.environ" not in text.replace('os.environ.get("TRITON_INTERPRET")', ""), path.name


def test_one_flag_with_two_values_is_refused_not_last_wins():
    """`--a tile_m=32,tile_m=64` or `--set tile_m=32 ... --set tile_m=64`: the last silently winning would run
    another configuration than the one the user wrote; the same value twice is one."""
    from engine.errors import UserError
    from engine.flags import parse_assignments

    with pytest.raises(UserError, match=r"--a: tile_m given twice \(32 and 64\): give one"):
        parse_assignments(["tile_m=32", "tile_m=64"], "--a")
    assert parse_assignments(["tile_m=32", "tile_m=32"], "--a") == {"tile_m": 32}


@pytest.mark.parametrize("fmt", ["text", "md", "json"])
def test_every_format_of_the_flags_command_shows_the_value_now_and_its_source(fmt, capsys):
    from inspector.cli import main

    assert main(["flags", "--set", "tile_m=32", "--format", fmt]) == 0
    out = capsys.readouterr().out
    if fmt == "json":
        import json

        entry = next(e for e in json.loads(out)["flags"] if e["name"] == "tile_m")
        assert (entry["value"], entry["source"]) == (32, "command line")
    else:
        line = "\n".join(part for part in out.split("\n\n") if "tile_m" in part) if fmt == "text" else \
            next(row for row in out.splitlines() if "`tile_m`" in row)
        assert "32 (command line)" in line, line


@pytest.mark.parametrize("assignment", ["moe_max_tokens=99999999999999999999999", "decode_floor=9007199254740993",
                                        "prefill_chunk=2147483648", "moe_gate=threshold:2147483648",
                                        "decode_floor=" + "9" * 5000])
def test_a_token_count_past_int32_is_refused_naming_the_flag(assignment):
    from engine.flags import parse_assignments

    with pytest.raises(UserError, match=f"flag {assignment.split('=')[0]} in --set"):
        parse_assignments([assignment])
    assert parse_assignments(["moe_max_tokens=2147483647"]) == {"moe_max_tokens": 2**31 - 1}
