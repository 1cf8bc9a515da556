"""The magnitude check (engine.compare) and `moe-inspector check-attention`: a dropped mask is
detected (verdict causal, exit 1), an honoured one is not (verdict masked, exit 0), a
configuration where the mask changes nothing says so (exit 2), and bad options exit 2 in one
line. Runs the Triton kernel under the interpreter at the CLI's CPU defaults."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import engine.compare as compare
from engine.errors import UserError
from inspector.cli import main

CPU_DEFAULTS = compare.DEFAULTS["cpu"]


def run_cli(capsys, *arguments):
    code = main(["check-attention", "--device", "cpu", *arguments])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def honoured():
    return compare.check_attention(**CPU_DEFAULTS, mode="honor", device="cpu", seed=1)


@pytest.fixture(scope="module")
def dropped():
    return compare.check_attention(**CPU_DEFAULTS, mode="drop", device="cpu", seed=1)


def test_discrimination_fires_at_the_cpu_defaults(honoured):
    discrimination = honoured["discrimination"]
    assert discrimination["fires"]
    assert discrimination["masked_vs_causal"] > compare.DISCRIMINATION_RATIO * honoured["control"]
    # The control is one fp32 ULP of the output: ~1e-7 relative, not a tolerance in disguise.
    assert 1e-8 < honoured["control"] < 1e-6


def test_honoured_mask_sits_on_the_masked_reference(honoured):
    assert honoured["verdict"] == "masked"
    assert honoured["ok"]
    errors, control = honoured["errors"], honoured["control"]
    assert errors["masked"] <= compare.SITS_ON_MULTIPLE[torch.float32] * control
    assert min(errors["causal"], errors["unmasked"]) > 1e3 * errors["masked"]
    assert [row["sink"] for row in honoured["sink_sweep"]] == ["-inf", -5.0, 0.0, 5.0, "+inf"]
    assert all(row["ok"] and row["finite"] for row in honoured["sink_sweep"])
    assert honoured["launches"] == {"flash_attention": 1 + len(compare.SINK_SWEEP)}


def test_dropped_mask_is_detected_as_causal(dropped):
    assert dropped["verdict"] == "causal"
    assert not dropped["ok"]
    # As in the incident: the error against the masked reference is the mask's whole effect.
    assert dropped["errors"]["masked"] == pytest.approx(dropped["discrimination"]["masked_vs_causal"], rel=1e-3)
    assert dropped["errors"]["causal"] <= compare.SITS_ON_MULTIPLE[torch.float32] * dropped["control"]
    worst = dropped["worst"]
    assert worst["key"] is not None and not worst["visible_in_masked"] and worst["visible_in_causal"]
    assert "CAUSAL" in dropped["sentence"]


def test_ablation_locates_a_kernel_that_drops_only_the_padding(monkeypatch):
    # A fused arm that honours window and summaries but forgets the padding: no reference fits,
    # and the ablation points at the padding.
    from kernels.attention import flash_attention

    def forgets_padding(q, k, v, sinks, spec, q_start=0, key_padding=None, scale=None):
        return flash_attention(q, k, v, sinks, spec, q_start, None, scale)

    monkeypatch.setattr(compare, "_fused_attention", lambda device: forgets_padding)
    result = compare.check_attention(**CPU_DEFAULTS, mode="honor", device="cpu", seed=2)
    assert result["verdict"] == "none"
    assert result["ablation"]["nearest"] == "padding_off"
    assert result["ablation"]["padding_off"]["fused"] <= compare.SITS_ON_MULTIPLE[torch.float32] * result["control"]
    assert "padding off" in result["sentence"]


def test_cli_honor_exits_0_and_drop_exits_1_with_json(capsys):
    code, out, _ = run_cli(capsys, "--json")
    assert code == 0
    assert json.loads(out)["verdict"] == "masked"

    code, out, _ = run_cli(capsys, "--mode", "drop", "--json")
    assert code == 1
    report = json.loads(out)
    assert report["verdict"] == "causal"
    assert set(report) >= {"discrimination", "errors", "control", "ablation", "worst", "sink_sweep", "verdict",
                           "sentence", "config"}
    assert set(report["errors"]) == {"masked", "causal", "unmasked"}
    assert report["config"]["mode"] == "drop"


def test_cli_table_names_the_verdict(capsys):
    code, out, _ = run_cli(capsys, "--mode", "drop")
    assert code == 1
    assert "verdict: causal" in out
    assert "discrimination" in out and "sink sweep" in out


def test_a_mask_that_changes_nothing_gives_no_verdict_and_exit_2(capsys):
    # Window longer than the sequence and no padding: composite == causal, nothing to discriminate.
    code, out, _ = run_cli(capsys, "--window", "200", "--pad", "0", "--json")
    report = json.loads(out)
    assert code == 2
    assert not report["discrimination"]["fires"]
    assert report["verdict"] == "none"


@pytest.mark.parametrize(
    "arguments, names",
    [
        (["--head-dim", "96"], "--head-dim"),  # not a power of two
        (["--head-dim", "1024"], "--head-dim"),  # a power of two above 512
        (["--window", "0"], "--window"),
        (["--block", "0"], "--block"),
        (["--pad", "96"], "--pad"),  # pad == seq-len: every key padded
        (["--heads", "3", "--kv-heads", "2"], "--kv-heads"),
        (["--dtype", "bf16"], "--dtype"),  # the interpreter's bf16 dot is wrong
        (["--seq-len", "0"], "--seq-len"),
    ],
)
def test_bad_options_exit_2_in_one_line(capsys, arguments, names):
    code, out, err = run_cli(capsys, *arguments)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and names in err and "Traceback" not in err


def test_cuda_without_a_gpu_is_a_user_error():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(UserError, match="--device cuda"):
        compare.resolve_device("cuda")


def test_the_command_imports_neither_textual_nor_plotext():
    code = (
        "import sys, inspector.cli, inspector.commands.check_attention, engine.compare; "
        "assert not {'textual', 'plotext'} & set(sys.modules), sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])
