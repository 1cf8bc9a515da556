"""`moe-inspector ab`'s bad input: each refused in one line (exit 2) before a tree is unpacked or a process starts.
In process, with engine.ab.run_ab replaced by a stub that fails the test when reached: an input that slipped
through would otherwise start two real processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import ab, ab_report, ab_stats, limits
from engine.errors import UserError
from inspector.cli import build_parser, main
from test_ab import StubProcess, bench_json, sides

BASE = ["ab", "--model", "tiny", "--tg", "2", "--tg-prompt", "4", "--reps", "1", "--warmup", "0", "--quiet"]
SIDES = ["--a", "tile_m=16", "--b", "tile_m=32"]


@pytest.fixture
def no_run(monkeypatch):
    """run_ab and the trees as stubs: a refusal must come first, so reaching either fails the test."""
    def ran(*args, **kwargs):
        raise AssertionError("the A/B started where its input should have been refused")

    monkeypatch.setattr(ab, "run_ab", ran)
    monkeypatch.setattr(ab, "tree_of_revision", ran)
    monkeypatch.setattr(ab, "current_tree", ran)


def refused(capsys, *argv) -> str:
    """The one error line of `moe-inspector ARGV`, which must exit 2."""
    code = main(list(argv))
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# -- 1. ceilings on --rounds, --resamples and --warmup -----------------------------------------------------------

@pytest.mark.parametrize("option, value, fragment", [
    ("--resamples", "1000000000", f"--resamples is 1000000000, more than {limits.MAX_AB_RESAMPLES} (bootstrap"),
    ("--rounds", "1000000000000", f"--rounds is 1000000000000, more than {limits.MAX_AB_ROUNDS} (timed rounds"),
    ("--warmup", "1000000000", f"--warmup is 1000000000, more than {limits.MAX_AB_WARMUP} (discarded runs"),
    ("--min-rounds", "1000000", f"--min-rounds is 1000000, more than {limits.MAX_AB_ROUNDS}"),
    ("--rounds", "9" * 40, "--rounds is a number of 40 digits, more than"),
    ("--reps", "5000", f"--reps is 5000, more than {limits.MAX_REPS}"),
])
def test_counts_above_their_ceiling_are_refused_before_anything_runs(capsys, no_run, option, value, fragment):
    assert fragment in refused(capsys, *BASE, *SIDES, option, value)


@pytest.mark.parametrize("option, value, fragment", [
    ("--rounds", "0", "--rounds 0: give at least 1 (timed rounds"),
    ("--warmup", "-1", "--warmup -1: give at least 0"),
    ("--min-rounds", "1", "--min-rounds 1: give at least 2 (rounds a verdict needs"),
    ("--resamples", "50", "--resamples 50: give at least 100 (bootstrap resamples"),
    ("--tg-prompt", "0", "--tg-prompt 0: give at least 1"),
])
def test_counts_below_their_floor_name_the_option_and_the_value(capsys, no_run, option, value, fragment):
    assert fragment in refused(capsys, *BASE, *SIDES, option, value)


def test_the_engine_refuses_the_ceilings_too():
    """run_ab and Rule are bounded whoever calls them, before a process starts."""
    StubProcess.log = []
    workload = ab.Workload("bench", "bench tg32", ["--model", "tiny"])
    for rounds, warmup in ((limits.MAX_AB_ROUNDS + 1, 0), (1, limits.MAX_AB_WARMUP + 1)):
        with pytest.raises(UserError, match="more than"):
            ab.run_ab(sides(), workload, rounds, warmup,
                      launcher=lambda side: StubProcess(side, lambda s, c: bench_json(1.0)))
    assert StubProcess.log == []
    with pytest.raises(ValueError, match=f"give from 100 to {limits.MAX_AB_RESAMPLES}"):
        ab_stats.Rule(resamples=limits.MAX_AB_RESAMPLES + 1)


def test_a_row_longer_than_the_models_context_is_refused_before_the_sides_start(capsys, no_run):
    line = refused(capsys, *BASE, *SIDES, "--tg-prompt", "100000")  # the last --tg-prompt holds
    assert "a row needs 100002 positions, more than the tiny context of 512" in line


# -- 2. percents: the option's own name, value and unit ---------------------------------------------------------

@pytest.mark.parametrize("value", ["150", "100", "0", "-2", "nan", "inf"])
def test_tolerance_is_a_percent_and_its_refusal_says_so(capsys, no_run, value):
    line = refused(capsys, *BASE, *SIDES, "--tolerance", value)
    assert f"--tolerance {value}: give a percent above 0 and below 100, e.g. 2 for a ±2 % no-change band" in line
    assert "--resamples" not in line and "fraction" not in line


# -- 3. --fail-on-regression -------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1"])
def test_fail_on_regression_refuses_what_no_ratio_can_exceed(capsys, no_run, value):
    line = refused(capsys, *BASE, *SIDES, f"--fail-on-regression={value}")  # `=`: argparse takes -inf for an option
    assert f"--fail-on-regression {value}: give a percent of 0 or more" in line


# -- 4. options the chosen workload would ignore ----------------------------------------------------------------

@pytest.mark.parametrize("argv, fragment", [
    (["--session", "s.toml"], "--session: the bench workload (the default) does not read it (the session workload "
                              "does); give --workload session, or drop --session"),
    (["--tokens", "1,2"], "--tokens: the bench workload (the default) does not read it"),
    (["--workload", "session", "--session", "sessions/quickstart.toml", "--pp", "16"],
     "--pp: the session workload does not read it (the bench workload does)"),
    (["--workload", "session", "--session", "sessions/quickstart.toml", "--seed", "0"],
     "--seed: the session workload does not read it"),  # given, though it is the default
    (["--workload", "session", "--session", "sessions/quickstart.toml", "--clock", "wall"],
     "--clock: the session workload does not read it"),
    (["--workload", "sweep", "--device", "cpu"], "--device: the sweep workload does not read it"),
    (["--workload", "sweep", "--allow-different-tokens"], "--allow-different-tokens: the sweep workload does not"),
])
def test_an_option_the_workload_does_not_read_is_refused(capsys, no_run, argv, fragment):
    assert fragment in refused(capsys, "ab", *SIDES, *argv)


def test_an_option_given_before_the_command_counts_as_given(capsys, no_run):
    line = refused(capsys, "--model", "tiny", "ab", *SIDES, "--workload", "session", "--session",
                   "sessions/quickstart.toml")
    assert "--model: the session workload does not read it" in line


def test_the_workload_defaults_still_hold_where_nothing_was_given():
    from inspector.commands.ab import _workload

    args = build_parser().parse_args(["ab", *SIDES])
    workload = _workload(args, {})
    arguments = dict(zip(workload.arguments[::2], workload.arguments[1::2]))
    assert arguments["--model"] == "demo" and arguments["--tg"] == "32" and arguments["--pp"] == "none"
    assert arguments["--reps"] == "3" and arguments["--tg-prompt"] == "32" and workload.clock == "device"


def test_a_flag_the_sweep_does_not_read_is_refused(capsys, no_run):
    line = refused(capsys, "ab", "--workload", "sweep", "--a", "shared_fold=on", "--b", "shared_fold=off")
    assert line.endswith("--a shared_fold: the sweep workload reads only moe_gate, decode_floor, moe_max_tokens, "
                         "grouped_variant, tile_m of the flags (the sweep takes no --set), so shared_fold would "
                         "change nothing it times; drop it, or give --workload bench")
    line = refused(capsys, "ab", "--workload", "sweep", "--sweep-arms", "gemv", "--a", "moe_gate=floor",
                   "--b", "moe_gate=grouped")
    assert "--a moe_gate: with --sweep-arms, the sweep workload reads only tile_m" in line


def test_set_and_a_side_giving_one_flag_two_values_is_refused(capsys, no_run):
    """`--a tile_m=16 --b tile_m=32 --set tile_m=64` ran without the 64 and reported "both sides: no --set"."""
    line = refused(capsys, *BASE, *SIDES, "--set", "tile_m=64")
    assert line.endswith("tile_m: --set tile_m=64 is both sides' value, and --a sets tile_m=16: give tile_m in --a "
                         "and --b, or in --set alone")
    line = refused(capsys, "--set", "tile_m=16", *BASE, *SIDES)  # equal on A, another value on B
    assert "and --b sets tile_m=32" in line


def test_set_reaches_both_sides_runs_and_the_report():
    from inspector.commands.ab import _sides

    made = _sides(build_parser().parse_args(["ab", *SIDES, "--set", "moe_gate=floor"]))
    assert made["A"].assignments == ["moe_gate=floor", "tile_m=16"]
    assert made["B"].assignments == ["moe_gate=floor", "tile_m=32"]
    for side in made.values():
        side.tree = ab.Tree(ab.REPOSITORY, "commit-x", "this tree")
    StubProcess.log = []
    report = ab.run_ab(made, ab.Workload("bench", "bench tg32", []), 2, 0,
                       launcher=lambda side: StubProcess(side, lambda s, c: bench_json(100.0))).to_json()
    assert all(argv[-4:-2] == ["--set", "moe_gate=floor"] for _, argv in StubProcess.log)
    assert "- both sides: --set moe_gate=floor\n" in ab_report.format_markdown(report)


def test_a_session_copy_holds_the_common_set_too(tmp_path):
    """A session A/B wrote only each side's own flags into its copy's [flags]: --set reached neither side."""
    import tomllib

    from inspector.commands.ab import _sides

    session = tmp_path / "s.toml"
    session.write_text('[session]\nversion = 1\nname = "s"\n[flags]\ndecode_floor = 3\n')
    made = _sides(build_parser().parse_args(["ab", *SIDES, "--set", "moe_gate=floor"]))
    for side in made.values():
        side.tree = ab.Tree(ab.REPOSITORY, "commit-x", "this tree")
    copies = {}

    def outputs(side, call):
        if call is None:
            return ""
        copies[side.name] = tomllib.loads(Path(StubProcess.log[-1][1][1]).read_text())["flags"]
        return 2, "", "stop here"

    StubProcess.log = []
    ab.run_ab(made, ab.Workload("session", "session s", [], session=session), 1, 0,
              launcher=lambda side: StubProcess(side, outputs))
    assert copies["A"] == {"decode_floor": 3, "moe_gate": "floor", "tile_m": 16}


# -- 5. blank values --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("option, value, fragment", [
    ("--a-tree", "", "--a-tree '': an empty value; give the root of a source tree, or drop it to run this tree"),
    ("--b-tree", " ", "--b-tree ' ': an empty value"),
    ("--a-rev", "", "--a-rev '': an empty value; give a commit, branch or tag, or drop it to run this tree"),
    ("--b-rev", "", "--b-rev '': an empty value"),
    ("--device", "", "--device '': an empty value"),
    ("--graphs", "", "--graphs '': an empty value"),
    ("--model", "", "--model '': an empty value"),
])
def test_a_blank_value_is_refused_naming_its_option(capsys, no_run, option, value, fragment):
    assert fragment in refused(capsys, *BASE, *SIDES, option, value)


def test_a_blank_side_is_refused_not_taken_as_no_overrides(capsys, no_run):
    assert "--a '': an empty flag list; give FLAG=VALUE,..., or drop --a" in refused(
        capsys, *BASE, "--a", "", "--b", "tile_m=32")


def test_the_engine_refuses_a_blank_tree_or_revision_naming_the_option():
    with pytest.raises(UserError, match="--b-tree '': an empty path"):
        ab.tree_at("", option="--b-tree")
    with pytest.raises(UserError, match="--a-rev '': an empty revision"):
        ab.tree_of_revision("", option="--a-rev")
