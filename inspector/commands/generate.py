"""`moe-inspector generate`: greedy decoding at temperature 0 with every decision recorded."""

from __future__ import annotations

from engine import flags as flag_registry
from engine.runtime import Engine, Generation
from inspector.commands.common import add_engine_arguments, add_json_argument, print_json, show_engagements


def add_generation_arguments(parser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--prompt", required=True, help="the prompt text")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens to generate (default 32)")
    parser.add_argument("--set", dest="set_flags", action="append", default=[], metavar="FLAG=VALUE",
                        help=f"set a flag, repeatable; flags: {', '.join(flag_registry.SPECS)}")
    add_json_argument(parser)
    parser.add_argument("--trace", default=None, metavar="FILE.json",
                        help="also write a Chrome/Perfetto trace of the steps, layers and decisions (engine.trace)")


def add_parser(subparsers) -> None:
    from inspector.commands.routing import add_record_argument

    parser = subparsers.add_parser("generate", help="run a prompt at temperature 0 and show which arm ran, and why")
    add_generation_arguments(parser)
    add_record_argument(parser)
    parser.set_defaults(run=run)


def print_generation(result: Generation, label: str = "") -> None:
    heading = f"[{label}] " if label else ""
    print(f"{heading}{result.model} ({result.weights}) on {result.device}; flags: {result.flags.describe()}")
    print(f"{heading}text: {result.text!r}")
    print(f"{'step':>4} {'phase':<8} {'n':>5} {'layer':>5}  {'decided':<9} {'executed':<10} {'woken':>11} "
          f"{'fill':>7} {'us':>9}  reason")
    for step in result.steps:
        for record in step["moe"]:
            woken = f"{record['woken_predicted']:.1f}/{record['woken_observed']}"
            decided = record["decided_arm"] + (f" v{record['variant']}" if record["variant"] is not None else "")
            us = "" if record["us"] is None else f"{record['us']:.1f}"
            print(f"{step['step']:>4} {step['phase']:<8} {step['n_tokens']:>5} {record['layer']:>5}  {decided:<9} "
                  f"{record['executed_arm']:<10} {woken:>11} {100 * record['fill']:>6.1f}% {us:>9}  {record['reason']}")
        for record in step["attention"]:
            print(f"{step['step']:>4} {step['phase']:<8} {step['n_tokens']:>5} {record['layer']:>5}  "
                  f"{record['decided_arm']:<9} {record['executed_arm']:<10} {'':>11} {'':>7} "
                  f"{'' if record['us'] is None else format(record['us'], '.1f'):>9}  attention: {record['reason']}")
    counts = ", ".join(f"{name} {count}" for name, count in result.counters["arms"].items() if count)
    print(f"{heading}counters: {counts}" + (f"; kernels: {result.counters['kernels']}" if result.counters["kernels"] else ""))


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
    size = trace.write(args.trace)
    print(f"trace: {args.trace} ({size / 1e6:.2f} MB)", file=sys.stderr)


def run(args) -> int:
    from inspector.commands.routing import recording_flags, write_recording

    resolved = recording_flags(args, flag_registry.resolve(args.set_flags))
    engine = Engine.load(args.model, args.device, args.seed, args.weights)
    if not args.json:
        show_engagements()
    clock = traced_clock(args, engine)
    result = engine.generate(args.prompt, args.max_tokens, resolved, on_step=clock)
    write_trace(args, [("generate: " + resolved.describe(), result, clock)])
    routing = write_recording(args.record_routing, result.routing) if args.record_routing else None
    if args.json:
        print_json({**result.to_json(), **({"routing_file": routing} if routing else {})})
    else:
        print_generation(result)
    return 0
