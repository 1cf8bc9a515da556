"""`moe-inspector check-attention --decode`: the decode check (engine.compare_decode) from the command line, and
its text form (F3 shows the same text).

Dims: the options given, else the model's (`--model`, or the global `--model` where given), else
engine.compare_decode.DEFAULTS for the device. Options of another check, or a model whose layers the decode
check does not take, are refused in one line (exit 2) before anything runs. Exit 0 when every run sits on `ok`,
1 when one sits elsewhere, 2 when a failure mode does not discriminate at these sizes.
"""

from __future__ import annotations

import argparse
import sys

from engine.errors import UserError
from inspector.commands.check_output import print_result
from inspector.commands.common import DEFAULT_MODEL

OTHER_CHECKS = {"block": "the sinks check", "pad": "the sinks check", "kv_lora_rank": "the latent (--mla) check",
                "rope_dim": "the latent (--mla) check", "nope_dim": "the latent (--mla) check",
                "v_dim": "the latent (--mla) check"}


def _refuse_other_options(args: argparse.Namespace) -> None:
    if not args.decode:
        given = next(name for name in ("batch", "sinks") if getattr(args, name) is not None)
        raise UserError(f"--{given} is an option of the decode check: add --decode, or drop it")
    if args.mla:
        raise UserError("--decode and --mla are two checks (the decode kernel, the latent kernel): give one")
    given = [name for name in OTHER_CHECKS if getattr(args, name) is not None]
    if given:
        raise UserError(f"--{given[0].replace('_', '-')} is an option of {OTHER_CHECKS[given[0]]}: drop it, or drop "
                        f"--decode")


def chosen_model(args: argparse.Namespace) -> str | None:
    """The model every check (sinks, decode, latent) takes its dims from: the subcommand's `--model`, else the global
    `--model` where it was given (`--model demo` too); None for neither. Both given and naming different models:
    UserError (which one was meant cannot be told)."""
    own = args.decode_model
    given = getattr(args, "given_globals", None)  # inspector.cli: the options given before the command
    outer = getattr(args, "model", DEFAULT_MODEL)
    if (outer == DEFAULT_MODEL) if given is None else ("model" not in given):
        outer = None
    if own is not None and outer is not None and not _same_model(own, outer):
        raise UserError(f"check-attention: --model {outer} before the command and --model {own} after it name two "
                        f"models: give one")
    return own or outer


def _same_model(a: str, b: str) -> bool:
    """The same preset, or two spellings of one directory (`dir`, `./dir/`)."""
    from pathlib import Path

    return a == b or (Path(a).is_dir() and Path(b).is_dir() and Path(a).resolve() == Path(b).resolve())


def decode_options(args: argparse.Namespace, device: str) -> dict:
    """check_decode's sizes and dims from the options, the model and the defaults (UserError for a model the
    check does not take)."""
    from engine import compare_decode
    from engine.model_source import model_config

    model_name = chosen_model(args)
    defaults = dict(compare_decode.DEFAULTS[device])
    max_seq_len = None
    if model_name is not None:
        model = model_config(model_name)
        declined = compare_decode.model_declines(model)
        if declined:
            raise UserError(f"check-attention --decode --model {model_name}: {declined}")
        defaults.update(compare_decode.model_dims(model))
        max_seq_len = model.max_seq_len
    options = {name: getattr(args, name) if getattr(args, name, None) is not None else default
               for name, default in defaults.items()}
    options["window"] = options["window"] or None  # --window 0: plain causal
    if args.seq_len is None:
        options["seq_len"] = compare_decode.default_seq_len(device, options["window"], max_seq_len)
        if options["seq_len"] > compare_decode.MAX_SEQ_LEN:  # the cache 2 W + 2 a --window asked for, not a --seq-len
            raise UserError(f"--window {options['window']}: the cache the check gives it (2 W + 2 = "
                            f"{options['seq_len']} keys) is more than {compare_decode.MAX_SEQ_LEN} keys per sequence; "
                            f"give a smaller --window, or --seq-len")
    return options


def run_decode(args: argparse.Namespace, device: str, fmt: str) -> int:
    from engine.compare_decode import DecodeCheckConfig, check_decode, check_request

    _refuse_other_options(args)
    options = decode_options(args, device)
    dtype = None if args.dtype == "auto" else args.dtype
    seed = getattr(args, "seed", 0)
    DecodeCheckConfig(**options, mode=args.mode, device=device, dtype=dtype or ("bf16" if device == "cuda" else "fp32"),
                      seed=seed)  # bad options: now, before anything runs
    check_request(options["seq_len"], options["batch"], options["heads"], options["kv_heads"], options["head_dim"],
                  device, "check-attention --decode")
    print(f"check-attention --decode: the decode kernel over {options['batch']} sequences in a cache of "
          f"{options['seq_len']} on {device}" + (" (the Triton interpreter: seconds)" if device == "cpu" else "")
          + " …", file=sys.stderr, flush=True)
    result = check_decode(**options, mode=args.mode, device=device, dtype=dtype, seed=seed)
    return print_result(result, fmt, format_decode_result)


def format_decode_result(result: dict) -> str:
    config, control = result["config"], result["control"]
    lines = [
        f"check-attention --decode  {config['mask']}  cache {config['seq_len']}  batch {config['batch']}  hd "
        f"{config['head_dim']}  heads {config['heads']}/{config['kv_heads']}  sinks "
        f"{'on' if config['sinks'] else 'off'}  {config['dtype']}  {config['device']}  mode {config['mode']}  "
        f"seed {config['seed']}",
        f"kernel: {config['kernel']} through the fused arm; positions {', '.join(map(str, config['positions']))} "
        f"(stale entries past each)",
        "",
        f"control: 1 {config['dtype']} ULP of the ok reference output = {control:.3g} (relative); a run sits on a "
        f"reference within {result['sits_on_multiple']:g} controls on every sequence",
        "",
        f"{'failure mode':<24}{'its reference vs ok':>20}  on sequence",
    ]
    for name, row in result["discrimination"]["modes"].items():
        lines.append(f"  {name:<22}{row['ratio']:>19.3g}x  {row['sequence']}"
                     + ("" if row["fires"] else "  DOES NOT DISCRIMINATE"))
    lines += ["", f"{'run':<30}{'splits':>7}  {'vs ok':>9}  verdict"]
    for run in result["runs"]:
        ok_error = run["errors"]["ok"] / control if control > 0 else 0.0
        lines.append(f"  {run['run']:<28}{run['splits']:>7}  {ok_error:>8.3g}x  {run['verdict']}"
                     + ("" if run["finite"] else "  (non-finite output)"))
    if not result["merged"]:
        lines.append("  (one key tile: the kernel never merges splits at this shape)")
    worst = result["worst"]
    lines += ["", f"worst: {worst['run']}, sequence {worst['sequence']} at position {worst['position']}, head "
                  f"{worst['head']}: {worst['controls']:.3g} controls of its row; sits on "
                  f"{', '.join(worst['sits_on']) or 'nothing'} there",
              "launches: " + (", ".join(f"{name} x{count}" for name, count in result["launches"].items()) or "none"),
              "", f"verdict: {result['verdict']}", result["sentence"]]
    return "\n".join(lines)
