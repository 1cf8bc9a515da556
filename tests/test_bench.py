"""The bench harness: the steady-state rule on synthetic timelines, the refusal rules (each kind
refused with exit 2 and no table), kernel shares, and the command end to end on `tiny`."""

import csv
import io
import json
import math

import pytest
import torch

from engine import bench, flags
from engine.errors import MeasurementError
from engine.runtime import Engine
from engine.sequence import Sequence
from inspector.cli import main

# --------------------------------------------------------------------------------------------
# Steady state over synthetic timelines (no model)
# --------------------------------------------------------------------------------------------


def timeline(emitted_per_step, step_s=0.5, start=0.0):
    return [bench.StepEvent(start + i * step_s, start + (i + 1) * step_s, tuple(ids))
            for i, ids in enumerate(emitted_per_step)]


def test_admitting_window_gives_no_rate():
    # Sequence 3 is still queued for prefill when the run ends: 1, 2 decode, 3 never reaches the floor.
    events = timeline([[1], [1, 2], [1, 2], [1, 2], [1, 2, 3], [1, 2, 3]])
    assert bench.steady_window(events, [1, 2, 3], depth_floor=4) is None


def test_cohort_wide_but_shallow_is_still_admitting():
    # The waitsteady follow-up: every sequence admitted (cohort width reached) but only 2 tokens deep.
    events = timeline([[1], [2], [3], [1, 2, 3], [1, 2, 3]])
    assert bench.steady_window(events, [1, 2, 3], depth_floor=3) is None
    window = bench.steady_window(events, [1, 2, 3], depth_floor=2)  # depth 2 reached at step 3: one step left
    assert (window.first, window.last, window.tokens) == (4, 4, 3)
    events = timeline([[1], [2], [3], [1, 2, 3]])
    assert bench.steady_window(events, [1, 2, 3], depth_floor=2) is None  # no step after the floor is met


def test_steady_window_gives_the_decode_rate():
    # Ramp: three prefill steps emit one first token each, then all three decode for 8 steps of 0.25 s;
    # then sequence 1 finishes and the cohort shrinks (ramp-down, excluded).
    ramp = [[1], [2], [3]]
    steady = [[1, 2, 3]] * 8
    tail = [[2, 3], [3]]
    events = timeline(ramp, step_s=1.0) + timeline(steady + tail, step_s=0.25, start=3.0)
    window = bench.steady_window(events, [1, 2, 3], depth_floor=2)
    # depth 2 everywhere after the first steady step (index 3): the window is steps 4..10
    assert (window.first, window.last) == (4, 10)
    assert window.started == pytest.approx(3.25) and window.ended == pytest.approx(5.0)
    assert window.tokens == 7 * 3
    assert window.rate == pytest.approx(21 / 1.75)


def test_trajectory_bins_and_sparkline():
    events = timeline([[1]] * 4 + [[1, 2, 3, 4]] * 8, step_s=0.5)  # 6 s: 2 s bins
    rates = bench.trajectory(events, origin=0.0, bin_s=2.0)
    assert rates == pytest.approx([4 / 2.0, 16 / 2.0, 16 / 2.0])
    assert bench.sparkline(rates)[0] < bench.sparkline(rates)[-1]
    partial = bench.trajectory(timeline([[1]] * 5, step_s=0.5), origin=0.0, bin_s=2.0)
    assert partial == pytest.approx([4 / 2.0, 1 / 0.5])  # the last bin divided by the half second it covered


# --------------------------------------------------------------------------------------------
# Refusal on injected timings (the harness function)
# --------------------------------------------------------------------------------------------


def fake_run(spec, *, prompt_tokens=None, generated=None, step_times=(0.0, 1.0), stamp=True):
    """Sequences and step records of a pp row's single prefill step, with chosen defects."""
    sequences, rows = [], []
    for _ in range(spec.batch):
        sequence = Sequence(range(spec.prompt_len), spec.max_tokens)
        sequence.arrived_at = 0.0
        sequence.first_scheduled_at = step_times[0] if stamp else None
        sequence.first_token_at = step_times[1]
        sequence.generated = [5] * (spec.max_tokens if generated is None else generated)
        sequences.append(sequence)
        rows.append({"request_id": sequence.request_id,
                     "tokens": spec.prompt_len if prompt_tokens is None else prompt_tokens, "emitted": 5})
    steps = [{"step": 0, "phase": "prefill", "started": step_times[0], "ended": step_times[1], "rows": rows,
              "device_us": None, "host_us": 10.0, "graph": "eager"}]
    return sequences, steps


PP = bench.RowSpec("pp", 64, 2, 64, 1)


def test_a_valid_prefill_row_is_measured():
    measured = bench.measure(PP, *fake_run(PP, step_times=(0.0, 0.5)), depth_floor=1)
    assert measured.tokens == 128 and measured.wall_s == 0.5 and measured.device_s is None


@pytest.mark.parametrize("defect, fragment", [
    (dict(prompt_tokens=0), "zero prompt tokens"),
    (dict(prompt_tokens=40), "80 prompt tokens processed, fewer than the 128 asked"),
    (dict(generated=0), "generated 0 tokens, fewer than the 1 asked"),
    (dict(step_times=(2.0, 2.0)), "zero time"),
    (dict(step_times=(0.0, math.nan)), "not a finite positive number"),
    (dict(step_times=(0.0, math.inf)), "not a finite positive number"),
    (dict(stamp=False), "no time stamp"),
])
def test_each_invalid_row_kind_is_refused(defect, fragment):
    with pytest.raises(MeasurementError, match=fragment) as caught:
        bench.measure(PP, *fake_run(PP, **defect), depth_floor=1)
    assert caught.value.exit_code == 2 and "pp64 @ b2" in str(caught.value)


def test_a_decode_row_without_a_steady_window_says_admitting():
    spec = bench.RowSpec("tg", 4, 2, 8, 4)
    sequences = [Sequence(range(8), 4) for _ in range(2)]
    first, second = sequences
    for sequence in sequences:
        sequence.arrived_at, sequence.first_scheduled_at, sequence.first_token_at = 0.0, 0.0, 1.0
        sequence.generated = [1, 2, 3, 4]

    def step(index, phase, rows):
        return {"step": index, "phase": phase, "started": float(index), "ended": index + 1.0, "device_us": None,
                "host_us": 1.0, "graph": "eager", "rows": rows}

    prefill = [{"request_id": s.request_id, "tokens": 8, "emitted": 1} for s in sequences]
    # the second sequence only decodes after the first has finished: never both at depth >= 2
    steps = [step(0, "prefill", prefill[:1])] + [step(i, "decode", [{"request_id": first.request_id, "tokens": 1,
                                                                      "emitted": 1}]) for i in (1, 2, 3)]
    steps += [step(4, "prefill", prefill[1:])] + [step(i, "decode", [{"request_id": second.request_id, "tokens": 1,
                                                                       "emitted": 1}]) for i in (5, 6, 7)]
    measured = bench.measure(spec, sequences, steps, depth_floor=2)
    assert measured.steady is None
    row = bench.Row(spec, [measured], {"arms": {}, "kernels": {}, "graph_replays": 0}, 2)
    assert row.to_json()["state"] == "admitting" and row.to_json()["tps_wall"] is None
    report = bench.Report("tiny", "cpu", [row], {"commit": "x", "device": "cpu", "versions": {}, "model": "tiny",
                                                 "dtype": "float32", "flags": "", "graphs": "off", "weights": "",
                                                 "clocks": ""}, {})
    assert "| tg4 @ b2 | admitting | admitting |" in bench.format_markdown(report)
    # a graph of several steps that could not be captured: the row says so, and the replays column counts launches
    row.counters.update(graph_replays=12, graph_launches=12,
                        graph_notes=["graph of 8 steps not captured: RuntimeError: out of memory"])
    markdown = bench.format_markdown(report)
    assert "tg4 @ b2: graph of 8 steps not captured: RuntimeError: out of memory; its steps replayed one per launch" \
        in markdown
    assert bench.replays_cell(row.counters) == "12"
    assert bench.replays_cell({"graph_replays": 381, "graph_launches": 66}) == "381 in 66 launches"


# --------------------------------------------------------------------------------------------
# Kernel shares
# --------------------------------------------------------------------------------------------


def test_kernel_shares_aggregate_by_kernel_over_the_window():
    steps = {0: (0.0, 100.0), 1: (100.0, 200.0), 2: (200.0, 300.0)}
    kernels = [("prefill_gemm", 10.0, 80.0),  # step 0: outside the window
               ("gemv", 110.0, 20.0), ("attn", 140.0, 10.0), ("gemv", 160.0, 20.0),
               ("gemv", 210.0, 20.0), ("attn", 240.0, 10.0), ("gemv", 260.0, 20.0)]
    rows, note = bench.kernel_shares(kernels, steps, window={1, 2}, window_device_us=100.0)
    assert [row["kernel"] for row in rows] == ["gemv", "attn"]
    gemv, attention = rows
    assert (gemv["device_us"], gemv["calls"], gemv["launches_per_step"], gemv["share"]) == (80.0, 4, 2.0, 0.8)
    assert (attention["calls"], attention["share"]) == (2, 0.2)
    assert "2 steps" in note
    assert "us_per_call_by_site" not in attention  # one launch per step: one site
    rows, note = bench.kernel_shares(kernels, steps, window=set(), window_device_us=None, run_steps=3)
    assert "whole run" in note and "admitting" in note
    assert sum(row["share"] for row in rows) == pytest.approx(1.0)
    assert {row["kernel"]: row["calls"] for row in rows} == {"prefill_gemm": 1, "gemv": 4, "attn": 2}
    assert {row["kernel"]: row["launches_per_step"] for row in rows}["gemv"] == pytest.approx(4 / 3)


def test_kernel_shares_split_a_kernel_by_its_site_in_the_step():
    # One GEMV kernel serves three sites per step (q/k/v 12 us, router 5, head 3); a kernel whose count
    # differs between steps gets no per-site figures.
    steps = {1: (100.0, 200.0), 2: (200.0, 300.0)}
    kernels = [("gemv", 101.0, 12.0), ("odd", 115.0, 1.0), ("gemv", 120.0, 5.0), ("gemv", 150.0, 3.0),
               ("gemv", 201.0, 14.0), ("gemv", 220.0, 5.0), ("gemv", 250.0, 3.0), ("odd", 260.0, 1.0),
               ("odd", 270.0, 1.0)]
    rows, _ = bench.kernel_shares(kernels, steps, window={1, 2}, window_device_us=100.0)
    by_name = {row["kernel"]: row for row in rows}
    assert by_name["gemv"]["us_per_call_by_site"] == [13.0, 5.0, 3.0]
    assert "us_per_call_by_site" not in by_name["odd"]


def test_kernel_shares_say_what_each_kernel_adds_to_the_step_when_spans_overlap():
    # Programmatic dependent launch: "b" launches while "a" runs and waits for it, so its own time (30) counts
    # a's tail; what it adds to the step is its end minus a's (10). The gap before "c" is charged to "c".
    steps = {1: (100.0, 200.0), 2: (200.0, 300.0)}
    kernels = [("a", 101.0, 40.0), ("b", 121.0, 30.0), ("c", 155.0, 5.0), ("b", 161.0, 2.0),
               ("a", 201.0, 40.0), ("b", 221.0, 30.0), ("c", 157.0 + 100.0, 5.0), ("b", 263.0, 4.0)]
    rows, _ = bench.kernel_shares(kernels, steps, window={1, 2}, window_device_us=70.0)
    by_name = {row["kernel"]: row for row in rows}
    assert by_name["a"]["critical_us_per_step"] == pytest.approx(40.0)
    assert by_name["b"]["critical_us_by_site"] == pytest.approx([10.0, 4.0])  # 163 - 160 = 3, 267 - 262 = 5
    assert by_name["c"]["critical_us_per_step"] == pytest.approx(10.0)  # 160-151 = 9, 262-251 = 11
    assert sum(row["critical_us_per_step"] for row in rows) == pytest.approx(((163 - 101) + (267 - 201)) / 2)
    # no step ranges (no markers): no additions, rather than a guess
    rows, _ = bench.kernel_shares(kernels, {}, window={1, 2}, window_device_us=None, run_steps=2)
    assert all("critical_us_per_step" not in row for row in rows)


def test_an_empty_profile_is_an_error_not_a_table_of_zeros():
    with pytest.raises(MeasurementError, match="no device kernels"):
        bench.kernel_shares([], {0: (0.0, 1.0)}, {0}, 1.0)


def test_active_weight_bytes_match_the_config_expert_bytes():
    from engine.config import PRESETS

    config = PRESETS["v4-shape"]
    weights = bench.active_weight_bytes(config, element_bytes=2)
    assert weights["experts"] == config.active_expert_bytes_per_token * config.n_layers
    assert weights["total"] > weights["experts"] > weights["dense"] > 0


# --------------------------------------------------------------------------------------------
# Real runs on tiny: stamps, the command, refusal through the CLI
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    return Engine.load("tiny", "cpu", seed=0)


def test_prefill_only_requests_are_timed_with_an_injected_clock(tiny):
    ticks = iter(range(1000))
    spec = bench.RowSpec("pp", 24, 3, 24, 1)
    result = tiny.generate_batch(bench.prompts_for(spec, 0, 0, 256), 1, flags.resolve(environ={}),
                                 clock=lambda: float(next(ticks)))
    assert len(result.steps) == 1  # every request finishes inside the step that processed it
    measured = bench.measure(spec, result.sequences, result.steps, depth_floor=1)
    step = result.steps[0]
    assert measured.wall_s == step["ended"] - step["started"] > 0 and measured.tokens == 72
    assert all(sequence.first_scheduled_at == step["started"] for sequence in result.sequences)


@pytest.fixture(scope="module")
def bench_json():
    import io
    from contextlib import redirect_stdout

    output = io.StringIO()
    with redirect_stdout(output):
        code = main(["bench", "--model", "tiny", "--device", "cpu", "--pp", "24", "--tg", "8", "--batch", "1,3",
                     "--reps", "2", "--tg-prompt", "6", "--format", "json", "--no-progress"])
    assert code == 0
    return json.loads(output.getvalue())


def test_bench_rows_carry_rates_clocks_and_counters(bench_json):
    rows = {row["test"]: row for row in bench_json["rows"]}
    assert list(rows) == ["pp24", "pp24 @ b3", "tg8", "tg8 @ b3"]
    layers = 2
    for row in rows.values():
        assert row["reps"] == 2 and len(row["tps_wall"]["values"]) == 2
        assert all(math.isfinite(value) and value > 0 for value in row["tps_wall"]["values"])
        assert row["tps_device"] is None and row["clock_disagreement"] is None  # CPU: no device clock
        arms = row["counters"]["arms"]
        assert set(arms) >= {"gemv", "grouped_v0", "grouped_v1", "grouped_v2", "reference", "fused", "unfused"}
        assert arms["gemv"] == arms["grouped_v2"] == arms["fused"] == 0  # the CPU runs the references only
    assert rows["pp24 @ b3"]["counters"]["arms"]["reference"] == 2 * layers  # one prefill step per rep
    tg = rows["tg8 @ b3"]
    assert tg["state"] == "steady" and tg["depth_floor"] == 2
    # 3 sequences x 8 tokens: the window starts once all have 2 tokens and holds 6 decode steps
    assert tg["window_steps"] == 6 and tg["tps_wall"]["mean"] > 0
    assert tg["counters"]["arms"]["reference"] == 2 * (1 + 7) * layers  # 1 prefill + 7 decode steps, 2 reps
    assert tg["trajectory"]["tokens_per_s"] and tg["trajectory"]["bin_s"] == 2.0
    span = tg["trajectory"]["span_s"]  # the run's own length: the TUI plots the last bin there, not at its nominal end
    assert 0 < span <= 2.0 * len(tg["trajectory"]["tokens_per_s"])
    footer = bench_json["footer"]
    assert {"commit", "device", "versions", "flags", "graphs", "clocks"} <= set(footer)
    assert "n/a" in footer["clocks"] and footer["versions"]["torch"]
    assert bench_json["targets"]["rows"][0]["test"] == "tg8"


def test_markdown_and_csv_come_from_the_same_report(tiny):
    report = bench.run_bench(tiny, flags.resolve(environ={}), [bench.RowSpec("tg", 4, 2, 5, 4)], 1)
    markdown = bench.format_markdown(report)
    assert markdown.startswith("| test | t/s (wall) | t/s (device) |") and "| tg4 @ b2 |" in markdown
    assert "commit" in markdown and "Generated tokens/s in 2-second bins" in markdown
    lines = bench.format_csv(report).splitlines()
    assert lines[0].startswith("test,kind,tokens,batch,state") and lines[1].startswith("tg4 @ b2,tg,4,2,steady")
    rows = list(csv.DictReader(io.StringIO(bench.format_csv(report))))
    assert rows[0]["model"] == "tiny" and rows[0]["weights"].startswith("random, seed 0")


def test_csv_rows_name_the_checkpoint_they_ran():
    """Rows of several models concatenated in CI must say which model each came from: a checkpoint by its path."""
    footer = {"model": "qwen3-moe", "weights": "2 files", "checkpoint": {"path": "/ckpts/qwen3", "family": "qwen3-moe"}}
    assert bench.csv_model(footer) == "/ckpts/qwen3"
    assert bench.csv_model({"model": "demo"}) == "demo"


@pytest.mark.parametrize("clock, fragment", [
    (lambda: 5.0, "zero time"),
    (lambda: math.nan, "not a finite positive number"),
])
def test_refusal_through_the_command_exits_2_with_no_table(monkeypatch, capsys, clock, fragment):
    monkeypatch.setattr(bench, "TIME_SOURCE", clock)
    code = main(["bench", "--model", "tiny", "--device", "cpu", "--pp", "16", "--tg", "none", "--batch", "1",
                 "--reps", "1", "--no-progress"])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    last = captured.err.strip().splitlines()[-1]  # (earlier in-process tests may leave logging noise above it)
    assert last.startswith("moe-inspector: error: pp16") and fragment in last


def test_profile_without_device_activity_exits_2(capsys):
    code = main(["bench", "--model", "tiny", "--device", "cpu", "--pp", "16", "--tg", "none", "--batch", "1",
                 "--reps", "1", "--profile", "--no-progress"])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == "" and "no device kernels" in captured.err


@pytest.mark.parametrize("argv, fragment", [
    (["--pp", "none", "--tg", "none"], "nothing to measure"),
    (["--pp", "600"], "more than the tiny context of 512"),
    (["--batch", "0"], "at least one batch size"),
    (["--batch", "2,-1"], "every value must be an integer >= 1"),
    (["--reps", "0"], "--reps must be >= 1"),
    (["--graphs", "maybe"], "use on or off"),
    (["--gpu-weights"], "--gpu-weights draws weights on a GPU"),
    (["--set", "prefill_chunk=4"], "prefill_chunk"),
])
def test_bad_bench_options_exit_2(capsys, argv, fragment):
    code = main(["bench", "--model", "tiny", "--device", "cpu", "--tg", "none", "--pp", "16", "--no-progress"] + argv)
    assert code == 2 and fragment in capsys.readouterr().err


def test_targets_print_the_hosts_busy_time_and_the_devices_wait_for_it():
    # Two replays in flight: the host's busy time per step (71 µs) runs beside the device; what the host
    # costs the critical path is the wall step beyond the device step (1.3 µs). Both lines are printed.
    entry = {"test": "tg128", "tps": 6755.0, "bound_tps": 11177.0, "ratio_to_bound": 1.65, "target_ratio": 1.3,
             "host_us_per_step": 71.1, "device_us_per_step": 146.7, "host_share": 0.485, "target_host_share": 0.2,
             "graph_steps": 360, "window_steps": 360, "wall_us_per_step": 148.0, "device_waits_us_per_step": 1.3,
             "device_waits_share": 1.3 / 148.0}
    targets = {"active_weight_bytes_per_token": {"total": 381.7e6},
               "copy_bandwidth": {"bytes_per_s": 4.26e12, "clock": "CUDA events"}, "rows": [entry]}
    footer = {"model": "v4-shape", "dtype": "bfloat16", "device": "H200", "commit": "c", "versions": {},
              "flags": "", "graphs": "", "weights": "", "clocks": ""}
    text = bench.format_markdown(bench.Report("v4-shape", "cuda", [], footer, targets))
    assert "71.1 µs of 146.7 µs device = 48.5 %" in text
    assert "wall 148.0 µs - device 146.7 µs = 1.3 µs = 0.9 % of the step" in text
    # beside the mean (the target's figure), the median and p90 show how much of it a slow tail makes
    entry.update(host_us_p50=12.0, host_us_p90=30.5)
    text = bench.format_markdown(bench.Report("v4-shape", "cuda", [], footer, targets))
    assert "71.1 µs (median 12.0, p90 30.5: the mean counts the slow tail) of 146.7 µs device = 48.5 %" in text


def test_decode_targets_are_the_projects_shapes_and_no_other():
    assert bench.decode_target("v4-shape") == 1.3
    assert bench.decode_target("qwen3-moe:qwen3-30b-a3b") == 1.35
    assert bench.decode_target("deepseek-v2:DeepSeek-V2-Lite") == 1.4
    assert bench.decode_target("demo") is None and bench.decode_target("qwen3-moe:my-model") is None
    entry = {"test": "tg128", "tps": 20000.0, "bound_tps": 1e6, "ratio_to_bound": 50.0, "target_ratio": None,
             "host_us_per_step": 17.5, "device_us_per_step": None, "host_share": None, "target_host_share": 0.2,
             "graph_steps": 0, "window_steps": 10, "wall_us_per_step": 50.0}
    targets = {"active_weight_bytes_per_token": {"total": 4.2e6},
               "copy_bandwidth": {"bytes_per_s": 4.26e12, "clock": "CUDA events"}, "rows": [entry]}
    footer = {"model": "demo", "dtype": "bfloat16", "device": "H200", "commit": "c", "versions": {},
              "flags": "", "graphs": "", "weights": "", "clocks": ""}
    text = bench.format_markdown(bench.Report("demo", "cuda", [], footer, targets))
    assert "50.00x the bound (no target for this model)" in text and "target <= 1.3x" not in text


def test_host_time_quantiles_come_from_the_windows_steps():
    assert bench._quantile([5.0], 0.9) == 5.0
    assert bench._quantile([1.0, 2.0, 3.0, 4.0, 100.0], 0.5) == 3.0
    assert bench._quantile([float(v) for v in range(11)], 0.9) == pytest.approx(9.0)
    assert bench._quantile([0.0, 10.0], 0.9) == pytest.approx(9.0)


def test_every_profiled_repetition_runs_after_every_timed_one(tiny, monkeypatch):
    # A torch.profiler session leaves the process's CUDA calls slower (bench/experiments/probe_launch.py), so no row may be
    # timed after another row's profile: the timed repetitions of both rows come first, then both profiles.
    order = []
    run_once = bench._run_once

    def recording_run_once(engine, flags_, spec, runner, budget, clock, repetition):
        order.append(("timed" if repetition <= 1 else "profiled", spec.name))
        return run_once(engine, flags_, spec, runner, budget, clock, repetition)

    def fake_profile(spec, runner, run_once_, repetition, floor):
        run_once_(repetition)
        return [], "stub"

    monkeypatch.setattr(bench, "_run_once", recording_run_once)
    monkeypatch.setattr(bench, "_profiled_repetition", fake_profile)
    specs = [bench.RowSpec("pp", 16, 1, 16, 1), bench.RowSpec("tg", 4, 1, 5, 4)]
    report = bench.run_bench(tiny, flags.resolve(environ={}), specs, 1, profile=True)
    names = [spec.name for spec in specs]
    assert order == [("timed", names[0])] * 2 + [("timed", names[1])] * 2 + [("profiled", n) for n in names]
    assert [row.profile_note for row in report.rows] == ["stub", "stub"]


def test_profile_note_says_when_kernel_times_overlap(monkeypatch):
    from engine.bench import profile_note
    from kernels import pdl

    plain = profile_note("steps 8-127 (120 steps)", torch.device("cpu"))
    assert plain == "steps 8-127 (120 steps) of one extra repetition under torch.profiler (not in the timings)"
    monkeypatch.setattr(pdl, "enabled", lambda device: True)
    assert "overlap and add up to more than the step" in profile_note("steps 8-127 (120 steps)", torch.device("cpu"))


def test_one_repetition_has_no_spread_to_show():
    """A stddev over one value is not a measured 0: the cells say n/a; over several, the sample stddev."""
    from engine.bench import latency_cell, latency_summary, mean_std, spread_cell

    assert spread_cell(mean_std([3269.771])) == "3269.77 ± n/a"
    assert spread_cell(mean_std([10.0, 12.0]), 1) == "11.0 ± 1.4"
    assert latency_cell(latency_summary([4.28])) == "4.28 ± n/a"
    assert latency_cell(latency_summary([2.0, 2.0])) == "2.00 ± 0.00"  # a measured 0: equal latencies
