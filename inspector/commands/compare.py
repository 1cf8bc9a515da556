"""`moe-inspector compare`: the same prompt under configurations A and B, side by side.

By default a summary that leads with where A and B part (the first divergent token, both
tokens, the logit relative error), then both texts and each side's arm table; `--records` adds
the per-layer rows, `--format jsonl|csv` gives them alone with a config column (A, B), `--json`
everything. Ctrl-C stops at the next token: what was generated is printed (B may not have run),
exit 130 and "cancelled": true in JSON.
"""

from __future__ import annotations

from engine import flags as flag_registry
from engine.comma_list import parse_flag_list
from engine.runtime import Engine
from engine.sidebyside import compare
from inspector import records
from inspector.commands.common import show_engagements
from inspector.commands.generate import (add_generation_arguments, check_generation_size, check_trace_path,
                                         counters_line, generation_json, print_records,
                                         print_summary, progress_for, prompt_of, step_callback, token_words,
                                         traced_clock, write_trace)
from inspector.commands.output import INTERRUPTED, output_format, print_json, stop_on_interrupt


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("compare", help="run A and B flag sets on one prompt; first divergence, logit error")
    add_generation_arguments(parser)
    parser.add_argument("--a", default="", metavar="FLAG=VALUE,...", help="configuration A overrides")
    parser.add_argument("--b", default="", metavar="FLAG=VALUE,...", help="configuration B overrides")
    parser.set_defaults(run=run)


def divergence_line(engine: Engine, result_a, result_b, summary: dict | None) -> str:
    if summary is None:
        return "first divergence: not known (cancelled before B finished)"
    index, errors = summary["first_divergence"], summary["logit_rel_err"]
    worst = max(range(len(errors)), key=errors.__getitem__) if errors else None
    error = ("" if worst is None else
             "; logit rel err 0 at every generated token (bit-identical logits)" if errors[worst] == 0 else
             f"; logit rel err max {errors[worst]:.2e} at generated token {worst}")
    if index is None:
        return f"first divergence: none, A and B generate the same {len(result_a.tokens)} tokens{error}"
    return (f"first divergence: generated token {index}: A {token_words(engine, result_a.tokens, index)} vs "
            f"B {token_words(engine, result_b.tokens, index)}{error}")


def run(args) -> int:
    fmt = output_format(args)
    prompt = prompt_of(args)
    base = flag_registry.resolve(args.set_flags)
    flags_a = base.with_overrides(parse_flag_list(args.a, "--a"), flag_registry.COMMAND_LINE)
    flags_b = base.with_overrides(parse_flag_list(args.b, "--b"), flag_registry.COMMAND_LINE)
    check_trace_path(args)
    engine = Engine.load(args.model, args.device, args.seed, args.weights, text=True)
    check_generation_size(engine, prompt, args.max_tokens)
    if fmt == "text":
        show_engagements()
    progress = progress_for(args, 2 * args.max_tokens, f"compare {engine.config.name}")
    clock_a, clock_b = traced_clock(args, engine), traced_clock(args, engine)
    result_b = None
    try:
        with stop_on_interrupt("stopping at the next token") as stop:
            result_a = engine.generate(prompt, args.max_tokens, flags_a, cancel=stop,
                                       on_step=step_callback(clock_a, progress))
            if not result_a.cancelled:
                if clock_b is not None:
                    clock_b.__init__()  # B's first step starts when A's run ends
                result_b = engine.generate(prompt, args.max_tokens, flags_b, cancel=stop,
                                           on_step=step_callback(clock_b, progress))
    finally:
        if progress is not None:
            progress.close()
    write_trace(args, [(f"A: {args.a or 'no overrides'}", result_a, clock_a)]
                + ([(f"B: {args.b or 'no overrides'}", result_b, clock_b)] if result_b is not None else []))
    cancelled = result_a.cancelled or result_b is None or result_b.cancelled
    summary = compare(result_a, result_b) if result_b is not None and not cancelled else None
    if fmt == "json":
        print_json({"a": generation_json(engine, result_a),
                    "b": None if result_b is None else generation_json(engine, result_b),
                    "first_divergence": None if summary is None else summary["first_divergence"],
                    "logit_rel_err": None if summary is None else summary["logit_rel_err"], "cancelled": cancelled})
    elif fmt in records.EXPORTS:
        rows = records.rows_of("A", result_a.steps, engine.device.type)
        if result_b is not None:
            rows += records.rows_of("B", result_b.steps, engine.device.type)
        print(records.EXPORTS[fmt](rows), end="")
    else:
        print(f"{engine.config.name} ({engine.weights_source}) on {engine.device_label}; "
              f"A: {args.a or 'no overrides'} · B: {args.b or 'no overrides'}")
        print(divergence_line(engine, result_a, result_b, summary))
        if summary is not None and summary["logit_rel_err"]:
            print("logit rel err per generated token: "
                  + " ".join(f"{value:.2e}" for value in summary["logit_rel_err"]))
        for label, result in (("A", result_a), ("B", result_b)):
            print()
            if result is None:
                print(f"{label}: not run (cancelled during A)")
                continue
            print_summary(engine, result, args.max_tokens, label)
            if args.records:
                print()
                print_records(result, label)
        if result_b is not None:
            print(f"\ncounters: A {counters_line(result_a)} · B {counters_line(result_b)}")
    return INTERRUPTED if cancelled else 0
