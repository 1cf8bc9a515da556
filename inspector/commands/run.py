"""`moe-inspector run SESSION.toml`: run a session headless, write its results file, print a report.

The report's format is --format (or --json), else --report's extension (.md, .json, .jsonl,
.csv); a name that says no format, or another one than --format, is refused before anything
runs, never written in a format it does not name. Exit 0 when every step ran and every check
held, 1 when a check failed, 2 for an invalid session, environment or report name (nothing is
run and no results are written), 130 after Ctrl-C: the steps finished so far are reported, the
results file is left as it was.
"""

from __future__ import annotations

import sys

from engine.errors import UserError
from engine.printable import printable
from inspector.commands.output import INTERRUPTED, add_format_arguments, format_for_path, output_format, stop_on_interrupt
from inspector.output_paths import check_output_path, distinct_outputs, write_output
from inspector.session import load_session
from inspector.session_report import FORMATS, render
from inspector.session_runner import dumps_results, recorded_session, results_path_for, run_session


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("run", help="run a session file headless: a report, a results file, an exit code")
    parser.add_argument("session", metavar="SESSION.toml", help="the session file (see sessions/ for examples)")
    parser.add_argument("--report", metavar="FILE", help="write the report to FILE instead of printing it "
                                                         "(its format from the extension unless --format says)")
    add_format_arguments(parser, FORMATS, "md", "with --report: the extension's format")
    parser.add_argument("--results", metavar="FILE", help="results file (default: SESSION.results.jsonl beside it)")
    parser.add_argument("--device", default=None, help="override the session's [engine] device: auto, cpu or cuda")
    parser.add_argument("--trace", default=None, metavar="FILE.json",
                        help="also write a Chrome/Perfetto trace of every step's runs (engine.trace)")
    parser.set_defaults(run=run)


def progress_printer(label: str):
    """One line per finished step on stderr, so a report on stdout stays clean."""
    def progress(index: int, total: int, step, result: dict | None) -> None:
        if result is None:
            print(f"[{label}] step {index}/{total} {step.action} …", file=sys.stderr, flush=True)
            return
        check = result.get("check")
        outcome = "" if check is None else f" — check {'held' if check['held'] else 'FAILED'}: {check['detail']}"
        print(f"[{label}] step {index}/{total} {step.action}: {result['wall_s']:.2f} s{outcome}", file=sys.stderr)
    return progress


def report_format(args) -> str:
    """The format the report is written in; a --report name that would get another one is refused."""
    explicit = output_format(args) if (args.json or args.format) else None
    if args.report:
        return format_for_path(args.report, explicit, FORMATS, "--report")
    return explicit or args.default_format


def check_outputs(session_path, results_path, report_path, results_label: str = "--results",
                  trace_path=None) -> None:
    """Before anything runs: no output is the session, and no two outputs are the same file."""
    protect = {"the session file being run": session_path}
    check_output_path(results_path, results_label, protect=protect)
    for path, option in ((report_path, "--report"), (trace_path, "--trace")):
        if path is not None:
            check_output_path(path, option, protect=protect)
            recorded = recorded_session(path)
            if recorded is not None:  # another session's recording (or this one's) is not a report's to replace
                raise UserError(f"{option} {printable(str(path))}: that is the recorded results of session "
                                f"{printable(repr(recorded), 60)}, which a report would replace; pick another name")
    distinct_outputs({"--report": report_path, results_label: results_path, "--trace": trace_path})


def run(args) -> int:
    # Every output before the session is even read: a bad name costs nothing.
    results_path = results_path_for(args.session, args.results)
    check_outputs(args.session, results_path, args.report, "--results" if args.results else "the results file",
                  args.trace)
    report_format(args)
    session = load_session(args.session)
    recorded = recorded_session(results_path)
    if recorded is not None and recorded != session.name:  # re-recording is this session's results only
        raise UserError(f"{'--results' if args.results else 'the results file'} {printable(str(results_path))}: it "
                        f"records session {printable(repr(recorded), 60)}, not {printable(repr(session.name), 60)}; "
                        f"pick another --results, or remove that file first")
    from engine import ep_launch

    if session.engine.ep > 1 or ep_launch.under_torchrun():  # [engine] ep = N: every rank runs every step
        from engine.expert_parallel import check_divisible
        from inspector.session_runner import preflight

        device = args.device or session.engine.device
        model, _ = preflight(session, args.session, device)  # every step checked before a rank is spawned
        check_divisible(model.n_experts, session.engine.ep, session.engine.model, f"{args.session}: [engine] ep")
        return ep_launch.run(session.engine.ep, run_rank, args, device=device)
    return run_on(args)


def run_rank(group, args) -> int:
    return run_on(args, group)


def run_on(args, group=None) -> int:
    """The session's steps on this process (one rank of `group`, or one device); rank 0 alone writes the results
    file (atomically, after every step ran), the report and the trace."""
    results_path = results_path_for(args.session, args.results)
    fmt = report_format(args)
    session = load_session(args.session)
    trace = None
    if args.trace and (group is None or group.rank == 0):
        from engine.trace import Trace

        trace = Trace()
    if group is not None:  # the ranks run the same steps: Ctrl-C ends them all, no rank stops alone
        outcome = run_session(session, args.session, args.device,
                              progress_printer("run") if group.rank == 0 else None, trace=trace, group=group)
        if group.rank != 0:
            return outcome.exit_code
    else:
        with stop_on_interrupt("stopping after the current step") as stop:
            outcome = run_session(session, args.session, args.device, progress_printer("run"), trace=trace,
                                  cancel=stop)
    if trace is not None:
        data = trace.dumps()
        write_output(args.trace, data, "--trace")
        print(f"trace: {printable(str(args.trace))} ({len(data) / 1e6:.2f} MB)", file=sys.stderr)
    if not outcome.cancelled:
        write_output(results_path, dumps_results(outcome.header, outcome.steps), "--results")
    report = render(outcome.header, outcome.steps, fmt, session.description, cancelled=outcome.cancelled)
    if args.report:
        write_output(args.report, report, "--report")
        print(f"report: {printable(str(args.report))}", file=sys.stderr)
    else:
        sys.stdout.write(report)
    failed = outcome.failed_checks
    checks = sum(1 for step in outcome.steps if step["check"] is not None)
    ran = len(outcome.steps)
    done = (f"cancelled after {ran} of {len(session.steps)} step{'' if len(session.steps) == 1 else 's'}"
            if outcome.cancelled else f"{ran} step{'' if ran == 1 else 's'}")
    shown = printable(str(results_path))
    results = (f"results file not written (cancelled); {shown} is as it was" if outcome.cancelled
               else f"results in {shown}")
    print(f"[run] {session.name}: {done} on {outcome.header['device']}, "
          + (f"{len(failed)} of {checks} checks FAILED" if failed else
             ("the check held" if checks == 1 else f"all {checks} checks held") if checks else "no checks")
          + f"; {results}", file=sys.stderr)
    return INTERRUPTED if outcome.cancelled else outcome.exit_code
