"""Which torch device a command asked for, and its name for people and results headers."""

from __future__ import annotations

import torch

from engine.errors import UserError


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise UserError(f"unknown device {name!r}: use auto, cpu or cuda")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {name}: no CUDA GPU is visible here; use --device cpu or auto")
    return torch.device(name)


def device_label(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
