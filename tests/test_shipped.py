"""Shipped checkpoints: loaded by default, checked tensor by tensor against the preset."""

import pytest
import torch
from safetensors.torch import save_file

from engine import shipped
from engine.config import PRESETS
from engine.errors import UserError
from engine.model import random_weights
from engine.runtime import Engine
from inspector.cli import main


@pytest.fixture
def weights_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(shipped, "WEIGHTS_DIRECTORY", tmp_path)
    (tmp_path / "tiny").mkdir()
    return tmp_path / "tiny"


def test_a_shipped_checkpoint_is_loaded_by_default_and_random_on_request(weights_dir):
    trained = random_weights(PRESETS["tiny"], 11, torch.device("cpu"), torch.bfloat16)
    save_file(trained, str(weights_dir / "model.safetensors"))
    engine = Engine.load("tiny", "cpu")
    assert engine.weights_source.startswith("trained checkpoint")
    assert torch.equal(engine.weights["layers.0.w13"], trained["layers.0.w13"].float())
    assert Engine.load("tiny", "cpu", weights="random").weights_source == "random, seed 0"


def test_a_mismatched_tensor_is_named_with_its_file(weights_dir, capsys):
    wrong = random_weights(PRESETS["tiny"], 11, torch.device("cpu"), torch.bfloat16)
    wrong["layers.1.w2"] = wrong["layers.1.w2"][:, :, :16].contiguous()
    save_file(wrong, str(weights_dir / "model.safetensors"))
    assert main(["generate", "--model", "tiny", "--prompt", "x"]) == 2
    error = capsys.readouterr().err
    assert "model.safetensors" in error and "layers.1.w2" in error and "Traceback" not in error


def test_a_truncated_file_is_named(weights_dir):
    save_file(random_weights(PRESETS["tiny"], 11, torch.device("cpu"), torch.bfloat16),
              str(weights_dir / "model.safetensors"))
    data = (weights_dir / "model.safetensors").read_bytes()
    (weights_dir / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match="model.safetensors"):
        Engine.load("tiny", "cpu")


def test_the_shipped_demo_matches_its_preset_when_present():
    directory = shipped.shipped_directory("demo")
    if directory is None:
        pytest.skip("no trained demo checkpoint in this checkout (train/train_demo.py makes one)")
    engine = Engine.load("demo", "cpu")
    assert engine.weights_source.startswith("trained checkpoint")
    record = shipped.training_record("demo")
    assert record["preset"] == "demo" and record["loss_curve"]
