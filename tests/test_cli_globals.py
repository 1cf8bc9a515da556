"""Options given before a command reach it: a command's own defaults (generate's --model demo, sweep's v4-shape,
--device auto, --set's empty list) do not undo them, as argparse's subcommands would; an option given on both sides
with two values is refused in one line; --set given on both sides keeps both."""

from __future__ import annotations

import argparse
import json

import pytest

from inspector.cli import build_parser, main

# two valid values of each top-level option a command also takes (--set appends: both kept, tested below)
TWO_VALUES = {"model": ("tiny", "demo"), "device": ("cpu", "cuda"), "seed": ("1", "2"), "weights": ("auto", "random"),
              "session": ("a.toml", "b.toml"), "prompt_file": ("a.txt", "b.txt"), "sweep": ("a.json", "b.json")}


# what each command requires besides the option under test, by the dest that also satisfies it (--prompt-file
# does what --prompt would)
REQUIRED = {"generate": [("prompt_file", ["--prompt", "x"])], "compare": [("prompt_file", ["--prompt", "x"])],
            "run": [("session", ["s.toml"])], "replay": [("session", ["s.toml"])], "routing": [("file", ["r.json"])],
            "quantize": [("model", ["tiny"]), ("experts", ["--experts", "trellis:K=2,code=hyb"]),
                         ("out", ["--out", "o"])]}


def _clashes():
    parser = build_parser()
    outer = {action.dest: action.option_strings[-1] for action in parser._actions if action.option_strings}
    commands = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction)).choices
    for name, command in commands.items():
        for action in command._actions:
            if action.dest in outer and action.dest in TWO_VALUES and action.default is not argparse.SUPPRESS:
                inner = action.option_strings[-1] if action.option_strings else None  # None: a positional
                yield name, action.dest, outer[action.dest], inner


def test_a_global_option_is_not_undone_by_the_commands_default(capsys):
    assert main(["--model", "tiny", "generate", "--prompt", "hi", "--max-tokens", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "tiny"
    args = build_parser().parse_args(["--device", "cpu", "--seed", "3", "bench", "--tg", "4"])
    assert (args.model, args.device, args.seed) == ("demo", "cpu", 3)


def test_a_commands_own_default_holds_where_nothing_was_given_before_it():
    assert build_parser().parse_args(["sweep"]).model == "v4-shape"
    assert build_parser().parse_args(["--model", "demo", "sweep"]).model == "demo"
    assert build_parser().parse_args(["ab", "--b", "moe_gate=floor"]).weights is None
    assert build_parser().parse_args([]).model == "demo"  # the TUI's


def test_set_before_and_after_the_command_are_both_kept(capsys):
    assert main(["--set", "tile_m=32", "generate", "--set", "decode_floor=3", "--prompt", "hi", "--max-tokens", "1",
                 "--json"]) == 0
    flags = json.loads(capsys.readouterr().out)["flags"]
    assert flags["tile_m"] == {"value": 32, "source": "command line"}
    assert flags["decode_floor"] == {"value": 3, "source": "command line"}


def test_one_option_given_twice_with_two_values_is_refused_in_one_line(capsys):
    try:
        main(["--model", "tiny", "generate", "--model", "demo", "--prompt", "hi"])
    except SystemExit as stop:
        assert stop.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "moe-inspector: error: --model: given before the command (tiny) and after it (demo): give one"
    assert main(["--model", "tiny", "generate", "--model", "tiny", "--prompt", "hi", "--max-tokens", "1",
                 "--json"]) == 0  # the same value twice is one


def test_an_explicit_global_demo_is_a_model_given(capsys):
    """`--model demo` before check-attention --mla names a model without latent attention, as `--model tiny`
    would: refused, not taken for no model at all."""
    assert main(["--model", "demo", "check-attention", "--mla"]) == 2
    assert "demo has no latent attention" in capsys.readouterr().err
    assert build_parser().parse_args(["--model", "demo", "curve"]).given_globals == {"model"}


@pytest.mark.parametrize("command, dest, outer, inner", list(_clashes()))
def test_every_option_on_both_sides_with_two_values_is_one_line_exit_2(command, dest, outer, inner, capsys):
    """Generated over every command: a top-level option the command also takes (as an option or a positional),
    given on both sides with two values: one line naming both, exit 2, never a traceback."""
    first, second = TWO_VALUES[dest]
    required = [part for required_dest, parts in REQUIRED.get(command, []) if required_dest != dest for part in parts]
    argv = [outer, first, command] + ([inner, second] if inner else [second]) + required
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(argv)
    assert stop.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("moe-inspector: error: ") and f"({first})" in last and f"({second})" in last, last


def _strays():
    parser = build_parser()
    outer = {action.dest: action.option_strings[-1] for action in parser._actions
             if action.option_strings and action.dest in TWO_VALUES}
    commands = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction)).choices
    for name, command in commands.items():
        known = {action.dest for action in command._actions} | set(command.get_default("reads_globals") or ())
        for dest in sorted(set(outer) - known):
            yield name, dest, outer[dest]


@pytest.mark.parametrize("command, dest, option", list(_strays()))
def test_a_global_the_command_does_not_take_is_refused_not_ignored(command, dest, option, capsys):
    """Generated over every command: `--session s.toml flags` or `--model X run s.toml` would otherwise run
    without the option the user gave: one line naming it and the command, exit 2."""
    required = [part for _, parts in REQUIRED.get(command, []) for part in parts]
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args([option, TWO_VALUES[dest][0], command] + required)
    assert stop.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"moe-inspector: error: {option} given before the command; {command} does not take"), last


def test_check_attention_reads_the_global_model():
    assert build_parser().parse_args(["--model", "demo", "check-attention", "--mla"]).model == "demo"


def test_compare_sides_given_twice_are_both_kept(capsys):
    """`--a tile_m=32 --a fused_mask=drop` ran A with fused_mask alone: argparse keeps the last of an option."""
    assert main(["compare", "--model", "tiny", "--device", "cpu", "--prompt", "hi", "--max-tokens", "1",
                 "--a", "tile_m=32", "--a", "fused_mask=drop", "--json"]) == 0
    flags = json.loads(capsys.readouterr().out)["a"]["flags"]
    assert flags["tile_m"]["value"] == 32 and flags["fused_mask"]["value"] == "drop"
