"""Every entry point's generation is the batched runtime's: Engine.generate on generate_batch (streaming,
cancelling, keeping logits, reusing the runner), and per-layer µs read back from a profile of replays
(engine.layer_timing) on synthetic timelines."""

import threading

import pytest
import torch

from engine import flags, layer_timing
from engine.model import KVCache, forward
from engine.runtime import Dispatcher, Engine


@pytest.fixture(scope="module")
def tiny():
    return Engine.load("tiny", "cpu", seed=0)


def test_generate_is_one_sequence_of_generate_batch(tiny):
    resolved = flags.resolve(environ={})
    prompt = list(b"a prompt of some length")
    single = tiny.generate(prompt, 9, resolved)
    batched = tiny.generate_batch([prompt], 9, resolved)
    assert single.tokens == batched.tokens[0]
    assert [step["phase"] for step in single.steps] == [step["phase"] for step in batched.steps]
    assert single.graphs == batched.graphs == "off (CPU: no CUDA graphs)"


def test_generate_streams_each_step_with_its_token(tiny):
    seen = []
    result = tiny.generate("stream me", 6, flags.resolve(environ={}), on_step=lambda record, token: seen.append(
        (record["step"], token)))
    assert seen == [(step["step"], step["token"]) for step in result.steps]
    assert [token for _, token in seen] == result.tokens


def test_a_long_prompt_prefills_in_chunks_and_only_its_last_chunk_emits(tiny):
    resolved = flags.resolve(["prefill_chunk=16"], environ={})
    result = tiny.generate(list(range(1, 41)), 3, resolved)  # 40 prompt tokens: chunks of 16, 16, 8
    assert [step["n_tokens"] for step in result.steps[:3]] == [16, 16, 8]
    assert [step["token"] for step in result.steps[:2]] == [None, None]
    assert len(result.logits) == len(result.tokens) == 3


def test_kept_logits_are_the_forward_logits_of_each_step(tiny):
    resolved = flags.resolve(environ={})
    prompt = list(b"logits")
    result = tiny.generate(prompt, 4, resolved)
    assert len(result.logits) == 4 and all(logits.shape == (tiny.config.vocab_size,) for logits in result.logits)
    # the same steps by hand: the prompt, then each generated token fed back
    cache = KVCache.allocate(tiny.config, 1, len(prompt) + 4, tiny.device, tiny.dtype)
    dispatcher = Dispatcher(tiny, resolved, timed=False)
    inputs, start = torch.tensor([prompt]), 0
    for step, token in enumerate(result.tokens):
        logits = forward(tiny.config, tiny.weights, inputs, start, cache, dispatcher)[0]
        assert torch.allclose(logits, result.logits[step], rtol=1e-5, atol=1e-5), f"step {step}"
        assert int(torch.argmax(logits)) == token
        start += inputs.shape[1]
        inputs = torch.tensor([[token]])


def test_without_keep_logits_no_logits_come_back(tiny):
    result = tiny.generate("no logits", 3, flags.resolve(environ={}), keep_logits=False)
    assert result.logits == [] and len(result.tokens) == 3


def test_cancel_ends_the_run_after_the_step_in_flight(tiny):
    cancel = threading.Event()

    def after(record, token):
        if record["step"] == 2:
            cancel.set()

    result = tiny.generate("cancel", 20, flags.resolve(environ={}), on_step=after, cancel=cancel)
    assert result.cancelled and len(result.tokens) == 3
    again = tiny.generate("cancel", 4, flags.resolve(environ={}))  # the runner is left usable
    assert not again.cancelled and len(again.tokens) == 4


def test_the_engine_reuses_its_runner_while_it_is_large_enough(tiny):
    resolved = flags.resolve(environ={})
    tiny.generate("first", 4, resolved)
    runner = tiny._runner
    tiny.generate("second prompt", 8, resolved)
    assert tiny._runner is runner
    tiny.generate([1 + index % 250 for index in range(299)], 100, resolved)  # 398 positions: more than it holds
    assert tiny._runner is not runner and tiny._runner.capacity >= 398


def test_cpu_records_say_how_their_us_were_measured(tiny):
    timed = tiny.generate("timed", 2, flags.resolve(environ={}))
    assert all(record["us"] is not None and record["us_method"] == "cpu wall clock"
               for step in timed.steps for record in step["moe"] + step["attention"])
    assert timed.layer_timing.startswith("cpu wall clock")
    untimed = tiny.generate("timed", 2, flags.resolve(["layer_timing=off"], environ={}))
    assert all(record["us"] is None for step in untimed.steps for record in step["moe"] + step["attention"])
    assert untimed.layer_timing.startswith("off")


# ------------------------------------------------------------------------------------------------
# Reading replayed layers back from a profile
# ------------------------------------------------------------------------------------------------

def _step(step, graph, layers):
    """A step record: per layer an attention arm of one kernel and a MoE arm of two."""
    return {"step": step,
            "attention": [{"step": step, "layer": layer, "graph": graph, "us": None,
                           "arm_kernels": ["_flash_decode_split_kernel"]} for layer in range(layers)],
            "moe": [{"step": step, "layer": layer, "graph": graph, "us": 7.0 if graph == "eager" else None,
                     "arm_kernels": ["_gate_up_kernel", "_down_kernel"]} for layer in range(layers)]}


def _timeline(steps, glue=("_gemv_kernel", "_rms_norm_kernel")):
    """Kernels as a profile of `steps` would list them, glue around every arm, each with its own duration."""
    kernels, clock = [], 0.0
    for step in steps:
        for layer in range(len(step["moe"])):
            for name in (*glue, "_flash_decode_split_kernel", *glue, "_gate_up_kernel", "_down_kernel"):
                clock += 1.0
                kernels.append((name, clock, 0.5 + step["step"] + 0.1 * layer + (0.25 if "down" in name else 0)))
    return kernels


def test_replayed_layers_take_their_arm_kernels_in_device_order():
    steps = [_step(0, "eager", 2), _step(1, "capture", 2), _step(2, "replay", 2), _step(3, "replay", 2)]
    kernels = _timeline(steps)
    note = layer_timing.attribute(steps, list(reversed(kernels)))  # any order in: sorted by start
    assert note == "8 replayed layer records timed from the profile"
    for step in steps[2:]:
        for layer in range(2):
            expected_attention = 0.5 + step["step"] + 0.1 * layer
            assert step["attention"][layer]["us"] == round(expected_attention, 1)
            assert step["moe"][layer]["us"] == round(2 * expected_attention + 0.25, 1)
            assert step["moe"][layer]["us_method"] == layer_timing.PROFILED
    assert steps[0]["moe"][0]["us"] == 7.0  # an eager step keeps what its events measured
    assert steps[1]["attention"][0]["us"] is None


def test_a_profile_that_does_not_match_the_records_times_nothing():
    steps = [_step(0, "replay", 2), _step(1, "replay", 2)]
    kernels = _timeline(steps)
    missing = [kernel for kernel in kernels if kernel[0] != "_down_kernel" or kernel[1] < kernels[-1][1]]
    note = layer_timing.attribute(steps, missing)
    assert "not attributed" in note and "_down_kernel" in note
    assert all(record["us"] is None for step in steps for record in step["moe"] + step["attention"])
    extra = _timeline(steps + [_step(2, "replay", 1)])
    note = layer_timing.attribute([_step(0, "replay", 2), _step(1, "replay", 2)], extra)
    assert "left over" in note


def test_records_without_arm_kernels_are_stepped_over():
    steps = [_step(0, "replay", 1)]
    steps[0]["attention"][0]["arm_kernels"] = []  # a torch arm: nothing the profiler can name
    kernels = [kernel for kernel in _timeline(steps) if kernel[0] != "_flash_decode_split_kernel"]
    assert layer_timing.attribute(steps, kernels) == "1 replayed layer records timed from the profile"
    assert steps[0]["attention"][0]["us"] is None and steps[0]["moe"][0]["us"] is not None


def test_a_prompt_token_outside_the_vocabulary_is_refused(tiny):
    from engine.errors import UserError

    with pytest.raises(UserError, match="prompt token 256 is not a token id of tiny"):
        tiny.generate([1, 256], 2, flags.resolve(environ={}))
