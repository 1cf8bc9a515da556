"""A session's check-attention step with `decode = true`: the decode check (engine.compare_decode.check_decode, what
`check-attention --decode` and F3 on a causal or window-only model run), its dims from the model unless the step
gives them; run, recorded, replayed by verdict (a changed verdict is a difference); F3's recorded action saved as
such a step loads back; and the combinations refused before anything runs (one line, exit 2).

The model is a config.json-only Mixtral directory (a sliding window of 12 on every layer, GQA 4/2, head_dim 64)
with random weights; the check draws its own inputs and runs the decode kernel under the Triton interpreter.
"""

from __future__ import annotations

import json

import pytest
from test_session_mla_check import assert_refused, check_step_session

from inspector.cli import main
from inspector.session_runner import read_results

MIXTRAL = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 64,
           "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 64, "num_local_experts": 4, "num_experts_per_tok": 2, "vocab_size": 300,
           "max_position_embeddings": 256, "sliding_window": 12}


def _session(tmp_path, step: str, model: str | None = None) -> tuple:
    return check_step_session(tmp_path, "decode", MIXTRAL, step, model)


def test_a_decode_check_step_runs_at_the_models_shape_and_replays(capsys, tmp_path):
    path, results = _session(tmp_path, 'decode = true\nseq_len = 40\nbatch = 3\nmode = "honor"\nexpect = "ok"')
    assert main(["run", str(path), "--results", str(results), "--device", "cpu"]) == 0, capsys.readouterr().err
    _, steps = read_results(results, "decode.toml")
    numbers = steps[0]["numbers"]
    assert numbers["verdict"] == "ok" and steps[0]["check"]["held"]
    assert {key: numbers["config"][key] for key in ("heads", "kv_heads", "head_dim", "window", "sinks", "seq_len",
                                                     "batch")} == {
        "heads": 4, "kv_heads": 2, "head_dim": 64, "window": 12, "sinks": False, "seq_len": 40, "batch": 3}
    capsys.readouterr()
    assert main(["replay", str(path), "--results", str(results), "--device", "cpu"]) == 0
    assert "match" in capsys.readouterr().out
    # a recording whose verdict differs from what runs now is a difference
    lines = results.read_text().splitlines()
    recorded = [json.loads(line) for line in lines]
    recorded[-1]["numbers"]["verdict"] = "window_wide"
    results.write_text("\n".join(json.dumps(entry) for entry in recorded) + "\n")
    assert main(["replay", str(path), "--results", str(results), "--device", "cpu"]) == 1
    assert "verdict differs: recorded window_wide, now ok" in capsys.readouterr().out


def test_window_0_checks_the_causal_layers_of_a_windowed_model(capsys, tmp_path):
    # gpt-oss-style: the model's default is its sliding window; window = 0 asks for its plain causal layers
    path, results = _session(tmp_path, 'decode = true\nseq_len = 40\nbatch = 3\nwindow = 0\nmode = "honor"\n'
                                       'expect = "ok"')
    assert main(["run", str(path), "--results", str(results), "--device", "cpu"]) == 0, capsys.readouterr().err
    _, steps = read_results(results, "decode.toml")
    assert steps[0]["numbers"]["verdict"] == "ok" and steps[0]["numbers"]["config"]["window"] is None


def test_a_dropped_mask_step_reads_stale_and_fails_an_ok_expectation(capsys, tmp_path):
    path, results = _session(tmp_path, 'decode = true\nseq_len = 40\nbatch = 3\nmode = "drop"\nexpect = "ok"')
    assert main(["run", str(path), "--results", str(results), "--device", "cpu"]) == 1
    _, steps = read_results(results, "decode.toml")
    assert steps[0]["numbers"]["verdict"] == "reads_stale" and not steps[0]["check"]["held"]


def test_f3s_recorded_decode_action_saves_as_a_step_that_loads(tmp_path):
    from inspector.session import load_session
    from inspector.session_recorder import SessionRecorder

    path = tmp_path / "recorded.toml"
    recorder = SessionRecorder(path, {"model": "tiny", "seed": 0})
    step = recorder.append({"action": "check-attention", "decode": True, "seq_len": 160, "batch": 4, "head_dim": 64,
                            "heads": 4, "kv_heads": 2, "window": None, "sinks": False, "mode": "honor",
                            "device": "cpu", "dtype": "torch.float32", "seed": 0})
    assert step.decode and step.batch == 4 and step.window is None and step.sinks is False
    loaded = load_session(path).steps[-1]
    assert (loaded.decode, loaded.seq_len, loaded.batch, loaded.dtype) == (True, 160, 4, "float32")


@pytest.mark.parametrize("step, model, fragment", [
    ('decode = true\nmla = true\nseq_len = 40\nmode = "honor"', None, "mla = true and decode = true are two checks"),
    ('decode = true\nseq_len = 40\nmode = "honor"\nblock = 8', None, "block belongs to another check"),
    ('decode = true\nseq_len = 40\nmode = "honor"\npad = 3', None, "pad belongs to another check"),
    ('decode = true\nseq_len = 40\nmode = "honor"\nexpect = "masked"', None, 'expect = "masked" is a verdict of '
                                                                            'another check'),
    ('seq_len = 40\nmode = "honor"\nbatch = 3', "tiny", "batch belongs to the decode check; add decode = true"),
    ('seq_len = 40\nmode = "honor"\nexpect = "reads_stale"', "tiny", 'expect = "reads_stale" belongs to the decode'),
    ('decode = true\nseq_len = 40\nmode = "honor"', "tiny", "model tiny runs a composite mask"),
    ('decode = true\nseq_len = 1\nmode = "honor"', None, "seq_len must be >= 3"),
    ('decode = true\nseq_len = 2\nmode = "honor"', None, "seq_len must be >= 3"),
    ('decode = true\nseq_len = 12\nmode = "honor"', None, "window 12: the window must be in 1..seq_len - 2 = 10"),
    ('decode = true\nseq_len = 40\nbatch = 1\nmode = "honor"', None, "batch must be in 2..39"),
    ('decode = true\nseq_len = 40\nmode = "decline"', None, "mode must be one of honor, drop"),
    ('decode = true\nseq_len = 40\nmode = "honor"\ndtype = "bfloat16"', None, "dtype bf16 needs device cuda"),
    ('decode = true\nseq_len = 40\nmode = "honor"\nheads = 5', None, "must be a positive multiple of kv_heads"),
    ('decode = "yes"\nseq_len = 40\nmode = "honor"', None, "decode"),
    ('seq_len = 40\nmode = "honor"\nwindow = 0', "tiny", "window = 0 (plain causal layers) is the decode check's"),
    ('decode = true\nseq_len = 40\nmode = "honor"\nwindow = -1', None, "window"),
])
def test_decode_check_steps_it_cannot_run_are_refused_in_one_line(capsys, tmp_path, step, model, fragment):
    assert_refused(capsys, *_session(tmp_path, step, model), fragment)


def test_a_composite_model_runs_the_decode_check_at_the_dims_the_step_gives(capsys, tmp_path):
    path, results = _session(tmp_path, 'decode = true\nseq_len = 40\nbatch = 2\nhead_dim = 64\nheads = 2\n'
                                       'kv_heads = 1\nmode = "honor"\nexpect = "ok"', "tiny")
    assert main(["run", str(path), "--results", str(results), "--device", "cpu"]) == 0, capsys.readouterr().err
