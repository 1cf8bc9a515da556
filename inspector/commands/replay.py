"""`moe-inspector replay SESSION.toml`: re-run a session and diff it against its recorded results.

Generated tokens (temperature 0) must match exactly, and so must the launch counters and the
per-step per-layer decisions; timings are shown beside the recording, not compared. Exit 0 when
everything matches, 1 on a difference (the first is named: step, config, token index, both
tokens) or a failed check, 2 when there is nothing comparable (no results file: `run` first; a
different device, flags or session).
"""

from __future__ import annotations

import sys

from inspector.commands.run import progress_printer
from inspector.session import load_session
from inspector.session_report import render_replay
from inspector.session_runner import replay_session, results_path_for


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("replay", help="re-run a session and diff tokens, counters and decisions "
                                                  "against its recorded results")
    parser.add_argument("session", metavar="SESSION.toml", help="the session file")
    parser.add_argument("--results", metavar="FILE", help="recorded results (default: SESSION.results.jsonl beside it)")
    parser.add_argument("--device", default=None, help="device to re-run on (default: the recording's)")
    parser.set_defaults(run=run)


def run(args) -> int:
    session = load_session(args.session)
    results_path = results_path_for(args.session, args.results)
    outcome = replay_session(session, args.session, results_path, args.device, progress_printer("replay"))
    sys.stdout.write(render_replay(outcome.recorded_header, outcome.recorded, outcome.rerun.header,
                                   outcome.rerun.steps, outcome.differences))
    if outcome.differences:
        print(f"moe-inspector: replay differs from {results_path}: {outcome.differences[0]}"
              + (f" (and {len(outcome.differences) - 1} more)" if len(outcome.differences) > 1 else ""),
              file=sys.stderr)
    elif outcome.rerun.failed_checks:
        print(f"moe-inspector: replay matches {results_path}, but {len(outcome.rerun.failed_checks)} check(s) "
              f"failed", file=sys.stderr)
    return outcome.exit_code
