"""`moe-inspector replay SESSION.toml`: re-run a session and diff it against its recorded results.

Generated tokens (temperature 0) must match exactly, and so must the launch counters and the
per-step per-layer decisions; timings are shown beside the recording, not compared. Exit 0 when
everything matches, 1 on a difference (the first is named: step, config, token index, both
tokens) or a failed check, 2 when there is nothing comparable (no results file: `run` first; a
different device, flags or session), 130 after Ctrl-C (the steps re-run so far are compared).
Markdown by default; `--json` (or `--format json`) one object with `matches`, every difference,
a row per step and configuration, the checks and both headers (`matches` null where the
session has no steps: nothing was compared).
"""

from __future__ import annotations

import sys

from inspector.commands.output import INTERRUPTED, add_format_arguments, output_format, print_json, stop_on_interrupt
from inspector.commands.run import progress_printer
from inspector.session import load_session
from inspector.session_report import render_replay, replay_json
from inspector.session_runner import replay_session, results_path_for


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("replay", help="re-run a session and diff tokens, counters and decisions "
                                                  "against its recorded results")
    parser.add_argument("session", metavar="SESSION.toml", help="the session file")
    parser.add_argument("--results", metavar="FILE", help="recorded results (default: SESSION.results.jsonl beside it)")
    parser.add_argument("--device", default=None, help="device to re-run on (default: the recording's)")
    add_format_arguments(parser, ("md", "json"), "md")
    parser.set_defaults(run=run)


def run(args) -> int:
    fmt = output_format(args)
    session = load_session(args.session)
    results_path = results_path_for(args.session, args.results)
    with stop_on_interrupt("stopping after the current step") as stop:
        outcome = replay_session(session, args.session, results_path, args.device, progress_printer("replay"),
                                 cancel=stop)
    cancelled = outcome.rerun.cancelled
    pieces = (outcome.recorded_header, outcome.recorded, outcome.rerun.header, outcome.rerun.steps,
              outcome.differences)
    if fmt == "json":
        print_json(replay_json(*pieces, cancelled=cancelled))
    else:
        sys.stdout.write(render_replay(*pieces, cancelled=cancelled))
    if outcome.differences:
        print(f"moe-inspector: replay differs from {results_path}: {outcome.differences[0]}"
              + (f" (and {len(outcome.differences) - 1} more)" if len(outcome.differences) > 1 else ""),
              file=sys.stderr)
    elif outcome.rerun.failed_checks:
        print(f"moe-inspector: replay matches {results_path}, but {len(outcome.rerun.failed_checks)} check(s) "
              f"failed", file=sys.stderr)
    if cancelled:
        print(f"moe-inspector: replay cancelled after {len(outcome.rerun.steps)} of {len(outcome.recorded)} steps",
              file=sys.stderr)
        return INTERRUPTED
    return outcome.exit_code
