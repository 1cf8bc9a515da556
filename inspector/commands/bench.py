"""`moe-inspector bench`: llama-bench-style pp/tg rows over the batched engine, refusing any row
that would be a lie (exit 2, no table). The harness lives in engine.bench; this module parses
options and prints. The progress bar goes to stderr, so stdout is the table (or JSON/CSV) only."""

from __future__ import annotations

import contextlib
import sys
import threading
from pathlib import Path

from engine import bench, limits
from engine import flags as flag_registry
from engine.config import PRESETS
from engine.errors import UserError
from engine.printable import printable
from engine.progress import Progress
from engine.runtime import Engine, model_config, resolve_device
from inspector.commands.common import positive_int_list, seed_argument
from inspector.commands.output import (EXTENSIONS, INTERRUPTED, add_format_arguments, dumps, output_format,
                                       stop_on_interrupt)

FORMATS = ("md", "json", "csv")
from inspector.output_paths import check_output_path, distinct_outputs, write_output


def _switch(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("on", "true", "1", "yes"):
        return True
    if lowered in ("off", "false", "0", "no"):
        return False
    raise UserError(f"--graphs {text!r}: use on or off")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench", help="llama-bench-style pp/tg rows with both clocks, launch counters and refusal of invalid rows")
    parser.add_argument("--model", default="demo",
                        help="preset name (tiny, demo, v4-shape; default demo) or a Hugging Face checkpoint directory")
    parser.add_argument("--weights", choices=("auto", "random"), default="auto",
                        help="a directory's weights: auto = its safetensors files, random = random weights of its "
                             "family and shape drawn on the device from config.json alone (presets always bench "
                             "random weights)")
    parser.add_argument("--device", default="auto", help="auto (the GPU if there is one), cpu or cuda")
    parser.add_argument("--seed", type=seed_argument, default=0, help="weight and prompt seed (default 0)")
    parser.add_argument("--pp", default="128,512,2048",
                        help="prompt lengths of the pp rows (default 128,512,2048; none or 0 for no pp rows)")
    parser.add_argument("--tg", default="128",
                        help="generated tokens of the tg rows (default 128; none or 0 for no tg rows)")
    parser.add_argument("--batch", default="1,8,32", help="sequences per row (default 1,8,32)")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per row, after one warm-up (default 5)")
    parser.add_argument("--tg-prompt", type=int, default=32, help="prompt tokens of each tg sequence (default 32)")
    parser.add_argument("--set", dest="set_flags", action="append", default=[], metavar="FLAG=VALUE",
                        help="set a flag, repeatable; `moe-inspector flags` lists them")
    add_format_arguments(parser, FORMATS, "md")
    parser.add_argument("--json-out", default=None, metavar="FILE", help="also write the JSON report to FILE")
    parser.add_argument("--profile", action="store_true",
                        help="per-kernel device time, calls, share and launches per step (torch.profiler, one extra "
                             "repetition per row); needs device activity")
    parser.add_argument("--graphs", default="on", help="CUDA graphs for decode steps on a GPU: on (default) or off")
    parser.add_argument("--gpu-weights", action="store_true",
                        help="draw random weights on the GPU (seconds, not minutes, at v4-shape width); timing only: "
                             "not the CPU-drawn weights generate/compare use, and the footer says so")
    parser.add_argument("--token-budget", type=int, default=None,
                        help="prompt tokens per prefill step over all sequences (default max(prefill_chunk, 2048))")
    parser.add_argument("--depth-floor", type=int, default=None,
                        help="generated tokens every sequence needs before a decode window opens "
                             "(default min(8, tg/4))")
    parser.add_argument("--trace", default=None, metavar="FILE.json",
                        help="also write a Chrome/Perfetto trace: every repetition's steps, layers and decisions; on "
                             "a GPU it runs the profiled repetition (as --profile) and attributes its kernels to "
                             "layers and arms")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar or checkpoint loading lines on stderr")
    from inspector.commands.routing import add_record_argument

    add_record_argument(parser, "each row's last timed repetition (FILE for one row, else FILE's name with each "
                                "row's, e.g. routing.tg128-b8.safetensors)")
    from inspector.commands.generate import add_ep_argument

    add_ep_argument(parser)
    parser.set_defaults(run=run)


class _Stopped(Exception):
    """Ctrl-C: the bench stops after its current repetition."""


class StoppingProgress(Progress):
    """The progress bar, which also ends the bench at the next repetition once `stop` is set."""

    def __init__(self, total: int, label: str, stop, show: bool) -> None:
        super().__init__(total, label)
        self.stop, self.show = stop, show

    def advance(self, steps: int = 1, note: str = "") -> None:
        if self.show:
            super().advance(steps, note)
        if self.stop.is_set():
            raise _Stopped


def run(args) -> int:
    """One device, or `--ep N` ranks (engine.ep_launch): every rank runs the same rows, rank 0 prints and writes."""
    from engine import ep_launch
    from inspector.commands.generate import expert_parallel_ranks

    ep = expert_parallel_ranks(args)
    if ep > 1 or ep_launch.under_torchrun():
        if args.profile:
            raise UserError("--profile with --ep: the profile of one rank's kernels is not attributed yet; drop "
                            "--profile (the rows say the exchange's share of each step)")
        _checked(args)  # bad options are refused here, before a rank is spawned
        return ep_launch.run(ep, run_rank, args, device=args.device)
    return run_on(args)


def run_rank(group, args) -> int:
    return run_on(args, group)


def _checked(args):
    """Every option checked before a weight is drawn: (format, flags, rows, config, directory?, device, graphs)."""
    fmt = output_format(args)
    if args.json_out:  # the JSON report, never under a name that says another format
        named = EXTENSIONS.get(Path(args.json_out).suffix.lower().lstrip("."))
        if named not in (None, "json"):
            raise UserError(f"--json-out {args.json_out}: the name says {named}, and this file gets the JSON report; "
                            "name it .json")
    from inspector.commands.routing import recording_flags

    resolved = recording_flags(args, flag_registry.resolve(args.set_flags))
    pp = positive_int_list(args.pp, "--pp", allow_none=True)
    tg = positive_int_list(args.tg, "--tg", allow_none=True)
    batches = positive_int_list(args.batch, "--batch", allow_none=True)
    if not batches:
        raise UserError("--batch: give at least one batch size, e.g. 1,8,32")
    if not pp and not tg:
        raise UserError("--pp and --tg are both empty: nothing to measure")
    if args.tg_prompt < 1:
        raise UserError(f"--tg-prompt must be >= 1, got {args.tg_prompt}")
    if args.depth_floor is not None and args.depth_floor < 1:
        raise UserError(f"--depth-floor must be >= 1, got {args.depth_floor}")
    if args.token_budget is not None and args.token_budget < resolved["prefill_chunk"]:
        raise UserError(f"--token-budget {args.token_budget} is below prefill_chunk={resolved['prefill_chunk']}: "
                        "raise it or lower the chunk with --set prefill_chunk=N")
    graphs = _switch(args.graphs)
    if args.json_out is not None:
        check_output_path(args.json_out, "--json-out")
    if args.trace:
        check_output_path(args.trace, "--trace")
    distinct_outputs({"--json-out": args.json_out, "--trace": args.trace, "--record-routing": args.record_routing})
    for values, option in ((pp, "--pp"), (tg, "--tg"), (batches, "--batch")):
        limits.check_list(values, option)
    specs = bench.row_specs(pp, tg, batches, args.tg_prompt)
    config = model_config(args.model)
    directory = args.model not in PRESETS
    device = resolve_device(args.device)
    if args.profile and device.type != "cuda":  # known now, not after every row is timed
        raise UserError("--profile: a CPU run records no device kernels in torch.profiler, so there would be no "
                        "shares to show; drop --profile, or run on a GPU")
    for spec in specs:  # before drawing weights: a bad row costs nothing
        needed = spec.prompt_len + spec.max_tokens
        if needed > config.max_seq_len:
            raise UserError(f"{spec.name} needs {needed} positions, more than the {config.name} context of "
                            f"{config.max_seq_len}: choose shorter --pp/--tg/--tg-prompt")
    limits.check_bench_request(config, device, Engine.dtype_for(device), specs, args.reps, "bench",
                               weights_loaded=False)
    if args.gpu_weights and device.type != "cuda":
        raise UserError("--gpu-weights draws weights on a GPU; this run is on the CPU: drop the option")
    return fmt, resolved, specs, config, directory, device, graphs


def run_on(args, group=None) -> int:
    from engine import ep_launch, expert_parallel

    fmt, resolved, specs, config, directory, device, graphs = _checked(args)
    if group is not None:
        device = resolve_device(ep_launch.rank_device(args.device, group.rank))
    rank0 = group is None or group.rank == 0
    weights, weights_note = None, ""
    if directory:
        engine = Engine.load(args.model, str(device) if group is not None else args.device, args.seed, args.weights,
                             progress=not args.no_progress)
        weights_note = engine.weights_source
    else:
        if args.gpu_weights:
            import torch

            weights = bench.device_random_weights(config, args.seed, device, torch.bfloat16)
            weights_note = (f"random, seed {args.seed}, drawn on the GPU by a seeded CUDA generator "
                            "(timing only: not the CPU-drawn weights of generate/compare)")
        engine = Engine(config, device, args.seed, weights=weights)
    if group is not None:
        expert_parallel.shard(engine, group)
    if not rank0:  # the same rows as rank 0, quietly: rank 0 prints and writes
        bench.run_bench(engine, resolved, specs, args.reps, graphs=graphs, depth_floor=args.depth_floor,
                        token_budget=args.token_budget, weights_note=weights_note)
        return 0
    trace = None
    if args.trace:
        from engine import trace as tracing

        trace = tracing.Trace()
        tracing.enable_nvtx(device)
    # a profiled repetition runs on rank 0 alone: never under --ep, where every rank must run the same steps
    profile = group is None and (args.profile or (trace is not None and device.type == "cuda"))
    rows: list = []  # each row as its timed repetitions finish: what Ctrl-C still prints
    cancelled = False
    with (stop_on_interrupt("stopping after the current repetition") if group is None
          else contextlib.nullcontext(threading.Event())) as stop:  # ranks stop together (Ctrl-C ends them all)
        progress = StoppingProgress(len(specs) * (args.reps + 1 + int(profile)), f"bench {config.name}", stop,
                                    show=not args.no_progress)
        try:
            report = bench.run_bench(engine, resolved, specs, args.reps, graphs=graphs, profile=profile,
                                     depth_floor=args.depth_floor, token_budget=args.token_budget,
                                     progress=progress, weights_note=weights_note, trace=trace, on_row=rows.append)
        except _Stopped:
            cancelled = True
            report = bench.Report(config.name, engine.device_label, rows,
                                  bench.footer(engine, resolved, bench.graphs_note(engine, graphs), weights_note), {})
        finally:
            progress.close()
    if trace is not None:
        data = trace.dumps()
        write_output(args.trace, data, "--trace")
        print(f"trace: {printable(str(args.trace))} ({len(data) / 1e6:.2f} MB)", file=sys.stderr)
    if args.json_out:
        write_output(args.json_out, bench.format_json(report), "--json-out")
    if args.record_routing:
        from inspector.commands.routing import row_path, write_recording

        for row in report.rows:
            write_recording(row_path(args.record_routing, row.spec.name, len(report.rows)), row.routing)
    if fmt == "json":
        payload = report.to_json()
        payload["cancelled"] = cancelled
        print(dumps(payload), end="")
    else:
        print({"md": bench.format_markdown, "csv": bench.format_csv}[fmt](report), end="")
    if cancelled:
        print(f"moe-inspector: bench cancelled: {len(rows)} of {len(specs)} rows measured", file=sys.stderr)
        return INTERRUPTED
    return 0
