"""`moe-inspector`: the TUI when no subcommand is given, else one headless command.

Exit codes: 0 ok, 1 a check failed, 2 bad input or an invalid environment/measurement, 130 stopped by
Ctrl-C (a long command prints what it had done first).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from engine.errors import UserError
from engine.printable import one_line
from inspector.commands import COMMAND_MODULES
from inspector.commands.common import DEFAULT_MODEL, DEFAULT_SEED


class _Parser(argparse.ArgumentParser):
    """argparse exits 2 on bad usage already; keep its message to one line plus the usage."""

    def error(self, message: str) -> None:  # noqa: D401 - argparse API
        self.print_usage(sys.stderr)
        print(f"moe-inspector: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def add_tui_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="preset name (tiny, demo, v4-shape; default demo) or a Hugging Face checkpoint directory")
    parser.add_argument("--device", default="auto", help="cuda, cpu or auto (the GPU if there is one)")
    parser.add_argument("--set", dest="set_flags", action="append", default=[], metavar="FLAG=VALUE",
                        help="set a flag (repeatable); see `moe-inspector flags`")
    parser.add_argument("--session", default=None, metavar="FILE", help="open (or start) this session file")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="weight seed for random presets (default 0)")
    parser.add_argument("--weights", choices=("auto", "random"), default="auto",
                        help="auto: the shipped or the directory's weights; random: random weights of the model's "
                             "shape (a directory's from its config.json, drawn on the device)")
    parser.add_argument("--sweep", default=None, metavar="FILE", help="sweep JSON for the tile-fill µs-per-arm plot")
    parser.add_argument("--prompt-file", default=None, metavar="FILE",
                        help="start with the prompt box holding FILE's text (newlines kept)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="moe-inspector",
        description="Inspect which MoE and attention kernels run, why, how full their tiles are and "
        "whether fused arms compute what their references compute. With no command: the TUI.",
    )
    add_tui_arguments(parser)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMAND_MODULES:
        importlib.import_module(f"inspector.commands.{name}").add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command is None:
            from inspector.tui import launch  # textual is imported only for the TUI

            return launch(args)
        return int(args.run(args))
    except UserError as error:  # one line, whatever the message carries from a file
        print(f"moe-inspector: error: {one_line(str(error))}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:  # a second Ctrl-C, or one where a command has nothing to print yet
        print("\nmoe-inspector: interrupted", file=sys.stderr)
        return 130
