"""`moe-inspector generate`: greedy decoding at temperature 0 with every decision recorded.

By default a summary: the text, and an arm table aggregated over layers and steps (what was
decided, what executed, how often, the µs and the reasons); `--records` adds the per-layer
rows, `--format jsonl|csv` gives them alone (the dispatch log, one row per layer per step), and
`--json` the whole generation. Progress goes to stderr; Ctrl-C stops at the next token and
prints what was generated (exit 130, "cancelled": true in JSON).
"""

from __future__ import annotations

import argparse

from engine import flags as flag_registry
from engine import limits
from engine.printable import printable
from engine.progress import Progress
from engine.runtime import Engine, Generation
from inspector import records
from inspector.commands.common import add_engine_arguments, show_engagements
from inspector.commands.output import INTERRUPTED, add_format_arguments, output_format, print_json, stop_on_interrupt
from inspector.describe import changed_flags, shared_reason_text
from inspector.output_paths import write_output
from inspector.prompt_file import read_prompt_file

FORMATS = ("text", "json", "jsonl", "csv")


def add_generation_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the prompt text")
    source.add_argument("--prompt-file", metavar="FILE",
                        help="read the prompt from FILE ('-': standard input): its text exactly, newlines kept")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens to generate (default 32)")
    parser.add_argument("--set", dest="set_flags", action="append", default=[], metavar="FLAG=VALUE",
                        help="set a flag, repeatable; `moe-inspector flags` lists them")
    parser.add_argument("--records", action="store_true",
                        help="text output: also one row per MoE and attention layer per step")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar or checkpoint loading lines on stderr")
    add_format_arguments(parser, FORMATS, "text", "jsonl and csv: the dispatch log, one row per layer per step")
    parser.add_argument("--trace", default=None, metavar="FILE.json",
                        help="also write a Chrome/Perfetto trace of the steps, layers and decisions (engine.trace)")


def add_ep_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ep", default="1", metavar="N",
                        help="expert parallelism: the experts sharded over N ranks, tokens exchanged all-to-all "
                             "(spawns the ranks itself: gloo on CPU, NCCL on GPUs; or run under torchrun); default 1")


def add_parser(subparsers) -> None:
    from inspector.commands.routing import add_record_argument

    parser = subparsers.add_parser("generate", help="run a prompt at temperature 0 and show which arm ran, and why")
    add_generation_arguments(parser)
    add_ep_argument(parser)
    add_record_argument(parser)
    parser.set_defaults(run=run)


def prompt_of(args: argparse.Namespace) -> str:
    return read_prompt_file(args.prompt_file) if args.prompt_file is not None else args.prompt


def ep_device(device: str, rank: int) -> str:
    from engine.ep_launch import rank_device

    return rank_device(device, rank)


def token_words(engine: Engine, tokens: list[int], index: int | None) -> str:
    if index is None:
        return ""
    if index >= len(tokens):
        return "(ended)"
    return f"'{printable(engine.tokenizer.decode([tokens[index]]), limit=None)}'"  # as the text line shows bytes


def print_records(result: Generation, label: str = "") -> None:
    """One row per MoE and attention layer per step."""
    heading = f"[{label}] " if label else ""
    print(f"{heading}{'step':>4} {'phase':<8} {'n':>5} {'layer':>5}  {'decided':<15} {'executed':<15} {'woken':>11} "
          f"{'fill':>12} {'us':>9}  reason")
    for step in result.steps:
        for record in step["moe"]:
            woken = f"{record['woken_predicted']:.1f}/{record['woken_observed']}"
            decided = record["decided_arm"] + (f" v{record['variant']}" if record["variant"] is not None else "")
            us = "" if record["us"] is None else f"{record['us']:.1f}"
            fill = records.fill_text(record["pairs_per_woken"], record["tile_m"])
            print(f"{heading}{step['step']:>4} {step['phase']:<8} {step['n_tokens']:>5} {record['layer']:>5}  "
                  f"{decided:<15} {record['executed_arm']:<15} {woken:>11} {fill:>12} {us:>9}  {record['reason']}"
                  + (f" · {shared_reason_text(record)}" if record.get("shared_path") else ""))
            if "ranks" in record:
                print(f"{heading}{'':>30}{rank_line(record)}")
        for record in step["attention"]:
            us = "" if record["us"] is None else f"{record['us']:.1f}"
            print(f"{heading}{step['step']:>4} {step['phase']:<8} {step['n_tokens']:>5} {record['layer']:>5}  "
                  f"{record['decided_arm']:<15} {record['executed_arm']:<15} {'':>11} {'':>12} {us:>9}  "
                  f"attention: {record['reason']}")


def _kilobytes(value: int) -> str:
    return f"{value / 1e3:.1f} kB"


def rank_line(record: dict) -> str:
    """An expert-parallel MoE record's ranks side by side: each rank's arm, rows over its experts, woken,
    fill, µs and exchange; then the imbalance of routed pairs (max/mean)."""
    cells = []
    for view in record["ranks"]:
        us = "" if view.get("us") is None else f" {view['us']:.0f}us"
        exchange = view["exchange"]
        moved = f" a2a {_kilobytes(exchange['bytes'])}" + ("" if exchange.get("us") is None
                                                           else f" {exchange['us']:.0f}us")
        cells.append(f"r{view['rank']} {view['executed_arm']} {view['rows']} rows/{view['local_experts']} "
                     f"woken {view['woken_observed']} fill {100 * view['fill']:.1f}%{us}{moved}")
    imbalance = record.get("imbalance")
    return " | ".join(cells) + f" ; imbalance {'n/a' if imbalance is None else f'{imbalance:.2f}'}"


def ep_summary(steps: list[dict]) -> str:
    """One line for an expert-parallel run: ranks, experts per rank, the exchange's bytes and µs per step beside
    the MoE layers' µs, and the imbalance across ranks (mean and worst over layers and steps)."""
    records = [record for step in steps for record in step["moe"] if "ranks" in record]
    if not records:
        return "expert parallel: no MoE layer ran"
    ep = records[0]["ep"]
    exchange_bytes = sum(record["ep"]["exchange"]["bytes"] for record in records) / len(steps)
    times = [record["ep"]["exchange"]["us"] for record in records]
    moe_us = [record["us"] for record in records]
    spent = ""
    if all(value is not None for value in times + moe_us) and sum(times) + sum(moe_us):
        spent = (f", {sum(times) / len(steps):.0f} µs per step: {100 * sum(times) / (sum(times) + sum(moe_us)):.1f}% "
                 f"of its MoE layers' µs (exchange + arms)")
    ratios = [record["imbalance"] for record in records if record["imbalance"] is not None]
    balance = (f"; imbalance of routed pairs (max/mean over ranks) mean {sum(ratios) / len(ratios):.2f}, "
               f"worst {max(ratios):.2f}" if ratios else "")
    return (f"expert parallel: {ep['ranks']} ranks ({ep['backend']}), {ep['local_experts']} of {ep['experts']} "
            f"experts each; rank 0 exchanged {_kilobytes(exchange_bytes)} per step{spent}{balance}")


def counters_line(result: Generation) -> str:
    counts = ", ".join(f"{name} {count}" for name, count in result.counters["arms"].items() if count)
    kernels = result.counters["kernels"]
    return counts + (f"; Triton kernels: {', '.join(f'{k} {v}' for k, v in kernels.items())}" if kernels else "")


def print_summary(engine: Engine, result: Generation, max_tokens: int, label: str = "") -> None:
    """The text, how much was generated, the arm table and the counters of one generation."""
    side = f"{label}: " if label else ""
    done = (f"{len(result.tokens)} of {max_tokens} tokens (cancelled)" if result.cancelled
            else f"{len(result.tokens)} tokens")
    print(f"{side}flags: {changed_flags(result.flags)}")
    print(f"{side}prompt {len(result.prompt_tokens)} tokens, generated {done}")
    print(f"{side}text: '{printable(result.text, limit=None)}'")  # \xNN for bytes outside UTF-8, as the TUI shows them
    table = records.arm_table(records.rows_of(label or "", result.steps, engine.device.type))
    print(f"\n{side}arms over {engine.config.n_layers} layers x {len(result.steps)} steps:")
    print(records.format_arm_table(table))
    print(f"{side}counters: {counters_line(result)}")


def generation_json(engine: Engine, result: Generation) -> dict:
    payload = result.to_json()
    payload["arm_table"] = records.arm_table(records.rows_of("", result.steps, engine.device.type))
    return payload


def progress_for(args: argparse.Namespace, total: int, label: str) -> Progress | None:
    return None if args.no_progress else Progress(total, label)


def traced_clock(args, engine):
    """A StepClock when --trace was given (and NVTX ranges on a GPU), else None."""
    if not getattr(args, "trace", None):
        return None
    from engine import trace

    trace.enable_nvtx(engine.device)
    return trace.StepClock()


def write_trace(args, runs) -> None:
    """The --trace file of (configuration, Generation, StepClock) runs; its size on stderr."""
    if not getattr(args, "trace", None):
        return
    import sys

    from engine.trace import Trace

    trace = Trace()
    for configuration, result, clock in runs:
        trace.add_run(configuration, f"{result.model}: {len(result.tokens)} tokens", clock.stamped(result.steps))
    data = trace.dumps()
    write_output(args.trace, data, "--trace")
    print(f"trace: {printable(str(args.trace))} ({len(data) / 1e6:.2f} MB)", file=sys.stderr)


def step_callback(clock, progress: Progress | None):
    """Engine.generate's on_step: the trace's clock and the progress bar, each when there is one."""
    if progress is None:
        return clock

    def on_step(record: dict, token: int) -> None:
        if clock is not None:
            clock(record, token)
        progress.advance()
    return on_step


def check_generation_size(engine: Engine, prompt: str, max_tokens: int, sequences: int = 1) -> None:
    """Before generating: the prompt fits the context, and the cache fits in memory (a checkpoint's
    context can be millions of positions)."""
    prompt_tokens = engine.encode_prompt(prompt)
    engine.check_length(prompt_tokens, max_tokens)
    limits.check_generation_request(engine.config, engine.device, engine.dtype, len(prompt_tokens) + max_tokens,
                                    sequences, "generate")


def check_trace_path(args) -> None:
    """--trace (and --record-routing, whose own check is recording_flags'): writable, and not one file."""
    from inspector.output_paths import check_output_path, distinct_outputs

    if getattr(args, "trace", None):
        check_output_path(args.trace, "--trace")
    distinct_outputs({"--trace": getattr(args, "trace", None), "--record-routing": getattr(args, "record_routing", None)})


def expert_parallel_ranks(args) -> int:
    """--ep N, validated against the model before a rank is spawned: N divides its experts."""
    from engine import ep_launch, expert_parallel
    from engine.model_source import model_config

    ep = expert_parallel.parse_ep(getattr(args, "ep", "1"))
    if ep > 1 or ep_launch.under_torchrun():
        expert_parallel.check_divisible(model_config(args.model).n_experts, ep, args.model)
    return ep


def run(args) -> int:
    from engine import ep_launch

    ep = expert_parallel_ranks(args)
    if ep > 1 or ep_launch.under_torchrun():
        args.prompt, args.prompt_file = prompt_of(args), None  # read once, here: standard input is not the ranks'
        output_format(args)  # bad options are refused here, before a rank is spawned
        flag_registry.resolve(args.set_flags)
        check_trace_path(args)
        return ep_launch.run(ep, run_rank, args, device=args.device)
    return run_on(args)


def run_rank(group, args) -> int:
    """One rank of `generate --ep N`: every rank generates; rank 0 alone prints and writes."""
    return run_on(args, group)


def run_on(args, group=None) -> int:
    from engine import expert_parallel
    from inspector.commands.routing import recording_flags, write_recording

    fmt = output_format(args)
    prompt = prompt_of(args)
    resolved = recording_flags(args, flag_registry.resolve(args.set_flags))
    check_trace_path(args)
    engine = Engine.load(args.model, args.device if group is None else ep_device(args.device, group.rank),
                         args.seed, args.weights, text=True, progress=not args.no_progress)
    if group is not None:
        expert_parallel.shard(engine, group)
    check_generation_size(engine, prompt, args.max_tokens)  # before the progress bar starts
    if group is not None and group.rank != 0:  # the same steps as rank 0, quietly; rank 0 gathers the records
        engine.generate(prompt, args.max_tokens, resolved)
        return 0
    if fmt == "text":
        show_engagements()
        print(printable(f"{engine.config.name} ({engine.weights_source}) on {engine.device_label}", limit=None)
              + (f", expert parallel over {group.describe()}" if group is not None else ""))
    clock = traced_clock(args, engine)
    progress = progress_for(args, args.max_tokens, f"generate {engine.config.name}")
    try:
        if group is not None:  # every rank must run the same steps: Ctrl-C stops the ranks, not one of them
            result = engine.generate(prompt, args.max_tokens, resolved, on_step=step_callback(clock, progress))
        else:
            with stop_on_interrupt("stopping at the next token") as stop:
                result = engine.generate(prompt, args.max_tokens, resolved, cancel=stop,
                                         on_step=step_callback(clock, progress))
    finally:
        if progress is not None:
            progress.close()
    write_trace(args, [("generate: " + resolved.describe(), result, clock)])
    routing = write_recording(args.record_routing, result.routing) if args.record_routing else None
    if fmt == "json":
        print_json({**generation_json(engine, result), **({"routing_file": routing} if routing else {})})
    elif fmt in records.EXPORTS:
        print(records.EXPORTS[fmt](records.rows_of("", result.steps, engine.device.type, engine.model_spec)), end="")
    else:
        print_summary(engine, result, args.max_tokens)
        if group is not None:
            print(ep_summary(result.steps))
        if args.records:
            print()
            print_records(result)
    return INTERRUPTED if result.cancelled else 0
