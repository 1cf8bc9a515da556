"""`moe-inspector ab`: the statistics on stub timings, the refusals, the rounds' order and the bad input, with
stub processes (a launcher returning canned bench/sweep JSON); one real run of two processes on the tiny
model at the end."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from engine import ab, ab_report, ab_rows, ab_stats
from engine.errors import UserError

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------ statistics

def test_no_change_inside_the_band():
    generator = random.Random(1)
    a = [100 * (1 + generator.gauss(0, 0.002)) for _ in range(10)]
    b = [100 * (1 + generator.gauss(0, 0.002)) for _ in range(10)]
    result = ab_stats.compare(a, b)
    assert result.verdict == ab_stats.NO_CHANGE, result.why
    low, high = result.interval
    assert 0.98 <= low <= result.ratio <= high <= 1.02


def test_slower_and_faster_outside_the_band():
    generator = random.Random(2)
    a = [100 * (1 + generator.gauss(0, 0.003)) for _ in range(8)]
    b = [110 * (1 + generator.gauss(0, 0.003)) for _ in range(8)]
    slower = ab_stats.compare(a, b)
    assert slower.verdict == ab_stats.SLOWER and slower.interval[0] > 1
    assert 1.08 < slower.ratio < 1.12
    faster = ab_stats.compare(b, a)
    assert faster.verdict == ab_stats.FASTER and faster.interval[1] < 1


def test_a_small_real_change_inside_the_band_is_no_change_not_slower():
    a = [100.0, 100.1, 99.9, 100.0, 100.05, 99.95]
    b = [value * 1.01 for value in a]  # 1 % slower, every round: inside the ±2 % band, so no change by the rule
    assert ab_stats.compare(a, b).verdict == ab_stats.NO_CHANGE
    tight = ab_stats.compare(a, b, ab_stats.Rule(tolerance=0.005))
    assert tight.verdict == ab_stats.SLOWER


def test_insufficient_data_too_few_rounds_and_too_noisy():
    few = ab_stats.compare([1.0, 1.1, 0.9], [1.0, 1.1, 0.9])
    assert few.verdict == ab_stats.INSUFFICIENT and few.interval is None and "fewer than the 5" in few.why
    generator = random.Random(3)
    a = [100 * (1 + generator.gauss(0, 0.15)) for _ in range(6)]
    b = [100 * (1 + generator.gauss(0, 0.15)) for _ in range(6)]
    noisy = ab_stats.compare(a, b)
    assert noisy.verdict == ab_stats.INSUFFICIENT and "too noisy" in noisy.why
    assert noisy.interval[0] < 1 < noisy.interval[1]


def test_bootstrap_is_seeded_and_pairs_rounds():
    a = [10.0, 20.0, 30.0, 40.0, 50.0, 60.0]
    b = [11.0, 22.0, 33.0, 44.0, 55.0, 66.0]  # each round exactly 10 % slower, though the rounds drift 6x
    first = ab_stats.bootstrap_interval(a, b, ab_stats.Rule(seed=5))
    assert first == ab_stats.bootstrap_interval(a, b, ab_stats.Rule(seed=5))
    # paired: every resample holds the same rounds on both sides, so the drift cancels exactly
    assert first == pytest.approx((1.1, 1.1))
    assert ab_stats.compare(a, b).verdict == ab_stats.SLOWER


def test_non_measurements_are_refused_by_the_statistics():
    for bad in (0.0, float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError):
            ab_stats.compare([1.0] * 5 + [bad], [1.0] * 6)
    with pytest.raises(ValueError):
        ab_stats.compare([1.0] * 5, [1.0] * 6)


def test_regression_beyond_uses_the_verdict_and_the_ratio():
    slower = {"verdict": ab_stats.SLOWER, "ratio": 1.06}
    assert ab_stats.regression_beyond(slower, 5) and not ab_stats.regression_beyond(slower, 7)
    assert not ab_stats.regression_beyond({"verdict": ab_stats.INSUFFICIENT, "ratio": 1.5}, 5)


# ------------------------------------------------------------------------------------------------ stub sides

def bench_json(us_per_token: float, state: str = "steady", arms: dict | None = None, crc: int | None = 7,
               test: str = "tg32") -> str:
    row = {"test": test, "state": state, "counters": {"arms": arms or {"gemv": 64}, "graph_replays": 0},
           "tokens_crc32": crc}
    if state == "admitting":
        row.update(tps_wall=None, tps_device=None)
    else:
        row.update(tps_wall={"mean": 1e6 / us_per_token / 1.01}, tps_device={"mean": 1e6 / us_per_token})
    return json.dumps({"rows": [row]})


class StubProcess:
    """A side's process: each run returns `outputs(side, call)`; records the calls."""

    log: list = []

    def __init__(self, side, outputs) -> None:
        self.side, self.outputs, self.calls = side, outputs, 0
        if outputs(side, None) == "does not start":
            raise ab.SideFailed(side.name, f"{side.tree.label} does not start: SyntaxError: invalid syntax")

    def run(self, argv):
        StubProcess.log.append((self.side.name, argv))
        self.calls += 1
        output = self.outputs(self.side, self.calls)
        if isinstance(output, tuple):
            return output
        return 0, output, ""

    def close(self) -> None:
        pass


def sides(a: dict | None = None, b: dict | None = None, tree_b: ab.Tree | None = None) -> dict:
    from engine import flags as registry

    made = {}
    for name, overrides in (("A", a if a is not None else {"moe_gate": "tile-fill"}),
                            ("B", b if b is not None else {"moe_gate": "floor"})):
        flags = dict(registry.from_environment({}).with_overrides(overrides, registry.COMMAND_LINE).values)
        tree = tree_b if name == "B" and tree_b is not None else ab.Tree(REPO, "commit-x", "this tree")
        made[name] = ab.Side(name, tree, overrides, flags, [f"{k}={v}" for k, v in overrides.items()])
    return made


def run_stub(outputs, rounds=6, warmup=1, the_sides=None, **options):
    StubProcess.log = []
    workload = ab.Workload("bench", "bench tg32", ["--model", "tiny"])
    return ab.run_ab(the_sides or sides(), workload, rounds, warmup, launcher=lambda side: StubProcess(side, outputs),
                     **options).to_json()


def test_rounds_interleave_a_b_b_a_after_warm_ups():
    report = run_stub(lambda side, call: bench_json(100.0), rounds=4, warmup=1)
    order = [name for name, _ in StubProcess.log]
    assert order == ["A", "B"] + ["A", "B", "B", "A", "A", "B", "B", "A"]  # warm-up, then rounds 0..3
    assert [(run["round"], run["side"]) for run in report["runs"]] == [
        (0, "A"), (0, "B"), (1, "B"), (1, "A"), (2, "A"), (2, "B"), (3, "B"), (3, "A")]
    argv_a = StubProcess.log[0][1]
    assert argv_a[:3] == ["bench", "--format", "json"] and argv_a[-2:] == ["--set", "moe_gate=tile-fill"]


def test_stub_timings_give_each_verdict():
    generator = random.Random(4)

    def timings(factor):
        return lambda side, call: bench_json(100 * (factor if side.name == "B" else 1.0) * (1 + generator.gauss(0, .002)))

    assert run_stub(timings(1.0))["rows"][0]["verdict"] == ab_stats.NO_CHANGE
    slower = run_stub(timings(1.2))["rows"][0]
    assert slower["verdict"] == ab_stats.SLOWER and slower["interval"][0] > 1.15
    assert slower["unit"] == "device µs/token" and len(slower["values"]["A"]) == 6
    assert run_stub(timings(0.8))["rows"][0]["verdict"] == ab_stats.FASTER
    assert run_stub(timings(1.2), rounds=3)["rows"][0]["verdict"] == ab_stats.INSUFFICIENT


def test_a_host_bound_side_is_named_and_one_process_per_side_says_so():
    def outputs(side, call):
        payload = json.loads(bench_json(100.0 * (30 if side.name == "B" else 1)))
        payload["rows"][0]["host_share"] = 1.01 if side.name == "B" else 0.12
        return json.dumps(payload)

    row = run_stub(outputs)["rows"][0]
    assert any(note.startswith("host-bound: the host's busy time per step (101 %") for note in row["notes"])
    assert any("--fresh" in note for note in row["notes"])
    fresh = run_stub(outputs, fresh=True)["rows"][0]  # the launcher is the stub; the mode is what --fresh sets
    assert not any("--fresh" in note for note in fresh["notes"])
    quiet = run_stub(lambda side, call: bench_json(100.0))["rows"][0]
    assert not any(note.startswith("host-bound") for note in quiet["notes"])


def test_a_steady_window_against_admission_is_refused():
    report = run_stub(lambda side, call: bench_json(100.0, "admitting" if side.name == "B" else "steady"))
    row = report["rows"][0]
    assert row["verdict"] is None and "B has no time" in row["refused"] or "window" in row["refused"]
    mixed = run_stub(lambda side, call: bench_json(100.0, "prefill" if side.name == "B" else "steady"))
    assert "A measured a steady decode window, B a prefill window" in mixed["rows"][0]["refused"]
    drifting = run_stub(lambda side, call: bench_json(100.0, "prefill" if call == 3 else "steady"))
    assert "rounds measured different things" in drifting["rows"][0]["refused"]


def test_an_executed_arm_other_than_claimed_is_refused():
    claimed = sides({"moe_gate": "grouped", "grouped_variant": 1}, {"moe_gate": "grouped", "grouped_variant": 2})

    def outputs(side, call):  # B says variant 2 but its counters show variant 1 ran
        return bench_json(100.0, arms={"grouped_v1": 64})

    report = run_stub(outputs, the_sides=claimed)
    assert report["rows"][0]["refused"] == ("B executed other arms than it claims: grouped_v1 ran where the flags "
                                            "claim grouped_v2")
    cpu = run_stub(lambda side, call: bench_json(100.0, arms={"reference": 64}), the_sides=claimed)
    assert "reference ran where the flags claim grouped_v1" in cpu["rows"][0]["refused"]
    fine = run_stub(lambda side, call: bench_json(100.0, arms={f"grouped_v{1 if side.name == 'A' else 2}": 64}),
                    the_sides=claimed)
    assert fine["rows"][0]["refused"] is None


def test_different_tokens_are_refused_unless_allowed():
    outputs = lambda side, call: bench_json(100.0, crc=1 if side.name == "A" else 2)  # noqa: E731
    report = run_stub(outputs)
    assert report["rows"][0]["refused"].startswith("different tokens at temperature 0 between A and B")
    allowed = run_stub(outputs, allow_different_tokens=True)["rows"][0]
    assert allowed["refused"] is None and any("allowed by --allow-different-tokens" in n for n in allowed["notes"])
    older = run_stub(lambda side, call: bench_json(100.0, crc=None if side.name == "B" else 3))["rows"][0]
    assert older["refused"] is None and any("an older tree" in note for note in older["notes"])


def test_a_row_only_one_side_measured_is_refused():
    report = run_stub(lambda side, call: bench_json(100.0, test="tg32" if side.name == "A" else "tg64"))
    assert {row["row"]: row["refused"] for row in report["rows"]} == {
        "tg32": "B did not measure this row in 6 of 6 rounds", "tg64": "A did not measure this row in 6 of 6 rounds"}


def test_a_side_that_fails_mid_way_keeps_what_was_measured():
    def outputs(side, call):
        if side.name == "B" and call == 3:  # warm-up, round 0, then round 1 fails
            return 2, "", "moe-inspector: error: out of memory while drawing weights\n"
        return bench_json(100.0)

    report = run_stub(outputs)
    assert report["failure"] == {"side": "B", "line": "this tree: `bench` exited 2: moe-inspector: error: out of "
                                                      "memory while drawing weights"}
    assert [(run["round"], run["side"]) for run in report["runs"]] == [(0, "A"), (0, "B")]
    row = report["rows"][0]
    assert row["rounds"] == 1 and row["verdict"] == ab_stats.INSUFFICIENT
    assert "Stopped**: side B" in ab_report.format_markdown(report)


def test_a_side_that_does_not_build_keeps_the_other_sides_run():
    report = run_stub(lambda side, call: "does not start" if side.name == "B" else bench_json(100.0), warmup=0)
    assert report["failure"]["side"] == "B" and "does not start: SyntaxError" in report["failure"]["line"]
    assert [(run["round"], run["side"]) for run in report["runs"]] == [(0, "A")]
    assert report["rows"][0]["refused"] == "no round completed on both sides"
    assert report["rows"][0]["values"]["A"] == [pytest.approx(100.0)]


def test_output_that_is_not_json_is_a_side_failure():
    report = run_stub(lambda side, call: "Traceback: nothing here" if side.name == "A" else bench_json(1.0))
    assert report["failure"]["side"] == "A" and "not the JSON this A/B reads" in report["failure"]["line"]


def test_the_same_sides_are_refused_before_anything_runs():
    same = sides({"moe_gate": "floor"}, {"moe_gate": "floor"})
    with pytest.raises(UserError, match="the two sides are the same"):
        run_stub(lambda side, call: bench_json(1.0), the_sides=same)
    assert StubProcess.log == []
    # the same flag values, other code: not the same
    other = sides({"moe_gate": "floor"}, {"moe_gate": "floor"}, tree_b=ab.Tree(REPO, "commit-y", "other"))
    assert run_stub(lambda side, call: bench_json(1.0), the_sides=other)["failure"] is None


def test_sweep_rows_time_each_sides_decided_arm():
    from inspector.commands.ab import decided_arms

    def sweep_json(side, call):
        arm = "grouped_v1" if side.name == "A" else "grouped_v2"
        return json.dumps({"timing": {"method": "graph"}, "check_tolerance": 0.01, "rows": [
            {"tokens": 32, "arms": {arm: {"us": 50.0, "rel_err": 1e-3, "timing": "graph",
                                          "launches_per_call": {f"moe_grouped.gate_up.v{arm[-1]}": 1}}}}]})

    flags = sides({"moe_gate": "grouped", "grouped_variant": 1}, {"moe_gate": "grouped", "grouped_variant": 2})
    decided = {name: decided_arms("tiny", (32,), side.flags) for name, side in flags.items()}
    assert decided == {"A": {32: "grouped_v1"}, "B": {32: "grouped_v2"}}
    workload = ab.Workload("sweep", "sweep", ["--model", "tiny", "--tokens", "32"], arms_by_tokens=decided)
    StubProcess.log = []
    report = ab.run_ab(flags, workload, 5, 0, launcher=lambda side: StubProcess(side, sweep_json)).to_json()
    row = report["rows"][0]
    assert row["row"] == "n=32" and row["verdict"] == ab_stats.NO_CHANGE and row["state"] == "graph"
    assert row["arms"] == {"A": {"grouped_v1": 5}, "B": {"grouped_v2": 5}}
    argv = dict(StubProcess.log)
    assert "grouped_v1" in argv["A"] and "grouped_v2" in argv["B"] and "--calibration" in argv["A"]
    with pytest.raises(UserError, match="moe_gate=measured reads this GPU's calibration"):
        decided_arms("tiny", (32,), sides({"moe_gate": "measured"}, {})["A"].flags)


def test_sweep_rows_refuse_other_timing_methods_and_failed_checks():
    cold = {"rows": [{"tokens": 1, "arms": {"gemv": {"us": 80.0, "rel_err": 1e-3}}}]}
    graph = {"timing": {"method": "graph"}, "rows": [{"tokens": 1, "arms": {"gemv": {"us": 77.0, "rel_err": 1e-3,
                                                                                     "timing": "graph"}}}]}
    a, b = ab_rows.sweep_samples(cold)["n=1 gemv"], ab_rows.sweep_samples(graph)["n=1 gemv"]
    assert a.state == "cold eager" and b.state == "graph"
    claims = {"moe": None, "attention": None}
    assert "A measured cold eager, B graph" in ab_rows.refusal("n=1", [a] * 5, [b] * 5, claims, claims)[0]
    broken = {"rows": [{"tokens": 1, "arms": {"gemv": {"us": 70.0, "rel_err": 0.5}}}]}
    c = ab_rows.sweep_samples(broken)["n=1 gemv"]
    assert "failed its reference check" in ab_rows.refusal("n=1", [a] * 5, [c] * 5, claims, claims)[0]


def test_claimed_arms_follow_the_flags():
    assert ab_rows.claimed_arms({"moe_gate": "gemv", "grouped_variant": 2, "flash_512": True}) == {
        "moe": {"gemv"}, "attention": None}
    claims = ab_rows.claimed_arms({"moe_gate": "measured", "grouped_variant": 0, "flash_512": False})
    assert "grouped_v1" not in claims["moe"] and "gemv" in claims["moe"] and claims["attention"] == {"unfused"}
    assert ab_rows.arm_mismatch({"fused": 3}, claims) == "fused ran where the flags claim unfused"


def test_markdown_report_lists_every_row_and_the_rule():
    report = run_stub(lambda side, call: bench_json(100.0 if side.name == "A" else 130.0))
    text = ab_report.format_markdown(report, fail_on_regression=5)
    assert "| tg32 | device µs/token | 100.0 (±0.0 %) | 130.0 (±0.0 %) | 1.3000 |" in text
    assert "slower (beyond 5 %)" in text and "2000 resamples" in text


# ------------------------------------------------------------------------------------------------ the CLI

def run_cli(*argv, cwd=REPO, timeout=300):
    return subprocess.run([sys.executable, "-m", "inspector", "ab", *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    done = run_cli("--a-rev", "no-such-revision-xyz", "--b", "moe_gate=floor")
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0
    assert "no such revision" in done.stderr and "Traceback" not in done.stderr
    same = run_cli("--a", "moe_gate=floor", "--b", "moe_gate=floor", "--model", "tiny")
    assert same.returncode == 2 and "the two sides are the same" in same.stderr
    tree = run_cli("--a-tree", str(tmp_path), "--b", "moe_gate=floor")
    assert tree.returncode == 2 and "not a checkout of moe-inspector" in tree.stderr
    flag = run_cli("--a", "moe_gate=nonsense")
    assert flag.returncode == 2 and "moe_gate" in flag.stderr


def test_a_directorys_random_weights_reach_both_sides_bench():
    """`ab --weights random` hands bench its --weights: a config.json directory (bench/configs/...) has no
    safetensors, and without it each side's bench would stop at loading."""
    from inspector.cli import build_parser
    from inspector.commands.ab import _workload

    args = build_parser().parse_args(["ab", "--model", "bench/configs/deepseek-v2-lite", "--weights", "random",
                                      "--tg", "128", "--b", "shared_fold=on"])
    arguments = _workload(args, {}).arguments
    assert arguments[arguments.index("--weights") + 1] == "random"
    assert "--weights" not in _workload(build_parser().parse_args(["ab", "--b", "moe_gate=floor"]), {}).arguments


@pytest.mark.slow
def test_two_real_processes_on_the_tiny_model(tmp_path):
    """Two processes of this tree, on the CPU; B's tree is a copy that does not build, so its failure is kept
    in the report beside A's run."""
    out = tmp_path / "ab.json"
    done = run_cli("--model", "tiny", "--device", "cpu", "--tg", "2", "--tg-prompt", "4", "--reps", "1",
                   "--rounds", "2", "--min-rounds", "2", "--warmup", "0", "--a", "moe_gate=tile-fill",
                   "--b", "moe_gate=floor", "--json-out", str(out), "--quiet", timeout=600)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    row = report["rows"][0]
    assert row["row"] == "tg2" and row["refused"] is None and row["unit"] == "wall µs/token"
    assert row["verdict"] in ab_stats.VERDICTS and len(row["values"]["A"]) == 2
    broken = tmp_path / "broken"
    (broken / "inspector").mkdir(parents=True)
    (broken / "inspector" / "cli.py").write_text("def main(:\n")
    failed = run_cli("--model", "tiny", "--device", "cpu", "--tg", "2", "--tg-prompt", "4", "--reps", "1",
                     "--rounds", "2", "--warmup", "0", "--b-tree", str(broken), "--json-out", str(out), "--quiet",
                     timeout=600)
    assert failed.returncode == 2 and "side B" in failed.stderr and "does not start: SyntaxError" in failed.stderr
    kept = json.loads(out.read_text())
    assert [run["side"] for run in kept["runs"]] == ["A"] and kept["rows"][0]["values"]["A"][0] > 0


def test_the_report_spells_a_switch_as_set_does():
    """A side's bool flag read `shared_fold=True` in the report's header; --set spells it on/off."""
    report = run_stub(lambda side, call: bench_json(100.0), rounds=2,
                      the_sides=sides({"shared_fold": False}, {"shared_fold": True}))
    text = ab_report.format_markdown(report)
    assert "- **A**: this tree; shared_fold=off" in text and "- **B**: this tree; shared_fold=on" in text, text
    assert "- both sides: no --set" in text


def test_the_report_names_the_common_set_once_and_each_sides_own_flags():
    """Each side's own flags were labelled '--set on both sides' with the common ones."""
    the_sides = sides({"prefill_chunk": 512}, {"prefill_chunk": 16})
    for side in the_sides.values():
        side.assignments = ["moe_gate=reference", "flash_512=off"] + side.assignments
    text = ab_report.format_markdown(run_stub(lambda side, call: bench_json(100.0), rounds=2, the_sides=the_sides))
    assert "- **A**: this tree; prefill_chunk=512\n" in text and "- **B**: this tree; prefill_chunk=16\n" in text, text
    assert "- both sides: --set moe_gate=reference flash_512=off\n" in text


def test_relative_paths_reach_each_sides_tree_whole(tmp_path, monkeypatch):
    """Each side runs in its own tree (its cwd) and a session runs from a scratch copy: a relative --model, and a
    session's relative [engine] model and step paths, are written out in full before a side starts."""
    from engine import ab
    from inspector.cli import build_parser
    from inspector.commands.ab import _workload

    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)
    args = build_parser().parse_args(["ab", "--model", "bench/configs/deepseek-v2-lite", "--weights", "random",
                                      "--b", "shared_fold=on"])
    arguments = _workload(args, {}).arguments
    assert arguments[arguments.index("--model") + 1] == str(root / "bench" / "configs" / "deepseek-v2-lite")
    (tmp_path / "sessions").mkdir()
    session = tmp_path / "sessions" / "s.toml"
    session.write_text('[session]\nversion = 1\nname = "s"\n[engine]\nmodel = "../q"\n[[step]]\naction = "compare"\n'
                       'prompt = "hi"\na = "base"\nb = "base"\nb_model = "source"\n[[step]]\naction = "check-quant"\n'
                       'original = "../src"\n')
    ab.session_copy(session, {"tile_m": 32}, tmp_path / "copy.toml")
    import tomllib

    copy = tomllib.loads((tmp_path / "copy.toml").read_text())
    assert copy["engine"]["model"] == str(tmp_path / "sessions" / "../q")
    assert copy["step"][0]["b_model"] == "source" and copy["step"][1]["original"] == str(tmp_path / "sessions/../src")
    assert copy["flags"] == {"tile_m": 32}
