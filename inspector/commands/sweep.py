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

from inspector.commands.common import seed_argument
from inspector.commands.output import add_format_arguments, output_format

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
    parser.add_argument("--skew", default="uniform",
                        help="routing of the timed token sets: uniform (default) or zipf:S (expert popularity "
                             "(rank + 1)^-S over a fixed random order of the experts)")
    parser.add_argument("--routing", default=None, metavar="FILE.safetensors",
                        help="also time every arm on each MoE layer's recorded ids (a routing file of this model: "
                             "generate/bench --record-routing); reports per layer observed woken experts, pairs per "
                             "woken expert, tile fill and crossover beside the uniform ones, and calibrates from it")
    parser.add_argument("--layers", default=None, metavar="L,L",
                        help="with --routing: only these MoE layers of the file (default every one)")
    parser.add_argument("--tile-m", dest="tile_m", type=int, default=None,
                        help="grouped-GEMM m-tile rows: 16, 32 or 64 (default: the kernel's DEFAULT_TILE_M)")
    parser.add_argument("--seed", type=seed_argument, default=0, help="seed of weights, activations and routing (default 0)")
    add_format_arguments(parser, ("text", "json"), "text")
    parser.add_argument("--calibration", default=None, metavar="FILE",
                        help="calibration file to write (default MOEI_CALIBRATION or ~/.cache/moe-inspector/calibration.json)")
    parser.add_argument("--timing", choices=("graph", "neighbours", "cold"), default="graph",
                        help="graph (default): calls back to back in a CUDA graph replay, as the runtime runs the "
                             "arm (the calibration is written only from it); neighbours: the same between the "
                             "runtime's router and next norm, what the arm adds to them; cold: one eager call "
                             "after an L2 flush")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from engine.progress import Progress
    from engine.sweep import (SweepConfig, parse_arms, parse_experts, parse_layers, parse_skew, parse_tokens,
                              require_cuda, run_sweep)
    from engine.triton_support import require_triton

    fmt = output_format(args)
    experts = parse_experts(args.experts)  # bad options first, GPU or not
    tokens = parse_tokens(args.tokens)
    arms = parse_arms(args.arms or (_ALL_ARMS if experts is None else _TRELLIS_ARMS))
    check_calibration_path(args.calibration)  # a place it cannot write: before any work
    tile_m = args.tile_m
    if tile_m is None:
        from engine.flags import SPECS

        tile_m = SPECS["tile_m"].default  # kernels.moe_grouped.DEFAULT_TILE_M, without importing the kernels
    config = SweepConfig(  # a routing file is checked against its model here: on any machine
        model=args.model,
        tokens=tokens,
        arms=arms,
        experts=experts,
        skew=parse_skew(args.skew),
        tile_m=tile_m,
        seed=args.seed,
        calibration=Path(args.calibration) if args.calibration else None,
        timing=args.timing,
        routing=Path(args.routing) if args.routing else None,
        layers=parse_layers(args.layers) if args.layers else None,
    )
    require_cuda()  # before run_sweep's kernel modules, which on a CPU may not even import
    require_triton("sweep")
    sources = 1
    if config.recording is not None:
        sources += len(config.layers) if config.layers is not None else len(config.recording.layers)
    progress = Progress(2 + sources * len(config.tokens) * (len(config.arms) + 1), f"sweep {config.model}")
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
        check_output_path(explicit, "--calibration", calibration=True)
        check_writable(Path(explicit))
        return
    path = calibration_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError:
        pass  # the check below says why it cannot be written
    check_output_path(path, "the calibration file (MOEI_CALIBRATION or ~/.cache/moe-inspector/calibration.json)",
                      calibration=True)
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
        f"F={shape['intermediate']}, {result['dtype']}), experts {result.get('experts', 'bf16')}, "
        f"tile_m={result['tile_m']}, skew={result['skew']}",
        f"device {result['device']}: copy {result['copy_bandwidth_gbs']:,.0f} GB/s, "
        f"bf16 matmul {result['matmul_tflops']:,.0f} TFLOP/s",
        *([f"timing: {result['timing']['method']}: {result['timing']['describe']}"]
          if isinstance(result.get("timing"), dict) else []),
        "",
    ]
    lines += _rows_table(rows, arms, result)
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
    routing = result.get("routing")
    lines.append(f"GEMV/grouped crossover{' (uniform routing)' if routing else ''}: "
                 f"{'none measured' if crossover is None else f'{crossover} tokens'}"
                 f" (best grouped variant faster than GEMV at every measured n >= it)")
    if result.get("dequant_crossover_tokens") is not None:
        lines.append(f"grouped/dequantize crossover: {result['dequant_crossover_tokens']} tokens "
                     "(trellis_dequant faster than trellis_grouped at every measured n >= it)")
    if routing:
        lines += _routing_section(routing, arms, result)
    if result.get("calibration_path"):
        lines.append(f"calibration written: {result['calibration_path']}"
                     + (" (from the recorded routing: the model's crossover and each layer's)" if routing else ""))
    elif result.get("calibration_note"):
        lines.append(f"calibration not written: {result['calibration_note']}")
    if result.get("check_failed"):
        lines.append(f"CHECK FAILED: an arm's relative error vs the reference exceeded {result['check_tolerance']}")
    lines.append(f"commit {result.get('commit') or 'unknown'}, torch {result['versions']['torch']}, "
                 f"triton {result['versions']['triton']}")
    return "\n".join(lines)


def _routing_section(routing: dict, arms: list[str], result: dict) -> list[str]:
    """Per recorded layer: its rows with woken experts, pairs per woken expert and fill observed against the
    uniform prediction, its crossover; then where it differs from the uniform crossovers."""
    lines = ["", f"recorded routing: {routing['file']} ({routing.get('model')}, {routing['recorded_steps']} steps, "
                 f"{routing['recorded_tokens']} tokens); {routing['windows']}"]
    for entry in routing["layers"]:
        lines += ["", f"MoE layer {entry['layer']}:"]
        lines += _rows_table(entry["rows"], arms, result, observed=True)
        crossover = entry["crossover_tokens"]
        lines.append(f"layer {entry['layer']} crossover: "
                     f"{'none measured' if crossover is None else f'{crossover} tokens'}")
    model = routing.get("model_crossover_tokens")
    lines += ["", f"the model's crossover on its recorded routing (every layer's µs summed per n): "
                  f"{'none measured' if model is None else f'{model} tokens'}"]
    lines += routing.get("differences", [])
    return lines


def _rows_table(rows: list[dict], arms: list[str], result: dict, observed: bool = False) -> list[str]:
    lines = []
    header = ["n", "woken", "bw µs", "tc µs", *[f"{arm} µs (×bound)" for arm in arms], "align µs"]
    if observed:
        header[1:2] = ["woken obs/uni", "pairs/woken obs/uni", "fill obs/uni"]
    table = [header]
    for row in rows:
        cells = [str(row["tokens"]), f"{row['woken_experts']:.1f}", _us(row["bandwidth_bound_us"]),
                 _us(row["tensor_core_bound_us"])]
        if observed:
            wrapped = "*" if row.get("wrapped") else ""
            cells[1:2] = [f"{row['woken_experts']:.1f}/{row['woken_predicted']:.1f}{wrapped}",
                          f"{row['pairs_per_woken_expert']:.2f}/{row['pairs_per_woken_predicted']:.2f}",
                          f"{100 * row['fill_observed']:.0f}%/{100 * row['fill_predicted']:.0f}%"]
        for arm in arms:
            entry = row["arms"][arm]
            if entry["us"] is None:
                cells.append("n/a")
                continue
            flag = "" if entry["rel_err"] is not None and entry["rel_err"] <= result["check_tolerance"] else " CHECK"
            cold = " cold" if entry.get("timing") == "cold" and result.get("timing", {}).get("method") != "cold" else ""
            cells.append(f"{_us(entry['us'])} ({entry['ratio']:.2f}){cold}{flag}")
        cells.append(_us(row["align_us"]))
        table.append(cells)
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    for index, line in enumerate(table):
        lines.append("  ".join(cell.rjust(width) for cell, width in zip(line, widths)))
        if index == 0:
            lines.append("  ".join("-" * width for width in widths))
    if observed and any(row.get("wrapped") for row in rows):
        lines.append("* n exceeds the recorded tokens: the windows repeat rows, so woken is at most the recording's")
    return lines


if __name__ == "__main__":  # pragma: no cover - `python3 -m inspector.commands.sweep FILE.json`
    print(render_table(json.load(open(sys.argv[1]))))
