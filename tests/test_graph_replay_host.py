"""The host side of a CUDA-graph decode step, on a CPU: the batch runner takes its graph path with
the stub graph of bench/host_step.py (a replay does nothing; the template holds the records an
eager forward through it made). What a replayed step records must be the capture's decisions,
renumbered, with every field a consumer reads; replays are counted; a steady cohort copies no inputs."""

import importlib.util
from pathlib import Path

import pytest

from engine import flags
from engine.batch_runner import BatchRunner
from engine.runtime import Engine

_SPEC = importlib.util.spec_from_file_location("host_step", Path(__file__).resolve().parents[1] / "bench" / "host_step.py")
host_step = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(host_step)


@pytest.fixture(scope="module")
def tiny():
    return Engine.load("tiny", "cpu", seed=0, weights="random")


def _stubbed_run(engine, prompt, tokens):
    runner = BatchRunner(engine, 1, len(prompt) + tokens - 1, graphs=True)
    host_step.stub_graphs(runner)
    copies = []
    original = runner._replay

    def replay(captured, rows):  # count the host->device input copies a replay makes
        holds = captured.holds
        original(captured, rows)
        copies.append(holds != [(row.sequence.request_id, row.tokens[0], row.start) for row in rows])

    runner._replay = replay
    return engine.generate_batch([prompt], tokens, flags.resolve(environ={}), runner=runner), copies


def test_replayed_steps_carry_the_capture_records_renumbered(tiny):
    result, copies = _stubbed_run(tiny, list(b"hello!"), 12)
    layers = tiny.config.n_layers
    assert [step["graph"] for step in result.steps] == ["eager", "capture"] + ["replay"] * 10
    capture = result.steps[1]
    for step in result.steps[2:]:
        assert step["phase"] == "decode" and step["n_tokens"] == 1 and step["eager_reason"] == ""
        for family in ("moe", "attention"):
            assert [record["layer"] for record in step[family]] == list(range(layers))
            for record, captured in zip(step[family], capture[family]):
                assert record == {**captured, "step": step["step"], "graph": "replay"}
                # the same field order as a record copied from the template, then observed
                order = [key for key in captured if key != "pairs_per_woken_observed"] + ["graph"]
                if family == "moe":
                    order.append("pairs_per_woken_observed")
                assert list(record) == order
        assert all(record["woken_observed"] >= 1 for record in step["moe"])
        assert step["kernel_launches"] == {name: layers for name in host_step.KERNELS_PER_LAYER}
        assert step["device_us"] == 250.0 and step["host_us"] > 0
    # records are per step: renumbering one step never reaches another
    assert len({id(record) for step in result.steps for record in step["moe"]}) == layers * len(result.steps)
    counters = result.counters
    assert counters["graph_replays"] == 10
    assert counters["arms"]["reference"] == counters["arms"]["unfused"] == layers * len(result.steps)
    assert counters["kernels"] == {name: 10 * layers for name in host_step.KERNELS_PER_LAYER}
    assert copies == [True] + [False] * 9  # the first replay copies its inputs in; the steady cohort never


def test_a_new_cohort_reuses_the_graph_and_copies_its_inputs_once(tiny):
    runner = BatchRunner(tiny, 1, 16, graphs=True)
    host_step.stub_graphs(runner)
    resolved = flags.resolve(environ={})
    first = tiny.generate_batch([list(b"abcd")], 8, resolved, runner=runner)
    second = tiny.generate_batch([list(b"wxyz")], 8, resolved, runner=runner)
    assert runner.captured_sizes == [1]
    assert [step["graph"] for step in second.steps] == ["eager"] + ["replay"] * 7
    captured = next(iter(runner._graphs.values()))
    (request_id, token, position), = captured.holds
    sequence = second.sequences[0]
    assert (request_id, token, position) == (sequence.request_id, sequence.generated[-1], sequence.cached)
    assert first.counters["graph_replays"] == 6 and second.counters["graph_replays"] == 7
