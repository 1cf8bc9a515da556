"""`moe-inspector compare`: the same prompt under configurations A and B, side by side."""

from __future__ import annotations

from engine import flags as flag_registry
from engine.runtime import Engine
from engine.sidebyside import compare
from inspector.commands.common import print_json, show_engagements
from inspector.commands.generate import (add_generation_arguments, check_generation_size, check_trace_path,
                                       print_generation, traced_clock, write_trace)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("compare", help="run A and B flag sets on one prompt; first divergence, logit error")
    add_generation_arguments(parser)
    parser.add_argument("--a", default="", metavar="FLAG=VALUE,...", help="configuration A overrides")
    parser.add_argument("--b", default="", metavar="FLAG=VALUE,...", help="configuration B overrides")
    parser.set_defaults(run=run)


def run(args) -> int:
    base = flag_registry.resolve(args.set_flags)
    flags_a = base.with_overrides(flag_registry.parse_assignments(args.a, "--a"), flag_registry.COMMAND_LINE)
    flags_b = base.with_overrides(flag_registry.parse_assignments(args.b, "--b"), flag_registry.COMMAND_LINE)
    check_trace_path(args)
    engine = Engine.load(args.model, args.device, args.seed, args.weights)
    check_generation_size(engine, args.prompt, args.max_tokens)
    if not args.json:
        show_engagements()
    clock_a, clock_b = traced_clock(args, engine), traced_clock(args, engine)
    result_a = engine.generate(args.prompt, args.max_tokens, flags_a, on_step=clock_a)
    if clock_b is not None:
        clock_b.__init__()  # B's first step starts when A's run ends
    result_b = engine.generate(args.prompt, args.max_tokens, flags_b, on_step=clock_b)
    write_trace(args, [(f"A: {args.a or 'no overrides'}", result_a, clock_a),
                       (f"B: {args.b or 'no overrides'}", result_b, clock_b)])
    summary = compare(result_a, result_b)
    if args.json:
        print_json({"a": result_a.to_json(), "b": result_b.to_json(), **summary})
        return 0
    print_generation(result_a, "A")
    print_generation(result_b, "B")
    divergence = summary["first_divergence"]
    print("first divergence: " + ("none (identical tokens)" if divergence is None else f"generated token {divergence}"))
    print("logit rel err per step: " + " ".join(f"{value:.2e}" for value in summary["logit_rel_err"]))
    return 0
