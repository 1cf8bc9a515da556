"""What a recording says (engine.routing_stats), the windows the sweep replays (engine.routing_replay), the sweep's
routing options and table, the measured gate calibrated per layer from a recording, and `moe-inspector routing`."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from engine import calibration, dispatch, flags, routing_file, routing_replay, routing_stats
from engine.errors import UserError
from engine.routing_record import RoutingRecorder, pack
from engine.runtime import Engine
from engine.sweep import SweepConfig, parse_layers, parse_skew
from inspector.cli import main
from inspector.commands.sweep import render_table


def _recording(steps: list[list[list[list[int]]]], experts: int, top_k: int):
    """steps: per step, per MoE layer, per token its k ids -> a RoutingRecording (weights 1/k each)."""
    recorder = RoutingRecorder(experts, top_k, 1 << 24)
    for number, layers in enumerate(steps):
        pairs = [(torch.tensor(tokens, dtype=torch.int32), torch.full((len(tokens), top_k), 1 / top_k))
                 for tokens in layers]
        recorder.append(number, "prefill" if number == 0 else "decode", tuple(range(len(layers))), pack(pairs).numpy())
    return recorder.finish({"model": "hand-made", "device": "cpu", "prompt": {"count": 1, "tokens": [3]}})


# step 0: three tokens; steps 1 and 2: one token each. Layer 0 always picks expert 0 first; layer 1 spreads.
STEPS = [
    [[[0, 1], [0, 2], [0, 3]], [[0, 1], [2, 3], [4, 5]]],
    [[[0, 1]], [[6, 7]]],
    [[[0, 2]], [[1, 0]]],
]


def test_load_imbalance_and_woken_along_the_expert_axis():
    recording = _recording(STEPS, experts=8, top_k=2)
    summary = routing_stats.summarize(recording, routing_stats.RUN)
    assert (summary.steps, summary.tokens, summary.first_step, summary.last_step) == (3, 5, 0, 2)
    first, second = summary.layers
    assert first.load.tolist() == [5, 2, 2, 1, 0, 0, 0, 0]  # 10 pairs
    assert first.mean == pytest.approx(10 / 8) and first.max_over_mean == pytest.approx(5 / (10 / 8))
    assert first.cv == pytest.approx(np.std([5, 2, 2, 1, 0, 0, 0, 0]) / (10 / 8))
    assert first.woken == 4 and first.woken_predicted == pytest.approx(dispatch.woken_experts(5, 2, 8))
    assert first.woken_per_step == pytest.approx((4 + 2 + 2) / 3)
    assert first.woken_per_step_predicted == pytest.approx(
        (dispatch.woken_experts(3, 2, 8) + 2 * dispatch.woken_experts(1, 2, 8)) / 3)
    assert first.hottest[0] == (0, 5, 0.5)
    assert second.load.tolist() == [2, 2, 1, 1, 1, 1, 1, 1] and second.woken == 8 and second.woken_per_step == pytest.approx((6 + 2 + 2) / 3)
    last = routing_stats.summarize(recording, routing_stats.LAST)
    assert last.steps == 1 and last.first_step == 2 and last.layers[0].load.tolist() == [1, 0, 1, 0, 0, 0, 0, 0]
    window = routing_stats.summarize(recording, routing_stats.parse_scope("window:2"))
    assert (window.first_step, window.tokens) == (1, 2)
    assert routing_stats.summarize(recording, routing_stats.parse_scope("window:99")).steps == 3


@pytest.mark.parametrize("text", ["", "windows:3", "window:0", "window:-1", "lastt", "window:1e3"])
def test_a_bad_scope_names_the_choices(text):
    with pytest.raises(UserError, match="run .* last .* window:N"):
        routing_stats.parse_scope(text)


def test_the_csv_has_every_layer_and_expert_with_its_rank():
    summary = routing_stats.summarize(_recording(STEPS, 8, 2))
    lines = routing_stats.loads_csv(summary).splitlines()
    assert lines[0] == "layer,expert,load,share,rank" and len(lines) == 1 + 2 * 8
    assert lines[1] == "0,0,5,0.500000,1" and lines[5].startswith("0,4,0,0.000000,")


def test_the_command_prints_the_summary_and_writes_the_csv(tmp_path, capsys):
    path = tmp_path / "hand.safetensors"
    routing_file.save(_recording(STEPS, 8, 2), path)
    out = tmp_path / "loads.csv"
    assert main(["routing", str(path), "--csv", str(out), "--scope", "last"]) == 0
    printed = capsys.readouterr().out
    assert "the last step: steps 2..2 (1 step, 1 routed token), top-2 of 8 experts" in printed
    assert "loads written" in printed and out.read_text().startswith("layer,expert,load,share,rank\n0,0,1,")
    assert main(["routing", str(path), "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["layers"][0]["hottest"][0] == {"expert": 0, "load": 5, "share": 0.5}
    assert payload["recorded_steps"] == 3 and payload["header"]["model"] == "hand-made"
    for bad in (["--scope", "most"], ["--top", "0"], ["--csv", str(tmp_path / "no" / "x.csv")]):
        assert main(["routing", str(path), *bad]) == 2
        assert "Traceback" not in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------------------
# Replay into the sweep: the windows, the observed fill, the crossovers
# ------------------------------------------------------------------------------------------------------------

def test_windows_are_consecutive_recorded_rows_and_wrap_only_past_the_recording():
    ids = np.arange(20, dtype=np.int32).reshape(10, 2)
    weights = np.full((10, 2), 0.5, np.float32)
    sets, wrapped = routing_replay.windows(ids, weights, 4, 4)  # 16 rows asked of 10: spread over the recording
    assert not wrapped and [s[0][0, 0] for s in sets] == [0, 4, 8, 12]  # starts 0, 2, 4, 6 of 0..6
    assert all((s[0] == ids[s[0][0, 0] // 2:s[0][0, 0] // 2 + 4]).all() for s in sets)
    sets, wrapped = routing_replay.windows(ids, weights, 2, 4)  # 8 of 10 rows: the steps in order, from the middle
    assert not wrapped and [int(s[0][0, 0]) // 2 for s in sets] == [1, 3, 5, 7]
    assert (np.concatenate([s[0] for s in sets]) == ids[1:9]).all()
    sets, wrapped = routing_replay.windows(ids, weights, 25, 4)
    assert wrapped and all(len(s[0]) == 25 for s in sets) and (sets[0][0][10:20] == ids).all()


def test_fill_rows_and_crossovers_against_uniform():
    row = routing_replay.fill_row(32, 4.0, 6, 64, 16)  # 32 tokens all on 4 experts: 48 pairs each
    assert row["pairs_per_woken_expert"] == 48 and row["fill_observed"] == 3
    assert row["woken_predicted"] == pytest.approx(dispatch.woken_experts(32, 6, 64))
    rows = [{"tokens": n, "pairs_per_woken_expert": p} for n, p in ((8, 3), (16, 17), (32, 12), (64, 20), (128, 40))]
    assert routing_replay.fill_crossover(rows, 16) == 64  # 16 filled, 32 did not
    layers = [[{"tokens": n, "arms": {"gemv": {"us": g}, "grouped_v2": {"us": v}}} for n, g, v in per]
              for per in ([(8, 1, 3), (64, 5, 2)], [(8, 1, 2), (64, 5, 6)])]
    summed = routing_replay.summed_rows(layers)
    assert summed[1]["arms"] == {"gemv": {"us": 10}, "grouped_v2": {"us": 8}}
    lines = routing_replay.differences([{"layer": 0, "crossover_tokens": 64, "fill_crossover_tokens": 64},
                                        {"layer": 1, "crossover_tokens": 683, "fill_crossover_tokens": None}],
                                       683, 683, 16)
    assert lines[0].endswith("differs from uniform routing's") and lines[1].endswith("the same as uniform routing's")


@pytest.mark.parametrize("text,value", [("uniform", 0.0), ("zipf:1.2", 1.2), ("ZIPF:0", 0.0), (" zipf:3 ", 3.0)])
def test_skew_takes_uniform_or_zipf(text, value):
    assert parse_skew(text) == value


@pytest.mark.parametrize("text", ["1.2", "zipf", "zipf:", "zipf:-1", "zipf:nan", "zipf:inf", "pareto:1"])
def test_a_bad_skew_names_the_syntax(text):
    with pytest.raises(UserError, match="zipf:S"):
        parse_skew(text)


def test_the_sweep_checks_a_routing_file_against_its_model_before_the_gpu(tmp_path, capsys):
    tiny = Engine.load("tiny", "cpu", seed=0, weights="random")
    run = tiny.generate("sweep me", 4, flags.resolve(["record_routing=on"], environ={}))
    path = tmp_path / "tiny.safetensors"
    routing_file.save(run.routing, path)
    config = SweepConfig(model="tiny", tokens=(1, 8), routing=path)
    assert config.recording.layers == (0, 1)
    with pytest.raises(UserError, match="not the shape of demo"):
        SweepConfig(model="demo", routing=path)
    with pytest.raises(UserError, match="choose|one of them"):
        SweepConfig(model="tiny", routing=path, skew=1.0)
    with pytest.raises(UserError, match="recorded MoE layers"):
        SweepConfig(model="tiny", routing=path, layers=parse_layers("0,5"))
    with pytest.raises(UserError, match="--routing"):
        SweepConfig(model="tiny", layers=(0,))
    assert main(["sweep", "--model", "demo", "--routing", str(path)]) == 2
    error = capsys.readouterr().err
    assert "Traceback" not in error and "experts, k differ" in error


def _sweep_row(n, gemv, grouped, woken):
    return {"tokens": n, "woken_experts": woken, "woken_predicted": dispatch.woken_experts(n, 6, 64),
            "pairs_per_woken_expert": n * 6 / woken, "pairs_per_woken_predicted": dispatch.pairs_per_woken_expert(n, 6, 64),
            "fill_observed": n * 6 / woken / 16, "fill_predicted": dispatch.tile_fill(n, 6, 64, 16), "wrapped": n > 100,
            "bandwidth_bound_us": 1.0, "tensor_core_bound_us": 1.0, "align_us": 2.0,
            "arms": {"gemv": {"us": gemv, "rel_err": 1e-3, "ratio": gemv, "timing": "graph"},
                     "grouped_v2": {"us": grouped, "rel_err": 1e-3, "ratio": grouped, "timing": "graph"}}}


def test_the_table_shows_each_layer_beside_uniform_and_where_they_differ():
    uniform = [_sweep_row(n, g, v, w) for n, g, v, w in ((8, 5, 9, 40), (64, 9, 12, 63), (256, 20, 15, 64))]
    layer = [_sweep_row(n, g, v, w) for n, g, v, w in ((8, 5, 9, 20), (64, 12, 8, 30), (256, 30, 12, 40))]
    result = {"device": "NVIDIA H200", "model": "demo", "dtype": "bfloat16", "tile_m": 16, "skew": 0.0,
              "shape": {"experts": 64, "top_k": 6, "hidden": 256, "intermediate": 48}, "copy_bandwidth_gbs": 4200.0,
              "matmul_tflops": 800.0, "rows": uniform, "crossover_tokens": 256, "calibration_path": "/tmp/c.json",
              "check_tolerance": 0.01, "check_failed": False, "commit": "abc",
              "versions": {"torch": "2.11", "triton": "3.6"},
              "routing": {"file": "demo.safetensors", "model": "demo", "recorded_steps": 70, "recorded_tokens": 100,
                          "windows": "4 windows", "layers": [{"layer": 0, "rows": layer, "crossover_tokens": 64,
                                                              "fill_crossover_tokens": 64}],
                          "model_crossover_tokens": 64,
                          "differences": routing_replay.differences(
                              [{"layer": 0, "crossover_tokens": 64, "fill_crossover_tokens": 64}], 256, 171, 16)}}
    table = render_table(result)
    assert "GEMV/grouped crossover (uniform routing): 256 tokens" in table
    assert "MoE layer 0:" in table and "20.0/" in table and "layer 0 crossover: 64 tokens" in table
    assert "40.0/64.0*" in table and "* n exceeds the recorded tokens" in table
    assert "layer 0: recorded routing's crossover 64 tokens; uniform routing's (timed) 256; the uniform formula's " \
           "tile-fill flip 171" in table and "differs from uniform routing's" in table
    assert "from the recorded routing: the model's crossover and each layer's" in table


def test_the_measured_gate_reads_each_layers_crossover_from_a_recording(tmp_path, monkeypatch):
    tiny = Engine.load("tiny", "cpu", seed=0, weights="random")
    path = tmp_path / "calibration.json"
    monkeypatch.setenv("MOEI_CALIBRATION", str(path))
    entry = {"device": tiny.device_label, "k": 2, "experts": 8, "hidden": 64, "intermediate": 32, "tile_m": 16,
             "crossover_tokens": 12, "timing": "graph", "routing_weights": "bfloat16",
             "routing": {"file": "tiny.safetensors", "sha256": "0", "model": "tiny", "layers": [0, 1]},
             "layer_crossovers": {"0": 4, "1": 40}}
    calibration.save_entry(entry, path)
    resolved = flags.resolve(["moe_gate=measured", "decode_floor=0"], environ={})
    run = tiny.generate("ten bytes!", 2, resolved)
    first = run.steps[0]["moe"]  # 10 prefill tokens: layer 0 from 4 (grouped), layer 1 from 40 (GEMV)
    assert [record["decided_arm"] for record in first] == ["grouped", "gemv"]
    assert "on recorded routing (tiny.safetensors, layer 0) crossed over at 4 tokens" in first[0]["reason"]
    assert first[1]["boundary"] == 40
    # a recording of other MoE layers: the entry's one crossover for every layer
    entry["routing"]["layers"] = [0, 1, 2]
    calibration.save_entry(entry, path)
    run = tiny.generate("ten bytes!", 2, resolved)
    assert [record["boundary"] for record in run.steps[0]["moe"]] == [12, 12]
    assert "recorded routing" not in run.steps[0]["moe"][0]["reason"]
    assert math.isfinite(calibration.find_crossover(tiny.device_label, 2, 8, 64, 32, 16, path))


# ------------------------------------------------------------------------------------------------------------
# Sessions carry a routing file as a sweep step's input, its path taken from the session file's directory
# ------------------------------------------------------------------------------------------------------------

SESSION = """[session]
version = 1
name = "routing replay"

[engine]
model = "{model}"
device = "cpu"

[[step]]
action = "sweep"
tokens = [1, 8, 64]
routing = "{routing}"
"""


def test_a_sweep_step_takes_a_routing_file_from_the_sessions_directory(tmp_path, capsys):
    from inspector.session import loads_session
    from inspector.session_routing import routing_path

    tiny = Engine.load("tiny", "cpu", seed=0, weights="random")
    (tmp_path / "recordings").mkdir()
    routing_file.save(tiny.generate("session input", 4, flags.resolve(["record_routing=on"], environ={})).routing,
                      tmp_path / "recordings" / "tiny.safetensors")
    session_path = tmp_path / "replay.toml"
    session_path.write_text(SESSION.format(model="tiny", routing="recordings/tiny.safetensors"))
    step = loads_session(session_path.read_text(), str(session_path)).steps[0]
    assert step.routing == "recordings/tiny.safetensors"
    assert routing_path(step, str(session_path)) == tmp_path / "recordings" / "tiny.safetensors"
    # the file reads and matches: the step goes as far as the device (this machine has no GPU)
    assert main(["run", str(session_path), "--device", "cpu"]) == 2
    error = capsys.readouterr().err
    assert "needs a CUDA GPU" in error and "Traceback" not in error
    # another model's recording, and a missing one: refused before anything runs, naming the step and the file
    session_path.write_text(SESSION.format(model="demo", routing="recordings/tiny.safetensors"))
    assert main(["run", str(session_path), "--device", "cpu"]) == 2
    error = capsys.readouterr().err
    assert "step 1 (sweep): routing = 'recordings/tiny.safetensors'" in error and "experts, k differ" in error
    session_path.write_text(SESSION.format(model="tiny", routing="recordings/none.safetensors"))
    assert main(["run", str(session_path), "--device", "cpu"]) == 2
    assert "none.safetensors: no such file" in capsys.readouterr().err
    session_path.write_text(SESSION.format(model="tiny", routing="x").replace('routing = "x"', "routing = 3"))
    assert main(["run", str(session_path), "--device", "cpu"]) == 2
    assert "routing" in capsys.readouterr().err
