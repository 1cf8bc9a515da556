"""What every headless command promises about its output: JSON from each one (`--json`, or
`--format json`), a format chosen from a file name written or refused (never another), prompts
from a file, the summary by default with the per-layer rows on request, a flags command that
reads the registry, one-line warnings, and Ctrl-C that prints what was done (real processes,
SIGINT)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine import flags as flag_registry
from engine.flags import SPECS, FlagSpec
from inspector.cli import build_parser, main
from inspector.commands import COMMAND_MODULES
from inspector.describe import fill_text
from inspector.records import COLUMNS

REPOSITORY = Path(__file__).resolve().parent.parent

SESSION = """\
[session]
version = 1
name = "json-check"

[engine]
model = "tiny"
device = "cpu"
seed = 0

[[step]]
action = "prompt"
prompt = "hello there"
max_tokens = 3

[[step]]
action = "curve"
"""

# A session whose prompt steps take a while each: Ctrl-C lands between steps.
LONG_SESSION = SESSION.replace('max_tokens = 3', 'max_tokens = 24') + """
[[step]]
action = "prompt"
prompt = "and again"
max_tokens = 24

[[step]]
action = "prompt"
prompt = "and once more"
max_tokens = 24
"""


@pytest.fixture(autouse=True)
def no_flag_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("MOEI_CALIBRATION", str(tmp_path / "no-calibration.json"))
    for name in SPECS:
        monkeypatch.delenv(flag_registry.environment_name(name), raising=False)


def json_of(capsys, argv: list[str], code: int = 0) -> dict:
    assert main([str(arg) for arg in argv]) == code, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def subcommands() -> dict:
    parser = build_parser()
    action = next(action for action in parser._actions if action.dest == "command")
    return action.choices


# --------------------------------------------------------------------------------------------
# --json on every command
# --------------------------------------------------------------------------------------------

def test_every_command_takes_json_and_format():
    commands = subcommands()
    assert set(commands) == {name.replace("_", "-") for name in COMMAND_MODULES}
    for name, parser in commands.items():
        options = {option for action in parser._actions for option in action.option_strings}
        assert {"--json", "--format"} <= options, name
        assert "json" in next(action.choices for action in parser._actions if "--format" in action.option_strings)


def test_json_of_curve_generate_compare_flags(capsys):
    curve = json_of(capsys, ["curve", "--tokens", "512,8192", "--json"])
    assert curve["min_tokens"] == 683 and [row["n"] for row in curve["rows"]] == [512, 8192]
    generation = json_of(capsys, ["generate", "--model", "tiny", "--device", "cpu", "--prompt", "abc",
                                  "--max-tokens", "2", "--format", "json", "--no-progress"])
    assert len(generation["tokens"]) == 2 and generation["cancelled"] is False and generation["steps"]
    table = generation["arm_table"]
    assert sum(entry["count"] for entry in table) == 2 * 2 * 2  # 2 steps x 2 layers x (MoE + attention)
    assert {entry["executed"] for entry in table} == {"reference", "unfused"}
    both = json_of(capsys, ["compare", "--model", "tiny", "--device", "cpu", "--prompt", "abc", "--max-tokens", "2",
                            "--a", "fused_mask=drop", "--json", "--no-progress"])
    assert both["a"]["flags"]["fused_mask"]["value"] == "drop" and len(both["logit_rel_err"]) == 2
    assert both["cancelled"] is False and "first_divergence" in both
    listed = json_of(capsys, ["flags", "--json", "--set", "tile_m=32"])
    by_name = {entry["name"]: entry for entry in listed["flags"]}
    assert list(by_name) == list(SPECS)
    assert by_name["tile_m"]["value"] == 32 and by_name["tile_m"]["source"] == "command line"
    assert by_name["tile_m"]["environment"] == "MOEI_TILE_M" and by_name["tile_m"]["default"] == 16


def test_json_of_check_attention(capsys):
    result = json_of(capsys, ["check-attention", "--device", "cpu", "--seq-len", "24", "--head-dim", "64",
                              "--heads", "2", "--window", "8", "--block", "4", "--pad", "2", "--json"])
    assert result["verdict"] == "masked" and result["ok"] is True


def test_json_of_run_replay_and_bench(capsys, tmp_path):
    session = tmp_path / "check.toml"
    session.write_text(SESSION)
    report = json_of(capsys, ["run", session, "--json"])
    assert report["summary"]["steps"] == 2 and report["cancelled"] is False
    assert [step["action"] for step in report["steps"]] == ["prompt", "curve"]
    replay = json_of(capsys, ["replay", session, "--json"])
    assert replay["matches"] is True and replay["differences"] == [] and replay["cancelled"] is False
    assert replay["rows"][0]["tokens"] == "match" and replay["steps_rerun"] == 2
    bench = json_of(capsys, ["bench", "--model", "tiny", "--device", "cpu", "--pp", "8", "--tg", "4", "--batch", "1",
                             "--reps", "2", "--tg-prompt", "4", "--json", "--no-progress"])
    assert bench["cancelled"] is False and [row["test"] for row in bench["rows"]] == ["pp8", "tg4"]
    tg = bench["rows"][1]["latency"]
    for name in ("ttft_ms", "tpot_ms", "itl_ms"):
        assert tg[name]["p50"] <= tg[name]["p90"] <= tg[name]["p99"] and tg[name]["mean"] > 0
    assert tg["itl_ms"]["count"] == 2 * 3  # 2 timed repetitions x 3 gaps between 4 tokens
    assert bench["rows"][0]["latency"]["tpot_ms"] is None  # a pp row generates one token: no TPOT


def test_sweep_json_is_offered_and_refused_without_a_gpu(capsys):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("on a GPU the sweep runs (tests/test_sweep.py)")
    assert main(["sweep", "--json", "--tokens", "1,2"]) == 2
    error = capsys.readouterr().err
    assert "needs a CUDA GPU" in error and error.count("\n") == 1


def test_json_and_another_format_are_refused(capsys):
    assert main(["curve", "--json", "--format", "csv"]) == 2
    assert "--json and --format csv" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# Formats from file names: written or refused, never another
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, options, fragment", [
    ("report.html", [], "'.html' names no format"),
    ("report", [], "no extension names no format"),
    ("report.json", ["--format", "csv"], "the name says json and --format says csv"),
    ("report.md", ["--json"], "the name says md and --format says json"),
])
def test_a_report_name_without_its_format_is_refused_before_running(capsys, tmp_path, name, options, fragment):
    session = tmp_path / "check.toml"
    session.write_text(SESSION)
    assert main(["run", str(session), "--report", str(tmp_path / name), *options]) == 2
    error = capsys.readouterr().err
    assert fragment in error and error.count("\n") == 1
    assert not (tmp_path / name).exists() and not (tmp_path / "check.results.jsonl").exists()  # nothing ran


def test_a_report_is_written_in_the_format_its_name_says(capsys, tmp_path):
    session = tmp_path / "check.toml"
    session.write_text(SESSION)
    assert main(["run", str(session), "--report", str(tmp_path / "out.json")]) == 0
    assert json.loads((tmp_path / "out.json").read_text())["summary"]["steps"] == 2
    assert main(["run", str(session), "--report", str(tmp_path / "out.csv")]) == 0
    assert (tmp_path / "out.csv").read_text().startswith("table,")
    assert main(["run", str(session), "--report", str(tmp_path / "out.txt"), "--format", "md"]) == 0  # asked for
    assert (tmp_path / "out.txt").read_text().startswith("# session")


@pytest.mark.parametrize("argv, name, fragment", [
    (["bench", "--json-out"], "rows.csv", "name it .json"),
    (["ab", "--json-out"], "rows.md", "name it .json"),
    (["ab", "--report"], "report.json", "name it .md"),
])
def test_a_named_output_of_another_format_is_refused(capsys, tmp_path, argv, name, fragment):
    assert main([*argv, str(tmp_path / name)]) == 2
    assert fragment in capsys.readouterr().err and not (tmp_path / name).exists()


# --------------------------------------------------------------------------------------------
# Prompts from files
# --------------------------------------------------------------------------------------------

def test_a_prompt_file_keeps_every_line(capsys, tmp_path):
    prompt = "The \"if\" statement\n******************\n\n  if_stmt ::= \"if\" expression\n"
    path = tmp_path / "prompt.txt"
    path.write_text(prompt, encoding="utf-8")
    result = json_of(capsys, ["generate", "--model", "tiny", "--device", "cpu", "--prompt-file", path,
                              "--max-tokens", "1", "--json", "--no-progress"])
    assert result["prompt_tokens"] == len(prompt.encode())  # byte tokens: every line, the last newline too
    inline = json_of(capsys, ["generate", "--model", "tiny", "--device", "cpu", "--prompt", prompt,
                              "--max-tokens", "1", "--json", "--no-progress"])
    assert inline["tokens"] == result["tokens"]


@pytest.mark.parametrize("content, fragment", [
    (None, "no such file"),
    ("directory", "is a directory"),
    (b"", "the file is empty"),
    (b"caf\xe9", "not UTF-8 text (byte 3 is 0xe9)"),
    ("fifo", "not a regular file (a device, a socket or a pipe)"),  # no writer: a read would wait forever
])
def test_a_bad_prompt_file_is_one_line_and_exit_2(capsys, tmp_path, content, fragment):
    path = tmp_path / "prompt.txt"
    if content == "directory":
        path.mkdir()
    elif content == "fifo":
        os.mkfifo(path)
    elif content is not None:
        path.write_bytes(content)
    assert main(["generate", "--model", "tiny", "--device", "cpu", "--prompt-file", str(path)]) == 2
    error = capsys.readouterr().err
    assert fragment in error and error.count("\n") == 1 and "Traceback" not in error


def test_prompt_and_prompt_file_are_one_or_the_other(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--prompt", "x", "--prompt-file", str(tmp_path / "p.txt")])
    assert exit_info.value.code == 2 and "not allowed with" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# Summaries by default, rows on request
# --------------------------------------------------------------------------------------------

def test_generate_prints_a_summary_and_rows_only_when_asked(capsys):
    argv = ["generate", "--model", "tiny", "--device", "cpu", "--prompt", "abcdef", "--max-tokens", "4",
            "--no-progress"]
    assert main(argv) == 0
    summary = capsys.readouterr().out
    assert "text: " in summary and "arms over 2 layers x 4 steps" in summary and "why 1: " in summary
    assert summary.count("falling back to threshold:16; ") == 2  # each whole reason once: prefill, decode
    assert len(summary.splitlines()) < 25  # not one row per layer per step
    assert main(argv + ["--records"]) == 0
    rows = capsys.readouterr().out
    assert len(rows.splitlines()) >= len(summary.splitlines()) + 4 * 2 * 2


def test_compare_leads_with_the_first_divergence(capsys):
    prompt = "The quick brown fox jumps over the lazy dog"  # past tiny's window of 16: drop diverges
    assert main(["compare", "--model", "tiny", "--device", "cpu", "--prompt", prompt, "--max-tokens", "6",
                 "--a", "fused_mask=drop", "--b", "fused_mask=honor", "--no-progress"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("first divergence: ")
    assert any(line.startswith("A: arms over") for line in lines) and any(line.startswith("B: arms") for line in lines)


def test_generate_csv_and_jsonl_are_the_dispatch_log(capsys):
    argv = ["generate", "--model", "tiny", "--device", "cpu", "--prompt", "abc", "--max-tokens", "3", "--no-progress"]
    assert main(argv + ["--format", "csv"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split(",") == list(COLUMNS) and len(lines) == 1 + 3 * 2 * 2
    assert main(argv + ["--format", "jsonl"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 12 and {row["family"] for row in rows} == {"moe", "attention"}
    moe = next(row for row in rows if row["family"] == "moe")
    assert moe["reason"] and moe["decided_arm"] and moe["timing"].startswith("wall clock")
    assert {row["model"] for row in rows} == {"tiny"} and moe["weight_format"] == "fp32" and moe["bytes_moved"] > 0
    assert main(["compare", *argv[1:], "--format", "jsonl"]) == 0
    assert {json.loads(line)["config"] for line in capsys.readouterr().out.splitlines()} == {"A", "B"}


def test_curve_shows_fill_past_one_tile_as_full_tiles(capsys):
    assert main(["curve", "--tokens", "512,1024,8192"]) == 0
    out = capsys.readouterr().out
    assert "75.0%" in out and "1 full + 50%" in out and "12 full" in out and "1200" not in out
    assert fill_text(15.99, 16) == "99.9%" and fill_text(31.999, 16) == "2 full" and fill_text(16.0, 16) == "1 full"


# --------------------------------------------------------------------------------------------
# The flags command reads the registry
# --------------------------------------------------------------------------------------------

def test_flags_lists_every_flag_and_a_new_one_appears_by_itself(capsys, monkeypatch):
    extra = FlagSpec("carry_norm", True, "on or off", SPECS["flash_512"].parse, "bool", (True, False),
                     "a switch added to the registry")
    monkeypatch.setitem(SPECS, "carry_norm", extra)
    assert main(["flags"]) == 0
    out = capsys.readouterr().out
    for name, spec in SPECS.items():
        assert name in out and flag_registry.environment_name(name) in out and spec.help in out
    assert "MOEI_CARRY_NORM" in out and "a switch added to the registry" in out


# --------------------------------------------------------------------------------------------
# Real processes: one-line warnings and Ctrl-C
# --------------------------------------------------------------------------------------------

def cli_process(*argv, env: dict | None = None) -> subprocess.Popen:
    environment = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "inspector", *map(str, argv)], cwd=REPOSITORY, env=environment,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def interrupt_after(process: subprocess.Popen, marker: str, timeout: float = 120.0) -> tuple[str, str]:
    """SIGINT once `marker` shows on stderr (the work is under way); then the process's output."""
    seen, started = [], time.monotonic()
    for line in process.stderr:
        seen.append(line)
        if marker in line:
            break
        assert time.monotonic() - started < timeout, "".join(seen)
    process.send_signal(signal.SIGINT)
    out, rest = process.communicate(timeout=timeout)
    return out, "".join(seen) + rest


def test_a_bad_environment_value_is_one_line_in_a_real_process():
    completed = subprocess.run([sys.executable, "-m", "inspector", "flags", "--json"], cwd=REPOSITORY,
                               env={**os.environ, "MOEI_TILE_M": "48"}, capture_output=True, text=True)
    assert completed.returncode == 0
    assert completed.stderr == ("moe-inspector: warning: MOEI_TILE_M='48' is not allowed (16, 32 or 64); "
                                "keeping the default 16\n")


def test_ctrl_c_during_generate_prints_the_tokens_so_far():
    process = cli_process("generate", "--model", "demo", "--device", "cpu", "--prompt", "hello", "--max-tokens",
                          "4000", "--json")
    out, err = interrupt_after(process, "generate demo: 1/4000")
    assert process.returncode == 130, err
    result = json.loads(out)
    assert result["cancelled"] is True and 1 <= len(result["tokens"]) < 4000
    assert len(result["steps"]) == len(result["tokens"]) and "Traceback" not in err
    assert "stopping at the next token" in err


def test_ctrl_c_during_a_session_reports_the_finished_steps(tmp_path):
    session = tmp_path / "long.toml"
    session.write_text(LONG_SESSION)
    process = cli_process("run", session, "--json")
    out, err = interrupt_after(process, "[run] step 1/4 prompt:")
    assert process.returncode == 130, err
    report = json.loads(out)
    assert report["cancelled"] is True and 1 <= len(report["steps"]) < 4
    assert "results file not written (cancelled)" in err and not (tmp_path / "long.results.jsonl").exists()


def test_ctrl_c_during_b_compares_the_tokens_b_has():
    """A B cancelled part-way was reported as 'first divergence: not known', its tokens discarded."""
    process = cli_process("compare", "--model", "demo", "--device", "cpu", "--prompt", "hello", "--max-tokens",
                          "600", "--json")
    out, err = interrupt_after(process, "compare demo: 720/1200")  # B's 120th token (progress by tenths)
    assert process.returncode == 130, err
    result = json.loads(out)
    generated = len(result["b"]["tokens"])
    assert result["cancelled"] is True and len(result["a"]["tokens"]) == 600 and 120 <= generated < 600
    assert len(result["logit_rel_err"]) == generated
    assert result["first_divergence"] is None  # one model, one configuration: the same tokens as far as B went
    assert result["logit_rel_err"] == [0.0] * generated


def test_no_progress_also_quiets_a_checkpoints_loading_lines(tmp_path, capsys):
    """--no-progress said 'no progress bar on stderr', and a checkpoint's loading lines still came."""
    from test_trellis_checkpoint import write_tiny_mixtral

    directory = write_tiny_mixtral(tmp_path / "mixtral", layers=1)
    argv = ["bench", "--model", str(directory), "--device", "cpu", "--pp", "none", "--tg", "2", "--batch", "1",
            "--reps", "1"]
    assert main(argv) == 0
    assert "loading mixtral" in capsys.readouterr().err
    assert main(argv + ["--no-progress"]) == 0
    assert "loading" not in capsys.readouterr().err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="/dev/full is Linux's")
def test_standard_output_with_no_room_is_one_line_and_exit_2():
    """`> out.json` on a full disk (here /dev/full): one line on stderr, exit 2, no traceback."""
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "inspector", "flags"], stdout=full, stderr=subprocess.PIPE,
                              text=True, timeout=120, cwd=REPOSITORY)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip() == ("moe-inspector: error: standard output could not be written (No space left on "
                                   "device); free space or send it elsewhere")


def test_format_does_not_make_a_session_name_a_report(capsys, tmp_path):
    """`run s.toml --report other.toml --format md` would put markdown over another session: refused, untouched."""
    other = tmp_path / "other.toml"
    other.write_text((REPOSITORY / "sessions" / "quickstart.toml").read_text())
    before = other.read_bytes()
    session = tmp_path / "s.toml"
    session.write_text(other.read_text())
    assert main(["run", str(session), "--report", str(other), "--format", "md"]) == 2
    err = capsys.readouterr().err
    assert "the name says a session (TOML), which this command does not write; end the name in .md" in err
    assert other.read_bytes() == before


@pytest.mark.parametrize("argv, option", [
    (["generate", "--model", "tiny", "--prompt", "hi", "--trace", ""], "--trace"),
    (["generate", "--model", "tiny", "--prompt", "hi", "--record-routing", " "], "--record-routing"),
    (["bench", "--model", "tiny", "--tg", "1", "--trace", ""], "--trace"),
    (["replay", "s.toml", "--results", ""], "--results"),
    (["run", ""], "SESSION.toml"),
])
def test_a_blank_path_is_refused_not_taken_as_not_given(argv, option, capsys):
    """`--trace ''` ran and wrote nothing: every option that names a file refuses a blank one, naming it."""
    assert main(argv) == 2
    assert capsys.readouterr().err == f"moe-inspector: error: {option}: an empty path; give a file name\n"


@pytest.mark.parametrize("argv", [["--max-tokens", "\u0663"], ["--max-tokens", "1_0"], ["--set", "decode_floor=\u0663"],
                                  ["--set", "tile_m=1_6"], ["--set", "grouped_variant=\u0661"],
                                  ["--set", "moe_gate=threshold:\u0663"]])
def test_integers_are_ascii_digits(argv, capsys):
    """int() takes an Arabic-Indic three and 1_0; an option or a flag takes the digits a user types."""
    try:
        code = main(["generate", "--model", "tiny", "--prompt", "hi", *argv])
    except SystemExit as usage:  # argparse's refusal: its usage line and one error line
        code = usage.code
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and ("invalid int value" in err or "is not allowed" in err), err


@pytest.mark.parametrize("argv, piece", [
    (["--nope-dim", "99999999"], "the latent projections at seq_len"),
    (["--v-dim", "99999999"], "the latent projections at seq_len"),
    (["--kv-lora-rank", "99999999"], "the fused MLA kernel takes no such shape"),
])
def test_the_latent_checks_dims_are_bounded_and_named_before_anything_runs(argv, piece, capsys):
    """--nope-dim 99999999 was an allocator traceback; --kv-lora-rank 99999999 blamed seq_len and heads."""
    assert main(["check-attention", "--mla", "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err
    assert piece in err and err.count("\n") == 1, err
