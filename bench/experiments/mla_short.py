"""What latent attention adds to a DeepSeek-V2-Lite decode layer at one token, and what its candidates would add.

At one token V2-Lite's step spent 264 µs of 2126 in the split kernel (run 70: 9.3 µs a layer) walking a short cache
(the bench's 159 keys) in ONE program: at 16 heads a sequence is one row block, and the split rule asked each split
for 4 key tiles. Each figure here is the per-layer time of a chain captured 27 times in one CUDA graph, PDL on as
the step runs it (engine.bench.graph_call_us), at DeepSeek-V2-Lite's widths (16 heads, nope 128, RoPE 64, v 128,
latent 512, D 2048):

    absorb + unabsorb + o                the chain without attention: the base
    ... + split S, merged in unabsorb    kernels.attention_mla.mla_split at S splits, its partials merged by
                                         kernels.mla_absorb.unabsorb (no combine launch)
    ... + split S, combine kernel        the same splits merged by the combine kernel, then unabsorb
    ... + the baseline's split, S        `--baseline FILE`, an older kernels/attention_mla.py (`git show
                                         REV:kernels/attention_mla.py > bench/experiments/baseline_attention_mla.py`:
                                         the device's copy of the tree has no git), with its own combine
    ... + config C at its splits         key tiles, warps and stages (CONFIGS)

at capacities 159, 512, 1024 and 4096, the query at the last position (the graph walks the visible keys only).

    python3 bench/experiments/mla_short.py [--baseline FILE]    # JSON to $OUT/mla_short.json, a table on stdout
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from engine.bench import graph_call_us  # noqa: E402
from engine.provenance import commit_label  # noqa: E402
from kernels import attention_mla  # noqa: E402
from kernels.attention_mla import MlaConfig, default_config, default_num_splits, mla_split  # noqa: E402
from kernels.gemv import gemv  # noqa: E402
from kernels.mla_absorb import absorb, unabsorb  # noqa: E402

D, HEADS, NOPE, ROPE, VALUE, LATENT = 2048, 16, 128, 64, 128, 512
LAYERS = 27
SCALE = (NOPE + ROPE) ** -0.5
SPLITS = {159: (1, 2, 3, 5), 512: (1, 2, 4, 8, 16), 1024: (1, 4, 8, 16, 32), 4096: (8, 16, 32, 64)}
CONFIGS = (MlaConfig(16, 16, 4, 2), MlaConfig(16, 64, 4, 2), MlaConfig(16, 32, 4, 3), MlaConfig(16, 32, 2, 2),
           MlaConfig(16, 64, 8, 2), MlaConfig(16, 64, 8, 2, tma=True))


def _module_from(path: Path):
    """An older kernels/attention_mla.py, loaded as its own module (its imports resolve to this tree's kernels)."""
    spec = importlib.util.spec_from_file_location("attention_mla_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _draw(*shape, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(torch.bfloat16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, default=REPO / "bench/experiments/baseline_attention_mla.py",
                        help="an older kernels/attention_mla.py whose split kernel is timed beside (skipped if absent)")
    args = parser.parse_args()
    torch.manual_seed(0)
    before = _module_from(args.baseline) if args.baseline.is_file() else None
    label = args.baseline.name
    kv_b = _draw(HEADS * (NOPE + VALUE), LATENT, scale=NOPE ** -0.5)
    w_o = _draw(D, HEADS * VALUE, scale=0.02)
    q = _draw(1, HEADS, NOPE + ROPE)
    rows: list[dict] = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def time(name: str, layer, **extra) -> float:
        us = graph_call_us(layer, LAYERS, warmup=3, replays=9)
        rows.append({"chain": name, "us_per_layer": us, **extra})
        print(f"{name:58s} {us:8.2f} µs a layer", flush=True)
        return us

    def chain(attend):
        def layer():
            absorbed = absorb(q, kv_b, NOPE, VALUE)
            attended = attend(absorbed)
            gemv(attended.reshape(1, HEADS * VALUE), w_o)
        return layer

    for capacity, candidates in SPLITS.items():
        cache = _draw(1, capacity, 1, LATENT + ROPE)
        q_start = torch.tensor([capacity - 1], device="cuda", dtype=torch.int32)
        fixed_latent = _draw(1, HEADS, LATENT)
        base = time(f"@{capacity} absorb + unabsorb + o",
                    chain(lambda absorbed: unabsorb(fixed_latent, kv_b, NOPE, VALUE)), capacity=capacity)
        default = default_config(LATENT, HEADS)
        chosen = default_num_splits(1, HEADS, capacity, default, sms)

        def merged(splits, config=None):
            def attend(absorbed):
                split = mla_split(absorbed.view(1, 1, HEADS, -1), cache, LATENT, SCALE, q_start, num_splits=splits,
                                  config=config)
                return unabsorb(split.out.view(1, HEADS, LATENT), kv_b, NOPE, VALUE, split)
            return attend

        def combined(module, splits):
            def attend(absorbed):
                out = module.mla_decode(absorbed.view(1, 1, HEADS, -1), cache, LATENT, SCALE, q_start,
                                        num_splits=splits)
                return unabsorb(out.view(1, HEADS, LATENT), kv_b, NOPE, VALUE)
            return attend

        for splits in candidates:
            extra = {"capacity": capacity, "splits": splits, "default_splits": chosen}
            here = time(f"@{capacity} + split {splits}, merged in unabsorb", chain(merged(splits)),
                        merge="unabsorb", **extra) - base
            apart = time(f"@{capacity} + split {splits}, combine kernel", chain(combined(attention_mla, splits)),
                         merge="kernel", **extra) - base
            old = float("nan")
            if before is not None:
                old = time(f"@{capacity} + {label}'s split {splits}", chain(combined(before, splits)),
                           merge="kernel", baseline=label, **extra) - base
            print(f"@{capacity}, {splits} splits: attention adds {here:.2f} µs merged in unabsorb, {apart:.2f} with "
                  f"the combine kernel, {old:.2f} with {label}'s kernel", flush=True)
        for config in CONFIGS:
            splits = default_num_splits(1, HEADS, capacity, config, sms)
            took = time(f"@{capacity} + {config.label()}, {splits} splits", chain(merged(splits, config)),
                        capacity=capacity, config=config.label(), splits=splits) - base
            print(f"@{capacity}, {config.label()} at {splits} splits: attention adds {took:.2f} µs", flush=True)
    out = Path(os.environ.get("OUT", "bench/results/latest"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "mla_short.json").write_text(json.dumps({
        "commit": commit_label(), "device": torch.cuda.get_device_name(), "layers": LAYERS,
        "baseline": label if before is not None else None,
        "rows": rows,
    }, indent=1))


if __name__ == "__main__":
    main()
