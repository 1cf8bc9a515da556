"""`check-attention --mla --model M`: the latent check at the model's heads and latent dims (as F3 takes them),
read from a preset or a checkpoint directory's config.json alone; a model without latent attention is refused in
one line, exit 2, before anything runs."""

from __future__ import annotations

import json
from pathlib import Path

from inspector.cli import main

CONFIG = Path(__file__).resolve().parents[1] / "bench" / "configs" / "deepseek-v2-lite" / "config.json"


def _tiny_deepseek(directory: Path) -> Path:
    """V2-Lite's config.json at tiny widths: 4 heads, latent 32 + rope 16, nope 16, v 16 (no weights needed)."""
    values = json.loads(CONFIG.read_text())
    values.update(hidden_size=64, intermediate_size=96, kv_lora_rank=32, moe_intermediate_size=16, n_routed_experts=8,
                  n_shared_experts=1, num_attention_heads=4, num_key_value_heads=4, num_experts_per_tok=2,
                  num_hidden_layers=2, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, vocab_size=300,
                  max_position_embeddings=256, rope_scaling=None)
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(values))
    return directory


def test_the_latent_check_takes_the_models_heads_and_latent_dims(tmp_path, capsys):
    model = _tiny_deepseek(tmp_path / "dsv2-tiny")
    code = main(["check-attention", "--mla", "--model", str(model), "--seq-len", "24", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["ok"]
    config = result["config"]
    assert (config["heads"], config["kv_lora_rank"], config["rope_dim"], config["nope_dim"], config["v_dim"]) == \
        (4, 32, 16, 16, 16)


def test_an_option_given_beside_the_model_wins(tmp_path, capsys):
    model = _tiny_deepseek(tmp_path / "dsv2-tiny")
    assert main(["check-attention", "--mla", "--model", str(model), "--seq-len", "24", "--heads", "2",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["heads"] == 2


def test_a_model_without_latent_attention_is_refused_in_one_line(capsys):
    code = main(["check-attention", "--mla", "--model", "tiny"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "has no latent attention" in err and "--decode" in err


def test_the_global_model_gives_what_the_commands_own_model_gives(tmp_path, capsys):
    model = _tiny_deepseek(tmp_path / "dsv2-tiny")
    assert main(["check-attention", "--mla", "--model", str(model), "--seq-len", "24", "--json"]) == 0
    own = json.loads(capsys.readouterr().out)["config"]
    assert main(["--model", str(model), "check-attention", "--mla", "--seq-len", "24", "--json"]) == 0
    outer = json.loads(capsys.readouterr().out)["config"]
    assert (outer["heads"], outer["kv_lora_rank"], outer["nope_dim"]) == (4, 32, 16)
    assert outer == own


def test_the_same_model_given_twice_is_one_model(tmp_path, capsys, monkeypatch):
    _tiny_deepseek(tmp_path / "dsv2-tiny")
    monkeypatch.chdir(tmp_path)
    assert main(["--model", "dsv2-tiny", "check-attention", "--mla", "--model", "./dsv2-tiny/", "--seq-len", "24",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["kv_lora_rank"] == 32


def test_two_different_models_are_refused_in_one_line(tmp_path, capsys):
    model = _tiny_deepseek(tmp_path / "dsv2-tiny")
    for check in ("--mla", "--decode"):
        code = main(["--model", "tiny", "check-attention", check, "--model", str(model), "--seq-len", "24"])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1, err
        assert "two models" in err and "tiny" in err and str(model) in err
