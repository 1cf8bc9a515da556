"""bench/trellis_bench.py's whole flow on the CPU (interpreted kernels, a small shape, host timers), so a bug
in the script costs no GPU run: every row is filled or names its failure, the report renders, the JSON
serialises. The numbers mean nothing here (and bf16 is not the interpreter's strength: checks may fail)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import trellis_bench  # noqa: E402


def host_timer(calls: list) -> dict:
    """One call, timed on the host (the flow is what is tested, not the numbers)."""
    started = time.perf_counter()
    calls[0]()
    return {"mean_us": (time.perf_counter() - started) * 1e6, "std_us": 0.0, "samples": 1}


@pytest.mark.slow  # about 50 s of interpreter, most of it the grouped arms: every arm of the bench runs once
def test_the_bench_runs_end_to_end_on_a_small_shape():
    setup = trellis_bench.Setup(
        torch.device("cpu"), "cpu", sms=1, bandwidth=1e10, clock=lambda note: (1e9, "test"),
        graph_timer=host_timer, event_timer=host_timer, experts=12, hidden=32, intermediate=16, gemv_calls=2,
        grouped_tokens=(5,), codes=("hyb", "1mad"), gemv_schedules=("r2c8",), grouped_schedules=("m64",))
    result = trellis_bench.measure(setup)
    assert [(row["code"], row["schedule"]) for row in result["trellis_gemv"]] == [
        ("hyb", "u2c16"), ("1mad", "u1c16"), ("hyb", "r1c16"), ("1mad", "r1c16"),
        ("hyb", "r2c8")]  # each code at its default and the baseline, the first at the others
    for row in result["trellis_gemv"]:
        assert "error" in row or (row["mean_us"] > 0 and row["bound_us"] >= row["bytes_bound_us"] > 0
                                  and row["issue_limit"] == "no SASS")  # interpreted: no cubin to read
    (grouped,) = result["grouped"]
    # the first code at the listed schedules; the others at the default, the pairs-per-expert pick and the
    # tensor-form baseline; the dequantize arm on the first
    assert [(arm["arm"], arm["code"], arm["schedule"]) for arm in grouped["arms"]] == [
        ("grouped", "hyb", "m64"), ("grouped", "1mad", "m64"), ("grouped", "1mad", "auto"),
        ("grouped", "1mad", "m64t"), ("dequant", "hyb", "m64")]
    assert all("error" in arm or arm["x_bf16_grouped"] > 0 for arm in grouped["arms"])
    assert {arm["runs"] for arm in grouped["arms"] if arm["schedule"] == "auto"} <= {"m64", "m64f"}  # 10 pairs, 12 experts: hyb m64, the computed codes m64f
    assert all(arm["windows"] >= 1 and arm["per_weight"] is None for arm in grouped["arms"]
               if arm["arm"] == "grouped" and "error" not in arm)  # interpreted: no SASS
    assert grouped["fused_equals_dequant_schedules"] == ["m64"] and grouped["fused_equals_dequant"]
    text = trellis_bench.report(result)
    assert "(i) n = 1" in text and "fused (m64) == dequantize" in text
    json.dumps(result, default=str)


@pytest.mark.slow  # about 10 s of interpreter
def test_the_grouped_only_run_skips_the_gemv_rows():
    setup = trellis_bench.Setup(
        torch.device("cpu"), "cpu", sms=1, bandwidth=1e10, clock=lambda note: (1e9, "test"),
        graph_timer=host_timer, event_timer=host_timer, experts=12, hidden=32, intermediate=16, gemv_calls=2,
        grouped_tokens=(5,), codes=("1mad",), grouped_schedules=(), gemv=False)
    result = trellis_bench.measure(setup)
    assert result["bf16_gemv"] is None and result["trellis_gemv"] == []
    assert [arm["schedule"] for arm in result["grouped"][0]["arms"]] == ["m64"]  # the dequantize arm alone
    text = trellis_bench.report(result)
    assert "(i) n = 1" not in text and "(ii)/(iii) grouped" in text
