"""Paths the system refuses, lists with holes in them, sizes with no ceiling: one line, exit 2, nothing written.

Each case here once ended in a traceback, a silent guess or an unbounded run: a 300-character model name
(ENAMETOOLONG out of Path.is_dir), a weight file that links to itself (ELOOP out of stat), `--tokens 1,,2`
taken as 1,2, `check-quant --tokens 100000000` allocating until the kernel killed it, `K=2_0` read as 20, and
quantize writing its output inside the model it reads."""

from __future__ import annotations

import os

import pytest

from engine import limits
from inspector.cli import main
from test_trellis_checkpoint import write_tiny_mixtral


def _one_line(capsys) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert captured.out == "" and len(lines) == 1, captured.err
    return lines[0]


def test_a_model_name_too_long_for_the_system_is_one_line(capsys):
    name = "a" * 300
    assert main(["generate", "--model", name, "--device", "cpu", "--prompt", "hi", "--no-progress"]) == 2
    line = _one_line(capsys)
    assert "(300 characters): file name too long; check the path" in line


def test_a_weight_file_that_links_to_itself_is_one_line(tmp_path, capsys):
    model = write_tiny_mixtral(tmp_path / "loop")
    weights = next(model.glob("*.safetensors"))
    weights.unlink()
    weights.symlink_to(weights.name)
    assert main(["generate", "--model", str(model), "--device", "cpu", "--prompt", "hi", "--no-progress"]) == 2
    assert weights.name in _one_line(capsys)


def test_a_model_path_that_is_a_link_loop_says_so(tmp_path, capsys):
    (tmp_path / "self").symlink_to("self")
    assert main(["generate", "--model", str(tmp_path / "self"), "--device", "cpu", "--prompt", "hi"]) == 2
    assert "is a link that leads nowhere (broken, or a loop)" in _one_line(capsys)


def test_a_broken_link_named_without_a_slash_is_not_called_an_unknown_preset(tmp_path, capsys, monkeypatch):
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    monkeypatch.chdir(tmp_path)
    assert main(["generate", "--model", "dangling", "--device", "cpu", "--prompt", "hi"]) == 2
    line = _one_line(capsys)
    assert "is a link that leads nowhere" in line and "unknown model" not in line, line


@pytest.mark.parametrize("tokens, said", [
    ("1,,2", "an empty item between commas"), ("1,2,", "an empty item between commas"),
    ("2_0", "expected comma-separated integers"), ("\u0662", "expected comma-separated integers"),
    (",".join(["1"] * (limits.MAX_LIST_VALUES + 1)), f"more than the {limits.MAX_LIST_VALUES}"),
])
def test_a_list_with_a_hole_or_a_foreign_digit_is_refused_not_guessed(capsys, tokens, said):
    assert main(["curve", "--tokens", tokens]) == 2
    assert said in _one_line(capsys)


def test_a_list_with_spaces_after_its_commas_is_read(capsys):
    assert main(["curve", "--tokens", " 1, 8", "--json"]) == 0
    assert '"n": 8' in capsys.readouterr().out


def test_check_quant_tokens_have_a_ceiling_before_anything_loads(capsys):
    too_many = str(limits.MAX_CHECK_QUANT_TOKENS + 1)
    assert main(["check-quant", "--model", "tiny", "--device", "cpu", "--tokens", f"1,{too_many}"]) == 2
    line = _one_line(capsys)
    assert f"--tokens: a token count is {too_many}, more than {limits.MAX_CHECK_QUANT_TOKENS}" in line


@pytest.mark.parametrize("spec", ["trellis:K= 2,code=hyb", "trellis:K=2_0,code=hyb", "trellis:K=\u0662,code=hyb",
                                  "trellis:K=2,code=hyb,V=+2"])
def test_an_experts_number_not_in_plain_digits_is_refused(tmp_path, capsys, spec):
    assert main(["quantize", "tiny", "--experts", spec, "--shape-only", "--out", str(tmp_path / "out")]) == 2
    assert "K and V are integers written in digits" in _one_line(capsys)
    assert not (tmp_path / "out").exists()


def test_quantize_never_writes_inside_the_model_it_reads(tmp_path, capsys):
    model = write_tiny_mixtral(tmp_path / "model")
    before = sorted(path.name for path in model.iterdir())
    assert main(["quantize", str(model), "--experts", "trellis:K=2,code=hyb", "--device", "cpu",
                 "--out", str(model / "coded")]) == 2
    assert "inside the source model's directory" in _one_line(capsys)
    assert sorted(path.name for path in model.iterdir()) == before


def test_check_quant_refuses_an_empty_original(capsys):
    assert main(["check-quant", "--model", "tiny", "--device", "cpu", "--original", " "]) == 2
    assert "--original is empty" in _one_line(capsys)


def test_a_session_with_a_blank_model_names_the_table(tmp_path, capsys):
    session = tmp_path / "s.toml"
    session.write_text('[session]\nversion = 1\nname = "x"\n[engine]\nmodel = "   "\n')
    assert main(["run", str(session)]) == 2
    assert f"{session}: [engine]: model is blank" in _one_line(capsys)


@pytest.mark.parametrize("where, tail", [
    ("engine", ""),
    ("b_model", '[[step]]\naction = "compare"\nprompt = "hi"\nmax_tokens = 2\na = "base"\nb = "base"\nb_model = "{long}"\n'),
])
def test_a_session_path_too_long_for_the_system_names_its_key(tmp_path, capsys, where, tail):
    """A path key the system refuses (ENAMETOOLONG) is named by the table or step that holds it, as a missing
    one is: the user has a key to fix, not only a path."""
    long = "y" * 5000
    model = long if where == "engine" else "tiny"
    session = tmp_path / "s.toml"
    session.write_text(f'[session]\nversion = 1\nname = "x"\n[engine]\nmodel = "{model}"\n' + tail.format(long=long))
    assert main(["run", str(session)]) == 2
    line = _one_line(capsys)
    said = "[engine] model: " if where == "engine" else "step 1 (compare): "
    assert line.startswith(f"moe-inspector: error: {session}: {said}") and "file name too long" in line, line


def test_generate_escapes_a_checkpoint_name_with_control_characters(tmp_path, capsys):
    tokenizers = pytest.importorskip("tokenizers")
    model = write_tiny_mixtral(tmp_path / "\x1b[31mred\nname")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel({"hi": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(str(model / "tokenizer.json"))
    assert main(["generate", "--model", str(model), "--device", "cpu", "--prompt", "hi", "--max-tokens", "1",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\\x1b[31mred\\x0aname" in out


def test_a_reader_that_goes_away_stops_the_command_quietly():
    """`generate ... | head -1` printed a BrokenPipeError traceback; a Unix tool stops quietly on SIGPIPE."""
    import subprocess
    import sys

    process = subprocess.Popen([sys.executable, "-m", "inspector", "generate", "--model", "tiny", "--device", "cpu",
                                "--prompt", "hi", "--max-tokens", "2", "--no-progress"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.close()  # before the first line is written
    error = process.stderr.read().decode()
    assert process.wait(timeout=120) == 141 and "Traceback" not in error and "BrokenPipe" not in error, error


def test_bench_says_when_the_weights_alone_do_not_fit(monkeypatch, capsys):
    from engine import model_source

    monkeypatch.setattr(model_source, "free_bytes", lambda device: 1000)
    assert main(["bench", "--model", "tiny", "--weights", "random", "--device", "cpu", "--pp", "16", "--tg", "none",
                 "--batch", "1", "--reps", "1", "--no-progress"]) == 2
    assert "fewer or shorter rows would not help" in _one_line(capsys)


def test_check_quant_takes_its_model_before_the_command_and_refuses_none(tmp_path, capsys):
    assert main(["check-quant", "--device", "cpu"]) == 2
    assert "check-quant needs --model DIR" in _one_line(capsys)
    assert main(["quantize", "tiny", "--experts", "trellis:K=2,code=hyb", "--shape-only", "--out",
                 str(tmp_path / "shape")]) == 0
    capsys.readouterr()
    for argv in (["check-quant", "--model", str(tmp_path / "shape")], ["--model", str(tmp_path / "shape"), "check-quant"]):
        assert main([*argv, "--device", "cpu"]) == 2
        assert "a trellis shape (config.json alone, no codes)" in _one_line(capsys)
    assert main(["generate", "--model", str(tmp_path / "shape"), "--device", "cpu", "--prompt", "hi"]) == 2
    assert "give --weights random to draw random codes of it" in _one_line(capsys)


@pytest.mark.parametrize("make, said", [
    (lambda path: os.mkfifo(path), "not a regular file"),
    (lambda path: path.mkdir(), "not a regular file"),
    (lambda path: path.symlink_to("absent.bin"), "no such file or directory"),
])
def test_a_weight_name_that_is_no_file_says_so(tmp_path, capsys, make, said):
    model = write_tiny_mixtral(tmp_path / "model")
    weights = next(model.glob("*.safetensors"))
    weights.unlink()
    make(weights)
    assert main(["bench", "--model", str(model), "--device", "cpu", "--pp", "4", "--tg", "none", "--batch", "1",
                 "--reps", "1", "--no-progress"]) == 2
    line = _one_line(capsys)
    assert said in line and weights.name in line, line


def test_a_config_that_is_a_link_loop_is_not_called_missing(tmp_path, capsys):
    model = write_tiny_mixtral(tmp_path / "model")
    (model / "config.json").unlink()
    (model / "config.json").symlink_to("config.json")
    assert main(["generate", "--model", str(model), "--device", "cpu", "--prompt", "hi", "--no-progress"]) == 2
    assert "config.json: not a regular file" in _one_line(capsys)


@pytest.mark.parametrize("argv_tail, name", [
    (["generate", "--prompt", "hi", "--max-tokens", "1", "--trace"], "config.json"),
    (["generate", "--prompt", "hi", "--max-tokens", "1", "--record-routing"], "extra.safetensors"),
    (["bench", "--pp", "none", "--tg", "1", "--batch", "1", "--reps", "1", "--json-out"], "config.json"),
])
def test_an_output_never_lands_on_a_file_a_checkpoint_load_reads(tmp_path, capsys, argv_tail, name):
    """--trace mx/config.json replaced the model's config with a trace; --record-routing mx/x.safetensors would join
    its weights at the next load. Refused before anything runs; the checkpoint is as it was."""
    model = write_tiny_mixtral(tmp_path / "mx")
    before = {path.name: path.read_bytes() for path in model.iterdir()}
    assert main(["--model", str(model), "--device", "cpu"] + argv_tail + [str(model / name)]) == 2
    assert "a file a load of the checkpoint" in _one_line(capsys)
    assert {path.name: path.read_bytes() for path in model.iterdir()} == before


def test_quantize_refuses_options_it_would_ignore_and_a_shape_inside_its_source(tmp_path, capsys):
    model = write_tiny_mixtral(tmp_path / "mx")
    base = ["quantize", str(model), "--experts", "trellis:K=2,code=hyb", "--device", "cpu"]
    assert main(base + ["--out", str(tmp_path / "q"), "--calibration-tokens", "7"]) == 2
    assert "--calibration-tokens without --calibration" in _one_line(capsys)
    text = tmp_path / "c.txt"
    text.write_text("some text")
    assert main(base + ["--out", str(tmp_path / "q"), "--shape-only", "--calibration", str(text)]) == 2
    assert "--shape-only writes no weights" in _one_line(capsys)
    assert main(base + ["--out", str(model / "q"), "--shape-only"]) == 2
    assert "inside the source model's directory" in _one_line(capsys)
    assert not (tmp_path / "q").exists() and not (model / "q").exists()
