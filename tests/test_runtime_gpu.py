"""The batched runtime on a GPU: CUDA-graph decode equals eager decode (tokens and counters),
replays are counted, launches per decode step do not grow with the batch, and the bench runs
end to end with both clocks and a kernel profile."""

import io
import json
import random
from contextlib import redirect_stdout

import pytest
import torch

from engine import bench, flags
from engine.batch_runner import BatchRunner
from engine.runtime import Engine
from inspector.cli import main

pytestmark = pytest.mark.gpu


def resolved(*settings):
    return flags.resolve(list(settings), environ={})


def prompts(lengths, seed=0):
    generator = random.Random(seed)
    return [[generator.randrange(256) for _ in range(length)] for length in lengths]


@pytest.fixture(scope="module")
def demo():
    return Engine.load("demo", "cuda", seed=0)


@pytest.mark.parametrize("gate", ["moe_gate=tile-fill", "moe_gate=grouped", "moe_max_tokens=4096"])
def test_graph_decode_gives_the_eager_tokens_and_counts_every_replay(demo, gate):
    batch = prompts([40, 17, 130, 64])  # ragged prompts: decode rows at four different positions
    eager = demo.generate_batch(batch, 12, resolved(gate), graphs=False)
    graphed = demo.generate_batch(batch, 12, resolved(gate), graphs=True)
    assert graphed.tokens == eager.tokens
    decode = [step for step in graphed.steps if step["phase"] == "decode"]
    modes = [step["graph"] for step in decode]
    assert modes[0] == "capture" and set(modes[1:]) == {"replay"}, [step["eager_reason"] for step in decode]
    assert graphed.counters["graph_replays"] == len(decode) - 1
    # replays are counted exactly: the same arm and Triton-kernel totals as the eager run
    assert graphed.counters["arms"] == eager.counters["arms"]
    assert graphed.counters["kernels"] == eager.counters["kernels"]
    for step in decode[1:]:
        assert len(step["moe"]) == demo.config.n_layers and all(record["graph"] == "replay" for record in step["moe"])
        assert all(record["woken_observed"] >= 1 for record in step["moe"])  # refilled by each replay
        assert step["kernel_launches"] == decode[1]["kernel_launches"]


def test_run_ahead_gives_the_same_tokens_and_counters_as_without_it(demo):
    batch = prompts([40, 17, 130, 64])
    runs = {}
    for run_ahead in (False, True):
        runner = BatchRunner(demo, len(batch), 130 + 24 - 1, graphs=True, run_ahead=run_ahead)
        runs[run_ahead] = (demo.generate_batch(batch, 24, resolved(), runner=runner, timed=False), runner)
    (off, off_runner), (on, on_runner) = runs[False], runs[True]
    assert on.tokens == off.tokens
    assert on.counters == off.counters
    assert off_runner.run_ahead_launches == 0 and on_runner.run_ahead_launches > 0
    assert on_runner.input_copies == off_runner.input_copies
    for first, second in zip(off.steps, on.steps):
        assert (first["step"], first["graph"], first["kernel_launches"], first["moe"] == second["moe"]) == (
            second["step"], second["graph"], second["kernel_launches"], True)
        assert second["device_us"] > 0 and second["host_us"] > 0


@pytest.mark.parametrize("lengths", [[40], [40, 17, 64]])
def test_two_replays_in_flight_give_the_eager_tokens(demo, lengths):
    """Depth-2 run-ahead: each step's next replay is launched before its sync, and each step reads its
    outputs from its own pinned landing buffer; the tokens must be the eager run's, at batch 1 and 3,
    in a first run (capture, then replays) and a second one on the same runner (replays from the start)."""
    batch = prompts(lengths, seed=len(lengths))
    eager = demo.generate_batch(batch, 16, resolved(), graphs=False)
    runner = BatchRunner(demo, len(batch), max(lengths) + 16 - 1, graphs=True, run_ahead=True)
    for run in range(2):
        launches = runner.run_ahead_launches
        # one step per launch: every step's own replay launched ahead (several steps: the test above)
        graphed = demo.generate_batch(batch, 16, resolved("steps_per_graph=1"), runner=runner)
        assert graphed.tokens == eager.tokens, run
        decode = [step for step in graphed.steps if step["phase"] == "decode"]
        assert [step["graph"] for step in decode] == ["capture" if run == 0 else "replay"] + ["replay"] * 14
        # launched ahead: every replay but the first of the run (run 0: the one after the capture)
        assert runner.run_ahead_launches - launches == (13 if run == 0 else 14)
        assert runner.ahead is None
        for step in decode[1:]:
            assert step["device_us"] > 0 and step["host_us"] > 0
            assert all(record["woken_observed"] >= 1 for record in step["moe"])
        # the counts each step observed are its own: equal to the eager step's
        assert [[record["woken_observed"] for record in step["moe"]] for step in decode] == [
            [record["woken_observed"] for record in step["moe"]]
            for step in eager.steps if step["phase"] == "decode"]


@pytest.mark.parametrize("run_ahead,fold", [(True, "on"), (False, "on"), (True, "off"), (True, "first")])
@pytest.mark.parametrize("lengths,steps", [([40], 4), ([40, 17, 130, 64], 3)])
def test_graphs_of_several_steps_give_the_eager_tokens_and_counts(demo, lengths, steps, run_ahead, fold):
    """steps_per_graph: one launch replays several decode steps, each fed by the one before on the device
    (its LM head's argmax) and writing its tokens and woken counts into its own row of the landing buffer.
    Tokens, every step's observed counts and the arm totals must be the eager run's, in a first run (capture)
    and a second one on the same runner; each step's kernel launches the eager step's, but where a one-row step
    of a graph of several carries the next one's first norm (engine.decode_fused.StepOutputs.carry): its LM head
    is gemv_pick_norm, and the step after launches no rms_norm (with qkv_norm_fold on or off: the fold leaves the
    first layer's norm to the carry). `first`: qkv_norm_fold on and carry_norm off, the first norm folded too and
    nothing carried."""
    from engine.decode_fused import carried_launches

    settings = ("qkv_norm_fold=on", "carry_norm=off") if fold == "first" else (f"qkv_norm_fold={fold}",)
    batch = prompts(lengths, seed=7 + len(lengths))
    eager = demo.generate_batch(batch, 24, resolved(*settings), graphs=False)
    eager_decode = [step for step in eager.steps if step["phase"] == "decode"]
    eager_woken = [[record["woken_observed"] for record in step["moe"]] for step in eager_decode]
    runner = BatchRunner(demo, len(batch), max(lengths) + 24 - 1, graphs=True, run_ahead=run_ahead)
    for run in range(2):
        graphed = demo.generate_batch(batch, 24, resolved(f"steps_per_graph={steps}", *settings), runner=runner)
        assert graphed.tokens == eager.tokens, run
        assert graphed.counters["arms"] == eager.counters["arms"]
        decode = [step for step in graphed.steps if step["phase"] == "decode"]
        carried = 0
        for step, eager_step in zip(decode, eager_decode):
            one_row = len(step["rows"]) == 1 and fold != "first"  # a one-row step carries, unless carry_norm=off
            carried_in = one_row and step["span_index"] > 0
            carried += carried_in
            expected = carried_launches(eager_step["kernel_launches"], carried_in,
                                        one_row and step["span_index"] + 1 < step["span"])
            assert step["kernel_launches"] == expected, (step["step"], step["span"], step["span_index"])
        if lengths == [40] and fold != "first":  # one row throughout: every later step of a graph is carried in
            assert carried > 0
        totals = dict(eager.counters["kernels"])
        for name, change in (("rms_norm", -carried), ("gemv_pick", -carried), ("gemv_pick_norm", carried)):
            totals[name] = totals.get(name, 0) + change
        assert graphed.counters["kernels"] == {name: count for name, count in totals.items() if count}
        assert [[record["woken_observed"] for record in step["moe"]] for step in decode] == eager_woken
        spans = [step["span"] for step in decode if step["span_index"] == 0]
        assert spans.count(steps) >= 5, spans  # 23 decode steps: blocks, then single steps at the tail
        launched = graphed.counters["graph_launches"]
        assert launched == graphed.counters["graph_replays"] - sum(span - 1 for span in spans)  # tails: K / 2, ...
        assert runner.served is None and runner.ahead is None
        for step in decode[1:]:
            assert step["device_us"] > 0 and step["host_us"] > 0
    assert not runner.block_notes


def _device_kernels_per_decode_step(engine, batch_size, gate):
    from torch.profiler import ProfilerActivity, profile

    runner = BatchRunner(engine, batch_size, 16 + 8, graphs=True)
    batch = prompts([16] * batch_size, seed=batch_size)
    engine.generate_batch(batch, 8, resolved(gate), runner=runner)  # warm-up: compile, capture
    runner.label_steps = True
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        result = engine.generate_batch(batch, 8, resolved(gate), runner=runner)
    runner.label_steps = False
    kernels, ranges = bench._profile_events(prof)
    replays = [step for step in result.steps if step["graph"] == "replay"]
    assert len(replays) == 7, [step["graph"] for step in result.steps]
    per_step = []
    for step in replays:
        start, end = ranges[step["step"]]
        per_step.append(sum(1 for _, begin, _ in kernels if start <= begin <= end))
    return replays, per_step


@pytest.mark.parametrize("gate", ["moe_gate=gemv", "moe_gate=grouped"])
def test_launches_per_decode_step_are_the_same_at_batch_1_and_32(demo, gate):
    single, single_kernels = _device_kernels_per_decode_step(demo, 1, gate)
    wide, wide_kernels = _device_kernels_per_decode_step(demo, 32, gate)
    # the engine's own counters: one launch of each arm per layer and the same Triton launches per step
    for step in single + wide:
        assert len(step["moe"]) == len(step["attention"]) == demo.config.n_layers
    # 6 and 192 pairs both take alignment's one-launch path (up to 512 pairs, kernels/moe_align.py),
    # so every Triton kernel launches the same number of times at batch 1 and batch 32 -- except the
    # dense products, which take GEMVs at one row and cuBLAS above (engine.decode_fused.GEMV_ROWS):
    # 3 per layer (q/k/v, o, router) plus the LM head, whatever the batch, in one kernel or the other;
    # and the glue the one-row GEMVs fold in (kernels.gemv_fused): the top-k into the router, the norms
    # in front of the router and the LM head, the step's next tokens (kernels.next_tokens) into the LM
    # head, and (qkv_norm_fold) each later layer's attention norm into its q/k/v GEMV (the first layer's norm is
    # the carry's, carry_norm: this step is not carried). rope_cache stays.
    layers = demo.config.n_layers
    single_launches, wide_launches = dict(single[-1]["kernel_launches"]), dict(wide[-1]["kernel_launches"])
    products = {name: single_launches.pop(name, 0) for name in ("gemv", "gemv_route", "gemv_norm", "gemv_pick")}
    assert products == {"gemv": layers + 1, "gemv_route": layers, "gemv_norm": layers - 1, "gemv_pick": 1}
    assert not wide_launches.keys() & products.keys()
    folded = {"rms_norm": 2 * layers, "topk_softmax": layers, "next_tokens": 1}
    for name, count in folded.items():
        wide_launches[name] -= count
    assert single_launches == {name: count for name, count in wide_launches.items() if count}
    arms = [{record["executed_arm"] for record in steps[-1]["moe"]} for steps in (single, wide)]
    assert arms[0] == arms[1], arms
    # every device kernel the profiler saw: a host loop over sequences would add >= 31 per layer;
    # cuBLAS may pick a split-K variant (one extra reduction) for some of the 5 GEMMs per layer at M=32
    # the first replay after capture may copy its inputs once; the steady replays launch a fixed set
    single_kernels, wide_kernels = single_kernels[1:], wide_kernels[1:]
    assert len(set(single_kernels)) == 1 and len(set(wide_kernels)) == 1, (single_kernels, wide_kernels)
    gap = wide_kernels[0] - single_kernels[0] - sum(folded.values())
    assert abs(gap) <= 5 * layers + 1, (single_kernels, wide_kernels)


def test_batched_prefill_at_batch_1_gives_generates_first_token(demo):
    for prompt in prompts([23, 300], seed=5):
        single = demo.generate(prompt, 1, resolved())
        batched = demo.generate_batch([prompt], 1, resolved())
        assert batched.tokens == [single.tokens]


def test_gpu_drawn_weights_are_seeded():
    from engine.config import PRESETS

    first = bench.device_random_weights(PRESETS["tiny"], 3, torch.device("cuda"), torch.bfloat16)
    second = bench.device_random_weights(PRESETS["tiny"], 3, torch.device("cuda"), torch.bfloat16)
    assert all(torch.equal(first[name], second[name]) for name in first)


def test_bench_on_demo_has_both_clocks_graphs_targets_and_a_profile():
    output = io.StringIO()
    with redirect_stdout(output):
        code = main(["bench", "--model", "demo", "--pp", "64", "--tg", "16", "--batch", "1,4", "--reps", "2",
                     "--format", "json", "--profile", "--no-progress"])
    assert code == 0
    report = json.loads(output.getvalue())
    rows = {row["test"]: row for row in report["rows"]}
    for row in rows.values():
        assert row["tps_device"] is not None and row["tps_device"]["mean"] > 0
        assert row["clock_disagreement"] is not None
        kernels = row["profile"]["kernels"]
        assert kernels and sum(entry["calls"] for entry in kernels) > 0
    for name in ("tg16", "tg16 @ b4"):
        assert rows[name]["state"] == "steady"
        assert rows[name]["graph_steps"] > 0 and rows[name]["counters"]["graph_replays"] > 0
    target = report["targets"]["rows"][0]
    assert target["test"] == "tg16" and target["host_share"] is not None and target["ratio_to_bound"] > 0
    assert report["footer"]["versions"]["cuda"]
