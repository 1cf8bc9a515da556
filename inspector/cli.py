"""`moe-inspector`: the TUI when no subcommand is given, else one headless command.

Exit codes: 0 ok, 1 a check failed, 2 bad input or an invalid environment/measurement, 130 stopped by
Ctrl-C (a long command prints what it had done first).
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import re
import sys

from engine.errors import UserError
from engine.printable import one_line, path_error, printable
from inspector.commands import COMMAND_MODULES
from inspector.commands.common import DEFAULT_MODEL, DEFAULT_SEED, seed_argument


class _Unset(list):
    """A value nobody gave: the parser's options start as these, so what the command line set can be told from a
    default. A list, so an append action (--set) extends a copy of it."""


def _unset(value) -> bool:
    return isinstance(value, _Unset) and not value


def _given(parser: argparse.ArgumentParser, arg_strings: list[str]) -> set[str]:
    """The dests `arg_strings` set explicitly on `parser` (parsed again over a namespace of _Unset: no defaults)."""
    probe = argparse.Namespace(**{action.dest: _Unset() for action in parser._actions
                                  if action.dest is not argparse.SUPPRESS})
    parser.parse_known_args(list(arg_strings), probe)
    return {dest for dest, value in vars(probe).items() if not _unset(value)}


class _Subcommands(argparse._SubParsersAction):
    """Subcommands whose defaults do not undo an option given before the command: `moe-inspector --model X bench`
    benches X (argparse's own would set bench's default over it). An option given on both sides is refused, unless
    it appends (--set: both kept, the command's after). An option the command does not know is refused with the
    command's usage line (argparse's own would print the top parser's)."""

    def __call__(self, parser, namespace, values, option_string=None):
        name, arg_strings = values[0], values[1:]
        subparser = self._name_parser_map.get(name)
        if subparser is None:  # argparse's own message
            return super().__call__(parser, namespace, values, option_string)
        outer = {dest for dest, value in vars(namespace).items() if not _unset(value) and dest != self.dest}
        known = {action.dest for action in subparser._actions} | set(subparser.get_default("reads_globals") or ())
        stray = [next(a.option_strings[-1] for a in parser._actions if a.dest == dest)
                 for dest in sorted(outer - known) if any(a.dest == dest for a in parser._actions)]
        if stray:  # `--session s.toml flags`, `--model X run s.toml`: not silently ignored
            subparser.error(f"{', '.join(stray)} given before the command; {name} does not take "
                            f"{'it' if len(stray) == 1 else 'them'}")
        setattr(namespace, self.dest, name)
        inner, rest = subparser.parse_known_args(list(arg_strings), None)
        given = _given(subparser, arg_strings)
        for dest, value in vars(inner).items():
            current = getattr(namespace, dest, None)
            if dest in outer and dest in given and current != value:
                if isinstance(current, list) and isinstance(value, list):
                    value = list(current) + list(value)
                else:
                    inner_action = next(a for a in subparser._actions if a.dest == dest)
                    outer_option = next((a.option_strings[-1] for a in parser._actions if a.dest == dest), dest)
                    inner_option = (inner_action.option_strings[-1] if inner_action.option_strings
                                    else inner_action.metavar or dest)  # a positional: its name
                    both = outer_option if inner_option == outer_option else f"{outer_option} and {inner_option}"
                    parser.error(f"{both}: given before the command ({printable(str(current))}) and after it "
                                 f"({printable(str(value))}): give one")
            elif dest in outer and dest not in given:
                continue  # the command's default does not override what was given before it
            setattr(namespace, dest, value)
        namespace.given_globals = frozenset(outer)
        if rest:  # the command's own usage line, not the top parser's (everything after the command is the command's)
            subparser.error(f"unrecognized arguments: {' '.join(printable(part) for part in rest)}")


def _ascii_int(text: str) -> int:
    """An integer written in ASCII digits, as a user types one: int() would also take "٣" (an Arabic-Indic three)
    and "1_0"."""
    if not re.fullmatch(r"\s*[+-]?[0-9]+\s*", text):
        raise ValueError(text)
    return int(text)


_ascii_int.__name__ = "int"  # argparse names the type in its refusal: "invalid int value: '٣'"


class _Parser(argparse.ArgumentParser):
    """argparse exits 2 on bad usage already; keep its message to one line plus the usage. The top parser tells
    the options given before a subcommand from its defaults (`_Subcommands`; `given_globals` names them)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.register("action", "parsers", _Subcommands)
        self.register("type", int, _ascii_int)  # every `type=int` option: what int() takes beyond ASCII digits

    def error(self, message: str) -> None:  # noqa: D401 - argparse API
        self.print_usage(sys.stderr)
        print(f"moe-inspector: error: {message}", file=sys.stderr)
        raise SystemExit(2)

    def parse_known_args(self, args=None, namespace=None):
        if namespace is not None or self._subparsers is None:  # a subcommand's parser, or a caller's namespace
            return super().parse_known_args(args, namespace)
        own = [action for action in self._actions if action.dest not in (argparse.SUPPRESS, "help")
               and not isinstance(action, argparse._SubParsersAction)]
        namespace = argparse.Namespace(**{action.dest: _Unset() for action in own})
        namespace, rest = super().parse_known_args(args, namespace)
        if not hasattr(namespace, "given_globals"):  # no subcommand: the TUI
            namespace.given_globals = frozenset(action.dest for action in own
                                                if not _unset(getattr(namespace, action.dest)))
        for action in own:  # what nobody gave takes its default; an appended _Unset becomes a plain list
            value = getattr(namespace, action.dest)
            if isinstance(value, _Unset):
                setattr(namespace, action.dest, list(value) if value else action.default)
        return namespace, rest


def add_tui_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="preset name (tiny, demo, v4-shape; default demo) or a Hugging Face checkpoint directory")
    parser.add_argument("--device", default="auto", help="cuda, cpu or auto (the GPU if there is one)")
    parser.add_argument("--set", dest="set_flags", action="append", default=[], metavar="FLAG=VALUE",
                        help="set a flag (repeatable); see `moe-inspector flags`")
    parser.add_argument("--session", default=None, metavar="FILE", help="open (or start) this session file")
    parser.add_argument("--seed", type=seed_argument, default=DEFAULT_SEED, help="weight seed for random presets (default 0)")
    parser.add_argument("--weights", choices=("auto", "random"), default="auto",
                        help="auto: the shipped or the directory's weights; random: random weights of the model's "
                             "shape (a directory's from its config.json, drawn on the device)")
    parser.add_argument("--sweep", default=None, metavar="FILE", help="sweep JSON for the tile-fill µs-per-arm plot")
    parser.add_argument("--b-model", default=None, metavar="MODEL",
                        help="run side B on another model with A's tokenizer (a preset, a checkpoint directory, or "
                             "source: the model a trellis checkpoint was quantized from), as compare --b-model")
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


# A write that found no room, with no path named: every file this tool writes goes through write_output, which
# names its path, so what is left is standard output (a full disk under `> out.json`, or /dev/full).
NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _stdout_refuses(error: OSError) -> bool:
    """Whether `error` is standard output finding no room; if so stdout is pointed at /dev/null, so that the
    interpreter's last flush does not fail again."""
    if error.filename is not None or error.errno not in NO_ROOM:
        return False
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return True


# Options and arguments that name a file: given as '' they were read as "not given" wherever the code tests the
# value's truth (`--trace ''` ran and wrote nothing), so a blank one is refused as the empty path it is.
PATH_DESTS = ("trace", "record_routing", "results", "report", "json_out", "csv", "prompt_file", "session", "sweep",
              "out", "calibration", "routing", "file")


def _blank_path(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str | None:
    """The option (or argument) of PATH_DESTS given as a blank string, as the user spells it; None if none."""
    actions = []
    for action in parser._actions:  # the command's own first: its `session` argument is not the TUI's --session
        if isinstance(action, argparse._SubParsersAction) and args.command in action.choices:
            actions += action.choices[args.command]._actions
    seen = {action.dest for action in actions}
    actions += [action for action in parser._actions if action.dest not in seen]
    for action in actions:
        value = getattr(args, action.dest, None)
        if action.dest in PATH_DESTS and isinstance(value, str) and not value.strip():
            return action.option_strings[-1] if action.option_strings else action.metavar or action.dest
    return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        blank = _blank_path(parser, args)
        if blank is not None:
            raise UserError(f"{blank}: an empty path; give a file name")
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
    except BrokenPipeError:
        # stdout's reader went away (`generate ... | head -1`): stop quietly, as a Unix tool does on SIGPIPE; stdout
        # goes to /dev/null so that the interpreter's last flush does not fail again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + 13
    except OSError as error:
        # A path the user gave that the system refuses (a name too long, a link loop, no permission) where no
        # check named it first: still one line naming the path, exit 2. Standard output that takes no more (a
        # full disk, /dev/full) is the user's too. Any other OSError about no path is a bug.
        if _stdout_refuses(error):
            print(f"moe-inspector: error: standard output could not be written ({error.strerror or error}); free "
                  f"space or send it elsewhere", file=sys.stderr)
            return 2
        if error.filename is None:
            raise
        print(f"moe-inspector: error: {path_error(error)}", file=sys.stderr)
        return 2

