"""What the chain experiments (qkv_fold.py, route_blocks.py, o_preload.py) share: a stack of LAYERS distinct weights
taken in turn, so a graph of LAYERS calls streams each from DRAM as the step does; the per-layer graph timing of a
chain; and the JSON every experiment writes under $OUT."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from engine.bench import graph_call_us
from engine.provenance import commit_label

LAYERS = 48


def draw(*shape, scale=0.02) -> torch.Tensor:
    """Fresh normal values times `scale` in bf16 on the GPU."""
    return (torch.randn(*shape, device="cuda") * scale).to(torch.bfloat16)


class Layers:
    """LAYERS weights of each stack: `next()` the next layer's (one of each stack), in turn."""

    def __init__(self, *shapes: tuple[int, ...]) -> None:
        self.stacks = [[draw(*shape) for _ in range(LAYERS)] for shape in shapes]
        self.index = 0

    def next(self) -> tuple[torch.Tensor, ...]:
        index, self.index = self.index % LAYERS, self.index + 1
        return tuple(stack[index] for stack in self.stacks)

    def first(self) -> tuple[torch.Tensor, ...]:
        return tuple(stack[0] for stack in self.stacks)


def timer(rows: list[dict], shape: str, layers: Layers, width: int = 40):
    """time(name, chain) -> µs a layer: `chain` captured LAYERS times in one CUDA graph (the layers from the first),
    the median of 9 replays over LAYERS; each figure appended to `rows` and printed."""
    def time(name: str, chain) -> float:
        layers.index = 0
        us = graph_call_us(chain, LAYERS, warmup=3, replays=9)
        rows.append({"shape": shape, "chain": name, "us_per_layer": us})
        print(f"{shape:18s} {name:{width}s} {us:8.2f} µs a layer", flush=True)
        return us
    return time


def write(name: str, rows: list[dict], **fields) -> None:
    """$OUT/<name>.json (default bench/results/latest): the commit, the device, LAYERS, `fields` and the rows."""
    out = Path(os.environ.get("OUT", "bench/results/latest"))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({
        "commit": commit_label(), "device": torch.cuda.get_device_name(), "layers": LAYERS, **fields, "rows": rows,
    }, indent=1))
