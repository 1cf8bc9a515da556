"""Outputs that would overwrite an input or each other, refused before any work (exit 2, one line), for
the commands whose outputs came after the output-path rules: ab, routing, generate and bench's
--record-routing beside --trace, and the TUI's --sweep file."""

from __future__ import annotations

import subprocess
import sys
from argparse import Namespace
from pathlib import Path

from engine import flags, routing_file
from engine.runtime import Engine
from inspector.cli import main

REPO = Path(__file__).resolve().parents[1]


def cli(capsys, *argv):
    code = main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_line_refusal(code: int, err: str, fragment: str) -> None:
    lines = [line for line in err.splitlines() if line.startswith("moe-inspector: error")]
    assert code == 2 and len(lines) == 1 and fragment in lines[0], err
    assert "Traceback" not in err


def test_ab_refuses_a_report_over_the_session_it_runs(tmp_path):
    session = tmp_path / "mine.toml"
    session.write_bytes((REPO / "sessions" / "quickstart.toml").read_bytes())
    before = session.read_bytes()
    for option in ("--report", "--json-out"):
        done = subprocess.run([sys.executable, "-m", "inspector", "ab", "--workload", "session", "--session",
                               str(session), "--a", "tile_m=16", "--b", "tile_m=32", option, str(session)],
                              cwd=REPO, capture_output=True, text=True, timeout=120)
        one_line_refusal(done.returncode, done.stderr, "the session file this A/B runs")
        assert session.read_bytes() == before


def test_routing_refuses_a_csv_over_the_recording_it_reads(tmp_path, capsys):
    tiny = Engine.load("tiny", "cpu", seed=0)
    run = tiny.generate("route", 3, flags.resolve(["record_routing=on"], environ={}))
    path = tmp_path / "r.safetensors"
    routing_file.save(run.routing, path)
    before = path.read_bytes()
    code, out, err = cli(capsys, "routing", path, "--csv", path)
    one_line_refusal(code, err, "the routing file being read")
    assert out == "" and path.read_bytes() == before


def test_generate_and_bench_refuse_one_file_for_the_trace_and_the_routing(tmp_path, capsys):
    target, link = tmp_path / "same.json", tmp_path / "same.safetensors"  # each named for its format, one file
    link.symlink_to(target)
    code, _, err = cli(capsys, "generate", "--model", "tiny", "--device", "cpu", "--prompt", "hi", "--max-tokens",
                       "2", "--no-progress", "--trace", target, "--record-routing", link)
    one_line_refusal(code, err, "name the same file")
    code, _, err = cli(capsys, "bench", "--model", "tiny", "--device", "cpu", "--pp", "none", "--tg", "2",
                       "--batch", "1", "--reps", "1", "--no-progress", "--trace", target, "--record-routing", link)
    one_line_refusal(code, err, "name the same file")
    assert not target.exists()


def test_the_tui_refuses_a_missing_or_broken_sweep_file_before_it_opens(tmp_path, capsys, monkeypatch):
    from inspector.tui import launch

    def args(sweep):
        return Namespace(model="tiny", device="cpu", seed=0, session=None, set_flags=[], sweep=str(sweep))

    assert launch(args(tmp_path / "nope.json")) == 2
    error = capsys.readouterr().err
    assert "no such file" in error and "loading" not in error  # refused before the model loads
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    monkeypatch.setenv("MOEI_SESSION_DIR", str(tmp_path / "sessions"))  # the autosave: not the user's
    assert launch(args(broken)) == 2
    assert "not JSON" in capsys.readouterr().err
