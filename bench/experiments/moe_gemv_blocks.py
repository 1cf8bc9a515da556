"""Block sizes of the gather-GEMV MoE arm on an H200: each candidate checked against the reference, then
timed replayed from a CUDA graph, beside the bandwidth bound of the bytes read.

Shapes: v4-shape (D = 4096, F = 2048, E = 256, top-6) at n = 1 and 8 tokens: the block table's candidates;
`--shapes qwen3,dsv2` (Qwen3-30B-A3B: D 2048, F 768, E 128, top-8; DeepSeek-V2-Lite: D 2048, F 1408, E 64,
top-6) at n = 1: the schedule's candidates (gate-up F_STEPS 1 or 2 x down BLOCK_D 2, 4 or 8, the threshold
off) beside what kernels.moe_gemv picks (gate_up_f_steps, DOWN_BLOCK_D). bf16, routing drawn at random (k distinct experts per
token). The module constants of kernels.moe_gemv are set per candidate (the launcher reads them at call
time); the entry in use is marked. Bound: w13 and w2 bytes of the distinct experts touched, over the
device-to-device copy bandwidth measured in this run.

    python3 bench/experiments/moe_gemv_blocks.py [--shapes v4,qwen3,dsv2]   # JSON to $OUT/moe_gemv_blocks.json
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from engine.bench import copy_bandwidth, graph_call_us  # noqa: E402
from engine.errors import MeasurementError  # noqa: E402
from engine.provenance import commit_label  # noqa: E402
from kernels import moe_gemv  # noqa: E402
from kernels.reference import moe_reference  # noqa: E402

SHAPES = {"v4": (4096, 2048, 256, 6), "qwen3": (2048, 768, 128, 8), "dsv2": (2048, 1408, 64, 6)}
SCHEDULE_FIELDS = ("GATE_UP_F_STEPS", "DOWN_BLOCK_D", "MIN_GATE_UP_PROGRAMS")
# (BLOCK_F, BLOCK_D). Measured at n = 1 (results under bench/results/): run 10 timed (4, 512), (8, 1024), (16, 256)
# and (4, 1024): none beat (8, 512); run 45 added tl.range software pipelining (2-4 stages through shared memory) to
# (8, 512), (4, 512), (8, 256), (16, 256), (16, 512) and (4, 1024): within 0.5 % in the arm, slower in the v4 step.
# Each program now runs GATE_UP_F_STEPS (2) such blocks in turn (run 49, in the v4 step).
GATE_UP = [(8, 512), (4, 1024), (8, 1024)]
# (BLOCK_D, BLOCK_F) of down's walk over a token's k pairs. Before it (runs 10, 45), one program per pair and output
# block summed by the last of a token's k programs: 78.9-79.5 us at (8, 1024). Run 48: the walk at (8, 1024) 77.3 us;
# (4, 2048) 77.9, (8, 2048) 77.7, (4, 1024) 81.2, (2, 2048) 81.5, (8, 512) 84.0, (16, 1024) 86.5, (16, 512) 137.3;
# pipelined walks (runs 47, 48) 78.3-85.1.
DOWN = [(8, 1024), (4, 2048), (8, 2048), (4, 1024)]
FIELDS = ("GATE_UP_BLOCK_F", "GATE_UP_BLOCK_D", "DOWN_BLOCK_D", "DOWN_BLOCK_F")


def _time(tokens, w13, w2, generator, bandwidth, label: dict, rows: list) -> bool:
    """One candidate (the module constants already set): checked, timed, appended to `rows`; False if wrong."""
    E, K = w13.shape[0], label["top_k"]
    D = w13.shape[2]
    x = torch.randn(tokens, D, generator=generator, device="cuda").bfloat16()
    ids = torch.stack([torch.randperm(E, generator=generator, device="cuda")[:K] for _ in range(tokens)]).int()
    weights = torch.softmax(torch.randn(tokens, K, generator=generator, device="cuda"), -1).bfloat16()
    expected = moe_reference(x, w13, w2, ids, weights).float()
    bound_us = torch.unique(ids).numel() * w13[0].numel() * 3 // 2 * 2 / bandwidth * 1e6
    try:
        out = moe_gemv.moe_gemv(x, w13, w2, ids, weights).float()
        error = ((out - expected).abs().max() / expected.abs().max()).item()
        us = graph_call_us(lambda: moe_gemv.moe_gemv(x, w13, w2, ids, weights), calls=10)
    except Exception as problem:  # noqa: BLE001 - a candidate that does not compile is a row, not a crash
        rows.append({**label, "tokens": tokens, "error": str(problem)[:120]})
        return True
    ok = error < 2e-2
    rows.append({**label, "tokens": tokens, "us": round(us, 2), "bound_us": round(bound_us, 2),
                 "ratio": round(us / bound_us, 3), "max_rel_error": error, "ok": ok})
    return ok


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="v4", help="comma list of v4, qwen3, dsv2 (default v4)")
    args = parser.parse_args()
    generator = torch.Generator(device="cuda").manual_seed(0)
    bandwidth = copy_bandwidth(torch.device("cuda"))["bytes_per_s"]
    table = tuple(getattr(moe_gemv, field) for field in FIELDS)
    saved = {field: getattr(moe_gemv, field) for field in FIELDS + SCHEDULE_FIELDS}
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; {torch.cuda.get_device_name()}; commit {commit_label()}; "
          f"table entry gate_up {table[:2]} down {table[2:]}")
    rows, failed = [], False
    for shape in args.shapes.split(","):
        D, F, E, K = SHAPES[shape]
        w13 = (torch.randn(E, 2 * F, D, generator=generator, device="cuda") / D ** 0.5).bfloat16()
        w2 = (torch.randn(E, D, F, generator=generator, device="cuda") / F ** 0.5).bfloat16()
        if shape == "v4":
            for tokens in (1, 8):
                candidates = [(g, table[2:]) for g in GATE_UP] + [(table[:2], d) for d in DOWN if d != table[2:]]
                for gate_up, down in candidates:
                    for field, value in zip(FIELDS, gate_up + down):
                        setattr(moe_gemv, field, value)
                    label = {"shape": shape, "top_k": K, "gate_up": gate_up, "down": down,
                             "table": (gate_up, down) == (table[:2], table[2:])}
                    failed |= not _time(tokens, w13, w2, generator, bandwidth, label, rows)
                    for field, value in saved.items():
                        setattr(moe_gemv, field, value)
        else:
            picked = (moe_gemv.gate_up_f_steps(1, F, K), moe_gemv.DOWN_BLOCK_D)
            for f_steps in (1, 2):
                for block_d in (2, 4, 8):
                    moe_gemv.GATE_UP_F_STEPS, moe_gemv.DOWN_BLOCK_D = f_steps, block_d
                    moe_gemv.MIN_GATE_UP_PROGRAMS = 0  # exactly these blocks
                    label = {"shape": shape, "top_k": K, "gate_up": (f_steps,), "down": (block_d,),
                             "table": (f_steps, block_d) == picked}
                    failed |= not _time(1, w13, w2, generator, bandwidth, label, rows)
                    for field, value in saved.items():
                        setattr(moe_gemv, field, value)
        del w13, w2
        torch.cuda.empty_cache()
    print("| shape | n | gate_up (F, D) or (F_STEPS) | down (D, F) or (BLOCK_D) | us | x bound | rel err |")
    print("|---|---:|---|---|---:|---:|---:|")
    for row in rows:
        if "error" in row:
            print(f"| {row['shape']} | {row['tokens']} | {row['gate_up']} | {row['down']} | failed: {row['error']} | | |")
            continue
        mark = " (in use)" if row["table"] else ""
        print(f"| {row['shape']} | {row['tokens']} | {row['gate_up']}{mark} | {row['down']} | {row['us']:.2f} | "
              f"{row['ratio']:.3f} | {row['max_rel_error']:.1e}{'' if row['ok'] else ' FAILED'} |")
    out_dir = Path(os.environ.get("OUT", REPO / "bench" / "results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "moe_gemv_blocks.json").write_text(json.dumps(
        {"commit": commit_label(), "device": torch.cuda.get_device_name(), "copy_bandwidth": bandwidth,
         "rows": rows}, indent=1, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except MeasurementError as error:
        print(f"invalid measurement: {error}", file=sys.stderr)
        sys.exit(2)
