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

from inspector.commands.output import add_format_arguments, output_format

_DEFAULT_TOKENS = "1,2,4,8,9,16,32,64,128,256,512,683,1024,2048,4096,8192"
_ALL_ARMS = "gemv,grouped_v0,grouped_v1,grouped_v2,torch_grouped_mm"


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
    parser.add_argument("--arms", default=_ALL_ARMS, help=f"arms to time, comma separated (default {_ALL_ARMS})")
    parser.add_argument("--skew", type=float, default=0.0,
                        help="Zipf exponent of expert popularity (default 0 = uniform routing)")
    parser.add_argument("--tile-m", dest="tile_m", type=int, default=None,
                        help="grouped-GEMM m-tile rows: 16, 32 or 64 (default: the kernel's DEFAULT_TILE_M)")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights, activations and routing (default 0)")
    add_format_arguments(parser, ("text", "json"), "text")
    parser.add_argument("--calibration", default=None, metavar="FILE",
                        help="calibration file to write (default MOEI_CALIBRATION or ~/.cache/moe-inspector/calibration.json)")
    parser.add_argument("--timing", choices=("graph", "cold"), default="graph",
                        help="graph (default): calls back to back in a CUDA graph replay, as the runtime runs the "
                             "arm (the calibration is written only from it); cold: one eager call after an L2 flush")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from engine.progress import Progress
    from engine.sweep import SweepConfig, parse_arms, parse_tokens, require_cuda, run_sweep
    from engine.triton_support import require_triton

    fmt = output_format(args)
    tokens, arms = parse_tokens(args.tokens), parse_arms(args.arms)  # bad options first, GPU or not
    check_calibration_path(args.calibration)  # a place it cannot write: before any work
    require_cuda()  # before the kernel modules below, which on a CPU may not even import
    require_triton("sweep")
    tile_m = args.tile_m
    if tile_m is None:
        from kernels.moe_grouped import DEFAULT_TILE_M

        tile_m = DEFAULT_TILE_M
    config = SweepConfig(
        model=args.model,
        tokens=tokens,
        arms=arms,
        skew=args.skew,
        tile_m=tile_m,
        seed=args.seed,
        calibration=Path(args.calibration) if args.calibration else None,
        timing=args.timing,
    )
    progress = Progress(2 + len(config.tokens) * (len(config.arms) + 1), f"sweep {config.model}")
    try:
        result = run_sweep(config, progress)
    finally:
        progress.close()
    if fmt == "json":
        print(json.dumps(result, indent=1))
    else:
        print(render_table(result))
    return 1 if result["check_failed"] else 0


def check_calibration_path(explicit: str | None) -> None:
    """Before anything is measured: the calibration file the sweep will write can be written. The
    default place (our own cache directory) is created; a given one must already have its directory."""
    from engine.calibration import calibration_path, check_writable
    from inspector.output_paths import check_output_path

    if explicit is not None:
        check_output_path(explicit, "--calibration")
        check_writable(Path(explicit))
        return
    path = calibration_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError:
        pass  # the check below says why it cannot be written
    check_output_path(path, "the calibration file (MOEI_CALIBRATION or ~/.cache/moe-inspector/calibration.json)")
    check_writable(path)


def _us(value) -> str:
    return "-" if value is None else f"{value:,.1f}"


def render_table(result: dict) -> str:
    """The human table of a sweep result (also usable on a saved sweep JSON)."""
    rows = result["rows"]
    arms = list(rows[0]["arms"]) if rows else []
    shape = result["shape"]
    lines = [
        f"MoE arms sweep: {result['model']} (E={shape['experts']}, k={shape['top_k']}, D={shape['hidden']}, "
        f"F={shape['intermediate']}, {result['dtype']}), tile_m={result['tile_m']}, skew={result['skew']}",
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
