"""The sweep's arithmetic, argument checks, table and progress bar (CPU); the measurement itself
runs on the GPU machine (bench/gpu_all.sh tests)."""

from __future__ import annotations

import io
import json

import pytest
import torch

from engine.errors import UserError
from engine.progress import Progress
from engine.sweep import (
    moe_shape,
    SweepConfig,
    bandwidth_bound_us,
    crossover_tokens,
    parse_arms,
    parse_tokens,
    tensor_core_bound_us,
    zipf_popularity,
)
from inspector.cli import main
from inspector.commands.sweep import render_table


def test_bounds_at_v4_shape_match_hand_arithmetic():
    shape = moe_shape("v4-shape")
    # one expert: 3 * 4096 * 2048 * 2 bytes = 50.3 MB; n=1 wakes 6 of them
    assert shape.expert_weight_bytes() == 50_331_648
    us = bandwidth_bound_us(shape, tokens=1, woken_experts=6, copy_bandwidth_gbs=4200)
    assert us == pytest.approx((6 * 50_331_648 + 2 * 4096 * 2) / 4.2e12 * 1e6)
    assert 71 < us < 73
    # n=8192: 2 * 8192 * 6 * 3 * 4096 * 2048 FLOPs at 790 TFLOP/s = 3.13 ms
    assert tensor_core_bound_us(shape, 8192, 790) == pytest.approx(2 * 8192 * 6 * 3 * 4096 * 2048 / 790e12 * 1e6)


def _row(tokens, gemv, grouped):
    arms = {"gemv": {"us": gemv}, "grouped_v0": {"us": grouped * 1.3}, "grouped_v2": {"us": grouped}}
    return {"tokens": tokens, "arms": arms}


def test_crossover_is_the_start_of_the_last_run_of_grouped_wins():
    rows = [_row(1, 10, 20), _row(8, 20, 15), _row(16, 30, 40), _row(32, 50, 30), _row(64, 90, 40)]
    assert crossover_tokens(rows) == 32  # grouped also won at 8, but lost again at 16
    assert crossover_tokens([_row(1, 10, 5), _row(2, 10, 5)]) == 1
    assert crossover_tokens([_row(1, 10, 5), _row(2, 10, 50)]) is None  # GEMV wins the largest n
    assert crossover_tokens([{"tokens": 1, "arms": {"gemv": {"us": 3.0}}}]) is None  # no grouped arm


def test_zipf_popularity_sums_to_one_and_follows_the_ranks():
    shares = zipf_popularity(4, 1.0, [2, 0, 3, 1])
    assert sum(shares) == pytest.approx(1.0)
    assert shares[2] > shares[0] > shares[3] > shares[1]
    assert zipf_popularity(3, 0.0, [0, 1, 2]) == pytest.approx([1 / 3] * 3)


@pytest.mark.parametrize("text", ["0", "-3", "abc", "", "1,,2", "70000"])
def test_bad_tokens_name_the_value(text):
    with pytest.raises(UserError, match="--tokens"):
        parse_tokens(text)


def test_tokens_sorted_without_repeats_and_arms_checked():
    assert parse_tokens("8, 1,8,683") == (1, 8, 683)
    assert parse_arms("gemv,grouped_v2,gemv") == ("gemv", "grouped_v2")
    with pytest.raises(UserError, match="unknown arm 'grouped_v3'.*grouped_v2"):
        parse_arms("grouped_v3")
    with pytest.raises(UserError, match="--tile-m"):
        SweepConfig(model="tiny", tile_m=8)
    with pytest.raises(UserError, match="unknown model"):
        SweepConfig(model="v5")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_sweep_without_cuda_exits_2_with_one_line(capsys):
    assert main(["sweep", "--model", "tiny", "--tokens", "1,2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "sweep needs a CUDA GPU" in err[0]


def test_sweep_bad_arguments_exit_2_before_touching_the_gpu(capsys):
    assert main(["sweep", "--tokens", "1,zero"]) == 2
    assert "'zero'" in capsys.readouterr().err
    assert main(["sweep", "--arms", "gemv,fast"]) == 2
    assert "'fast'" in capsys.readouterr().err


def test_progress_prints_about_every_tenth_when_not_a_terminal():
    stream = io.StringIO()
    progress = Progress(40, "sweep tiny", stream=stream)
    for _ in range(40):
        progress.advance()
    progress.close()
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("sweep tiny: ") and lines[-1].startswith("sweep tiny: 40/40 (100 %)")
    assert 10 <= len(lines) <= 12 and "\r" not in stream.getvalue()


def test_table_renders_a_result_and_flags_failed_checks():
    result = {
        "device": "NVIDIA H200", "model": "tiny", "dtype": "bfloat16", "tile_m": 16, "skew": 0.0,
        "shape": {"experts": 8, "top_k": 2, "hidden": 64, "intermediate": 32},
        "copy_bandwidth_gbs": 4200.0, "matmul_tflops": 790.0, "crossover_tokens": 2,
        "calibration_path": "/tmp/calibration.json", "check_tolerance": 1e-2, "check_failed": True,
        "commit": "abc", "versions": {"torch": "2.11", "triton": "3.6"},
        "rows": [{
            "tokens": 1, "woken_experts": 2.0, "pairs_per_woken_expert": 1.0, "bandwidth_bound_us": 1.5,
            "tensor_core_bound_us": 0.1, "bound_us": 1.5, "align_us": 6.0,
            "arms": {"gemv": {"us": 3.0, "ratio": 2.0, "rel_err": 0.004, "launches_per_call": {"moe_gemv.down": 1}},
                     "grouped_v2": {"us": 6.0, "ratio": 4.0, "rel_err": 0.5, "launches_per_call": {}},
                     "torch_grouped_mm": {"us": None, "ratio": None, "rel_err": None, "launches_per_call": {},
                                          "unavailable": "torch._grouped_mm does not run on this GPU"}},
        }],
    }
    table = render_table(json.loads(json.dumps(result)))
    assert "3.0 (2.00)" in table and "6.0 (4.00) CHECK" in table and "n/a" in table
    assert "crossover: 2 tokens" in table and "CHECK FAILED" in table


# --- trellis experts: the format's bytes, arms and crossovers -------------------------------------

def test_trellis_bandwidth_bound_counts_packed_bytes():
    from engine.sweep import parse_experts
    from kernels.trellis_reference import packed_bytes_per_expert

    shape = moe_shape("v4-shape")
    code = parse_experts("trellis:K=2,code=hyb")
    packed = packed_bytes_per_expert(code, 2 * 2048, 4096) + packed_bytes_per_expert(code, 4096, 2048)
    assert packed == 3 * 4096 * 2048 * 2 // 8 + 4 * (2 * 2048 + 4096)  # 6.03 MiB against 48 MiB in bf16
    us = bandwidth_bound_us(shape, tokens=1, woken_experts=6, copy_bandwidth_gbs=4200, expert_bytes=packed)
    assert us == pytest.approx((6 * packed + 2 * 4096 * 2) / 4.2e12 * 1e6)
    assert 8.9 < us < 9.1


@pytest.mark.parametrize("text, expected", [("bf16", None), ("trellis:K=2,code=hyb", ("hyb", 2, 2)),
                                            ("trellis:code=1mad,K=4", ("1mad", 4, 1)),
                                            ("trellis:K=3,code=3inst", ("3inst", 3, 1))])
def test_experts_formats_parse(text, expected):
    from engine.sweep import parse_experts

    code = parse_experts(text)
    assert (code if code is None else (code.code, code.K, code.V)) == expected


@pytest.mark.parametrize("text", ["int4", "trellis:K=5,code=hyb", "trellis:K=2,code=lut", "trellis:K=2,K=3",
                                  "trellis:bits=2", "trellis:K=3"])
def test_bad_experts_format_names_the_value(text):
    from engine.sweep import parse_experts

    with pytest.raises(UserError, match="--experts"):
        parse_experts(text)


def test_trellis_sweep_takes_trellis_arms_only():
    from engine.sweep import parse_experts

    code = parse_experts("trellis:K=2,code=hyb")
    with pytest.raises(UserError, match="cannot run trellis experts"):
        SweepConfig(model="v4-shape", arms=("gemv",), experts=code)
    with pytest.raises(UserError, match="cannot run bf16 experts"):
        SweepConfig(model="v4-shape", arms=("trellis_gemv",))
    assert SweepConfig(model="v4-shape", arms=parse_arms("trellis_gemv,trellis_dequant"), experts=code).arms == (
        "trellis_gemv", "trellis_dequant")


def test_trellis_crossovers_use_the_trellis_arms():
    def row(tokens, gemv, grouped, dequant):
        return {"tokens": tokens, "arms": {"trellis_gemv": {"us": gemv}, "trellis_grouped": {"us": grouped},
                                           "trellis_dequant": {"us": dequant}}}

    rows = [row(1, 10, 20, 40), row(16, 30, 25, 45), row(4096, 900, 400, 420), row(8192, 1800, 800, 700)]
    assert crossover_tokens(rows, "trellis_gemv", ("trellis_grouped",)) == 16
    assert crossover_tokens(rows, "trellis_grouped", ("trellis_dequant",)) == 8192
    assert crossover_tokens(rows) is None  # the bf16 arms were not measured
