"""Headless defects a newcomer found by trying what the README and --help say, each with the refusal or the
behaviour that replaced it (CPU, seconds)."""

from __future__ import annotations

import argparse

import pytest

from engine.limits import MAX_SEED
from inspector.cli import build_parser, main
from inspector.commands.common import seed_argument


def one_error_line(capsys) -> str:
    """The `moe-inspector: error: ...` line (a malformed command line also gets its usage above it)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("moe-inspector: error:")]
    assert len(errors) == 1, err
    return errors[0]


# -- 1. --seed outside what a session records ------------------------------------------------------------------

@pytest.mark.parametrize("seed", ["-1", "99999999999999999999999", str(MAX_SEED + 1)])
@pytest.mark.parametrize("argv", [["--model", "tiny"], ["generate", "--model", "tiny", "--prompt", "x"],
                                  ["check-attention"], ["bench", "--model", "tiny"], ["sweep"], ["check-quant"],
                                  ["quantize", "tiny", "--experts", "trellis:K=2", "--out", "x"],
                                  ["ab", "--a", "tile_m=16", "--b", "tile_m=32"]])
def test_a_seed_a_session_cannot_record_is_refused_at_parsing(argv, seed, capsys):
    """`--seed -1` was taken, and the TUI's recording then failed on every action: sessions take 0..2**63-1."""
    with pytest.raises(SystemExit) as stopped:
        main(argv + ["--seed", seed])
    assert stopped.value.code == 2
    assert f"argument --seed: {seed} is out of range: give an integer from 0 to {MAX_SEED}" in one_error_line(capsys)


def test_every_seed_option_has_the_one_seed_type():
    """The range is checked in one place: every parser's --seed uses `seed_argument`, whatever the command."""
    parser = build_parser()
    parsers = [parser] + list(next(action for action in parser._actions
                                   if isinstance(action, argparse._SubParsersAction)).choices.values())
    seeds = [action for each in parsers for action in each._actions if "--seed" in action.option_strings]
    assert len(seeds) >= 8 and all(action.type is seed_argument for action in seeds)
    assert seed_argument("0") == 0 and seed_argument(str(MAX_SEED)) == MAX_SEED


# -- 2. check-attention --model, before or after the command -------------------------------------------------

@pytest.mark.parametrize("argv", [["check-attention", "--model", "tiny"], ["--model", "tiny", "check-attention"]])
def test_the_sinks_check_takes_model_on_either_side_of_the_command(argv, capsys, monkeypatch):
    """`check-attention --model tiny` was refused as a decode/latent option while `--model tiny check-attention`
    ran, and `--decode --model tiny` pointed back at the check without --decode: --help says the sinks check
    takes the model's dims, and the side --model is given on must not change what runs."""
    from engine import compare

    taken = {}
    monkeypatch.setattr(compare, "check_attention", lambda **kwargs: taken.update(kwargs) or {})
    monkeypatch.setattr("inspector.commands.check_attention.print_result", lambda result, fmt, formatter: 0)
    assert main(argv + ["--device", "cpu"]) == 0
    assert {key: taken[key] for key in ("head_dim", "heads", "kv_heads", "window", "block")} == {
        "head_dim": 512, "heads": 2, "kv_heads": 1, "window": 16, "block": 8}


# -- 3. a directory with config.json alone --------------------------------------------------------------------

QWEN3_CONFIG = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
                "intermediate_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 1,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
                "num_experts_per_tok": 2, "vocab_size": 320, "max_position_embeddings": 256, "rms_norm_eps": 1e-6}


def test_a_config_only_directory_is_told_about_its_weights_before_its_tokenizer(tmp_path, capsys):
    """generate asked for tokenizer.json first, and only once it was there for the weights; with --weights random
    (the fix the second message gives) no tokenizer is needed, so the first message sent the user the long way."""
    import json

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_CONFIG))
    assert main(["generate", "--model", str(tmp_path), "--prompt", "hi", "--device", "cpu"]) == 2
    line = one_error_line(capsys)
    assert "config.json but no *.safetensors: give --weights random" in line and "tokenizer" not in line


# -- 4. a session's check-attention step ----------------------------------------------------------------------

SESSION_HEAD = '[session]\nversion = 1\nname = "s"\n[engine]\nmodel = "tiny"\n'


def test_a_latent_check_step_needs_no_mode_and_missing_keys_are_named_at_once():
    """`mla = true` was refused without `mode` (the CLI's --mode defaults to honor), and a step missing three keys
    was refused for one of them a run."""
    from engine.errors import UserError
    from inspector.session import loads_session

    step = loads_session(SESSION_HEAD + '[[step]]\naction = "check-attention"\nmla = true\nseq_len = 8\n').steps[0]
    assert step.mla and step.mode == "honor"
    with pytest.raises(UserError) as refused:
        loads_session(SESSION_HEAD + '[[step]]\naction = "compare"\n')
    message = str(refused.value)
    assert "step 1 (compare): missing keys 'prompt' (" in message and "'a' (" in message and "'b' (" in message


# -- 5. a text file given as a routing file -------------------------------------------------------------------

@pytest.mark.parametrize("text", ["just some text here\n", "12345678" + "x" * 100])
def test_a_routing_files_bogus_header_length_is_never_printed(tmp_path, capsys, text):
    """`routing notes.txt` printed its first 8 characters as a number (`claims a 8319678385066701424-byte
    header`); docs/hostile-input.md: a header length from a file is never printed, as the checkpoint reader says."""
    import struct

    path = tmp_path / "notes.txt"
    path.write_text(text)
    assert main(["routing", str(path)]) == 2
    line = one_error_line(capsys)
    bogus = struct.unpack("<Q", text.encode()[:8])[0]
    assert str(bogus) not in line
    assert f"its first 8 bytes do not give the length of a header inside its {len(text)} bytes" in line


# -- 6. an output file named for another format ----------------------------------------------------------------

@pytest.mark.parametrize("argv, option, ending", [
    (["generate", "--model", "tiny", "--prompt", "hi", "--trace", "{dir}/trace.csv"], "--trace", "json"),
    (["generate", "--model", "tiny", "--prompt", "hi", "--record-routing", "{dir}/rr.txt"], "--record-routing",
     "safetensors"),
    (["routing", "{dir}/r.safetensors", "--csv", "{dir}/r.json"], "--csv", "csv"),
])
def test_an_output_named_for_another_format_is_refused_before_any_work(tmp_path, capsys, monkeypatch, argv, option,
                                                                       ending):
    """`--trace out/trace.csv` wrote JSON and `--record-routing rr.txt` safetensors; the conventions say nothing is
    written in a format its name does not say."""
    from engine import runtime

    monkeypatch.setattr(runtime.Engine, "load", classmethod(lambda *a, **k: pytest.fail("nothing may load")))
    (tmp_path / "r.safetensors").write_bytes(b"")
    assert main([part.format(dir=tmp_path) for part in argv] + ["--device", "cpu"] * (argv[0] != "routing")) == 2
    line = one_error_line(capsys)
    assert f"{option} " in line and f"{option} writes {ending}; name the file *.{ending}" in line
    assert sorted(path.name for path in tmp_path.iterdir()) == ["r.safetensors"]


# -- 7. commands suggested in messages, with paths a shell would split --------------------------------------

def test_a_suggested_command_quotes_its_path(tmp_path, capsys):
    """`replay` said ``re-record with `moe-inspector run /tmp/x/odd dir ü $x/s.toml` ``: pasted, the shell splits
    it at the space and expands $x."""
    import json
    import shlex

    directory = tmp_path / "odd dir ü $x"
    directory.mkdir()
    session = directory / "s.toml"
    session.write_text(SESSION_HEAD + 'device = "cpu"\n[[step]]\naction = "curve"\n')
    assert main(["run", str(session)]) == 0, capsys.readouterr().err
    capsys.readouterr()
    results = directory / "s.results.jsonl"
    lines = results.read_text().splitlines()
    header = json.loads(lines[0])
    header["device"] = "cuda:NVIDIA H200"  # recorded elsewhere: replay refuses and suggests re-recording here
    results.write_text("\n".join([json.dumps(header)] + lines[1:]) + "\n")
    assert main(["replay", str(session)]) == 2
    line = one_error_line(capsys)
    assert f"`moe-inspector run {shlex.quote(str(session))}" in line


def test_a_moved_sessions_re_record_hint_names_where_it_is_now(tmp_path, capsys):
    """The recording's session_file is where the session was run; after a move the hint names the file replayed."""
    import shlex

    before, after = tmp_path / "before", tmp_path / "after"
    before.mkdir()
    (before / "s.toml").write_text(SESSION_HEAD + 'device = "cpu"\n[[step]]\naction = "curve"\n')
    assert main(["run", str(before / "s.toml")]) == 0, capsys.readouterr().err
    capsys.readouterr()
    before.rename(after)
    session = after / "s.toml"
    session.write_text(session.read_text().replace('model = "tiny"', 'model = "tiny"\nseed = 1'))
    assert main(["replay", str(session)]) == 2
    line = one_error_line(capsys)
    assert "recorded with seed 0, the session now says 1" in line, line
    assert f"`moe-inspector run {shlex.quote(str(session))}` to re-record" in line and str(before) not in line


def test_the_tuis_open_suggestion_quotes_its_path(tmp_path):
    import shlex

    from engine.errors import UserError
    from engine.runtime import Engine
    from inspector.tui_session import TuiSession

    path = tmp_path / "a b" / "s.toml"
    path.parent.mkdir()
    path.write_text(SESSION_HEAD.replace('"tiny"', '"demo"'))
    with pytest.raises(UserError) as refused:
        TuiSession.open(path, Engine.load("tiny", "cpu", 0))
    assert f"`moe-inspector --session {shlex.quote(str(path))}`" in str(refused.value)


# -- 9. an unknown option after a command ---------------------------------------------------------------------

def test_an_unknown_option_after_a_command_shows_that_commands_usage(capsys):
    """`generate ... --bogus` printed `usage: moe-inspector [-h] ...`, the top parser's usage."""
    with pytest.raises(SystemExit) as stopped:
        main(["generate", "--model", "tiny", "--prompt", "x", "--bogus"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: moe-inspector generate ") and "moe-inspector: error: unrecognized arguments: --bogus" in err


# -- another session's recording is neither overwritten nor read as "changes" ---------------------------------

def _two_sessions(tmp_path, capsys):
    for name in ("a", "b"):
        (tmp_path / f"{name}.toml").write_text(SESSION_HEAD.replace('name = "s"', f'name = "{name}"')
                                               + 'device = "cpu"\n[[step]]\naction = "curve"\n')
    assert main(["run", str(tmp_path / "a.toml")]) == 0, capsys.readouterr().err
    capsys.readouterr()
    return tmp_path / "a.results.jsonl"


@pytest.mark.parametrize("option", ["--report", "--results"])
def test_run_refuses_to_write_over_another_sessions_recording(tmp_path, capsys, option):
    recording = _two_sessions(tmp_path, capsys)
    before = recording.read_bytes()
    assert main(["run", str(tmp_path / "b.toml"), option, str(recording)]) == 2
    line = one_error_line(capsys)
    assert "session 'a'" in line and str(recording) in line, line
    assert recording.read_bytes() == before


def test_replay_of_another_sessions_recording_names_the_session_not_a_change(tmp_path, capsys):
    recording = _two_sessions(tmp_path, capsys)
    assert main(["replay", str(tmp_path / "b.toml"), "--results", str(recording)]) == 2
    line = one_error_line(capsys)
    assert "records session 'a', not 'b'" in line and "changed" not in line, line
