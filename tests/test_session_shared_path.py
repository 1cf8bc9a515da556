"""A session's results carry, per MoE layer with shared experts (DeepSeek, Qwen2-MoE), the path they took
(`shared_path`: "routed launches" or "apart") and why (`shared_reason`), as the dispatcher's records say; the
report shows them, replay compares them, and a results file written before they were recorded (the fields
absent or null) still loads, reports and replays.

The model: a tiny DeepSeek-V2-Lite-shaped config.json with random weights, run on the CPU (a second each)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine import flags as flag_registry
from engine.runtime import Engine
from inspector.cli import main
from inspector.session_report import render
from inspector.session_runner import read_results, results_path_for
from inspector.session_steps import summarize_generation
from test_check_mla_model import _tiny_deepseek

PROMPT, TOKENS = "shared experts", 3
SESSION = f"""[session]
version = 1
name = "shared"

[engine]
model = "dsv2-tiny"
device = "cpu"
weights = "random"

[[config]]
name = "unfolded"
shared_fold = false

[[step]]
action = "compare"
prompt = "{PROMPT}"
max_tokens = {TOKENS}
a = "base"
b = "unfolded"
"""


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """(session path, results text) of the session run once."""
    directory = tmp_path_factory.mktemp("shared")
    _tiny_deepseek(directory / "dsv2-tiny")
    session = directory / "shared.toml"
    session.write_text(SESSION)
    assert main(["run", str(session)]) == 0
    return session, results_path_for(session).read_text()


def _copy(recorded, tmp_path, edit=None) -> Path:
    """The session beside its model and a copy of its results, each step line passed through `edit`."""
    session, text = recorded
    copy = tmp_path / session.name
    copy.write_text(session.read_text())
    (tmp_path / "dsv2-tiny").symlink_to(session.parent / "dsv2-tiny")
    lines = [json.loads(line) for line in text.splitlines()]
    for line in lines[1:]:
        edit and edit(line)
    results_path_for(copy).write_text("".join(json.dumps(line) + "\n" for line in lines))
    return copy


def _moe_entries(step: dict, side: int) -> list[dict]:
    return [entry["moe"] for entry in step["runs"][side]["decisions"] if "moe" in entry]


def _records(directory: Path, flags: list[str]) -> list[dict]:
    engine = Engine.load(str(directory), "cpu", 0, "random")
    generation = engine.generate(PROMPT, TOKENS, flag_registry.resolve(flags, environ={}))
    return [record for step in generation.steps for record in step["moe"]]


def test_the_decisions_carry_the_records_shared_path_and_reason(recorded):
    session, text = recorded
    step = json.loads(text.splitlines()[1])
    for side, flags in ((0, []), (1, ["shared_fold=off"])):
        records = _records(session.parent / "dsv2-tiny", flags)
        entries = _moe_entries(step, side)
        assert len(entries) == len(records) > 0
        assert [(e["shared_path"], e["shared_reason"]) for e in entries] == \
            [(r["shared_path"], r["shared_reason"]) for r in records]
    # on a CPU the reference arm runs the routed experts, so they are apart; the off flag says so in its own words
    assert {e["shared_reason"].split(":")[0] for e in _moe_entries(step, 1)} == {"shared_fold=off"}
    assert {e["shared_path"] for e in _moe_entries(step, 0)} == {"apart"}


def test_the_report_shows_where_the_shared_experts_ran_and_why(recorded):
    header, steps = read_results(results_path_for(recorded[0]), "shared")
    report = render(header, steps, "md")
    assert "| shared experts |" in report and f"apart x{len(_moe_entries(steps[0], 0))}" in report
    assert "Where the shared experts ran, and why:" in report
    why = _moe_entries(steps[0], 1)[0]["shared_reason"]
    assert f"- step 1 unfolded: apart: {why}" in report
    assert "shared experts why" in render(header, steps, "csv").splitlines()[0]


def test_replay_compares_the_shared_experts_path(recorded, tmp_path, capsys):
    (tmp_path / "same").mkdir()
    assert main(["replay", str(_copy(recorded, tmp_path / "same"))]) == 0
    assert "matches the recording" in capsys.readouterr().out

    def edit(line):
        _moe_entries(line, 0)[0]["shared_reason"] = "a reason the engine never gave"

    (tmp_path / "edited").mkdir()
    assert main(["replay", str(_copy(recorded, tmp_path / "edited", edit))]) == 1
    out = capsys.readouterr().out
    assert "config base: decision at generated step 0" in out
    assert "shared experts apart (a reason the engine never gave)" in out


@pytest.mark.parametrize("older", ["absent", "null"])
def test_results_written_before_the_fields_load_report_and_replay(recorded, tmp_path, capsys, older):
    def edit(line):
        for side in (0, 1):
            for moe in _moe_entries(line, side):
                for key in ("shared_path", "shared_reason"):
                    del moe[key]
                    if older == "null":
                        moe[key] = None

    session = _copy(recorded, tmp_path, edit)
    header, steps = read_results(results_path_for(session), "shared")
    report = render(header, steps, "md")
    assert "| decided |" in report and "shared experts" not in report
    assert main(["replay", str(session)]) == 0, capsys.readouterr().err
    assert "matches the recording" in capsys.readouterr().out


def test_a_model_without_shared_experts_records_nothing_more():
    engine = Engine.load("tiny", "cpu", 0)
    generation = engine.generate("no shared", 2, flag_registry.resolve([], environ={}))
    summary = summarize_generation(generation, "base", 0.0)
    assert all(set(entry["moe"]) == {"decided", "executed", "variant"} for entry in summary["decisions"]
               if "moe" in entry)
