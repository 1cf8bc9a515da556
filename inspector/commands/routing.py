"""`moe-inspector routing FILE`: what a recorded run routed, per MoE layer: each expert's load, the imbalance
along the expert axis (max/mean, coefficient of variation), the woken experts against the uniform prediction
and the hottest experts, over the whole run, its last step or a window of its last steps; `--csv` writes the
load of every (layer, expert). The TUI's routing screen shows the same summary.

Also the `--record-routing FILE` option of `generate` and `bench` (`add_record_argument`, `recording_flags`,
`write_recording`). Imports nothing heavy at module level (the CLI imports every command to build its parser).
"""

from __future__ import annotations

import sys
from pathlib import Path

from engine.errors import UserError
from engine.printable import printable


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "routing", help="a routing file's load per layer and expert, imbalance, woken experts vs uniform",
        description="Summarizes a routing file (written by generate/bench --record-routing, or the TUI's routing "
                    "screen): per MoE layer the max/mean load and the coefficient of variation along the expert "
                    "axis, woken experts per step and over the scope against the uniform-routing prediction, the "
                    "hottest experts, and a heat strip of every expert's load.")
    parser.add_argument("file", metavar="FILE", help="a routing file (.safetensors)")
    parser.add_argument("--scope", default="run", help="run (default), last (the last step) or window:N (the last "
                                                       "N steps)")
    parser.add_argument("--top", type=int, default=3, help="hottest experts named per layer (default 3)")
    parser.add_argument("--csv", default=None, metavar="OUT.csv",
                        help="write layer,expert,load,share,rank for every expert of every layer ('-': stdout)")
    parser.add_argument("--model", default=None,
                        help="check the file was recorded on this model's routing shape (MoE layers, experts, k)")
    parser.add_argument("--columns", type=int, default=64, help="cells of each layer's heat strip (default 64)")
    from inspector.commands.output import add_format_arguments

    add_format_arguments(parser, ("text", "json", "csv"), "text", "csv: layer,expert,load,share,rank on stdout")
    parser.set_defaults(run=run)


def load_checked(path: str, model: str | None = None, base: Path | None = None):
    """The recording in `path`, checked against `model`'s routing shape when one is given."""
    from engine import routing_file

    recording = routing_file.load(path)
    if model is not None:
        from engine.model_source import model_config

        routing_file.check_model(recording, model_config(model), path, model)
    return recording


def run(args) -> int:
    from engine import routing_stats
    from inspector.commands.output import output_format

    fmt = output_format(args)
    if fmt == "csv" and args.csv is None:
        args.csv = "-"

    if not 1 <= args.top <= 1024:
        raise UserError(f"--top {args.top}: name between 1 and 1024 experts per layer")
    if not 8 <= args.columns <= 1024:
        raise UserError(f"--columns {args.columns}: give 8 to 1024 cells")
    scope = routing_stats.parse_scope(args.scope)
    if args.csv not in (None, "-"):
        from inspector.output_paths import check_output_path

        check_output_path(args.csv, "--csv", protect={"the routing file being read": args.file})
    recording = load_checked(args.file, args.model)
    summary = routing_stats.summarize(recording, scope, args.top)
    if args.csv == "-":
        sys.stdout.write(routing_stats.loads_csv(summary))
        return 0
    if args.csv:
        write_text(args.csv, routing_stats.loads_csv(summary))
    if fmt == "json":
        import json

        payload = {"file": args.file, "header": recording.header, "truncated": recording.truncated,
                   "unrecorded": recording.unrecorded, "layers": list(recording.layers),
                   "recorded_steps": recording.n_steps, "recorded_tokens": recording.tokens,
                   **summary.to_json(), "csv": args.csv}
        print(json.dumps(payload, indent=1, default=str))
        return 0
    print(routing_stats.format_summary(summary, recording.header, args.columns))
    print(describe_limits(recording))
    if args.csv:
        print(f"loads written: {printable(str(args.csv))}")
    return 0


def describe_limits(recording) -> str:
    """Whether the recording is the whole run: the cap, and steps whose routing never reached the host."""
    notes = []
    if recording.truncated:
        cut = recording.truncated
        notes.append(f"stopped at the cap ({cut.get('cap_bytes', 0) / 2**20:.0f} MiB, routing_cap_mb) at step "
                     f"{cut.get('at_step')}: {cut.get('dropped_steps')} later steps ({cut.get('dropped_tokens')} "
                     f"tokens) not recorded")
    for first, steps, why in recording.unrecorded:
        notes.append(f"steps {first}..{first + steps - 1} not recorded: {why}")
    return "recording: " + ("; ".join(notes) if notes else f"the whole run ({recording.n_steps} steps, "
                                                             f"{recording.tokens} tokens)")


# --------------------------------------------------------------------------------------------------
# Writing files the user names
# --------------------------------------------------------------------------------------------------

def check_writable(path: str, option: str) -> None:
    """Before a run: `path` names a file this command may write (inspector.output_paths), so a long
    run does not end in a refusal."""
    from inspector.output_paths import check_output_path

    check_output_path(path, option)


def write_text(path: str, text: str, option: str = "--csv") -> None:
    """Write atomically (inspector.output_paths.write_output): the file is whole or as it was."""
    from inspector.output_paths import write_output

    write_output(Path(path).expanduser(), text, option)


# --------------------------------------------------------------------------------------------------
# --record-routing FILE (generate, bench)
# --------------------------------------------------------------------------------------------------

def add_record_argument(parser, what: str = "the run") -> None:
    parser.add_argument("--record-routing", dest="record_routing", default=None, metavar="FILE.safetensors",
                        help=f"record {what}'s top-k expert ids and weights per step and MoE layer into FILE (sets "
                             f"the flag record_routing=on; at most routing_cap_mb of host memory); "
                             f"`moe-inspector routing FILE` summarizes it")


def recording_flags(args, resolved):
    """`resolved` with record_routing on where --record-routing was given (its path checked first)."""
    from engine import flags as flag_registry

    if not getattr(args, "record_routing", None):
        return resolved
    check_writable(args.record_routing, "--record-routing")
    return resolved.with_overrides({"record_routing": True}, flag_registry.COMMAND_LINE)


def row_path(path: str, row: str, rows: int) -> str:
    """Where a bench row's routing goes: `path` itself for a single row, else the row's name before the suffix
    (routing.safetensors -> routing.tg128-b8.safetensors)."""
    if rows == 1:
        return path
    where = Path(path)
    slug = row.replace(" @ ", "-").replace(" ", "")
    return str(where.with_name(f"{where.stem}.{slug}{where.suffix or '.safetensors'}"))


def write_recording(path: str, recording, quiet: bool = False) -> dict:
    """Save a run's routing to `path`; a line on stderr (unless `quiet`); what was written, for --json."""
    from engine import routing_file

    if recording is None:
        raise UserError(f"--record-routing {path}: the run recorded no routing (record_routing was off)")
    routing_file.save(recording, Path(path).expanduser())
    size = Path(path).expanduser().stat().st_size
    written = {"path": path, "steps": recording.n_steps, "tokens": recording.tokens, "bytes": size,
               "truncated": recording.truncated}
    if not quiet:
        print(f"routing: {printable(str(path))} ({recording.n_steps} steps, {recording.tokens} tokens, "
              f"{size / 1024:.1f} KiB)"
              + (f"; stopped at the cap at step {recording.truncated['at_step']}" if recording.truncated else ""),
              file=sys.stderr)
    return written
