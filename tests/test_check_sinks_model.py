"""`moe-inspector --model M check-attention`: the sinks check at the model's head_dim, heads, kv heads and first
masked layer's window and block (the sizes F3 takes), read from its config alone; a model whose layers another
check fits (--decode, --mla) or none is refused in one line, exit 2, before anything runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.config import PRESETS
from inspector.cli import main

CONFIGS = Path(__file__).resolve().parents[1] / "bench" / "configs"


def _config_dir(directory: Path, source: str, **changes) -> Path:
    values = json.loads((CONFIGS / source / "config.json").read_text())
    values.update(changes)
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(values))
    return directory


def test_the_sinks_check_takes_the_global_models_dims(capsys):
    tiny = PRESETS["tiny"]
    masked = next(mask for mask in tiny.layer_masks if mask.kind == "composite")
    assert main(["--model", "tiny", "check-attention", "--seq-len", "24", "--json"]) == 0
    config = json.loads(capsys.readouterr().out)["config"]
    assert (config["head_dim"], config["heads"], config["kv_heads"]) == (tiny.head_dim, tiny.n_heads, tiny.n_kv_heads)
    assert (config["window"], config["block"]) == (min(masked.window, 32), min(masked.block, 16))
    assert config["head_dim"] != 64  # not the check's own CPU default


def test_a_mask_cut_to_the_interpreters_sizes_says_so(capsys):
    """demo's mask is W=128, B=64; the CPU checks it at W=32, B=16: the user is told, and the JSON keeps both."""
    masked = next(mask for mask in PRESETS["demo"].layer_masks if mask.kind == "composite")
    assert main(["--model", "demo", "check-attention", "--seq-len", "48", "--device", "cpu", "--json"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert result["model_mask"] == {"window": masked.window, "block": masked.block,
                                    "checked_at_the_models_sizes": False}
    assert f"demo's mask is W={masked.window}, B={masked.block}; checked at W=32, B=16" in captured.err
    assert main(["--model", "demo", "check-attention", "--seq-len", "48", "--device", "cpu", "--window",
                 str(masked.window), "--block", str(masked.block), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["model_mask"]["checked_at_the_models_sizes"] and "mask is" not in captured.err


def test_an_option_given_beside_the_model_wins(capsys):
    assert main(["--model", "tiny", "check-attention", "--seq-len", "24", "--window", "8", "--json"]) == 0
    config = json.loads(capsys.readouterr().out)["config"]
    assert config["window"] == 8 and config["head_dim"] == PRESETS["tiny"].head_dim


@pytest.mark.parametrize("source, check", [("qwen3-30b-a3b", "--decode"), ("deepseek-v2-lite", "--mla")])
def test_a_model_another_check_fits_is_refused_naming_it(tmp_path, capsys, source, check):
    model = _config_dir(tmp_path / source, source, num_hidden_layers=2)
    code = main(["--model", str(model), "check-attention", "--seq-len", "24"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert str(model) in err and f"check-attention {check}" in err and "does not apply" in err


def test_a_model_no_check_fits_says_why(tmp_path, capsys):
    model = _config_dir(tmp_path / "odd-head-dim", "qwen3-30b-a3b", num_hidden_layers=2, head_dim=96)
    code = main(["--model", str(model), "check-attention"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "head_dim 96" in err and "no fused arm to check" in err
