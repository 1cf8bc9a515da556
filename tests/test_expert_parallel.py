"""Expert parallelism on CPU processes (gloo over localhost): outputs at EP = 1, 2, 4 against the one-device
run, the records each rank makes and rank 0 gathers, and how bad input and a dying rank end a run."""

import json
import time

import pytest
import torch

import ep_targets
from engine import ep_launch, expert_parallel
from engine.errors import UserError
from inspector.cli import main

MAX_TOKENS = 4


@pytest.fixture(scope="module")
def one_device():
    """The reference: each model on one process, every expert local, no exchange."""
    return {model: ep_targets.generate(ep_targets.build_engine(model), MAX_TOKENS) for model in ("tiny", "small")}


# fp32 throughout. The exchange changes only the order of a token's expert sum (each pair's weighted row is
# added on its owner in rank order, not in expert order inside one arm), a few fp32 roundings per layer; the
# logits are O(1): the small model's differ by 2.5e-7 relative at EP = 2 (tiny's not at all), so 1e-5 holds
# that with room and is far below what a wrong pair, weight or owner would change.
LOGIT_TOLERANCE = dict(rtol=1e-5, atol=1e-5)


# four ranks on this machine's two cores cost twice the time per step: two steps (a prefill, a decode) there
@pytest.mark.parametrize("ranks, steps", [(1, MAX_TOKENS), (2, MAX_TOKENS), (4, 2)])
def test_outputs_match_the_one_device_run(one_device, ranks, steps):
    """tiny (8 experts, top-2) and a small random MoE (12 experts, top-3, a shared expert) over 1, 2 and 4 ranks:
    the same greedy tokens and the same logits within fp32 tolerance, on ragged prompts (mixed steps, token
    counts that do not divide by the ranks: uneven owned slices, ranks that receive no row)."""
    # a hang fails through the launcher's own deadline (ep_launch.TIMEOUT_S); how fast the ranks run is a
    # benchmark's business: a wall-clock bound here failed under a loaded CI machine, not under a slow change
    results = ep_launch.run(ranks, ep_targets.generate_on_rank,
                            {"models": ["tiny", "small"], "max_tokens": steps}, device="cpu")
    for model, reference in one_device.items():
        result = results[model]
        assert result["tokens"] == [tokens[:steps] for tokens in reference["tokens"]], model
        for got, expected in zip(result["logits"], reference["logits"]):
            expected = expected[:steps]
            assert got.abs().max() > 0.1  # a real distribution, not an all-zero tensor
            torch.testing.assert_close(got, expected, **LOGIT_TOLERANCE)
        assert result["provenance"]["expert_parallel"]["ep"] == ranks


def test_records_per_rank_and_gathered_on_rank_zero():
    """Each MoE record is its rank's own decision (k = 1 rows over E/N local experts) with the exchange; rank 0's
    records carry every rank's view: their rows add up to the layer's pairs, the imbalance is their max/mean."""
    results = ep_launch.run(2, ep_targets.generate_on_rank, {"models": ["small"], "max_tokens": 2}, device="cpu")
    steps = results["small"]["moe"]
    config = ep_targets.small_moe_config()
    assert steps and all(len(records) == config.n_layers for records in steps)
    for records in steps:
        for record in records:
            ep = record["ep"]
            assert (ep["rank"], ep["ranks"], ep["local_experts"], ep["experts"]) == (0, 2, 6, 12)
            assert record["k"] == 1 and record["experts"] == 6 and record["n_tokens"] == ep["rows"]
            views = record["ranks"]
            assert [view["rank"] for view in views] == [0, 1]
            rows = [view["rows"] for view in views]
            assert sum(rows) == ep["tokens"] * config.top_k  # every pair of the step went to exactly one rank
            assert sum(view["pairs_sent"] for view in views) == sum(rows)
            assert record["imbalance"] == pytest.approx(max(rows) / (sum(rows) / 2), abs=1e-3)
            for view in views:
                assert 0 <= view["woken_observed"] <= min(6, view["rows"])
                assert view["exchange"]["bytes"] > 0 and view["exchange"]["us"] > 0
                # a rank no pair reached launches nothing and says so; every other rank's arm ran and was timed
                assert (view["executed_arm"] == "none") == (view["rows"] == 0)
                assert view["us"] > 0 or view["rows"] == 0


def test_owned_ranges_partition_the_tokens():
    for tokens in (0, 1, 5, 7, 64):
        for ranks in (1, 2, 3, 4, 8):
            ranges = [expert_parallel.owned_range(tokens, rank, ranks) for rank in range(ranks)]
            assert ranges[0][0] == 0 and ranges[-1][1] == tokens
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            assert max(hi - lo for lo, hi in ranges) - min(hi - lo for lo, hi in ranges) <= 1


def test_imbalance_is_max_over_mean():
    assert expert_parallel.imbalance([3, 1]) == 1.5 and expert_parallel.imbalance([2, 2, 2, 2]) == 1.0
    assert expert_parallel.imbalance([0, 0]) is None


@pytest.mark.parametrize("value, fragment", [("0", "from 1 to 64"), ("two", "'two'"), ("65", "from 1 to 64")])
def test_bad_ep_values(value, fragment):
    with pytest.raises(UserError, match=fragment):
        expert_parallel.parse_ep(value)


def test_experts_not_divisible_is_one_line_before_any_rank(capsys):
    started = time.monotonic()
    assert main(["generate", "--model", "tiny", "--prompt", "x", "--ep", "3"]) == 2
    error = capsys.readouterr().err
    assert "8 experts, not divisible by 3 ranks" in error and "1, 2, 4, 8" in error
    assert error.count("\n") == 1 and "Traceback" not in error
    assert time.monotonic() - started < 5  # refused before a process is spawned


def test_world_size_differs_from_ep(capsys, monkeypatch):
    """Under torchrun (WORLD_SIZE and RANK set) a world that is not --ep is refused on rank 0, before joining."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert main(["generate", "--model", "tiny", "--prompt", "x", "--ep", "4"]) == 2
    error = capsys.readouterr().err
    assert "--ep 4 but torchrun started 2 ranks" in error and error.count("\n") == 1


def test_a_dying_rank_ends_every_rank_and_writes_nothing(tmp_path):
    """Rank 1 exits right after joining (the test hook): rank 0, waiting in a collective, is stopped too, the run
    ends with one line naming the rank, within seconds (no hang), and rank 0 never writes its file."""
    path = tmp_path / "result.txt"
    started = time.monotonic()
    with pytest.raises(UserError) as raised:
        ep_launch.run(2, ep_targets.write_after_collective,
                      {"path": str(path), ep_launch.FAIL_RANK_KEY: 1}, device="cpu", timeout_s=120)
    # the death is named, not rank 0's consequence of it (its collective reset, exit 2)
    assert "rank 1 died (exit code 9)" in str(raised.value) and "\n" not in str(raised.value)
    assert time.monotonic() - started < 90  # ended by the death, well before the launcher's deadline
    assert not path.exists()


def test_a_rank_refusing_its_input_is_the_one_line(tmp_path):
    with pytest.raises(UserError, match=r"^rank 1: this input is refused$"):
        ep_launch.run(2, ep_targets.refuse_on_rank_one, {}, device="cpu", timeout_s=60)


def test_generate_ep_two_end_to_end(capfd):
    """The one command: generate --ep 2 spawns its ranks; the JSON says how it ran and the tokens are the one-device
    run's; jsonl rows carry each rank's view side by side."""
    argv = ["generate", "--model", "tiny", "--prompt", "hello", "--max-tokens", "3", "--no-progress"]
    assert main(argv + ["--json"]) == 0
    single = json.loads(capfd.readouterr().out)
    assert main(argv + ["--ep", "2", "--format", "jsonl"]) == 0
    rows = [json.loads(line) for line in capfd.readouterr().out.splitlines()]  # rank 0 prints: its own stdout
    moe = [row for row in rows if row["family"] == "moe"]
    assert moe and all(row["ep_ranks"] == 2 and len(row["ranks"]) == 2 and row["imbalance"] >= 1 for row in moe)
    assert main(argv + ["--ep", "2", "--json"]) == 0
    payload = json.loads(capfd.readouterr().out)
    assert payload["tokens"] == single["tokens"]


SESSION = """[session]
version = 1
name = "ep-tiny"

[engine]
model = "tiny"
device = "cpu"
ep = {ep}

[[step]]
action = "prompt"
prompt = "hello"
max_tokens = 3
"""


@pytest.mark.parametrize("value, fragment", [("0", "from 1 to 64"), ('"2"', "an integer from 1 to 64"),
                                             ("true", "an integer from 1 to 64")])
def test_session_ep_is_validated(tmp_path, capsys, value, fragment):
    path = tmp_path / "bad.toml"
    path.write_text(SESSION.format(ep=value))
    assert main(["run", str(path)]) == 2
    error = capsys.readouterr().err
    assert "[engine]" in error and "ep" in error and fragment in error and error.count("\n") == 1


def test_session_ep_not_dividing_leaves_the_results_as_they_were(tmp_path, capsys):
    path = tmp_path / "three.toml"
    path.write_text(SESSION.format(ep=3))
    results = tmp_path / "three.results.jsonl"
    results.write_text("recorded before\n")
    assert main(["run", str(path)]) == 2
    assert f"{path}: [engine] ep 3: tiny has 8 experts, not divisible by 3 ranks" in capsys.readouterr().err
    assert results.read_text() == "recorded before\n"


def test_a_bad_step_of_an_ep_session_is_refused_before_a_rank_is_spawned(tmp_path, capfd, monkeypatch):
    from engine import ep_launch

    monkeypatch.setattr(ep_launch, "run", lambda *args, **kwargs: pytest.fail("ranks spawned"))
    path = tmp_path / "bad.toml"
    path.write_text(SESSION.format(ep=2) + '\n[[step]]\naction = "curve"\nk = 100000\n')
    assert main(["run", str(path)]) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "step 2 (curve): k 100000 is more than experts 8" in err, err


def test_session_ep_two_runs_on_two_ranks_and_records_them(tmp_path, capfd):
    """`[engine] ep = 2`: `run` spawns the ranks; rank 0 writes the results file, whose header records the group,
    and the tokens are the one-device session's."""
    one, two = tmp_path / "one.toml", tmp_path / "two.toml"
    one.write_text(SESSION.format(ep=1))
    two.write_text(SESSION.format(ep=2))
    assert main(["run", str(one)]) == 0
    assert main(["run", str(two)]) == 0
    capfd.readouterr()
    single = [json.loads(line) for line in (tmp_path / "one.results.jsonl").read_text().splitlines()]
    parallel = [json.loads(line) for line in (tmp_path / "two.results.jsonl").read_text().splitlines()]
    assert parallel[0]["ep"] == 2 and parallel[0]["expert_parallel"]["local_experts"] == 4 and "ep" not in single[0]
    assert parallel[1]["runs"][0]["tokens"] == single[1]["runs"][0]["tokens"]


def test_the_tui_refuses_an_ep_session(tmp_path):
    from types import SimpleNamespace

    from inspector.session import load_session
    from inspector.tui import _session_engine

    path = tmp_path / "two.toml"
    path.write_text(SESSION.format(ep=2))
    args = SimpleNamespace(session=str(path), model="demo", seed=0, device="auto")
    with pytest.raises(UserError, match="the TUI runs one device"):
        _session_engine(args, load_session(path).engine)


def test_bench_ep_two_reports_the_exchange(capfd):
    """bench --ep 2: each row's exchange per step beside its step time and its bound over the bandwidth the group
    measured in the same run; the footer records the group."""
    assert main(["bench", "--model", "tiny", "--pp", "8", "--tg", "3", "--batch", "2", "--reps", "1",
                 "--ep", "2", "--no-progress", "--json"]) == 0
    payload = json.loads(capfd.readouterr().out)
    parallel = payload["footer"]["expert_parallel"]
    assert (parallel["ep"], parallel["backend"], parallel["local_experts"]) == (2, "gloo", 4)
    assert parallel["bandwidth"]["GBps"] > 0
    for row in payload["rows"]:
        exchange = row["exchange"]
        assert exchange["bytes_per_step"] > 0 and 0 < exchange["us_per_step"] < exchange["step_us"]
        assert 0 < exchange["share"] < 1 and exchange["bound_us"] > 0


def test_bench_ep_refuses_profile(capsys):
    assert main(["bench", "--model", "tiny", "--ep", "2", "--profile"]) == 2
    assert "--profile with --ep" in capsys.readouterr().err
