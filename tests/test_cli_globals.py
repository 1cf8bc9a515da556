"""Options given before a command reach it: a command's own defaults (generate's --model demo, sweep's v4-shape,
--device auto, --set's empty list) do not undo them, as argparse's subcommands would; an option given on both sides
with two values is refused in one line; --set given on both sides keeps both."""

from __future__ import annotations

import json

from inspector.cli import build_parser, main


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
    assert err[-1] == "moe-inspector: error: --model is given before the command (tiny) and after it (demo): give one"
    assert main(["--model", "tiny", "generate", "--model", "tiny", "--prompt", "hi", "--max-tokens", "1",
                 "--json"]) == 0  # the same value twice is one


def test_an_explicit_global_demo_is_a_model_given(capsys):
    """`--model demo` before check-attention --mla names a model without latent attention, as `--model tiny`
    would: refused, not taken for no model at all."""
    assert main(["--model", "demo", "check-attention", "--mla"]) == 2
    assert "demo has no latent attention" in capsys.readouterr().err
    assert build_parser().parse_args(["--model", "demo", "curve"]).given_globals == {"model"}
