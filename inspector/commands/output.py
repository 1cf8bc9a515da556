"""What every headless command shares about its output: `--format` with `--json` as its shorthand,
the format an output file's name asks for (written, or refused: never silently another), strict
JSON, and Ctrl-C that stops a long command where it stands and prints what it has.

Ctrl-C: the first one sets an event the command's loop reads (the engine stops at its next
step, a session after its current step, a bench after its current repetition), and the command
prints what was done with "cancelled": true in JSON, exiting 130; a second Ctrl-C stops at once.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

from engine.errors import UserError

INTERRUPTED = 130  # the shell's code for a process stopped by SIGINT

# File name endings and the format each names.
EXTENSIONS = {"md": "md", "markdown": "md", "json": "json", "jsonl": "jsonl", "csv": "csv"}
# Endings of files this tool reads but never writes as output: --format does not make such a name a report's
# (`run s.toml --report other.toml --format md` would put markdown over another session).
INPUT_EXTENSIONS = {"toml": "a session (TOML)", "safetensors": "weights (safetensors)", "py": "Python source"}


def add_format_arguments(parser: argparse.ArgumentParser, formats: tuple[str, ...], default: str,
                         about: str = "") -> None:
    """`--format` (one of `formats`, default `default`) and `--json`, its shorthand for `--format json`."""
    listed = ", ".join(formats)
    parser.add_argument("--format", choices=formats, default=None,
                        help=f"output format: {listed} (default {default}){'; ' + about if about else ''}")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout: --format json")
    parser.set_defaults(default_format=default)


def output_format(args: argparse.Namespace) -> str:
    """The format asked for: --format, or json with --json, else the command's default."""
    if args.json and args.format not in (None, "json"):
        raise UserError(f"--json and --format {args.format} ask for two formats: give one of them")
    return "json" if args.json else (args.format or args.default_format)


def format_for_path(path: str, explicit: str | None, allowed: tuple[str, ...], option: str,
                    alternative: str = ", or give --format") -> str:
    """The format a file named `path` gets: its extension's, or `explicit` (--format). A name that says
    another format than --format, or an ending no format has without --format, is refused."""
    suffix = Path(path).suffix.lower().lstrip(".")
    named = EXTENSIONS.get(suffix)
    endings = ", ".join(f".{ending}" for ending, fmt in EXTENSIONS.items() if fmt in allowed)
    if explicit is not None:
        if suffix in INPUT_EXTENSIONS:
            raise UserError(f"{option} {path}: the name says {INPUT_EXTENSIONS[suffix]}, which this command does not "
                            f"write; end the name in .{explicit}")
        if named is not None and named != explicit:
            raise UserError(f"{option} {path}: the name says {named} and --format says {explicit}; rename the file "
                            f"or drop --format")
        return explicit
    if named is None or named not in allowed:
        shown = f"'.{suffix}'" if suffix else "no extension"
        raise UserError(f"{option} {path}: {shown} names no format this command writes; end the name in "
                        f"{endings}{alternative}")
    return named


def strict(value: Any) -> Any:
    """JSON values only: non-finite floats become strings ("NaN", "+inf", "-inf"), the rest str()."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("+inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(key): strict(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(item) for item in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "tolist"):  # tensors and numpy values
        return strict(value.tolist())
    return str(value)


def dumps(payload: Any) -> str:
    return json.dumps(strict(payload), indent=2, ensure_ascii=False) + "\n"


def print_json(payload: Any) -> None:
    sys.stdout.write(dumps(payload))


@contextlib.contextmanager
def stop_on_interrupt(what: str) -> Iterator[threading.Event]:
    """While inside: the first Ctrl-C sets the yielded event and says `what` happens next ("stopping at the
    next token"); the second raises KeyboardInterrupt. Outside the main thread there is no signal to take."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def interrupted(signum, frame) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()
        print(f"\nmoe-inspector: {what}; Ctrl-C again stops at once", file=sys.stderr, flush=True)

    previous = signal.signal(signal.SIGINT, interrupted)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)
