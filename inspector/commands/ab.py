"""`moe-inspector ab`: one workload (bench rows, a sweep, a session) under two sides, interleaved in rounds
in separate processes; per row each side's median and spread, B/A with a bootstrap interval and a verdict
(engine.ab, engine.ab_stats; the rule in docs/ab.md).

Exit codes: 0 every row compared; 1 `--fail-on-regression PCT` and a row slower beyond PCT; 2 bad input, a
side that fails (the report keeps what was measured) or a row refused for measuring different things.

Bad input is refused in one line before a tree is unpacked or a process starts (`check_options`): a number out
of its range (counts against engine.limits' ceilings, percents in percent), a blank value, an option the chosen
workload does not read (the workload options default to None, so that a given one can be told from a default),
and a flag that `--set` gives both sides while `--a` or `--b` sets it to another value.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from engine import limits
from engine.errors import UserError
from engine.printable import printable
from inspector.commands.common import seed_argument
from inspector.commands.output import EXTENSIONS, add_format_arguments, output_format

_DEFAULT_ROUNDS = 8

# The workloads that read each workload option: given to another, it would be dropped without a word.
WORKLOAD_OPTIONS = {
    "model": ("bench", "sweep"), "device": ("bench", "session"), "seed": ("bench", "sweep"),
    "pp": ("bench",), "tg": ("bench",), "batch": ("bench",), "reps": ("bench",), "tg_prompt": ("bench",),
    "gpu_weights": ("bench",), "weights": ("bench",), "graphs": ("bench",), "clock": ("bench",),
    "tokens": ("sweep",), "sweep_arms": ("sweep",), "sweep_timing": ("sweep",), "session": ("session",),
    "allow_different_tokens": ("bench", "session"),  # sweep rows carry no tokens
}
# Their values where not given (the parser's defaults are None: see check_options).
WORKLOAD_DEFAULTS = {"model": "demo", "seed": 0, "pp": "none", "tg": "32", "batch": "1", "reps": 3, "tg_prompt": 32,
                     "tokens": "1,32", "clock": "device", "gpu_weights": False, "allow_different_tokens": False}
# The flags a sweep A/B reads (engine.dispatch.decide's, in decided_arms; with --sweep-arms, tile_m alone): the
# sweep takes no --set, so any other flag of a side would change nothing it times.
SWEEP_FLAGS = ("moe_gate", "decode_floor", "moe_max_tokens", "grouped_variant", "tile_m")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "ab", help="A/B of a workload under two flag sets or source trees: interleaved rounds, ratio with a "
                   "bootstrap interval, a verdict per row",
        description="Runs the same workload under side A and side B in rounds (A B, B A, ...), each side in its "
        "own process from its own checkout, and reports per row each side's median, B/A with a 95 % bootstrap "
        "interval and a verdict: faster, slower, no change or insufficient data. Rows that did not measure the "
        "same thing on both sides are refused.")
    sides = parser.add_argument_group("sides")
    sides.add_argument("--a", action="append", default=[], metavar="FLAG=VALUE,...", help="side A's flag values")
    sides.add_argument("--b", action="append", default=[], metavar="FLAG=VALUE,...", help="side B's flag values")
    sides.add_argument("--set", dest="set_flags", action="append", default=[], metavar="FLAG=VALUE",
                       help="a flag value of both sides, repeatable")
    for name in ("a", "b"):
        group = sides.add_mutually_exclusive_group()
        group.add_argument(f"--{name}-tree", default=None, metavar="PATH",
                           help=f"side {name.upper()} runs from this source tree (default: this one)")
        group.add_argument(f"--{name}-rev", default=None, metavar="REV",
                           help=f"side {name.upper()} runs from this git revision (unpacked with git archive)")
    work = parser.add_argument_group("workload")
    work.add_argument("--workload", choices=("bench", "sweep", "session"), default="bench",
                      help="bench rows (default), a sweep (GPU), or a session file")
    work.add_argument("--model", default=None, help="bench/sweep model (default demo)")
    work.add_argument("--device", default=None, help="bench: auto (default), cpu or cuda; session: its override")
    work.add_argument("--seed", type=seed_argument, default=None, help="bench/sweep weight and prompt seed (default 0)")
    work.add_argument("--pp", default=None, help="bench: prompt lengths of pp rows (default none)")
    work.add_argument("--tg", default=None, help="bench: generated tokens of tg rows (default 32)")
    work.add_argument("--batch", default=None, help="bench: sequences per row (default 1)")
    work.add_argument("--reps", type=int, default=None, help="bench: timed repetitions per run (default 3)")
    work.add_argument("--tg-prompt", type=int, default=None, help="bench: prompt tokens of tg rows (default 32)")
    work.add_argument("--gpu-weights", action="store_true", default=None, help="bench: random weights drawn on the GPU")
    work.add_argument("--weights", choices=("auto", "random"), default=None,
                      help="bench: a checkpoint directory's weights (bench --weights; random: of its config.json's "
                           "shape, drawn on the device)")
    work.add_argument("--graphs", default=None, help="bench: CUDA graphs on or off (default the bench's)")
    work.add_argument("--tokens", default=None, help="sweep: token counts (default 1,32)")
    work.add_argument("--sweep-arms", default=None,
                      help="sweep: time these arms on both sides (default: the arm each side's flags decide per n)")
    work.add_argument("--sweep-timing", default=None, choices=("graph", "cold"),
                      help="sweep: its timing method (default the side's own)")
    work.add_argument("--session", default=None, metavar="FILE.toml", help="session: the session file")
    work.add_argument("--clock", choices=("device", "wall"), default=None,
                      help="bench rows: the device clock where a row has one (default), else the wall clock")
    stats = parser.add_argument_group("rounds and verdicts")
    stats.add_argument("--rounds", type=int, default=_DEFAULT_ROUNDS, help=f"timed rounds (default {_DEFAULT_ROUNDS}, at most {limits.MAX_AB_ROUNDS})")
    stats.add_argument("--warmup", type=int, default=1, help=f"discarded runs per side first (default 1, at most {limits.MAX_AB_WARMUP})")
    stats.add_argument("--fresh", action="store_true",
                       help="a fresh `python -m inspector` process for every run (default: one per side)")
    stats.add_argument("--tolerance", type=float, default=2.0, metavar="PCT",
                       help="the no-change band, ±PCT %% (default 2)")
    stats.add_argument("--min-rounds", type=int, default=5, help="rounds a verdict needs (default 5)")
    stats.add_argument("--resamples", type=int, default=2000, help=f"bootstrap resamples (default 2000, at most {limits.MAX_AB_RESAMPLES})")
    stats.add_argument("--stats-seed", type=seed_argument, default=0, help="the bootstrap's seed (default 0)")
    stats.add_argument("--allow-different-tokens", action="store_true", default=None,
                       help="compare rows whose tokens differ at temperature 0 (marked), instead of refusing them")
    stats.add_argument("--fail-on-regression", type=float, default=None, metavar="PCT",
                       help="exit 1 when a row is slower and B/A exceeds 1 + PCT/100")
    out = parser.add_argument_group("output")
    add_format_arguments(out, ("md", "json"), "md")
    out.add_argument("--report", default=None, metavar="FILE.md", help="also write the markdown report to FILE")
    out.add_argument("--json-out", default=None, metavar="FILE.json",
                     help="also write the JSON report to FILE (the TUI's A/B screen opens it)")
    out.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.set_defaults(run=run)


def _tree(args, name: str):
    from engine import ab

    tree, revision = getattr(args, f"{name}_tree"), getattr(args, f"{name}_rev")  # a blank one: check_options
    if tree is not None:
        return ab.tree_at(tree, option=f"--{name}-tree")
    if revision is not None:
        return ab.tree_of_revision(revision, option=f"--{name}-rev")
    return ab.current_tree()


def _sides(args):
    from engine import ab
    from engine import flags as registry
    from engine.comma_list import parse_flag_list

    base = registry.resolve(args.set_flags)
    common = registry.parse_assignments(list(args.set_flags))
    sides = {}
    for name, given in (("A", args.a), ("B", args.b)):  # --a given twice: one list (a flag twice is refused)
        option = f"--{name.lower()}"
        overrides = parse_flag_list(",".join(given), option)  # a blank --a: check_options
        for flag, value in overrides.items():  # the side's value would silently replace --set's on this side
            if flag in common and common[flag] != value:
                raise UserError(f"{flag}: --set {flag}={registry.format_value(flag, common[flag])} is both sides' "
                                f"value, and {option} sets {flag}={registry.format_value(flag, value)}: give "
                                f"{flag} in --a and --b, or in --set alone")
        flags = base.with_overrides(overrides, registry.COMMAND_LINE)
        merged = {**common, **overrides}  # equal where both give a flag
        assignments = [f"{key}={registry.format_value(key, value)}" for key, value in merged.items()]
        sides[name] = ab.Side(name, None, overrides, dict(flags.values), assignments)
    return sides


def _workload(args, sides):
    from engine import ab
    from inspector.commands.common import positive_int_list

    for dest, default in WORKLOAD_DEFAULTS.items():  # None: not given (check_options refused one given elsewhere)
        if getattr(args, dest, None) is None:
            setattr(args, dest, default)
    if args.workload in ("bench", "sweep"):  # each side runs in its own tree: a relative path is taken from here
        from engine.config import PRESETS
        from engine.model_source import model_config

        config = model_config(args.model)  # a model that does not load is refused here, in its own words
        if args.model not in PRESETS:
            args.model = str(Path(args.model).expanduser().resolve())
    if args.workload == "bench":
        pp = positive_int_list(args.pp, "--pp", allow_none=True)
        tg = positive_int_list(args.tg, "--tg", allow_none=True)
        if not pp and not tg:
            raise UserError("--pp and --tg are both empty: nothing to measure; give --tg 32 or --pp 512")
        positive_int_list(args.batch, "--batch")
        needed = max([n + 1 for n in pp] + [args.tg_prompt + n for n in tg])  # bench's own check, before any start
        if needed > config.max_seq_len:
            raise UserError(f"a row needs {needed} positions, more than the {config.name} context of "
                            f"{config.max_seq_len}: choose shorter --pp/--tg/--tg-prompt")
        arguments = ["--model", args.model, "--seed", str(args.seed), "--pp", args.pp, "--tg", args.tg,
                     "--batch", args.batch, "--reps", str(args.reps), "--tg-prompt", str(args.tg_prompt)]
        arguments += ["--device", args.device] if args.device else []
        arguments += ["--gpu-weights"] if args.gpu_weights else []
        arguments += ["--weights", args.weights] if args.weights else []
        arguments += ["--graphs", args.graphs] if args.graphs else []
        rows = [f"pp{n}" for n in args.pp.split(",") if args.pp.lower() not in ("none", "0", "")] + \
               [f"tg{n}" for n in args.tg.split(",") if args.tg.lower() not in ("none", "0", "")]
        describe = f"bench {', '.join(rows) or 'no rows'} at batch {args.batch} on {args.model}, {args.reps} reps per run"
        return ab.Workload("bench", describe, arguments, clock=args.clock)
    if args.workload == "sweep":
        from engine.sweep import parse_arms, parse_tokens

        tokens = parse_tokens(args.tokens)
        _refuse_flags_the_sweep_ignores(args, sides)
        arguments = ["--model", args.model, "--tokens", ",".join(map(str, tokens)), "--seed", str(args.seed)]
        arguments += ["--timing", args.sweep_timing] if args.sweep_timing else []
        if args.sweep_arms:
            arms = parse_arms(args.sweep_arms)
            arguments += ["--arms", ",".join(arms)]
            return ab.Workload("sweep", f"sweep of {', '.join(arms)} at n = {args.tokens} on {args.model}", arguments)
        decided = {name: decided_arms(args.model, tokens, side.flags) for name, side in sides.items()}
        describe = f"sweep on {args.model}: at each n the MoE arm each side's flags decide (n = {args.tokens})"
        return ab.Workload("sweep", describe, arguments, arms_by_tokens=decided)
    if not args.session:
        raise UserError("--workload session needs --session FILE.toml")
    session = Path(args.session)
    if not session.is_file():
        raise UserError(f"--session {args.session}: no such file; give a session TOML file")
    return ab.Workload("session", f"session {session.name}", ["--device", args.device] if args.device else [],
                       session=session.resolve())


def _refuse_flags_the_sweep_ignores(args, sides) -> None:
    """A flag given to a sweep A/B that no sweep run reads (SWEEP_FLAGS; with --sweep-arms, tile_m alone): UserError
    naming it, where the A/B would time the same thing under a label that says otherwise."""
    from engine import flags as registry

    read = ("tile_m",) if args.sweep_arms else SWEEP_FLAGS
    given = [("--set", registry.parse_assignments(list(args.set_flags)))]
    given += [(f"--{name.lower()}", side.overrides) for name, side in sides.items()]
    for option, values in given:
        for flag in values:
            if flag not in read:
                which = "with --sweep-arms, the sweep workload reads only tile_m" if args.sweep_arms else \
                    f"the sweep workload reads only {', '.join(read)}"
                raise UserError(f"{option} {flag}: {which} of the flags (the sweep takes no --set), so {flag} "
                                "would change nothing it times; drop it, or give --workload bench")


def decided_arms(model: str, tokens, flags: dict) -> dict[int, str]:
    """n -> the sweep arm a side's gate decides at n tokens (a sweep A/B of flags times each side's own arm)."""
    from engine import dispatch
    from engine.model_source import model_config

    if flags["moe_gate"] == "measured":
        raise UserError("a sweep A/B of flags decides each side's arm per n, and moe_gate=measured reads this GPU's "
                        "calibration: give a fixed policy (--set moe_gate=grouped, tile-fill, threshold:N, ...) or "
                        "--sweep-arms")
    config = model_config(model)  # a preset, or a checkpoint directory's config.json (no weight is read)
    arms = {}
    for n in tokens:
        decision = dispatch.decide(dispatch.GateInputs(
            n_tokens=n, k=config.top_k, n_experts=config.n_experts, tile_m=flags["tile_m"],
            policy=flags["moe_gate"], decode_floor=flags["decode_floor"], moe_max_tokens=flags["moe_max_tokens"],
            grouped_variant=flags["grouped_variant"], measured_crossover=None))
        if decision.arm == dispatch.REFERENCE:
            raise UserError(f"at n = {n} the flags {flags['moe_gate']} decide the reference arm, which the sweep "
                            "does not time; give another moe_gate or --sweep-arms")
        arms[n] = f"grouped_v{decision.variant}" if decision.arm == dispatch.GROUPED else decision.arm
    return arms


# A blank value would fall back to a default (`--a-tree ''`: this tree) or drop the option: what to give instead.
_BLANK_ADVICE = {
    "a_tree": "the root of a source tree, or drop it to run this tree",
    "b_tree": "the root of a source tree, or drop it to run this tree",
    "a_rev": "a commit, branch or tag, or drop it to run this tree",
    "b_rev": "a commit, branch or tag, or drop it to run this tree",
    "model": "a preset (tiny, demo, v4-shape) or a checkpoint directory, or drop it for demo",
    "device": "auto, cpu or cuda, or drop it", "graphs": "on or off, or drop it for the bench's default",
    "sweep_arms": "arms, comma separated, or drop it to time the arm each side's flags decide",
}  # a blank --session, --report or --json-out: inspector.cli refuses every blank path option before a command


def _option(dest: str) -> str:
    return f"--{dest.replace('_', '-')}"


def _number(value) -> str:
    """A number as the user would have typed it: digits of a huge int are counted, not printed."""
    if isinstance(value, int):
        return str(value) if abs(value) < 10**30 else f"a number of {len(str(abs(value)))} digits"
    short = f"{value:g}"
    return short if float(short) == value else repr(value)


def _check_count(args, dest: str, low: int, high: int, why: str) -> None:
    value = getattr(args, dest)
    if value < low:
        raise UserError(f"{_option(dest)} {_number(value)}: give at least {low} ({why})")
    limits.require_at_most(value, high, _option(dest), why)


def check_options(args) -> None:
    """Every option checked before a tree is unpacked or a process starts, each refusal one line naming the option
    and echoing its value: a blank value, an option the chosen workload does not read, a count outside its range
    (engine.limits' ceilings), a percent that is not one."""
    for dest, advice in _BLANK_ADVICE.items():
        value = getattr(args, dest, None)
        if value is not None and not value.strip():
            raise UserError(f"{_option(dest)} {printable(repr(value), 20)}: an empty value; give {advice}")
    for name in ("a", "b"):  # `--a ''` would leave the side without the overrides it was meant to get
        for part in getattr(args, name):
            if not part.strip():
                raise UserError(f"--{name} {printable(repr(part), 20)}: an empty flag list; give FLAG=VALUE,..., or "
                                f"drop --{name}")
    for dest, workloads in WORKLOAD_OPTIONS.items():
        value = getattr(args, dest, None)  # None, or False for a switch: not given (`--seed 0` is given)
        if value is not None and value is not False and args.workload not in workloads:
            chosen = f"the {args.workload} workload" + (" (the default)" if args.workload == "bench" else "")
            readers = " and ".join(workloads)
            fix = f"give --workload {workloads[0]}, or drop {_option(dest)}" if len(workloads) == 1 else \
                f"drop {_option(dest)}"
            raise UserError(f"{_option(dest)}: {chosen} does not read it (the {readers} workload"
                            f"{'s' if len(workloads) > 1 else ''} do{'es' if len(workloads) == 1 else ''}); {fix}")
    _check_count(args, "rounds", 1, limits.MAX_AB_ROUNDS, f"timed rounds, each running both sides once; the default "
                 f"is {_DEFAULT_ROUNDS}")
    _check_count(args, "warmup", 0, limits.MAX_AB_WARMUP, "discarded runs per side; the default is 1")
    _check_count(args, "min_rounds", 2, limits.MAX_AB_ROUNDS, "rounds a verdict needs; the default is 5")
    _check_count(args, "resamples", 100, limits.MAX_AB_RESAMPLES, "bootstrap resamples of each row; the default is "
                 "2000")
    if args.reps is not None:
        _check_count(args, "reps", 1, limits.MAX_REPS, "timed repetitions of each row per run; the default is 3")
    if args.tg_prompt is not None and args.tg_prompt < 1:  # its ceiling is the model's context (_workload)
        raise UserError(f"--tg-prompt {_number(args.tg_prompt)}: give at least 1 (prompt tokens of each tg row; the "
                        "default is 32)")
    if not (math.isfinite(args.tolerance) and 0 < args.tolerance < 100):
        raise UserError(f"--tolerance {_number(args.tolerance)}: give a percent above 0 and below 100, e.g. 2 for a "
                        "±2 % no-change band")
    if args.fail_on_regression is not None and not (math.isfinite(args.fail_on_regression)
                                                    and args.fail_on_regression >= 0):
        raise UserError(f"--fail-on-regression {_number(args.fail_on_regression)}: give a percent of 0 or more, e.g. "
                        "5 to exit 1 on a row more than 5 % slower")


def run(args) -> int:
    from engine import ab, ab_report, ab_stats

    fmt = output_format(args)  # --json with another --format: refused before any round runs
    check_options(args)
    for option, path, wanted in (("--report", args.report, "md"), ("--json-out", args.json_out, "json")):
        named = EXTENSIONS.get(Path(path).suffix.lower().lstrip(".")) if path else None
        if named not in (None, wanted):  # a file gets the format its name says, or none at all
            raise UserError(f"{option} {path}: the name says {named}, and this file gets the {wanted} report; "
                            f"name it .{wanted}")
    from inspector.output_paths import check_output_path, distinct_outputs, write_output

    protect = {"the session file this A/B runs": args.session} if args.session else {}
    for option, path in (("--report", args.report), ("--json-out", args.json_out)):
        if path:
            check_output_path(path, option, protect=protect)
    distinct_outputs({"--report": args.report, "--json-out": args.json_out})

    rule = ab_stats.Rule(tolerance=args.tolerance / 100, resamples=args.resamples, min_rounds=args.min_rounds,
                         seed=args.stats_seed)  # its ranges: check_options, in the options' own units
    sides = _sides(args)
    workload = _workload(args, sides)
    trees = []
    try:
        for name in ("A", "B"):
            sides[name].tree = _tree(args, name.lower())
            trees.append(sides[name].tree)
        progress = None if args.quiet else (lambda note: print(f"[ab] {note}", file=sys.stderr))
        outcome = ab.run_ab(sides, workload, args.rounds, args.warmup, rule, fresh=args.fresh,
                            allow_different_tokens=bool(args.allow_different_tokens), progress=progress)
    finally:
        for tree in trees:
            tree.cleanup()
    report = outcome.to_json()
    markdown = ab_report.format_markdown(report, args.fail_on_regression)
    if args.report:
        write_output(args.report, markdown, "--report")
    if args.json_out:
        write_output(args.json_out, ab_report.format_json(report), "--json-out")
    sys.stdout.write(markdown if fmt == "md" else ab_report.format_json(report))
    if report["failure"]:
        failure = report["failure"]
        raise UserError(f"side {failure['side']}: {failure['line']} (the rounds measured before it are in the report)")
    refused = [row for row in report["rows"] if row.get("refused")]
    if refused or not report["rows"]:
        raise UserError(f"row {refused[0]['row']} refused: {refused[0]['refused']}" if refused else
                        "the workload measured no rows")
    if args.fail_on_regression is not None:
        slower = [row for row in report["rows"] if ab_stats.regression_beyond(row, args.fail_on_regression)]
        if slower:
            print(f"moe-inspector: ab: {slower[0]['row']} is slower by {100 * (slower[0]['ratio'] - 1):.1f} %, beyond "
                  f"--fail-on-regression {args.fail_on_regression:g} %", file=sys.stderr)
            return 1
    return 0
