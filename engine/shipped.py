"""Checkpoints that ship inside the package: today the trained `demo` (train/train_demo.py).

A shipped checkpoint is a directory under engine/weights/ holding `model.safetensors` (the
preset's tensor names, bf16) and `training.json` (data, steps, loss curve, seed). Loading checks
every tensor against the preset's shapes, so a checkpoint that does not match the model is an
error naming the file and the tensor, never a wrong model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.checkpoint import Checkpoint, nonfinite_allowed
from engine.config import ModelConfig
from engine.errors import UserError
from engine.model import tensor_shapes

WEIGHTS_DIRECTORY = Path(__file__).resolve().parent / "weights"


def shipped_directory(preset: str) -> Path | None:
    directory = WEIGHTS_DIRECTORY / preset
    return directory if (directory / "model.safetensors").is_file() else None


def training_record(preset: str) -> dict | None:
    directory = shipped_directory(preset)
    if directory is None or not (directory / "training.json").is_file():
        return None
    return json.loads((directory / "training.json").read_text())


def load_shipped(config: ModelConfig, directory: Path, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    checkpoint = Checkpoint.open(directory)
    checkpoint.allow_nonfinite = nonfinite_allowed()
    shapes = tensor_shapes(config)
    extra = checkpoint.names() - set(shapes)
    if extra:
        raise UserError(f"{directory}: tensor {sorted(extra)[0]} is not part of the {config.name} preset: the shipped "
                        f"checkpoint was trained for another architecture; retrain it with train/train_demo.py")
    weights = {}
    for name, shape in shapes.items():
        checkpoint.expect(name, shape, why=f"the {config.name} preset")
        weights[name] = checkpoint.read(name).to(device=device, dtype=dtype)
    checkpoint.close()
    return weights
