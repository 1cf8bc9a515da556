"""`moe-inspector run SESSION.toml`: run a session headless, write its results file, print a report.

Exit 0 when every step ran and every check held, 1 when a check failed, 2 for an invalid
session or environment (nothing is run and no results are written).
"""

from __future__ import annotations

import sys

from inspector.output_paths import check_output_path, distinct_outputs, write_output
from inspector.session import load_session
from inspector.session_report import FORMATS, format_for, render
from inspector.session_runner import dumps_results, results_path_for, run_session


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("run", help="run a session file headless: a report, a results file, an exit code")
    parser.add_argument("session", metavar="SESSION.toml", help="the session file (see sessions/ for examples)")
    parser.add_argument("--report", metavar="FILE", help="write the report to FILE instead of printing it")
    parser.add_argument("--format", choices=FORMATS, default=None,
                        help="report format: md (default), json, jsonl or csv; default from --report's extension")
    parser.add_argument("--results", metavar="FILE", help="results file (default: SESSION.results.jsonl beside it)")
    parser.add_argument("--device", default=None, help="override the session's [engine] device: auto, cpu or cuda")
    parser.add_argument("--trace", default=None, metavar="FILE.json",
                        help="also write a Chrome/Perfetto trace of every step's runs (engine.trace)")
    parser.set_defaults(run=run)


def progress_printer(label: str):
    """One line per finished step on stderr, so a report on stdout stays clean."""
    def progress(index: int, total: int, step, result: dict | None) -> None:
        if result is None:
            return
        check = result.get("check")
        outcome = "" if check is None else f" — check {'held' if check['held'] else 'FAILED'}: {check['detail']}"
        print(f"[{label}] step {index}/{total} {step.action}: {result['wall_s']:.2f} s{outcome}", file=sys.stderr)
    return progress


def check_outputs(session_path, results_path, report_path, results_label: str = "--results",
                  trace_path=None) -> None:
    """Before anything runs: no output is the session, and no two outputs are the same file."""
    protect = {"the session file being run": session_path}
    check_output_path(results_path, results_label, protect=protect)
    for path, option in ((report_path, "--report"), (trace_path, "--trace")):
        if path is not None:
            check_output_path(path, option, protect=protect)
    distinct_outputs({"--report": report_path, results_label: results_path, "--trace": trace_path})


def run(args) -> int:
    session = load_session(args.session)
    fmt = format_for(args.report, args.format)
    results_path = results_path_for(args.session, args.results)
    check_outputs(args.session, results_path, args.report, "--results" if args.results else "the results file",
                  args.trace)
    trace = None
    if args.trace:
        from engine.trace import Trace

        trace = Trace()
    outcome = run_session(session, args.session, args.device, progress_printer("run"), trace=trace)
    if trace is not None:
        size = trace.write(args.trace)
        print(f"trace: {args.trace} ({size / 1e6:.2f} MB)", file=sys.stderr)
    write_output(results_path, dumps_results(outcome.header, outcome.steps), "--results")
    report = render(outcome.header, outcome.steps, fmt, session.description)
    if args.report is not None:
        write_output(args.report, report, "--report")
        print(f"report: {args.report}", file=sys.stderr)
    else:
        sys.stdout.write(report)
    failed = outcome.failed_checks
    checks = sum(1 for step in outcome.steps if step["check"] is not None)
    print(f"[run] {session.name}: {len(outcome.steps)} steps on {outcome.header['device']}, "
          + (f"{len(failed)} of {checks} checks FAILED" if failed else
             f"all {checks} checks held" if checks else "no checks")
          + f"; results in {results_path}", file=sys.stderr)
    return outcome.exit_code
