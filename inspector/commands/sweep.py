"""`moe-inspector sweep`: time every MoE arm per token count on one layer, print the table (or
JSON), and write the calibration entry the `measured` gate reads.

Imports nothing heavy at module level (the CLI imports every command to build its parser), and
never textual or plotext: this command runs on the GPU machines.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

_DEFAULT_TOKENS = "1,2,4,8,9,16,32,64,128,256,512,683,1024,2048,4096,8192"
_ALL_ARMS = "gemv,grouped_v0,grouped_v1,grouped_v2,torch_grouped_mm"
_TRELLIS_ARMS = "trellis_gemv,trellis_grouped,trellis_dequant"


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "sweep",
        help="time the MoE arms per token count against this GPU's bandwidth and tensor-core bounds",
        description="Times every MoE arm on one layer per token count (median device time, inputs "
        "rotated, L2 evicted), measures copy bandwidth and the bf16 matmul rate in the same run, "
        "prints each arm's ratio to the larger bound and the GEMV/grouped crossover, and writes "
        "the calibration entry that moe_gate=measured reads. Needs a CUDA GPU.",
    )
    parser.add_argument("--model", default="v4-shape",
                        help="tiny, demo, v4-shape (default) or a checkpoint directory (its config.json's MoE shape)")
    parser.add_argument("--tokens", default=_DEFAULT_TOKENS, help=f"token counts, comma separated (default {_DEFAULT_TOKENS})")
    parser.add_argument("--arms", default=None, help=f"arms to time, comma separated (default {_ALL_ARMS}; with "
                        f"trellis experts {_TRELLIS_ARMS})")
    parser.add_argument("--experts", default="bf16", metavar="FORMAT",
                        help="the experts' format: bf16 (default) or trellis:K=2,code=hyb (random packed codes)")
    parser.add_argument("--skew", type=float, default=0.0,
                        help="Zipf exponent of expert popularity (default 0 = uniform routing)")
    parser.add_argument("--tile-m", dest="tile_m", type=int, default=None,
                        help="grouped-GEMM m-tile rows: 16, 32 or 64 (default: the kernel's DEFAULT_TILE_M)")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights, activations and routing (default 0)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--calibration", default=None, metavar="FILE",
                        help="calibration file to write (default MOEI_CALIBRATION or ~/.cache/moe-inspector/calibration.json)")
    parser.add_argument("--timing", choices=("graph", "cold"), default="graph",
                        help="graph (default): calls back to back in a CUDA graph replay, as the runtime runs the "
                             "arm (the calibration is written only from it); cold: one eager call after an L2 flush")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from engine.progress import Progress
    from engine.sweep import SweepConfig, parse_arms, parse_experts, parse_tokens, require_cuda, run_sweep

    tile_m = args.tile_m
    if tile_m is None:
        from kernels.moe_grouped import DEFAULT_TILE_M

        tile_m = DEFAULT_TILE_M
    experts = parse_experts(args.experts)
    config = SweepConfig(
        model=args.model,
        tokens=parse_tokens(args.tokens),
        arms=parse_arms(args.arms or (_ALL_ARMS if experts is None else _TRELLIS_ARMS)),
        experts=experts,
        skew=args.skew,
        tile_m=tile_m,
        seed=args.seed,
        calibration=Path(args.calibration) if args.calibration else None,
        timing=args.timing,
    )
    require_cuda()
    progress = Progress(2 + len(config.tokens) * (len(config.arms) + 1), f"sweep {config.model}")
    try:
        result = run_sweep(config, progress)
    finally:
        progress.close()
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(render_table(result))
    return 1 if result["check_failed"] else 0


def _us(value) -> str:
    return "-" if value is None else f"{value:,.1f}"


def render_table(result: dict) -> str:
    """The human table of a sweep result (also used on saved JSON by bench/gpu_moe.sh)."""
    rows = result["rows"]
    arms = list(rows[0]["arms"]) if rows else []
    shape = result["shape"]
    lines = [
        f"MoE arms sweep: {result['model']} (E={shape['experts']}, k={shape['top_k']}, D={shape['hidden']}, "
        f"F={shape['intermediate']}, {result['dtype']}), experts {result.get('experts', 'bf16')}, "
        f"tile_m={result['tile_m']}, skew={result['skew']}",
        f"device {result['device']}: copy {result['copy_bandwidth_gbs']:,.0f} GB/s, "
        f"bf16 matmul {result['matmul_tflops']:,.0f} TFLOP/s",
        *([f"timing: {result['timing']['method']}: {result['timing']['describe']}"]
          if isinstance(result.get("timing"), dict) else []),
        "",
    ]
    header = ["n", "woken", "bw µs", "tc µs", *[f"{arm} µs (×bound)" for arm in arms], "align µs"]
    table = [header]
    for row in rows:
        cells = [str(row["tokens"]), f"{row['woken_experts']:.1f}", _us(row["bandwidth_bound_us"]),
                 _us(row["tensor_core_bound_us"])]
        for arm in arms:
            entry = row["arms"][arm]
            if entry["us"] is None:
                cells.append("n/a")
                continue
            flag = "" if entry["rel_err"] is not None and entry["rel_err"] <= result["check_tolerance"] else " CHECK"
            cold = " cold" if entry.get("timing") == "cold" and result.get("timing", {}).get("method") == "graph" else ""
            cells.append(f"{_us(entry['us'])} ({entry['ratio']:.2f}){cold}{flag}")
        cells.append(_us(row["align_us"]))
        table.append(cells)
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    for index, line in enumerate(table):
        lines.append("  ".join(cell.rjust(width) for cell, width in zip(line, widths)))
        if index == 0:
            lines.append("  ".join("-" * width for width in widths))
    lines.append("")
    if rows:
        launch_notes = []
        for arm in arms:
            per_call = rows[-1]["arms"][arm].get("launches_per_call") or {}
            if per_call:
                launch_notes.append(f"{arm}: " + ", ".join(f"{name}×{count}" for name, count in sorted(per_call.items())))
            elif rows[-1]["arms"][arm].get("unavailable"):
                launch_notes.append(f"{arm}: {rows[-1]['arms'][arm]['unavailable']}")
        lines.append("launches per call: " + "; ".join(launch_notes))
    crossover = result["crossover_tokens"]
    lines.append(f"GEMV/grouped crossover: {'none measured' if crossover is None else f'{crossover} tokens'}"
                 f" (best grouped variant faster than GEMV at every measured n >= it)")
    if result.get("dequant_crossover_tokens") is not None:
        lines.append(f"grouped/dequantize crossover: {result['dequant_crossover_tokens']} tokens "
                     "(trellis_dequant faster than trellis_grouped at every measured n >= it)")
    if result.get("calibration_path"):
        lines.append(f"calibration written: {result['calibration_path']}")
    elif result.get("calibration_note"):
        lines.append(f"calibration not written: {result['calibration_note']}")
    if result.get("check_failed"):
        lines.append(f"CHECK FAILED: an arm's relative error vs the reference exceeded {result['check_tolerance']}")
    lines.append(f"commit {result.get('commit') or 'unknown'}, torch {result['versions']['torch']}, "
                 f"triton {result['versions']['triton']}")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover - `python3 -m inspector.commands.sweep FILE.json`
    print(render_table(json.load(open(sys.argv[1]))))
