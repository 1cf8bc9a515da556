"""Headless commands end to end through `inspector.cli.main`, and as a real process."""

import json
import subprocess
import sys

import pytest

from inspector.cli import main

LONG_PROMPT = "The fused path must honour the composite mask, not just causality. " * 3  # > demo's 128 window


def run_json(capsys, argv):
    assert main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_curve_json_pins_683(capsys):
    result = run_json(capsys, ["curve", "--k", "6", "--experts", "256", "--tile-m", "16",
                               "--tokens", "32,128,512,683,1024"])
    assert result["min_tokens"] == 683 and (result["k"], result["experts"], result["tile_m"]) == (6, 256, 16)
    rows = {row["n"]: row for row in result["rows"]}
    assert rows[32]["woken"] == pytest.approx(136.1, abs=0.05)
    assert rows[683]["amortizes"] and not rows[512]["amortizes"]
    assert set(rows[32]) == {"n", "woken", "pairs_per_woken", "fill", "amortizes"}


def test_curve_k6_of_8_experts_amortizes_at_32(capsys):
    result = run_json(capsys, ["curve", "--k", "6", "--experts", "8", "--tokens", "32"])
    assert result["rows"][0]["amortizes"] and result["rows"][0]["pairs_per_woken"] == pytest.approx(24.0)


def test_generate_json_shape(capsys):
    result = run_json(capsys, ["generate", "--model", "tiny", "--device", "cpu", "--prompt", "abcd",
                               "--max-tokens", "3", "--set", "moe_gate=tile-fill"])
    assert len(result["tokens"]) == 3 and isinstance(result["text"], str)
    assert result["flags"]["moe_gate"] == {"value": "tile-fill", "source": "command line"}
    assert result["flags"]["tile_m"]["source"] == "default"
    assert [step["phase"] for step in result["steps"]] == ["prefill", "decode", "decode"]
    record = result["steps"][0]["moe"][0]
    for key in ("decided_arm", "executed_arm", "variant", "reason", "n_tokens", "k", "experts", "tile_m",
                "woken_predicted", "woken_observed", "pairs_per_woken", "fill", "boundary", "us"):
        assert key in record
    assert result["counters"]["arms"]["reference"] == 3 * 2


def test_compare_honor_vs_honor_is_identical(capsys):
    result = run_json(capsys, ["compare", "--model", "tiny", "--device", "cpu", "--prompt", LONG_PROMPT,
                               "--max-tokens", "4", "--a", "fused_mask=honor", "--b", "fused_mask=honor"])
    assert result["first_divergence"] is None and result["logit_rel_err"] == [0.0] * 4
    assert result["a"]["tokens"] == result["b"]["tokens"]


def test_compare_drop_vs_honor_on_demo_diverges(capsys):
    result = run_json(capsys, ["compare", "--model", "demo", "--device", "cpu", "--prompt", LONG_PROMPT,
                               "--max-tokens", "4", "--a", "fused_mask=drop", "--b", "fused_mask=honor"])
    assert result["first_divergence"] is not None or max(result["logit_rel_err"]) > 0
    assert result["a"]["flags"]["fused_mask"]["value"] == "drop"


@pytest.mark.parametrize("argv, fragment", [
    (["generate", "--model", "huge", "--prompt", "x"], "unknown model 'huge'"),
    (["generate", "--model", "tiny", "--prompt", "x", "--set", "warp_speed=on"], "unknown flag 'warp_speed'"),
    (["generate", "--model", "tiny", "--prompt", "x", "--set", "tile_m=48"], "allowed: 16, 32 or 64"),
    (["curve", "--tile-m", "17"], "--tile-m 17: the grouped GEMM's m-tiles are 16, 32, 64"),
    (["curve", "--tile-m", "0"], "--tile-m 0: the grouped GEMM's m-tiles are 16, 32, 64"),
    (["generate", "--model", "tiny", "--prompt", "x" * 600], "longer than the tiny context of 512"),
    (["generate", "--model", "tiny", "--prompt", "x", "--max-tokens", "0"], "--max-tokens must be >= 1"),
    (["generate", "--model", "tiny", "--prompt", "hello", "--max-tokens", "9999"],
     "plus --max-tokens 9999 exceeds the tiny context of 512"),  # the TUI names its box instead (test_tui)
    (["compare", "--model", "tiny", "--prompt", "x", "--a", "fused_mask=sometimes"], "fused_mask in --a"),
    (["curve", "--k", "9", "--experts", "8"], "need 1 <= k <= experts"),
    (["curve", "--tokens", "1,zero"], "comma-separated integers"),
    (["generate", "--model", "tiny", "--device", "tpu", "--prompt", "x"], "unknown device"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, fragment):
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert fragment in error and error.count("\n") == 1 and "Traceback" not in error


@pytest.mark.parametrize("argv, item", [
    (["compare", "--model", "tiny", "--prompt", "x", "--a", "pdl=off,"], "--a 'pdl=off,': item 2 of 2"),
    (["compare", "--model", "tiny", "--prompt", "x", "--b", "pdl=off,,tile_m=32"],
     "--b 'pdl=off,,tile_m=32': item 2 of 3"),
    (["compare", "--model", "tiny", "--prompt", "x", "--a", " , "], "item 1 of 2"),  # blank items, not a blank list
    (["ab", "--a", ",pdl=off", "--b", "pdl=on"], "--a ',pdl=off': item 1 of 2"),
    (["quantize", "tiny", "--experts", "trellis:K=2,code=hyb,", "--out", "{tmp}/out"], "item 3 of 3"),
    (["sweep", "--model", "tiny", "--experts", "trellis:K=2,,code=hyb"], "item 2 of 3"),
])
def test_every_comma_list_of_name_value_refuses_an_empty_item(capsys, tmp_path, argv, item):
    """A trailing comma or an empty item was dropped by --a/--b and --experts; every such list refuses it alike."""
    assert main([part.replace("{tmp}", str(tmp_path)) for part in argv]) == 2
    error = capsys.readouterr().err
    assert f"{item} is empty" in error and "remove the extra comma" in error and error.count("\n") == 1


def test_real_process_exit_code_and_no_traceback():
    completed = subprocess.run([sys.executable, "-m", "inspector", "generate", "--model", "nope", "--prompt", "x"],
                               capture_output=True, text=True)
    assert completed.returncode == 2 and "unknown model" in completed.stderr and "Traceback" not in completed.stderr
