"""What a new user with their own checkpoint meets in sessions and the TUI's recording, each a defect found by
using the product as the README describes it (CPU, a 1-layer config-only Qwen3-MoE with random weights).
"""

from __future__ import annotations

import json

import pytest

from engine import flags as flag_registry
from engine.runtime import Engine
from inspector import tui
from inspector.cli import main
from inspector.session import load_session
from inspector.tui_session import TuiSession

# The smallest config.json the loader takes for a Qwen3-MoE; drawn with --weights random (no safetensors).
QWEN3_CONFIG = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
                "intermediate_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 1,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
                "num_experts_per_tok": 2, "vocab_size": 260, "max_position_embeddings": 256, "rms_norm_eps": 1e-6}


pytestmark = pytest.mark.usefixtures("pinned_environment")  # conftest: no calibration, no MOEI_*


def config_only_checkpoint(directory):
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(QWEN3_CONFIG))
    return directory


def test_a_tui_session_of_a_checkpoint_named_from_the_working_directory_runs_from_anywhere(tmp_path, monkeypatch):
    """`moe-inspector --model ckpt` started in the checkpoint's parent autosaves under ~/.cache: its [engine]
    model used to be written as typed ("ckpt"), which the session format reads from the session file's
    directory, so `run` of the saved session failed with "unknown model 'ckpt'"."""
    work = tmp_path / "work"
    config_only_checkpoint(work / "ckpt")
    monkeypatch.chdir(work)
    engine = Engine.load("ckpt", "cpu", 0, "random")
    path = tmp_path / "autosave" / "session.toml"
    path.parent.mkdir()
    info = tui.session_engine_info(engine, "ckpt", "cpu", 0, "random")
    session = TuiSession.start(path, engine, info, flag_registry.resolve([]))
    session.record({"action": "curve", "k": 2, "experts": 8, "tile_m": 16})
    assert load_session(path).engine.model == str((work / "ckpt").resolve())

    monkeypatch.chdir(tmp_path)  # elsewhere: the recorded path still names the checkpoint
    assert main(["replay", str(path)]) == 0  # the TUI's recording: the same weights, named by another path
    assert main(["run", str(path), "--report", str(tmp_path / "report.md")]) == 0
    monkeypatch.chdir(work)  # ctrl+o of it in an inspector started as `--model ckpt`: the same model
    assert len(TuiSession.open(path, engine).session.steps) == 1


def test_a_preset_is_recorded_by_name(tmp_path):
    engine = Engine.load("tiny", "cpu", 0)
    assert tui.session_engine_info(engine, "tiny", "auto", 0, "auto") == {"model": "tiny", "device": "auto",
                                                                          "seed": 0}


def test_a_session_whose_checkpoint_beside_it_moved_says_so(tmp_path, capsys):
    """`model = "ckpt"` (a directory beside the session) after the directory moved: the error was "unknown
    model 'ckpt': choose one of tiny, demo, v4-shape", with no word of the directory it looked for."""
    config_only_checkpoint(tmp_path / "ckpt")
    session = tmp_path / "s.toml"
    session.write_text('[session]\nversion = 1\nname = "s"\n\n[engine]\nmodel = "ckpt"\nweights = "random"\n'
                       'device = "cpu"\n\n[[step]]\naction = "curve"\ntokens = [1, 8]\n')
    assert main(["run", str(session), "--report", str(tmp_path / "r.md")]) == 0
    capsys.readouterr()
    (tmp_path / "ckpt").rename(tmp_path / "moved")
    before = session.read_text()
    for command in ("run", "replay"):
        assert main([command, str(session)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err
        assert f"'ckpt' is neither a preset" in err and str(tmp_path / "ckpt") in err and "moved" in err
    assert session.read_text() == before


def test_replay_still_refuses_other_weights_under_the_same_path():
    from inspector.session_runner import same_weights

    def header(path, sha, seed=0):
        return {"weights": f"checkpoint {path}", "checkpoint": {"path": path, "family": "qwen3-moe",
                                                                "config_sha256": sha,
                                                                "weights": {"source": "random", "seed": seed}}}

    assert same_weights(header("/a/ckpt", "1234"), header("/b/ckpt", "1234"))
    assert not same_weights(header("/a/ckpt", "1234"), header("/a/ckpt", "5678"))
    assert not same_weights(header("/a/ckpt", "1234"), header("/a/ckpt", "1234", seed=1))
    assert not same_weights({"weights": "random, seed 0"}, {"weights": "random, seed 1"})  # presets: as before


def test_a_check_quant_step_is_in_the_report():
    """`run` of a session with a check-quant step wrote '2 steps' and showed one: check-quant had no section."""
    from inspector.session_report import render_markdown

    numbers = {"config": {"layer": 0, "format": "trellis hyb K=2 V=2 L=16", "arm": "rotated-torch"},
               "rows": [{"tokens": 1, "errors": {"dequantized": 3.36e-07, "original": 0.466}, "control": 8.86e-08,
                         "verdict": "dequantized"}],
               "sentence": "rotated-torch sits on the dequantized reference at every token count"}
    step = {"kind": "step", "step": 1, "action": "check-quant", "definition": {"action": "check-quant", "layer": 0},
            "status": "ok", "runs": [], "numbers": numbers, "check": None, "wall_s": 1.0}
    report = render_markdown({"session": "q", "device": "cpu", "flags": {}}, [step])
    assert "## check-quant" in report and "| 1 | 0 | trellis hyb K=2 V=2 L=16 | rotated-torch | 1 |" in report
    assert "3.79x" in report and "0.466" in report and "sits on the dequantized reference" in report


def test_an_opened_session_reuses_its_configs_rather_than_dumping_every_flag(tmp_path):
    """A session listing one [flags] entry and a config `ref`, continued in the TUI (which passes its whole flag
    state): the new step names base and ref, not config-2 and config-3 holding every flag's default."""
    from engine import flags as flag_registry
    from inspector.session import load_session
    from inspector.session_recorder import SessionRecorder

    path = tmp_path / "s.toml"
    path.write_text('[session]\nversion = 1\nname = "s"\n[engine]\nmodel = "tiny"\n[flags]\ntile_m = 16\n'
                    '[[config]]\nname = "ref"\nmoe_gate = "reference"\n')
    everything = dict(flag_registry.resolve([]).values)  # the TUI's state: every flag, at its default here
    recorder = SessionRecorder.load(path)
    recorder.append({"action": "prompt", "prompt": "hi", "max_tokens": 2, "flags": everything,
                     "compare": {"name": "B", "flags": {**everything, "moe_gate": "reference"}}})
    session = load_session(path)
    assert [config.name for config in session.configs] == ["ref"]
    step = session.steps[-1]
    assert (step.config, step.compare) in (("base", "ref"), (None, "ref"))
