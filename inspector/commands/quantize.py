"""`moe-inspector quantize MODEL --experts trellis:K=2,code=hyb --out DIR`: the model's experts in a trellis
code, written as a checkpoint directory every command loads with `--model DIR` (engine.trellis_job)."""

from __future__ import annotations

import math
import shlex
import sys
from pathlib import Path

from engine.errors import UserError
from engine.printable import printable
from engine.trellis_checkpoint import WriteError
from engine.trellis_job import parse_experts, partial_directory, quantize_model, write_shape_only
from inspector.commands.common import seed_argument
from inspector.commands.output import INTERRUPTED, add_format_arguments, output_format, print_json


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "quantize", help="code a model's experts in a trellis code (QTIP) and write a checkpoint directory")
    parser.add_argument("model", metavar="MODEL", help="a preset (tiny, demo, v4-shape) or a checkpoint directory")
    parser.add_argument("--experts", required=True, metavar="FORMAT",
                        help="trellis:K=<2|3|4>,code=<1mad|3inst|hyb> (V is the code's own: 1 for 1mad and "
                             "3inst, 2 for hyb)")
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="the directory to write; must not exist (a killed run resumes from .DIR.partial)")
    parser.add_argument("--seed", type=seed_argument, default=0, help="seed of the Hadamard signs (default 0)")
    parser.add_argument("--device", default="auto", help="where the search runs: auto (the GPU if there is one), "
                                                         "cpu or cuda")
    parser.add_argument("--weights", choices=("auto", "random"), default="auto",
                        help="auto: the model's own weights (a preset's shipped checkpoint); random: random weights "
                             "of its shape")
    parser.add_argument("--calibration", default=None, metavar="TEXT_FILE",
                        help="run this text through the model first and weigh each expert's error by its inputs' "
                             "Hessian (LDLQ); default: the plain squared error")
    parser.add_argument("--calibration-tokens", type=int, default=None, metavar="N",
                        help="tokens of the calibration text to run (default 8192)")
    parser.add_argument("--shape-only", action="store_true",
                        help="write config.json alone (shape, code, seeds): load it with --weights random for "
                             "random valid codes drawn on the device, e.g. a v4-shape trellis model to time")
    add_format_arguments(parser, ("text", "json"), "text")
    parser.set_defaults(run=run)


def run(args) -> int:
    fmt = output_format(args)
    code = parse_experts(args.experts)  # bad input fails before the model loads
    if args.calibration_tokens is not None and args.calibration is None:  # else silently a plain run
        raise UserError("--calibration-tokens without --calibration: give the calibration text file, or drop it")
    if args.shape_only and args.calibration is not None:
        raise UserError("--shape-only writes no weights, so --calibration would weigh nothing: drop one of them")
    args.calibration_tokens = 8192 if args.calibration_tokens is None else args.calibration_tokens
    if args.shape_only:
        out = write_shape_only(args.model, code, args.out, seed=args.seed)
        print(printable(f"wrote {out}/config.json: {code.describe()} experts of {args.model}'s shape, no weights; "
                        f"load it with --model {shlex.quote(str(out))} --weights random", limit=None))
        return 0
    if args.calibration_tokens < 1:
        raise UserError(f"--calibration-tokens {args.calibration_tokens}: give at least 1")
    try:
        result = quantize_model(args.model, code, args.out, seed=args.seed, device=args.device, weights=args.weights,
                                calibration=args.calibration, calibration_tokens=args.calibration_tokens)
    except KeyboardInterrupt:
        print(f"\nmoe-inspector: interrupted; {interrupted_note(args)}", file=sys.stderr)
        return INTERRUPTED
    except WriteError as error:  # a full disk: no output, the finished layers kept for the same command
        raise UserError(f"{error}; {args.out} was not written: {interrupted_note(args)}") from None
    if fmt == "json":
        print_json(result.to_json())
        return 0
    print_text(result)
    return 0


def interrupted_note(args) -> str:
    """Where a stopped run left its work and the command that resumes it (the finished layers are kept)."""
    partial = partial_directory(Path(args.out))
    if not partial.is_dir():
        return f"nothing was written ({partial} was not started)"
    command = ["moe-inspector", "quantize", args.model, "--experts", args.experts, "--out", args.out]
    if args.seed:
        command += ["--seed", str(args.seed)]
    if args.device != "auto":
        command += ["--device", args.device]
    if args.weights != "auto":
        command += ["--weights", args.weights]
    if args.calibration is not None:
        command += ["--calibration", args.calibration, "--calibration-tokens", str(args.calibration_tokens)]
    return printable(f"the finished layers are in {partial}; resume with `{shlex.join(command)}`, or remove it "
                     f"(rm -r {shlex.quote(str(partial))})", limit=None)


def print_text(result) -> None:
    """The written directory, then per matrix its error: the relative MSE (mse over the weights' mean square)
    and its square root, the relative RMS error, the measure `check-quant` gives of the experts' outputs."""
    kept = f"; kept layers {', '.join(map(str, result.resumed_layers))} of an earlier run" if result.resumed_layers else ""
    print(printable(f"wrote {result.out}: experts in {result.code.describe()}, {result.expert_bytes} bytes per expert "
                    f"against {result.bf16_expert_bytes} in bf16 ({result.bf16_expert_bytes / result.expert_bytes:.2f}x "
                    f"fewer: {16 * result.expert_bytes / result.bf16_expert_bytes:.2f} bits per weight with the row "
                    f"scales), {result.seconds:.1f} s{kept}", limit=None))
    print(f"{'matrix':<18} {'shape':<16} {'mse':>11} {'rel. mse':>9} {'rel. rms':>9} {'max |error|':>12}")
    for item in result.matrices:
        shape = "x".join(map(str, item["shape"]))
        relative = item["relative_mse"]
        print(f"{item['name']:<18} {shape:<16} {item['mse']:>11.3e} {relative:>9.4f} {math.sqrt(relative):>9.3f} "
              f"{item['max_abs_error']:>12.3e}")
    print(printable(f"load it with --model {shlex.quote(str(result.out))}", limit=None))
