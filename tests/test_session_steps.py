"""inspector.session_steps: one action per step kind, and the TUI's results line is the runner's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import PRESETS
from engine.errors import UserError
from inspector.session import STEP_TYPES, CheckAttentionStep, SweepStep, load_session
from inspector.session_steps import ACTIONS, action_for, make_context, sweep_arms

SESSIONS = Path(__file__).resolve().parents[1] / "sessions"


class _Engine:
    """What a results line reads of the engine: its config and dtype."""

    config, dtype, device = PRESETS["demo"], torch.float32, torch.device("cpu")


def test_every_step_kind_has_an_action():
    assert set(ACTIONS) == set(STEP_TYPES.values())


@pytest.mark.parametrize("verdict, held, detail", [
    ("masked", True, "verdict masked, as expected"),
    ("causal", False, "expected verdict masked, got causal: the fused output sits on the causal reference")])
def test_the_check_attention_line_says_the_verdict_one_way(verdict, held, detail):
    session = load_session(SESSIONS / "flash512-mask.toml")
    step = CheckAttentionStep(seq_len=256, mode="honor", expect="masked")
    outcome = {"result": {"verdict": verdict, "sentence": f"the fused output sits on the {verdict} reference"},
               "wall_s": 0.5}
    line = action_for(step).result(make_context(session, "x.toml", _Engine()), 3, step, outcome)
    assert line["check"] == {"expect": "masked", "held": held, "detail": detail}
    assert line["status"] == ("ok" if held else "check failed") and line["numbers"]["dtype"] == "float32"
    assert line["step"] == 3 and line["wall_s"] == 0.5


def test_a_tui_recording_is_the_runners_line(tmp_path):
    """TuiSession._result_line is the action's result: the same dict for the same outcome."""
    from inspector.session_recorder import SessionRecorder
    from inspector.tui_session import TuiSession

    session = load_session(SESSIONS / "flash512-mask.toml")
    recorder = SessionRecorder.load(SESSIONS / "flash512-mask.toml")
    tui = TuiSession(recorder, _Engine())
    step = CheckAttentionStep(seq_len=256, mode="drop", expect="causal")
    outcome = {"result": {"verdict": "masked", "sentence": "s"}, "wall_s": 1.0}
    context = make_context(session, str(recorder.path), _Engine())
    assert tui._result_line(2, step, outcome) == action_for(step).result(context, 2, step, outcome)


def test_a_sweep_step_names_the_arms_the_sweep_times():
    flags = make_context(load_session(SESSIONS / "quickstart.toml"), "x", _Engine()).flags(None)
    assert sweep_arms(SweepStep(tokens=[1, 8]), flags) == ("gemv", f"grouped_v{flags['grouped_variant']}")
    assert sweep_arms(SweepStep(tokens=[1], arms=["reference", "torch_grouped_mm", "gemv"]), flags) == \
        ("torch_grouped_mm", "gemv")
    action, model = action_for(SweepStep(tokens=[1])), PRESETS["tiny"]
    with pytest.raises(UserError, match="needs a CUDA GPU"):
        action.preflight("s.toml: step 1 (sweep)", SweepStep(tokens=[1]), model, torch.device("cpu"))
    with pytest.raises(UserError, match="leaves nothing to time"):
        action.preflight("s.toml: step 1 (sweep)", SweepStep(tokens=[1], arms=["reference"]), model,
                         torch.device("cuda", 0))


@pytest.mark.gpu
def test_gpu_a_sweep_step_runs_and_records_its_numbers(tmp_path, monkeypatch):
    """The sweep step on a GPU: engine.sweep.run_sweep under the step's config, its rows in the line."""
    import dataclasses

    from inspector.session_runner import run_session

    monkeypatch.setenv("MOEI_CALIBRATION", str(tmp_path / "calibration.json"))
    session = load_session(SESSIONS / "quickstart.toml")
    session = dataclasses.replace(session, steps=(SweepStep(tokens=[1, 8], arms=["gemv", "grouped"]),))
    outcome = run_session(session, "quickstart.toml", "cuda")
    line = outcome.steps[0]
    assert line["action"] == "sweep" and line["status"] == "ok", line.get("check")
    assert [row["tokens"] for row in line["numbers"]["rows"]] == [1, 8]
    assert set(line["numbers"]["rows"][0]["arms"]) == {"gemv", "grouped_v2"}
    assert line["numbers"]["flags"]["pdl"]["value"] is True
