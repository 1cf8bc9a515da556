"""Headless commands as a new user with their own checkpoint meets them: each test a defect found by doing
what the README says, and a little more (CPU, seconds)."""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path

import pytest

from engine.progress import Progress
from inspector.cli import main


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc, a directory nobody can write in")
@pytest.mark.parametrize("shape_only", [True, False])
def test_quantize_into_a_directory_that_takes_no_write_is_one_line(tmp_path, capsys, shape_only):
    """As root, os.access() says yes to /proc: quantize went on and died in mkdir with a traceback."""
    argv = ["quantize", "tiny", "--experts", "trellis:K=2,code=hyb", "--out", "/proc/moei-quantized"]
    assert main(argv + (["--shape-only"] if shape_only else [])) == 2
    line = one_error_line(capsys)
    assert "--out /proc/moei-quantized: cannot write in /proc" in line


def test_quantize_out_under_a_file_says_so(tmp_path, capsys):
    (tmp_path / "a-file").write_text("keep")
    assert main(["quantize", "tiny", "--experts", "trellis:K=2,code=hyb", "--shape-only",
                 "--out", str(tmp_path / "a-file" / "out")]) == 2
    assert "a-file is not a directory" in one_error_line(capsys)
    assert (tmp_path / "a-file").read_text() == "keep"


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_progress_bar_fits_the_terminal(monkeypatch):
    """The bar was padded to its label + 70 columns: past the terminal's width every redraw wrapped, and each
    `\\r` then went back to the start of the wrapped line only, a new line per update (quantize: ~100 lines)."""
    monkeypatch.setattr("shutil.get_terminal_size", lambda fallback=(80, 24): os.terminal_size((80, 24)))
    stream = Terminal()
    progress = Progress(384, "quantizing qwen3-moe:qwen3 to trellis hyb K=2 V=2 L=16", stream=stream)
    for _ in range(384):
        progress.advance(1, "layers.0.w13")
    progress.close()
    redraws = stream.getvalue().rstrip("\n").split("\r")[1:]
    assert len(redraws) == 384 and all(len(line) < 80 for line in redraws)
    assert redraws[-1].rstrip().endswith("384/384 layers.0.w13") or "384/384" in redraws[-1]


def test_the_progress_bar_erases_a_longer_note(monkeypatch):
    monkeypatch.setattr("shutil.get_terminal_size", lambda fallback=(80, 24): os.terminal_size((200, 24)))
    stream = Terminal()
    progress = Progress(2, "loading", stream=stream)
    progress.advance(1, "layers.0.a_very_long_tensor_name")
    progress.advance(1, "x")
    first, second = stream.getvalue().split("\r")[1:]
    assert len(second) >= len(first.rstrip())  # the old text is overwritten, not left behind


def test_quantize_table_names_its_error_measure(capsys, tmp_path):
    """`relative` was the relative MSE (0.068 at 2 bits) while check-quant's `relative` is a norm ratio."""
    from inspector.commands import quantize

    class Result:
        out, code, resumed_layers, seconds, expert_bytes, bf16_expert_bytes = tmp_path, None, [], 1.0, 2048, 12288
        matrices = [{"name": "layers.0.w13", "shape": [8, 64, 64], "mse": 2.7e-5, "relative_mse": 0.0677,
                     "max_abs_error": 0.024}]

    class Code:
        @staticmethod
        def describe():
            return "trellis hyb K=2 V=2 L=16"

    Result.code = Code()
    quantize.print_text(Result())
    out = capsys.readouterr().out
    assert "rel. mse" in out and "0.0677" in out and "rel. rms" in out and "0.260" in out
    assert sys.modules["inspector.commands.quantize"] is quantize


def test_a_sweep_ab_of_flags_decides_arms_for_a_checkpoint_directory(tmp_path):
    """`ab --workload sweep --model DIR` read the model with the presets' lookup: "unknown model '/…/DIR'"."""
    import json

    from inspector.commands.ab import decided_arms

    config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
              "intermediate_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 1,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
              "num_experts_per_tok": 2, "vocab_size": 260, "max_position_embeddings": 256}
    (tmp_path / "config.json").write_text(json.dumps(config))
    flags = {"moe_gate": "tile-fill", "tile_m": 16, "decode_floor": 8, "moe_max_tokens": 0, "grouped_variant": 2}
    arms = decided_arms(str(tmp_path), [1, 64], flags)
    assert arms[1] == "gemv" and arms[64] != "gemv"  # top-2 of 8 experts: the tiles amortize from 64 tokens


def test_sweep_on_a_cpu_says_to_run_the_same_command_on_a_gpu(capsys):
    """It pointed at `bash bench/gpu_all.sh tests`, the project's GPU test suite, not the user's sweep."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible: sweep runs")
    assert main(["sweep", "--model", "tiny", "--tokens", "1"]) == 2
    line = one_error_line(capsys)
    assert "needs a CUDA GPU" in line and "run the same command on a machine with one" in line
    assert "gpu_all.sh" not in line


def _qwen3_config(directory: Path, **changes) -> Path:
    """A config-only Qwen3-MoE directory, as transformers writes it, with `changes` (None: the key removed)."""
    import json

    from transformers import Qwen3MoeConfig

    directory.mkdir()
    Qwen3MoeConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                   num_experts=8, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                   vocab_size=300).save_pretrained(directory)
    values = json.loads((directory / "config.json").read_text())
    for key, value in changes.items():
        values.pop(key, None) if value is None else values.__setitem__(key, value)
    (directory / "config.json").write_text(json.dumps(values))
    return directory


@pytest.mark.parametrize("changes, said", [
    ({"num_hidden_layers": 0}, "num_hidden_layers must be >= 1"),
    ({"num_key_value_heads": 3}, "num_attention_heads must be a multiple of num_key_value_heads"),
    ({"num_experts": None, "num_local_experts": None}, "no 'num_experts': config.json must give it"),
])
def test_a_config_error_names_config_jsons_keys(tmp_path, capsys, changes, said):
    """The validation said "n_layers must be >= 1" (the engine's field names) and a Qwen3-MoE config without an
    experts count "is 0: a dense model": the line now names the keys a user edits."""
    directory = _qwen3_config(tmp_path / "ckpt", **changes)
    assert main(["generate", "--model", str(directory), "--weights", "random", "--prompt", "x",
                 "--max-tokens", "1"]) == 2
    line = one_error_line(capsys)
    assert said in line and "config.json" in line, line


def test_a_config_error_keeps_a_directory_named_like_a_field(tmp_path, capsys):
    """The keys are translated in the problem only: a checkpoint directory called `hidden` keeps its name."""
    directory = _qwen3_config(tmp_path / "hidden", num_hidden_layers=0)
    assert main(["generate", "--model", str(directory), "--weights", "random", "--prompt", "x",
                 "--max-tokens", "1"]) == 2
    assert "qwen3-moe:hidden: num_hidden_layers must be >= 1" in one_error_line(capsys)


@pytest.mark.parametrize("argv", [["check-quant", "--model"], ["sweep", "--tokens", "1", "--model"],
                                  ["generate", "--prompt", "hi", "--model"]])
def test_a_model_path_that_is_not_a_directory_gets_the_same_line_everywhere(tmp_path, capsys, argv):
    """check-quant and sweep read the config first and answered 'unknown model', naming only the presets."""
    missing = str(tmp_path / "moved-away")
    assert main(argv + [missing]) == 2
    line = one_error_line(capsys)
    assert f"--model {missing}: does not exist; give a preset (tiny, demo, v4-shape) or a Hugging Face" in line


@pytest.mark.parametrize("argv", [["generate", "--prompt", "x", "--device", "cpu"],
                                  ["compare", "--prompt", "x", "--device", "cpu"],
                                  ["bench", "--tg", "2", "--device", "cpu"], ["sweep", "--tokens", "1"],
                                  ["check-quant", "--device", "cpu"], ["curve"]])
def test_an_empty_model_is_refused_not_taken_for_the_current_directory(argv, tmp_path, monkeypatch, capsys):
    """--model '' was the path '', the current directory: run inside a checkpoint directory, it loaded that."""
    from test_trellis_checkpoint import write_tiny_mixtral

    monkeypatch.chdir(write_tiny_mixtral(tmp_path / "checkpoint", layers=1))
    assert main([*argv, "--model", ""]) == 2
    assert "--model is empty" in one_error_line(capsys)
