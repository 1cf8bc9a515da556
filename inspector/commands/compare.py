"""`moe-inspector compare`: the same prompt under configurations A and B, side by side.

A and B are two flag sets on one model, or with `--b-model` two models that share a tokenizer (B's flags on B's
model): `--b-model source` is the model a trellis checkpoint was quantized from, so `compare --model DIR
--b-model source` sets the 2-bit experts against the bf16 ones they code.

By default a summary that leads with where A and B part (the first divergent token, both
tokens, the logit relative error), then both texts and each side's arm table; `--records` adds
the per-layer rows, `--format jsonl|csv` gives them alone with a config column (A, B), `--json`
everything. Ctrl-C stops at the next token: what was generated is printed (B may not have run; a B cancelled
part-way is compared over the tokens it has), exit 130 and "cancelled": true in JSON.
"""

from __future__ import annotations

from engine import flags as flag_registry
from engine.comma_list import parse_flag_list
from engine.printable import printable
from engine.runtime import Engine
from engine.sidebyside import compare
from inspector import records
from inspector import b_model
from inspector.commands.common import show_engagements
from inspector.commands.generate import (add_generation_arguments, check_generation_size, check_trace_path,
                                         counters_line, generation_json, print_records,
                                         print_summary, progress_for, prompt_of, step_callback, token_words,
                                         traced_clock, write_trace)
from inspector.commands.output import INTERRUPTED, output_format, print_json, stop_on_interrupt


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("compare", help="run A and B flag sets on one prompt; first divergence, logit error")
    add_generation_arguments(parser)
    parser.add_argument("--a", action="append", default=[], metavar="FLAG=VALUE,...", help="configuration A overrides")
    parser.add_argument("--b", action="append", default=[], metavar="FLAG=VALUE,...", help="configuration B overrides")
    parser.add_argument("--b-model", default=None, metavar="MODEL",
                        help="B runs this model (a preset or checkpoint directory with A's tokenizer; --weights and "
                             "--seed apply to both); 'source': the model the trellis checkpoint --model was "
                             "quantized from, with its recorded weights and seed (./source for a directory so named)")
    parser.set_defaults(run=run)


def divergence_line(engine: Engine, engine_b: Engine, result_a, result_b, summary: dict | None) -> str:
    if summary is None:
        return "first divergence: not known (cancelled before B ran)"
    index, errors = summary["first_divergence"], summary["logit_rel_err"]
    if result_b.cancelled and index is None:
        return (f"first divergence: none in the {len(result_b.tokens)} tokens B generated before it was cancelled"
                + ("" if not errors else f"; logit rel err max {max(errors):.2e}"))
    worst = max(range(len(errors)), key=errors.__getitem__) if errors else None
    error = ("" if worst is None else
             "; logit rel err 0 at every generated token (bit-identical logits)" if errors[worst] == 0 else
             f"; logit rel err max {errors[worst]:.2e} at generated token {worst}")
    if index is None:
        return f"first divergence: none, A and B generate the same {len(result_a.tokens)} tokens{error}"
    return (f"first divergence: generated token {index}: A {token_words(engine, result_a.tokens, index)} vs "
            f"B {token_words(engine_b, result_b.tokens, index)}{error}")


def model_line(engine: Engine) -> str:
    return printable(f"{engine.config.name} ({engine.weights_source}) on {engine.device_label}", limit=None)


def model_json(engine: Engine, given: str | None) -> dict:
    """`given`: --b-model as written (B's side; `source` names the model the checkpoint records), else None."""
    return {"model": engine.model_spec, "given": given, "name": engine.config.name,
            "weights": engine.weights_source, "checkpoint": engine.checkpoint}


def run(args) -> int:
    fmt = output_format(args)
    prompt = prompt_of(args)
    base = flag_registry.resolve(args.set_flags)
    # --a given twice is one list (a flag given two values is refused); an --a "" adds nothing
    args.a, args.b = (",".join(part for part in side if part) for side in (args.a, args.b))
    flags_a = base.with_overrides(parse_flag_list(args.a, "--a"), flag_registry.COMMAND_LINE)
    flags_b = base.with_overrides(parse_flag_list(args.b, "--b"), flag_registry.COMMAND_LINE)
    check_trace_path(args)
    b_plan = b_model.plan(args)  # before A loads: a typo in B costs no load
    engine = Engine.load(args.model, args.device, args.seed, args.weights, text=True, progress=not args.no_progress)
    check_generation_size(engine, prompt, args.max_tokens)
    engine_b = b_model.load(b_plan, args, engine, prompt)
    if engine_b is not engine:
        check_generation_size(engine_b, prompt, args.max_tokens)
    if fmt == "text":
        show_engagements()
    names = engine.config.name + ("" if b_plan is None else f" vs {engine_b.config.name}")
    progress = progress_for(args, 2 * args.max_tokens, printable(f"compare {names}", limit=None))
    clock_a, clock_b = traced_clock(args, engine), traced_clock(args, engine_b)
    result_b = None
    try:
        with stop_on_interrupt("stopping at the next token") as stop:
            result_a = engine.generate(prompt, args.max_tokens, flags_a, cancel=stop,
                                       on_step=step_callback(clock_a, progress))
            if not result_a.cancelled:
                if clock_b is not None:
                    clock_b.__init__()  # B's first step starts when A's run ends
                result_b = engine_b.generate(prompt, args.max_tokens, flags_b, cancel=stop,
                                           on_step=step_callback(clock_b, progress))
    finally:
        if progress is not None:
            progress.close()
    write_trace(args, [(f"A: {args.a or 'no overrides'}", result_a, clock_a)]
                + ([(f"B: {args.b or 'no overrides'}", result_b, clock_b)] if result_b is not None else []))
    cancelled = result_a.cancelled or result_b is None or result_b.cancelled
    # B cancelled part-way: its tokens so far are compared with A's first as many
    summary = (None if result_b is None else
               compare(result_a, result_b, len(result_b.tokens) if result_b.cancelled else None))
    if fmt == "json":
        print_json({"a": generation_json(engine, result_a),
                    "b": None if result_b is None else generation_json(engine_b, result_b),
                    "models": {"a": model_json(engine, None), "b": model_json(engine_b, args.b_model)},
                    "first_divergence": None if summary is None else summary["first_divergence"],
                    "logit_rel_err": None if summary is None else summary["logit_rel_err"], "cancelled": cancelled})
    elif fmt in records.EXPORTS:
        rows = records.rows_of("A", result_a.steps, engine.device.type, engine.model_spec)
        if result_b is not None:
            rows += records.rows_of("B", result_b.steps, engine_b.device.type, engine_b.model_spec)
        print(records.EXPORTS[fmt](rows), end="")
    else:
        if b_plan is None:
            print(f"{model_line(engine)}; A: {args.a or 'no overrides'} · B: {args.b or 'no overrides'}")
        else:
            print(f"A: {model_line(engine)}, {args.a or 'no overrides'}\n"
                  f"B: {model_line(engine_b)}, {args.b or 'no overrides'}")
        print(divergence_line(engine, engine_b, result_a, result_b, summary))
        if summary is not None and summary["logit_rel_err"]:
            print("logit rel err per generated token: "
                  + " ".join(f"{value:.2e}" for value in summary["logit_rel_err"]))
        for label, side, result in (("A", engine, result_a), ("B", engine_b, result_b)):
            print()
            if result is None:
                print(f"{label}: not run (cancelled during A)")
                continue
            print_summary(side, result, args.max_tokens, label)
            if args.records:
                print()
                print_records(result, label)
        if result_b is not None:
            print(f"\ncounters: A {counters_line(result_a)} · B {counters_line(result_b)}")
    return INTERRUPTED if cancelled else 0
