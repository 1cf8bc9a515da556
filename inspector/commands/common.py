"""Options and output helpers shared by the headless commands."""

from __future__ import annotations

import argparse
import logging
import sys

from engine import limits
from engine.errors import UserError
from engine.limits import MAX_SEED
from engine.printable import printable

DEFAULT_MODEL, DEFAULT_SEED = "demo", 0  # the TUI's and the engine commands' --model and --seed


def seed_argument(text: str) -> int:
    """The type of every command's --seed (and the TUI's): an integer from 0 to 2**63-1, the range a session
    records (`inspector.session`), refused at parsing (argparse: one line, exit 2) rather than after a run
    whose recording would then be refused."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{printable(repr(text), 40)}: expected an integer from 0 to {MAX_SEED}") \
            from None
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"{printable(text, 40)} is out of range: give an integer from 0 to "
                                         f"{MAX_SEED}")
    return value


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="preset name (tiny, demo, v4-shape; default demo) or a Hugging Face checkpoint directory")
    parser.add_argument("--device", default="auto", help="auto (the GPU if there is one), cpu or cuda")
    parser.add_argument("--seed", type=seed_argument, default=DEFAULT_SEED, help="weight seed of random presets (default 0)")
    parser.add_argument("--weights", choices=("auto", "random"), default="auto",
                        help="auto: a preset's shipped checkpoint where there is one (the trained demo), else "
                             "random from --seed; random: always random")


class _CurrentStderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at emit time (tests and the TUI swap it)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(sys.stderr, "isatty", lambda: False)():
            sys.stderr.write("\r\x1b[K")  # over a progress bar's line, which redraws on its next step
        super().emit(record)


def show_engagements() -> None:
    """Engagement lines (first time an arm runs per shape class) go to stderr, never into --json."""
    logger = logging.getLogger("moe_inspector.engine")
    if not logger.handlers:
        handler = _CurrentStderrHandler()
        handler.setFormatter(logging.Formatter("[engine] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def positive_int_list(text: str, option: str, allow_none: bool = False) -> list[int]:
    """Comma-separated integers >= 1; with `allow_none`, `none` (or 0, or nothing) means no values."""
    if allow_none and text.strip().lower() in ("none", "0", ""):
        return []
    alternative = ", or none" if allow_none else ""
    shown = printable(repr(text), 60)
    parts = [part.strip() for part in text.split(",")]
    if len(parts) > 1 and "" in parts:  # "1,,2" or "1,2,": an item left out is a typo, not a value to skip
        raise UserError(f"{option} {shown}: an empty item between commas; give comma-separated integers, e.g. "
                        f"1,8,64{alternative}")
    # ASCII digits only: int() would also take "2_0" (20) and other scripts' digits
    if not all(part.isascii() and part.lstrip("-").isdigit() for part in parts):
        raise UserError(f"{option} {shown}: expected comma-separated integers, e.g. 1,8,64{alternative}")
    values = [int(part) for part in parts]
    if any(value < 1 for value in values):
        raise UserError(f"{option} {shown}: every value must be an integer >= 1{alternative}")
    limits.check_list(values, option)
    return values
