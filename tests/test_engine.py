"""The CPU engine: determinism, step records, flags acting on what is computed."""

import subprocess
import sys

import pytest
import torch

from engine import flags
from engine.config import PRESETS
from engine.errors import UserError
from engine.model import random_weights
from engine.runtime import Engine
from engine.sidebyside import compare

PROMPT_300 = ("Mixture-of-Experts layers route every token to a few experts; the grouped GEMM sorts the "
              "pairs by expert and walks them in m-tiles, while the gather GEMV reads each expert once "
              "per pair. Which one wins depends on how full the tiles are, and that depends on tokens, "
              "top-k and the number of experts, always. ")[:300]


@pytest.fixture(scope="module")
def tiny():
    return Engine.load("tiny", "cpu", seed=0)


@pytest.fixture(scope="module")
def demo():
    return Engine.load("demo", "cpu", seed=0)


def test_prompt_is_300_bytes():
    assert len(PROMPT_300.encode()) == 300


def test_weights_are_bit_identical_for_the_same_seed_and_differ_across_seeds():
    first = random_weights(PRESETS["tiny"], 7, torch.device("cpu"), torch.float32)
    second = random_weights(PRESETS["tiny"], 7, torch.device("cpu"), torch.float32)
    other = random_weights(PRESETS["tiny"], 8, torch.device("cpu"), torch.float32)
    assert all(torch.equal(first[name], second[name]) for name in first)
    assert not torch.equal(first["layers.0.w13"], other["layers.0.w13"])


def test_weights_pinned_across_machines():
    # Drawn on the CPU from per-tensor generators: these leading values must not move between
    # machines or torch releases, or checkpoints and recorded sessions stop replaying.
    weights = random_weights(PRESETS["tiny"], 0, torch.device("cpu"), torch.float32)
    assert weights["embed"][0, :3].tolist() == pytest.approx(PINNED_EMBED, abs=1e-6)


PINNED_EMBED = [-0.6738615, 0.5625473, -0.2008674]


def test_generate_twice_gives_identical_tokens(tiny):
    first = tiny.generate("hello experts", 6, flags.resolve(environ={}))
    second = tiny.generate("hello experts", 6, flags.resolve(environ={}))
    assert first.tokens == second.tokens and len(first.tokens) == 6


def test_batch_step_records_open_with_the_dispatchers_step_record(tiny):
    # Engine._batch_step writes the step record inline (one dict literal on the host path of every
    # step) rather than calling Dispatcher.step_record: its leading keys must stay the same
    from engine.runtime import Dispatcher

    result = tiny.generate_batch([[1, 2, 3], [4, 5]], 3, flags.resolve())
    decision_keys = list(Dispatcher(tiny, flags.resolve(), timed=False).step_record())
    for step in result.steps:
        assert list(step)[:len(decision_keys)] == decision_keys


def test_step_records(tiny):
    prompt = "héllo"  # 6 bytes
    result = tiny.generate(prompt, 4, flags.resolve(environ={}))
    assert result.steps[0]["phase"] == "prefill" and result.steps[0]["n_tokens"] == len(prompt.encode())
    for step in result.steps[1:]:
        assert step["phase"] == "decode" and step["n_tokens"] == 1
    for step in result.steps:
        assert [record["layer"] for record in step["moe"]] == list(range(tiny.config.n_layers))
        assert [record["layer"] for record in step["attention"]] == list(range(tiny.config.n_layers))
        for record in step["moe"]:
            assert record["executed_arm"] == "reference"
            assert 1 <= record["woken_observed"] <= tiny.config.n_experts
            assert record["reason"]
    arms = result.counters["arms"]
    assert arms["reference"] == 4 * tiny.config.n_layers and arms["gemv"] == 0 and arms["grouped_v2"] == 0


def test_demo_gate_decisions_on_a_300_byte_prompt(demo):
    def arms(setting):
        result = demo.generate(PROMPT_300, 3, flags.resolve([setting], environ={}))
        return [{record["decided_arm"] for record in step["moe"]} for step in result.steps], result

    tile_fill, result = arms("moe_gate=tile-fill")
    assert tile_fill == [{"grouped"}, {"gemv"}, {"gemv"}]
    assert "pairs per woken expert" in result.steps[0]["moe"][0]["reason"]
    assert result.steps[0]["moe"][0]["boundary"] == 171
    threshold, _ = arms("moe_gate=threshold:16")
    assert threshold[0] == {"grouped"}
    pinned, result = arms("moe_max_tokens=4096")
    assert all(step == {"gemv"} for step in pinned)
    assert "moe_max_tokens=4096" in result.steps[0]["moe"][0]["reason"]


def test_drop_changes_what_the_cpu_computes_on_a_long_prompt(demo):
    base = flags.resolve(environ={})
    dropped = demo.generate(PROMPT_300, 4, base.with_overrides({"fused_mask": "drop"}, flags.COMMAND_LINE))
    honored = demo.generate(PROMPT_300, 4, base)
    summary = compare(dropped, honored)
    assert summary["first_divergence"] is not None or max(summary["logit_rel_err"]) > 1e-3
    assert dropped.steps[0]["attention"][0]["applied_mask"] == "causal"
    assert honored.steps[0]["attention"][0]["applied_mask"].startswith("composite")
    same = compare(honored, demo.generate(PROMPT_300, 4, base))
    assert same["first_divergence"] is None and max(same["logit_rel_err"]) == 0.0


def test_decline_falls_back_to_unfused_only_for_masked_layers(demo):
    result = demo.generate(PROMPT_300, 2, flags.resolve(["fused_mask=decline"], environ={}))
    composite, causal = result.steps[0]["attention"]
    assert composite["decided_arm"] == "unfused" and composite["declined"] and "declined" in composite["reason"]
    assert causal["decided_arm"] == "fused" and not causal["declined"]


def test_flash_512_off_takes_the_unfused_arm(tiny):
    result = tiny.generate("abc", 2, flags.resolve(["flash_512=off"], environ={}))
    assert {record["decided_arm"] for record in result.steps[0]["attention"]} == {"unfused"}


@pytest.mark.parametrize("prompt, max_tokens, fragment", [
    ("x" * 513, 1, "longer than the tiny context of 512"),
    ("x" * 500, 20, "at most 12 tokens"),
    ("abc", 0, "--max-tokens must be >= 1"),
    ("", 3, "prompt is empty"),
])
def test_length_errors(tiny, prompt, max_tokens, fragment):
    with pytest.raises(UserError, match=fragment):
        tiny.generate(prompt, max_tokens, flags.resolve(environ={}))


def test_cancel_stops_between_steps(tiny):
    import threading

    cancel = threading.Event()
    seen = []

    def on_step(record, token):
        seen.append(token)
        if len(seen) == 2:
            cancel.set()

    result = tiny.generate("abc", 50, flags.resolve(environ={}), on_step=on_step, cancel=cancel)
    assert result.cancelled and len(result.tokens) == 2


def test_engine_and_kernels_import_without_inspector_or_textual():
    code = ("import sys\n"
            "for blocked in ('textual', 'plotext', 'textual_plotext', 'tomli_w', 'inspector'):\n"
            "    sys.modules[blocked] = None\n"
            "import engine.runtime, engine.dispatch, engine.flags, engine.sidebyside, kernels.reference\n"
            "print('ok')\n")
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=".")
    assert completed.returncode == 0, completed.stderr


def test_launch_counts_of_replays_are_added_when_read():
    # record_many counts a captured mapping per replay and adds it into the totals only when they are read;
    # snapshot and since see every replay, interleaved with plain records, in any order of mappings.
    from kernels import launches

    before = launches.snapshot()
    first, second = {"test_kernel_a": 2, "test_kernel_b": 1}, {"test_kernel_a": 1}
    for _ in range(3):
        launches.record_many(first)
    launches.record("test_kernel_b", 4)
    launches.record_many(second)
    launches.record_many(first)
    assert launches.since(before) == {"test_kernel_a": 9, "test_kernel_b": 8}
    middle = launches.snapshot()
    launches.record_many(second)
    assert launches.since(middle) == {"test_kernel_a": 1}
    assert launches.snapshot()["test_kernel_a"] - before.get("test_kernel_a", 0) == 10


def test_launch_counts_read_on_another_thread_lose_no_replay():
    # The TUI reads counts on its own thread while the engine's thread records replays: a read adds the pending
    # replays into the totals, and a replay recorded meanwhile must not be lost. Threads switch every microsecond
    # and the recording goes on until the reader has read many times, so an unguarded read loses counts here.
    import sys
    import threading

    from kernels import launches

    before = launches.snapshot()
    counts = {"test_kernel_threads": 3}
    done, reads = threading.Event(), [0]

    def reader():
        while not done.is_set():
            launches.since(before)
            reads[0] += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    thread = threading.Thread(target=reader)
    thread.start()
    recorded = 0
    try:
        while recorded < 100_000 or (reads[0] < 20_000 and recorded < 5_000_000):
            launches.record_many(counts)
            recorded += 1
    finally:
        done.set()
        thread.join()
        sys.setswitchinterval(interval)
    assert reads[0] >= 20_000, reads[0]
    assert launches.since(before)["test_kernel_threads"] == 3 * recorded
