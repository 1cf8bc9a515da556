"""`moe-inspector check-quant --model DIR`: the magnitude check of a trellis MoE arm against the dequantized
reference and the original weights, beside a 1-ULP control (engine.quant_check), as a table or JSON.

Exit 0 when the arm sits on the dequantized reference at every token count; 1 when it sits elsewhere; 2 for
bad options, or when the quantization error is too small at these sizes to tell the references apart.
"""

from __future__ import annotations

import argparse
import sys

from engine.errors import UserError
from engine.printable import one_line
from inspector.commands.check_output import _json_safe
from inspector.commands.common import DEFAULT_MODEL, positive_int_list, seed_argument
from inspector.commands.output import add_format_arguments, output_format, print_json


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "check-quant", help="does a trellis arm compute the dequantized experts? and how far are they from bf16?",
        description="Run one MoE layer of a trellis checkpoint through a trellis arm, and compare it with the "
        "dequantized reference (it must sit on it) and with the source model's original weights (the "
        "quantization error), beside a 1-ULP control of the working dtype.")
    # not required here: `moe-inspector --model DIR check-quant` gives it before the command (run() refuses none)
    parser.add_argument("--model", default=argparse.SUPPRESS,
                        help="a trellis checkpoint directory (moe-inspector quantize); required")
    parser.add_argument("--layer", type=int, default=None,
                        help="the MoE layer (default: the first; a dense layer has no experts to check)")
    parser.add_argument("--tokens", default=None, help="comma-separated token counts (default 1,33 cpu / "
                                                       "1,64,2048 cuda)")
    parser.add_argument("--arm", default=None, help="the trellis arm under test (default: the first registered "
                                                    "trellis arm on this device, else rotated-torch)")
    parser.add_argument("--original", default=None, metavar="MODEL",
                        help="the unquantized model (default: the source config.json records)")
    parser.add_argument("--device", default=argparse.SUPPRESS, help="auto, cpu or cuda (default auto)")
    parser.add_argument("--seed", type=seed_argument, default=argparse.SUPPRESS, help="input seed (default 0)")
    add_format_arguments(parser, ("text", "json"), "text")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from engine.quant_check import check_quant  # torch only when run

    fmt = output_format(args)
    if args.model == DEFAULT_MODEL and "model" not in getattr(args, "given_globals", frozenset()):
        raise UserError("check-quant needs --model DIR: a trellis checkpoint directory, as `moe-inspector quantize "
                        "MODEL --experts trellis:K=2,code=hyb --out DIR` writes")
    tokens = positive_int_list(args.tokens, "--tokens") if args.tokens is not None else None
    if args.original is not None and not args.original.strip():
        raise UserError("--original is empty: name the model the experts were quantized from, or leave --original "
                        "out to use the one the checkpoint records")
    result = check_quant(args.model, layer=args.layer, tokens=tokens, arm=args.arm,
                         device=getattr(args, "device", "auto"), seed=getattr(args, "seed", 0),
                         original=args.original)
    if result.get("source_note"):  # a directory quantized before source fingerprints: said, then measured anyway
        print(f"moe-inspector: note: {one_line(result['source_note'])}", file=sys.stderr)
    if fmt == "json":
        print_json(_json_safe(result))
    else:
        print(format_result(result))
    if result["ok"]:
        return 0
    return 2 if not result["discriminates"] else 1


def format_result(result: dict) -> str:
    config = result["config"]
    lines = [f"check-quant  {config['model']}  layer {config['layer']}  {config['format']}  E={config['experts']} "
             f"k={config['top_k']} D={config['hidden']} F={config['intermediate']}  {config['dtype']}  "
             f"{config['device']}  seed {config['seed']}",
             f"arm: {config['arm']}", "",
             f"{'tokens':>6}  {'control (1 ULP)':>15}  {'vs dequantized':>15}  {'x control':>10}  {'vs original':>12}  "
             f"{'x control':>10}  {'quantization':>12}  verdict"]
    for row in result["rows"]:
        control, errors = row["control"], row["errors"]
        lines.append(f"{row['tokens']:>6}  {control:>15.3g}  {errors['dequantized']:>15.3g}  "
                     f"{errors['dequantized'] / control:>10.3g}  {errors['original']:>12.3g}  "
                     f"{errors['original'] / control:>10.3g}  {row['discrimination']['dequantized_vs_original']:>12.3g}"
                     f"  {row['verdict']}")
    lines.append("launches: " + (", ".join(f"{name} x{count}" for name, count in result["launches"].items()) or "none"))
    lines += ["", result["sentence"]]
    return "\n".join(lines)
