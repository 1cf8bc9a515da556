"""Sessions: the strict parser, the example sessions, run/replay exit codes, atomic saves, and
the recorder's round trip (record -> save -> run -> replay), all headless on the CPU."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine import atomic_file
from engine import flags as flag_registry
from engine.errors import UserError
from inspector import session as session_format
from inspector.cli import main
from inspector.session import (CompareStep, PromptStep, dumps_session, load_session, loads_session,
                               parse_session, save_session)
from inspector.session_recorder import SessionRecorder
from inspector.session_report import render
from engine.config import PRESETS
from inspector.session_runner import read_results, results_path_for, run_session

REPOSITORY = Path(__file__).resolve().parent.parent
SESSIONS = REPOSITORY / "sessions"
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "sessions"


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """On a shared 2-core machine, torch's second intra-op thread spins against other processes
    (gate-policies: 7 s with one thread, 36 s with two under load); one thread is steady."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


pytestmark = pytest.mark.usefixtures("pinned_environment")  # conftest: no calibration, no MOEI_*


def run_cli(capsys, *argv):
    code = main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# --------------------------------------------------------------------------------------------
# Bad sessions: exit 2, a message naming the file, the step and the key, nothing run or written
# --------------------------------------------------------------------------------------------

BAD_SESSIONS = [
    ("not_toml", ["not valid TOML", "line 9, column 14"]),
    ("unknown_key", ["step 2 (prompt)", "unknown key 'promt'", "did you mean 'prompt'",
                     "allowed: prompt, max_tokens"]),
    ("wrong_type", ["step 1 (prompt)", "key 'max_tokens' must be an integer >= 1", "got a string ('eight')"]),
    ("unknown_action", ["step 2", "unknown action 'generate'", "allowed: prompt, compare, curve"]),
    ("missing_prompt", ["step 1 (prompt)", "missing key 'prompt'"]),
    ("bad_flag_value", ["moe_gate", "[flags]", "'fastest' is not allowed", "allowed: floor, tile-fill"]),
    ("bad_config_flag_value", ["config 1 ('ignore')", "fused_mask", "allowed: honor, decline or drop"]),
    ("future_version", ["[session]", "version 2 is newer", "upgrade moe-inspector"]),
    ("undefined_config", ["step 1 (prompt)", "names config 'hnor', which is not defined", "defined: base, honor"]),
    ("bench_unknown_key", ["step 1 (bench)", "unknown key 'batches'", "did you mean 'batch'",
                           "allowed: pp, tg, batch, reps, config"]),
    ("bench_nothing_to_measure", ["step 1 (bench)", "nothing to measure", "pp = [...]"]),
    ("bench_too_long", ["step 2 (bench)", "row pp1024 needs 1025 positions", "context of 512"]),
    ("prompt_too_long", ["step 1 (prompt)", "443 tokens", "context of 512"]),
    ("sweep_needs_gpu", ["step 2 (sweep)", "needs a CUDA GPU", "this run is on cpu"]),
]


@pytest.mark.parametrize("name, fragments", BAD_SESSIONS, ids=[name for name, _ in BAD_SESSIONS])
def test_bad_session_exits_2_naming_the_problem(name, fragments, capsys, tmp_path):
    path = FIXTURES / f"{name}.toml"
    results = tmp_path / "results.jsonl"
    code, out, err = run_cli(capsys, "run", path, "--results", results)
    assert code == 2
    assert str(path) in err and "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, f"{fragment!r} not in {err!r}"
    assert out == "" and not results.exists()  # refused before anything ran


def test_missing_session_file_exits_2(capsys, tmp_path):
    code, _, err = run_cli(capsys, "run", tmp_path / "nowhere.toml")
    assert code == 2 and "no such session file" in err


def test_parser_is_plain_functions_over_plain_values():
    minimal = {"session": {"version": 1, "name": "x"}}
    assert parse_session(minimal, "x").steps == ()
    cases = [
        ({"step": [{"action": "prompt", "prompt": "p", "expect_match": True}]}, "add compare"),  # nothing to check
        ({"config": [{"name": "base"}]}, "reserved"),
        ({"config": [{"name": "a"}, {"name": "a"}]}, "already defined"),
        ({"config": [{"name": "a", "moe_gat": "floor"}]}, "did you mean 'moe_gate'"),
        ({"engine": {"model": "tiny", "gpu": True}}, "[engine]: unknown key 'gpu'"),
        ({"step": [{"action": "prompt", "prompt": "p", "max_tokens": True}]}, "got a boolean"),  # bool is not an int
        ({"step": [{"action": "curve", "tokens": []}]}, "non-empty list"),
        ({"step": [{"action": "check-attention", "seq_len": 8, "mode": "honor", "expect": "maybe"}]},
         "one of masked, causal, unmasked, no_rope, none"),
        ({"step": {"action": "curve"}}, "array of tables"),
        ({"extra": {}}, "unknown table 'extra'"),
        ({"foo": 1}, "unknown top-level key 'foo'; a session holds the tables"),
    ]
    for extra, fragment in cases:
        with pytest.raises(UserError, match="x.toml") as error:
            parse_session({**minimal, **extra}, "x.toml")
        assert fragment in str(error.value), (extra, str(error.value))
    with pytest.raises(UserError, match="missing key 'version'"):
        parse_session({"session": {"name": "x"}}, "x.toml")


@pytest.mark.parametrize("path", sorted(SESSIONS.glob("*.toml")), ids=lambda path: path.stem)
def test_example_sessions_round_trip_through_the_writer(path):
    session = load_session(path)
    assert loads_session(dumps_session(session), "rewritten") == session


# --------------------------------------------------------------------------------------------
# The example sessions run on the CPU with exit 0
# --------------------------------------------------------------------------------------------

def run_example(capsys, tmp_path, name, *extra):
    results = tmp_path / f"{name}.results.jsonl"
    code, out, err = run_cli(capsys, "run", SESSIONS / f"{name}.toml", "--results", results, "--device", "cpu", *extra)
    return code, out, err, results


def test_quickstart_runs(capsys, tmp_path):
    code, out, err, results = run_example(capsys, tmp_path, "quickstart")
    assert code == 0, err
    header, steps = read_results(results, "quickstart")
    assert header["device"] == "cpu" and header["flags"]["moe_gate"] == {"value": "tile-fill", "source": "session"}
    assert [step["action"] for step in steps] == ["prompt", "prompt", "curve"]
    assert steps[2]["numbers"]["min_tokens"] == 64  # top-2 of 8 experts, TILE_M=16
    assert "## prompt and compare" in out and "## curve (step 3)" in out and "commit" in out.splitlines()[-3]


def test_gate_policies_decide_per_width(capsys, tmp_path):
    code, out, err, results = run_example(capsys, tmp_path, "gate-policies")
    assert code == 0, err
    _, steps = read_results(results, "gate-policies")
    prefill = {}
    for step in steps[:-1]:
        run = step["runs"][0]
        first = run["decisions"][0]
        moe = first["moe"]
        variant = "" if moe["variant"] is None else f" v{moe['variant']}"
        prefill[(run["config"], first["n_tokens"])] = moe["decided"] + variant
        assert all(entry["moe"]["decided"] == "gemv" for entry in run["decisions"] if entry["phase"] == "decode")
    assert prefill == {
        ("floor", 12): "grouped v2", ("tile-fill", 12): "gemv", ("threshold:16", 12): "gemv", ("measured", 12): "gemv",
        ("floor", 40): "grouped v2", ("tile-fill", 40): "gemv", ("threshold:16", 40): "grouped v2",
        ("measured", 40): "grouped v2",
        **{(config, 195): "grouped v2" for config in ("floor", "tile-fill", "threshold:16", "measured")},
    }
    assert steps[-1]["numbers"]["min_tokens"] == 171  # top-6 of 64, TILE_M=16
    assert "falling back to threshold:16" in json.dumps(steps)  # measured without a calibration says so


def test_variant_proof_counts_each_variant_and_says_what_executed_on_cpu(capsys, tmp_path):
    code, out, err, results = run_example(capsys, tmp_path, "variant-proof")
    assert code == 0, err
    _, steps = read_results(results, "variant-proof")
    decided = set()
    for step in steps:
        assert step["check"] == {"expect": "match", "held": True, "detail": "identical tokens, as expected"}
        assert step["runs"][0]["tokens"] == step["runs"][1]["tokens"]
        for run in step["runs"]:
            variants = {entry["moe"]["variant"] for entry in run["decisions"]}
            assert len(variants) == 1 and {entry["moe"]["decided"] for entry in run["decisions"]} == {"grouped"}
            decided |= variants
            # On the CPU nothing but the reference executed, and the counters say so.
            arms = run["counters"]["arms"]
            assert arms["reference"] == len(run["decisions"]) and not any(arms[f"grouped_v{v}"] for v in (0, 1, 2))
            assert any("grouped cannot run on cpu" in note for note in run["notes"])
    assert decided == {0, 1, 2}
    assert "grouped v0 -> reference" in out and "not that the decided kernels do" in out


def test_flash512_mask_side_by_side_diverges(tmp_path):
    """The side-by-side part runs whether or not check-attention is in this build."""
    session = load_session(SESSIONS / "flash512-mask.toml")
    only_prompts = dataclasses.replace(session, steps=tuple(step for step in session.steps
                                                            if isinstance(step, PromptStep)))
    outcome = run_session(only_prompts, "flash512-mask.toml", "cpu")
    step = outcome.steps[0]
    assert step["check"]["held"] and step["numbers"]["first_divergence"] is not None
    drop, honor = step["runs"]
    assert {entry["attention"]["applied_mask"] for entry in drop["decisions"] if entry["layer"] == 0} == {"causal"}
    assert {entry["attention"]["applied_mask"] for entry in honor["decisions"]
            if entry["layer"] == 0} == {"composite(W=128,B=64)"}


def test_flash512_mask_runs_with_check_attention(capsys, tmp_path):
    code, out, err, results = run_example(capsys, tmp_path, "flash512-mask")
    assert code == 0, err
    _, steps = read_results(results, "flash512-mask")
    verdicts = [step["numbers"]["verdict"] for step in steps if step["action"] == "check-attention"]
    assert verdicts == ["masked", "causal"]


def test_check_attention_steps_call_engine_compare_with_the_model_shape(monkeypatch, capsys, tmp_path):
    """The runner's side of the contract with `engine.compare.check_attention` (from the attention
    branch), through a stand-in: the model's shape fills what the step leaves out, and the
    verdict is checked against `expect`."""
    import torch

    from engine import compare

    calls = []

    def check_attention(**arguments):
        calls.append(arguments)
        verdict = {"honor": "masked", "drop": "causal"}[arguments["mode"]]
        return {"verdict": verdict, "sentence": f"the fused output sits on the {verdict} reference",
                "errors": {"masked": torch.tensor(1e-7), "causal": 0.3}, "control": 4e-3}

    monkeypatch.setattr(compare, "check_attention", check_attention)
    session = load_session(SESSIONS / "flash512-mask.toml")
    checks = dataclasses.replace(session, steps=session.steps[1:])
    outcome = run_session(checks, "flash512-mask.toml", "cpu")
    assert outcome.exit_code == 0 and [step["check"]["held"] for step in outcome.steps] == [True, True]
    assert calls[0] == {"seq_len": 256, "head_dim": 512, "heads": PRESETS["demo"].n_heads, "kv_heads": 1, "window": 128, "block": 64,
                        "pad": 3, "mode": "honor", "device": torch.device("cpu"), "dtype": torch.float32, "seed": 0}
    assert outcome.steps[0]["numbers"]["errors"]["masked"] == pytest.approx(1e-7)  # tensors become JSON numbers
    report = render(outcome.header, outcome.steps, "md")
    assert "## check-attention" in report and "the fused output sits on the causal reference" in report

    wrong = dataclasses.replace(checks, steps=(dataclasses.replace(checks.steps[1], expect="masked"),))
    outcome = run_session(wrong, "flash512-mask.toml", "cpu")
    assert outcome.exit_code == 1 and "expected verdict masked, got causal" in outcome.steps[0]["check"]["detail"]


def test_a_failed_check_exits_1(capsys, tmp_path):
    code, out, err = run_cli(capsys, "run", FIXTURES / "check_fails.toml", "--results", tmp_path / "r.jsonl")
    assert code == 1
    assert "expected the configurations to diverge; tokens identical" in err + out
    assert "diverge: FAILED" in out
    _, steps = read_results(tmp_path / "r.jsonl", "check_fails")
    assert steps[0]["status"] == "check failed"  # results are written even when a check fails


def test_bench_step_runs_on_cpu_and_replays(capsys, tmp_path):
    """The bench step: llama-bench rows in the results, token counts and counters diffed on
    replay, timings not; a tampered counter is found."""
    session_path = tmp_path / "bench_tiny.toml"
    session_path.write_text((FIXTURES / "bench_tiny.toml").read_text())
    code, out, err = run_cli(capsys, "run", session_path)
    assert code == 0, err
    _, steps = read_results(results_path_for(session_path), "bench_tiny")
    assert [step["action"] for step in steps] == ["bench", "bench"]
    rows = steps[0]["numbers"]["rows"]
    assert [row["test"] for row in rows] == ["pp16", "pp16 @ b2", "tg8", "tg8 @ b2"]
    for row in rows:
        assert row["reps"] == 2 and row["tps_wall"]["mean"] > 0 and row["counters"]["arms"]["reference"] > 0
    # tiny's 2 layers, 2 timed repetitions, 8 decode steps each: the counters are exact.
    tg8 = rows[2]
    assert tg8["counters"]["arms"]["reference"] == 2 * 8 * 2 and tg8["state"] == "steady"
    assert steps[0]["numbers"]["footer"]["device"] == "cpu"
    assert steps[1]["numbers"]["footer"]["flags"].startswith("moe_gate=floor")  # config "floor"
    code, out, err = run_cli(capsys, "replay", session_path)
    assert code == 0, err

    results = results_path_for(session_path)
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    lines[1]["numbers"]["rows"][0]["tps_wall"]["mean"] *= 3  # a timing: shown, not compared
    lines[1]["numbers"]["rows"][2]["counters"]["arms"]["reference"] += 1
    results.write_text("".join(json.dumps(line) + "\n" for line in lines))
    code, out, err = run_cli(capsys, "replay", session_path)
    assert code == 1
    assert "step 1 (bench), row tg8: reference launches recorded 33, now 32" in err
    assert "more)" not in err  # the one difference: the tripled rate is a timing, not compared


# --------------------------------------------------------------------------------------------
# Report formats, results files, replay
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """quickstart run once into a scratch directory: (session path, results text)."""
    directory = tmp_path_factory.mktemp("recorded")
    session_path = directory / "quickstart.toml"
    session_path.write_text((SESSIONS / "quickstart.toml").read_text())
    assert main(["run", str(session_path), "--device", "cpu", "--report", str(directory / "report.md")]) == 0
    return session_path, results_path_for(session_path).read_text()


def fresh_copy(recorded, tmp_path):
    session_path, results_text = recorded
    copy = tmp_path / session_path.name
    copy.write_text(session_path.read_text())
    results_path_for(copy).write_text(results_text)
    return copy


def test_results_file_is_a_sibling_with_a_header(recorded):
    session_path, results_text = recorded
    assert results_path_for(session_path).name == "quickstart.results.jsonl"
    lines = [json.loads(line) for line in results_text.splitlines()]
    header = lines[0]
    for key in ("schema", "package_version", "commit", "torch", "triton", "device", "flags"):
        assert key in header
    assert header["flags"]["tile_m"] == {"value": 16, "source": "default"}
    assert [line["step"] for line in lines[1:]] == [1, 2, 3]
    run = lines[1]["runs"][0]
    for key in ("tokens", "text", "decisions", "counters", "timings"):
        assert key in run
    assert set(run["decisions"][0]) == {"step", "layer", "phase", "n_tokens", "moe", "attention"}
    assert (session_path.parent / "report.md").read_text().startswith("# session `quickstart`")


def test_report_formats_render_from_recorded_results(recorded, tmp_path):
    header, steps = read_results(results_path_for(recorded[0]), "quickstart")
    as_json = json.loads(render(header, steps, "json"))
    assert as_json["summary"] == {"steps": 3, "checks_held": 0, "checks_failed": 0}
    assert render(header, steps, "jsonl") == recorded[1]
    rows = render(header, steps, "csv").splitlines()
    assert rows[0].startswith("table,step,") and sum(row.startswith("generation,") for row in rows) == 3
    assert sum(row.startswith("curve,") for row in rows) == 7


def test_replay_of_a_fresh_run_exits_0(recorded, capsys, tmp_path):
    code, out, err = run_cli(capsys, "replay", fresh_copy(recorded, tmp_path))
    assert code == 0, err
    assert "matches the recording" in out and "DIFFERS" not in out and "wall s recorded" in out


def test_a_session_without_steps_runs_reports_and_replays(capsys, tmp_path):
    session_path = tmp_path / "empty.toml"
    session_path.write_text('[session]\nversion = 1\nname = "empty"\n[engine]\nmodel = "tiny"\n')
    code, out, err = run_cli(capsys, "run", session_path, "--device", "cpu")
    assert code == 0 and "0 steps" in out, err
    for extra in ([], ["--json"]):
        code, out, err = run_cli(capsys, "replay", session_path, *extra)
        assert code == 0 and "Traceback" not in err, err
    verdict = json.loads(out)  # the machine's verdict claims no match either: null, with the reason
    assert verdict["matches"] is None and verdict["note"] == "the session has no steps to compare"
    code, out, err = run_cli(capsys, "replay", session_path)
    # no comparison happened, so none is claimed: one line says so
    assert "# replay of `empty`: the session has no steps to compare\n" in out and "matches" not in out
    assert out.count("no steps") == 1


def test_replay_detects_a_tampered_token(recorded, capsys, tmp_path):
    session_path = fresh_copy(recorded, tmp_path)
    results = results_path_for(session_path)
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    tokens = lines[2]["runs"][1]["tokens"]  # step 2, config unfused
    original = tokens[3]
    tokens[3] = (original + 1) % 256
    results.write_text("".join(json.dumps(line) + "\n" for line in lines))
    code, out, err = run_cli(capsys, "replay", session_path)
    assert code == 1
    assert (f"step 2 (prompt), config unfused: generated token 3 differs: recorded {(original + 1) % 256}, "
            f"now {original}") in err
    assert "DIFFERS" in out


def test_replay_refuses_a_recording_missing_a_run_or_relabelled(recorded, capsys, tmp_path):
    """A run dropped from a step's line is a difference (not a pass over the runs both sides have), and a line
    whose action contradicts its own definition is an edited recording, refused before anything runs."""
    session_path = fresh_copy(recorded, tmp_path)
    results = results_path_for(session_path)
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    lines[2]["runs"].pop()  # step 2's unfused run
    results.write_text("".join(json.dumps(line) + "\n" for line in lines))
    code, out, err = run_cli(capsys, "replay", session_path)
    assert code == 1 and "step 2 (prompt): runs recorded under configs ['base'], re-run under ['base', " in err, err
    lines = [json.loads(line) for line in results_path_for(fresh_copy(recorded, tmp_path)).read_text().splitlines()]
    lines[3]["action"], lines[3]["numbers"]["k"] = "prompt", 7  # the curve step, relabelled and changed
    results.write_text("".join(json.dumps(line) + "\n" for line in lines))
    code, out, err = run_cli(capsys, "replay", session_path)
    assert code == 2 and "step 3's line says action 'prompt', its own definition 'curve': the recording was " \
        "edited" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("special", ["/dev/zero", "fifo"])
def test_replay_refuses_a_results_file_that_is_not_a_regular_file(recorded, capsys, tmp_path, special):
    """/dev/zero grew without end and a FIFO waited forever for a writer: both are refused by what they are."""
    session_path = fresh_copy(recorded, tmp_path)
    if special == "fifo":
        special = tmp_path / "fifo.jsonl"
        os.mkfifo(special)
    code, _, err = run_cli(capsys, "replay", session_path, "--results", str(special))
    assert code == 2 and "not a regular file (a device, a socket or a pipe)" in err
    assert len(err.strip().splitlines()) == 1


def test_replay_detects_a_changed_decision_and_counter(recorded, capsys, tmp_path):
    session_path = fresh_copy(recorded, tmp_path)
    results = results_path_for(session_path)
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    lines[1]["runs"][0]["decisions"][0]["moe"]["decided"] = "grouped"
    lines[1]["runs"][0]["counters"]["arms"]["reference"] += 1
    results.write_text("".join(json.dumps(line) + "\n" for line in lines))
    code, out, err = run_cli(capsys, "replay", session_path)
    assert code == 1
    assert "step 1 (prompt), config base: counters differ: reference recorded" in out
    assert "decision at generated step 0, layer 0 differs: recorded moe decided grouped" in out


def test_replay_without_results_says_run_first(capsys, tmp_path):
    session_path = tmp_path / "quickstart.toml"
    session_path.write_text((SESSIONS / "quickstart.toml").read_text())
    code, _, err = run_cli(capsys, "replay", session_path)
    assert code == 2 and "no recorded results" in err and f"moe-inspector run {session_path}" in err


def test_replay_refuses_a_session_changed_since_recording(recorded, capsys, tmp_path):
    session_path = fresh_copy(recorded, tmp_path)
    session_path.write_text(session_path.read_text().replace("max_tokens = 8", "max_tokens = 7", 1))
    code, _, err = run_cli(capsys, "replay", session_path)
    assert code == 2 and "step 1 was recorded as" in err and "re-record" in err


# --------------------------------------------------------------------------------------------
# Atomic saves
# --------------------------------------------------------------------------------------------

KILL_DURING_SAVE = """
import dataclasses, sys, time
from engine import atomic_file
from inspector import session as session_format

path = sys.argv[1]
session = session_format.load_session(path)
big = dataclasses.replace(session, steps=session.steps * 3000)  # a few hundred KB: several chunks

def slow(offset):
    if offset == 0:
        print("writing", flush=True)
    time.sleep(0.5)

atomic_file.after_chunk = slow
session_format.save_session(big, path)
print("finished", flush=True)
"""


def test_a_kill_during_a_save_leaves_the_previous_file_intact_and_no_temporary(tmp_path):
    path = tmp_path / "precious.toml"
    save_session(load_session(SESSIONS / "quickstart.toml"), path)
    before = path.read_bytes()
    process = subprocess.Popen([sys.executable, "-c", KILL_DURING_SAVE, str(path)], cwd=REPOSITORY,
                               stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline() == "writing\n"
        time.sleep(0.2)  # inside the slowed write: the first chunk is out, the rest is not
        during = sorted(entry.name for entry in tmp_path.iterdir())
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        process.stdout.close()
    assert process.returncode == -signal.SIGKILL
    # The bytes go to an unnamed file until complete: nothing but the real name, during or after.
    assert during == ["precious.toml"]
    assert path.read_bytes() == before  # the real name still holds the previous file
    assert load_session(path) == load_session(SESSIONS / "quickstart.toml")
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["precious.toml"]


def test_an_atomic_save_replaces_the_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "s.toml"
    session = load_session(SESSIONS / "quickstart.toml")
    save_session(session, path)
    save_session(dataclasses.replace(session, name="renamed"), path)
    assert load_session(path).name == "renamed" and [entry.name for entry in tmp_path.iterdir()] == ["s.toml"]


def test_a_failed_write_removes_its_temporary_and_keeps_the_file(tmp_path, monkeypatch):
    path = tmp_path / "s.toml"
    path.write_text("keep me")

    def disk_full(offset):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic_file, "after_chunk", disk_full)
    with pytest.raises(OSError):
        session_format.atomic_write_text(path, "new")
    assert path.read_text() == "keep me" and [entry.name for entry in tmp_path.iterdir()] == ["s.toml"]


# --------------------------------------------------------------------------------------------
# The recorder: TUI actions -> session file -> run -> replay
# --------------------------------------------------------------------------------------------

TINY = {"model": "tiny", "device": "cpu", "seed": 0}


def test_recorder_round_trip_record_save_run_replay(capsys, tmp_path):
    """Headless stand-in for the Pilot round trip: the payloads are the TUI's `record_action` dicts."""
    start = flag_registry.resolve(environ={})
    autosave = tmp_path / "autosave.toml"
    recorder = SessionRecorder(autosave, TINY, start)
    assert not autosave.exists()  # nothing to save before the first action

    recorder.append({"action": "flag", "config": "A", "flag": "moe_gate", "value": "floor",
                     "flags": {**start.values, "moe_gate": "floor"}})
    assert load_session(autosave).flags["moe_gate"] == "floor"  # before any step: the starting state

    flags_a = dict(recorder.current_flags)
    recorder.append({"action": "prompt", "prompt": "hello experts", "max_tokens": 4, "flags": flags_a,
                     "compare": {"name": "B", "overrides": {"fused_mask": "drop"},
                                 "flags": {**flags_a, "fused_mask": "drop"}}})
    recorder.append({"action": "config", "name": "B", "overrides": {"flash_512": False}})  # not a step
    recorder.append({"action": "flag", "config": "A", "flag": "tile_m", "value": "32"})
    recorder.append({"action": "prompt", "prompt": "hello experts", "max_tokens": 4,
                     "flags": {**flags_a, "tile_m": 32},
                     "compare": {"name": "B", "flags": {**flags_a, "tile_m": 32, "flash_512": False}},
                     "expect_match": True})
    recorder.append({"action": "curve", "k": 2, "experts": 8, "tile_m": 32, "policy": "floor", "boundary": 9,
                     "sweep": None})

    saved = load_session(autosave)  # autosaved after every action
    assert saved == recorder.session and len(saved.steps) == 3
    assert [config.name for config in saved.configs] == ["fused_mask=drop", "tile_m=32", "tile_m=32,flash_512=off"]
    assert saved.steps[0] == PromptStep(prompt="hello experts", max_tokens=4, compare="fused_mask=drop")
    assert saved.steps[1].config == "tile_m=32" and saved.steps[1].expect_match is True

    final = recorder.save_as(tmp_path / "mine.toml")
    assert recorder.path == final
    code, out, err = run_cli(capsys, "run", final)
    assert code == 0, err
    code, out, err = run_cli(capsys, "replay", final)
    assert code == 0, err

    reopened = SessionRecorder.load(final)  # ctrl+o: carries on from the last step's flags
    assert reopened.session == recorder.session and reopened.current_flags["tile_m"] == 32


def test_recorder_turns_tui_check_attention_and_compare_payloads_into_valid_steps(tmp_path):
    recorder = SessionRecorder(tmp_path / "s.toml", TINY, {"fused_mask": "honor"})
    step = recorder.append({"action": "check-attention", "seq_len": 64, "head_dim": 512, "heads": 2, "kv_heads": 1,
                            "window": 16, "block": 8, "pad": 2, "mode": "drop", "seed": 0, "device": "cpu",
                            "dtype": "torch.float32"})
    assert step.dtype == "float32" and step.mode == "drop" and step.pad == 2
    step = recorder.append({"action": "compare", "prompt": "p", "max_tokens": 2, "a": "base",
                            "b": {"name": "drop-it", "flags": {"fused_mask": "drop"}}, "expect_match": False})
    assert step == CompareStep(prompt="p", max_tokens=2, a="base", b="drop-it", expect_match=False)
    with pytest.raises(UserError, match="'florr' is not allowed"):
        recorder.append({"action": "flag", "name": "moe_gate", "value": "florr"})
    with pytest.raises(UserError, match="not one of flag"):
        recorder.append({"action": "dance"})
    assert load_session(tmp_path / "s.toml") == recorder.session  # refused actions changed nothing


def test_a_check_attention_steps_bad_values_name_its_keys(tmp_path, capsys):
    """The check's own validation (`--head-dim must be ...`) is spelled as the step's keys in a session."""
    path = tmp_path / "s.toml"
    for key, value, fragment in (("head_dim", "3", "head_dim must be one of 64, 128, 256, 512"),
                                 ("dtype", '"bfloat16"', "dtype bf16 needs [engine] device cuda")):
        path.write_text('[session]\nversion = 1\nname = "t"\n[engine]\nmodel = "tiny"\ndevice = "cpu"\n'
                        f'[[step]]\naction = "check-attention"\nseq_len = 32\n{key} = {value}\n')
        code, _, err = run_cli(capsys, "run", path)
        assert code == 2 and f"{path}: step 1 (check-attention): {fragment}" in err and "--" not in err, err


def test_a_session_model_too_large_for_memory_names_its_key(tmp_path, capsys, monkeypatch):
    from engine import model_source

    monkeypatch.setattr(model_source, "free_bytes", lambda device: 1000)
    path = tmp_path / "s.toml"
    path.write_text('[session]\nversion = 1\nname = "t"\n[engine]\nmodel = "tiny"\ndevice = "cpu"\n'
                    '[[step]]\naction = "prompt"\nprompt = "hi"\nmax_tokens = 2\n')
    code, _, err = run_cli(capsys, "run", path)
    assert code == 2 and f"{path}: [engine] model tiny: the model's weights take" in err and "--model" not in err


def test_a_session_with_a_byte_order_mark_is_refused_saying_so(tmp_path):
    path = tmp_path / "bom.toml"
    path.write_bytes("\ufeff".encode() + (SESSIONS / "quickstart.toml").read_bytes())
    with pytest.raises(UserError, match="starts with a byte-order mark"):
        load_session(path)
