"""Routing on a GPU: a graphed run records exactly the routing an eager run records (each replayed step's ids and
weights landed by its graph, the later steps of a graph of several steps included), a run that records gets
graphs of its own, and the sweep replays a recording into the kernels per layer."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from engine import flags, routing_file, routing_replay
from engine.batch_runner import BatchRunner
from engine.runtime import Engine

pytestmark = pytest.mark.gpu


def resolved(*settings):
    return flags.resolve(["record_routing=on", *settings], environ={})


def prompts(lengths, seed=0):
    generator = random.Random(seed)
    return [[generator.randrange(256) for _ in range(length)] for length in lengths]


@pytest.fixture(scope="module")
def demo():
    return Engine.load("demo", "cuda", seed=0)


@pytest.mark.parametrize("steps_per_graph", [1, 8])
@pytest.mark.parametrize("lengths", [[37], [40, 17, 130, 64]])  # batch 1; ragged rows of batch 4
def test_a_graphed_run_records_the_routing_an_eager_run_records(demo, lengths, steps_per_graph):
    batch = prompts(lengths)
    settings = (f"steps_per_graph={steps_per_graph}",)
    eager = demo.generate_batch(batch, 40, resolved(*settings), graphs=False)
    graphed = demo.generate_batch(batch, 40, resolved(*settings), graphs=True)
    assert graphed.tokens == eager.tokens
    modes = [step["graph"] for step in graphed.steps]
    assert modes.count("replay") >= 30, [step["eager_reason"] for step in graphed.steps]
    if steps_per_graph > 1:
        assert any(step["span"] == steps_per_graph for step in graphed.steps)  # served steps among them
    a, b = eager.routing, graphed.routing
    assert b.unrecorded == [] and b.truncated is None
    assert (b.steps == a.steps).all() and (b.offsets == a.offsets).all() and (b.phases == a.phases).all()
    assert (b.ids == a.ids).all() and (b.weight_bits == a.weight_bits).all()
    for index, step in enumerate(graphed.steps):  # what each replay's records observed is what it landed
        rows = b.ids[b.step_rows(index)]
        for position, record in enumerate(step["moe"]):
            assert record["woken_observed"] == len(np.unique(rows[:, position])), (step["step"], position)


def test_recording_gets_graphs_of_its_own_and_off_lands_nothing(demo):
    batch = prompts([33])
    runner = BatchRunner(demo, 1, 33 + 24, graphs=True)
    off = demo.generate_batch(batch, 24, flags.resolve([], environ={}), runner=runner)
    on = demo.generate_batch(batch, 24, resolved(), runner=runner)
    assert off.routing is None and off.tokens == on.tokens
    graphs = list(runner._graphs.values())
    assert len(graphs) == 2  # one per (size, flags): record_routing is a flag
    assert sorted(graph.routing is None for graph in graphs) == [False, True]
    recorded = next(graph for graph in graphs if graph.routing is not None)
    assert recorded.routing[0].is_pinned() and recorded.block is not None and recorded.block.routing is not None
    assert on.routing.n_steps == len(on.steps) and on.routing.memory_bytes > 0


def test_the_sweep_replays_each_recorded_layer(demo, tmp_path):
    from engine.sweep import ROTATIONS, SweepConfig, run_sweep

    text = "def __init__(self, other):\n    if not isinstance(other, int):\n        raise TypeError"
    path = tmp_path / "demo.safetensors"
    routing_file.save(demo.generate(text, 48, resolved()).routing, path)
    recording = routing_file.load(path)
    calibration = tmp_path / "calibration.json"
    result = run_sweep(SweepConfig(model="demo", tokens=(1, 16, 256), arms=("gemv", "grouped_v2"), routing=path,
                                   calibration=calibration))
    assert not result["check_failed"]
    routing = result["routing"]
    assert [entry["layer"] for entry in routing["layers"]] == list(recording.layers)
    for position, entry in enumerate(routing["layers"]):
        for row in entry["rows"]:
            windows, wrapped = routing_replay.windows(recording.ids[:, position], recording.weights[:, position],
                                                      row["tokens"], ROTATIONS)
            assert row["woken_experts"] == pytest.approx(np.mean([len(np.unique(ids)) for ids, _ in windows]))
            assert row["wrapped"] == wrapped and row["woken_predicted"] > 0
            assert all(arm["us"] > 0 for arm in row["arms"].values())
    if result["calibration_path"]:
        entry = json.loads(calibration.read_text())["entries"][0]
        assert entry["routing"]["layers"] == list(recording.layers) and "layer_crossovers" in entry
    else:
        assert "crossover" in result["calibration_note"]
