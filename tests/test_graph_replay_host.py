"""The host side of a CUDA-graph decode step, on a CPU: the batch runner takes its graph path with
the stub graph of bench/host_step.py (a replay does nothing; the template holds the records an
eager forward through it made). What a replayed step records must be the capture's decisions,
renumbered, with every field a consumer reads; replays are counted; a steady cohort copies no inputs."""

import importlib.util
from pathlib import Path

import pytest

from engine import batch_runner, flags
from engine.batch_runner import BatchRunner, _DecodeGraph
from engine.runtime import Engine

_SPEC = importlib.util.spec_from_file_location("host_step",
                                               Path(__file__).resolve().parents[1] / "bench" / "host_step.py")
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
    return engine.generate_batch([prompt], tokens, flags.resolve(environ={}), runner=runner), copies, runner


def test_replayed_steps_carry_the_capture_records_renumbered(tiny):
    result, copies, runner = _stubbed_run(tiny, list(b"hello!"), 12)
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
    assert runner.input_copies == 1


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


def test_input_copies_are_counted_once_per_new_cohort(tiny):
    runner = BatchRunner(tiny, 1, 16, graphs=True)
    host_step.stub_graphs(runner)
    resolved = flags.resolve(environ={})
    for _ in range(3):
        tiny.generate_batch([list(b"abcd")], 8, resolved, runner=runner)
    assert runner.input_copies == 3  # each run's first replay; its steady cohort feeds itself


def test_the_last_replayed_graph_serves_only_the_same_flags_and_batch_size(tiny):
    """A steady cohort finds its graph without a lookup; other flags or another size must not get it."""
    runner = BatchRunner(tiny, 2, 24, graphs=True)
    host_step.stub_graphs(runner)
    wide = flags.resolve(["tile_m=32"], environ={})
    narrow = flags.resolve(["tile_m=16"], environ={})
    for resolved, prompts in ((wide, [list(b"abcd")]), (narrow, [list(b"abcd")]), (wide, [list(b"ab"), list(b"cd")]),
                              (wide, [list(b"efgh")])):
        result = tiny.generate_batch(prompts, 6, resolved, runner=runner)
        replays = [step for step in result.steps if step["graph"] == "replay"]
        assert replays, [step["graph"] for step in result.steps]
        for step in replays:
            assert {record["tile_m"] for record in step["moe"]} == {resolved["tile_m"]}
            assert all(record["n_tokens"] == len(prompts) for record in step["moe"])
    assert len(runner._graphs) == 3 and runner.captured_sizes == [1, 1, 2]


def test_the_current_stream_is_made_once_per_stream_id(tiny, monkeypatch):
    made, ident = [], [(3, 0, 1)]
    monkeypatch.setattr(batch_runner, "_current_stream_ident", lambda device_index: ident[0])
    monkeypatch.setattr(batch_runner, "_stream_from", lambda stream: made.append(stream) or object())
    runner = BatchRunner(tiny, 1, 16)
    runner._device_index = 0
    first = runner._current_stream()
    assert runner._current_stream() is first and made == [(3, 0, 1)]
    ident[0] = (5, 0, 1)  # the caller switched streams: a new Stream object, then kept
    second = runner._current_stream()
    assert second is not first and runner._current_stream() is second and made == [(3, 0, 1), (5, 0, 1)]
    monkeypatch.setattr(batch_runner, "_current_stream_ident", None)  # a torch without the C call: ask torch
    monkeypatch.setattr(batch_runner.torch.cuda, "current_stream", lambda device: ("torch's", device))
    assert runner._current_stream() == ("torch's", 0)


def test_a_graph_replays_through_its_own_replay_unless_it_is_a_cuda_graph():
    class Graph:
        def replay(self):
            calls.append("replayed")

    calls = []
    captured = _DecodeGraph(Graph(), None, None, None, None, {})
    captured.launch()
    assert calls == ["replayed"]
