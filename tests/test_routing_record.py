"""Recording routing (engine.routing_record): what a run records is what its router chose, step by step and layer by
layer, on the eager path and on the graph path's host side (CPU stub graphs), and the recorder's memory is a
prefix of the run bounded by its cap."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from engine import flags, routing_record
from engine.dispatcher import Dispatcher
from engine.routing_record import RoutingRecorder, pack, unpack, words_per_token
from engine.runtime import Engine
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from graph_stubs import host_step, stub_runner


@pytest.fixture(scope="module")
def tiny():
    return Engine.load("tiny", "cpu", seed=0, weights="random")


def _rows(count: int, layers: int, top_k: int, experts: int, seed: int) -> np.ndarray:
    generator = torch.Generator().manual_seed(seed)
    pairs = []
    for _ in range(layers):
        ids = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(count)]).to(torch.int32)
        weights = torch.softmax(torch.randn(count, top_k, generator=generator), dim=1).to(torch.bfloat16)
        pairs.append((ids, weights))
    return pack(pairs).numpy(), pairs


@pytest.mark.parametrize("count,layers,top_k,experts", [
    (1, 1, 1, 2),  # one token, one layer, top-1
    (33, 3, 6, 67),  # odd token count, prime expert count
    (5, 2, 8, 8),  # every expert woken by every token
])
def test_pack_then_unpack_gives_the_ids_and_the_bf16_weights_back(count, layers, top_k, experts):
    packed, pairs = _rows(count, layers, top_k, experts, seed=count)
    assert packed.shape == (count, words_per_token(layers, top_k)) and packed.dtype == np.int16
    ids, bits = unpack(packed, layers, top_k)
    for layer, (layer_ids, layer_weights) in enumerate(pairs):
        assert (ids[:, layer] == layer_ids.numpy()).all()
        assert (bits[:, layer] == layer_weights.view(torch.int16).numpy().view(np.uint16)).all()
        assert (routing_record.bf16_to_float(bits[:, layer]) == layer_weights.float().numpy()).all()


def test_cpu_float32_weights_are_rounded_to_bf16():
    ids = torch.tensor([[3, 1]], dtype=torch.int32)
    weights = torch.tensor([[0.7000001, 0.2999999]], dtype=torch.float32)
    _, bits = unpack(pack([(ids, weights)]).numpy(), 1, 2)
    assert (routing_record.bf16_to_float(bits[:, 0]) == weights.to(torch.bfloat16).float().numpy()).all()


def _spy(monkeypatch) -> list:
    """Every (step, layer, ids, weights) the MoE hook receives."""
    seen = []
    original = Dispatcher.moe

    def moe(self, layer, h, w13, w2, topk_ids, topk_weights, experts=None, woken=None):
        seen.append((self.step, layer, topk_ids.clone(), topk_weights.clone()))
        return original(self, layer, h, w13, w2, topk_ids, topk_weights, experts, woken)

    monkeypatch.setattr(Dispatcher, "moe", moe)
    return seen


def test_a_batched_run_records_what_every_step_routed(tiny, monkeypatch):
    seen = _spy(monkeypatch)
    resolved = flags.resolve(["record_routing=on", "prefill_chunk=16"], environ={})
    prompts = [list(b"the routing of a longer prompt, in chunks"), list(b"short"), list(b"a third one")]
    run = tiny.generate_batch(prompts, [6, 9, 4], resolved)
    recording = run.routing
    assert recording.layers == (0, 1) and recording.experts == 8 and recording.top_k == 2
    assert list(recording.steps) == [step["step"] for step in run.steps]  # every step, in order
    assert [recording.phase(index) for index in range(recording.n_steps)] == [step["phase"] for step in run.steps]
    assert list(np.diff(recording.offsets)) == [step["n_tokens"] for step in run.steps]
    assert {"mixed", "prefill", "decode"} <= {step["phase"] for step in run.steps}
    for index, step in enumerate(run.steps):
        rows = recording.step_rows(index)
        for position, layer in enumerate(recording.layers):
            step_number, hook_layer, ids, weights = seen.pop(0)
            assert (step_number, hook_layer) == (step["step"], layer)
            assert (recording.ids[rows, position] == ids.numpy()).all()
            assert (recording.weights[rows, position] == weights.to(torch.bfloat16).float().numpy()).all()
            # the record's observed woken count and the recording agree
            assert step["moe"][position]["woken_observed"] == len(np.unique(recording.ids[rows, position]))
    assert not seen and recording.truncated is None and recording.unrecorded == []
    header = recording.header
    assert header["model"] == "tiny" and header["prompt"]["tokens"] == [len(p) for p in prompts]
    assert header["flags"]["record_routing"] is True and header["config"]["experts"] == 8


def test_off_by_default_and_the_same_tokens_on(tiny):
    off = tiny.generate("recorded or not", 6, flags.resolve([], environ={}))
    on = tiny.generate("recorded or not", 6, flags.resolve(["record_routing=on"], environ={}))
    assert off.routing is None and on.routing is not None
    assert on.tokens == off.tokens
    assert on.routing.header["prompt"]["text"] == "recorded or not"


def test_at_the_cap_later_steps_are_not_recorded(tiny, monkeypatch):
    row_bytes = 2 * (words_per_token(2, 2) + 3)  # a token's routing, then its step's number and phase

    class Small(RoutingRecorder):
        def __init__(self, experts, top_k, cap_bytes):
            super().__init__(experts, top_k, 20 * row_bytes)  # 20 tokens

    monkeypatch.setattr(routing_record, "RoutingRecorder", Small)
    full = tiny.generate("twelve bytes", 12, flags.resolve(["record_routing=on"], environ={}))
    recording = full.routing
    # the 12-token prefill and then 8 one-token decode steps fit; the 9th decode step (step 9) does not
    assert recording.n_steps == 9 and recording.tokens == 20
    assert list(recording.steps) == list(range(9))
    assert recording.truncated == {"at_step": 9, "dropped_steps": 3, "dropped_tokens": 3, "cap_bytes": 20 * row_bytes}
    assert len(full.steps) == 12


def test_the_recorders_memory_grows_linearly_and_stops_at_the_cap():
    row_bytes = 2 * (words_per_token(3, 4) + 3)
    cap = 10 * routing_record.CHUNK_ROWS * row_bytes + 5 * row_bytes  # ten chunks and a short one
    recorder = RoutingRecorder(16, 4, cap)
    rows, _ = _rows(7, 3, 4, 16, seed=1)
    held = []
    step = 0
    while recorder.truncated is None:
        recorder.append(step, "decode", (0, 1, 2), rows)
        held.append((recorder.rows, recorder.nbytes))
        step += 1
    kept = recorder.n_steps
    assert kept == step - 1 and recorder.truncated["at_step"] == kept
    assert kept == cap // row_bytes // 7  # every step that fits: 7 rows each
    for tokens, allocated in held:  # linear: whole chunks, never more than one chunk ahead, never past the cap
        assert tokens * row_bytes <= allocated <= min(cap, (tokens + routing_record.CHUNK_ROWS) * row_bytes)
    for later in range(step, step + 5):
        recorder.append(later, "decode", (0, 1, 2), rows)
    assert recorder.truncated["dropped_steps"] == 6 and recorder.n_steps == kept
    recording = recorder.finish({"model": "x"})
    assert recording.tokens == 7 * kept and list(recording.steps) == list(range(kept))
    assert (recording.ids[-7:] == unpack(rows, 3, 4)[0]).all() and (np.diff(recording.offsets) == 7).all()


def test_a_block_at_the_cap_keeps_the_steps_that_fit():
    words = words_per_token(1, 2)
    recorder = RoutingRecorder(8, 2, 2 * (words + 3) * 10)  # 10 rows
    block = np.arange(4 * 3 * words, dtype=np.int16).reshape(4, 3, words)  # 4 steps of 3 rows
    recorder.append_block(10, (0,), block)
    recorder.append_block(14, (0,), block)
    recording = recorder.finish()
    assert list(recording.steps) == [10, 11, 12] and recording.tokens == 9  # 12 rows would pass 10
    assert recording.truncated["at_step"] == 13 and recording.truncated["dropped_steps"] == 5
    kept_rows = block[:3].reshape(9, words)
    assert (recording.ids.reshape(9, 2) == np.ascontiguousarray(kept_rows[:, :4]).view(np.int32)).all()


def test_a_step_routing_other_layers_is_a_bug_not_a_silent_mix():
    recorder = RoutingRecorder(8, 2, 1 << 20)
    recorder.append(0, "prefill", (0, 1), np.zeros((3, words_per_token(2, 2)), np.int16))
    with pytest.raises(RuntimeError, match="layers"):
        recorder.append(1, "decode", (0,), np.zeros((1, words_per_token(1, 2)), np.int16))


# ------------------------------------------------------------------------------------------------------------
# The graph path's host side, on CPU stub graphs (bench/host_step.py): a replayed launch's steps come from its
# instance's landing buffer, read at the launch's sync, numbered and served as the launch's steps
# ------------------------------------------------------------------------------------------------------------

def _stand_in(token: int, position: int, layers: int, top_k: int, experts: int) -> list:
    """The routing a stub replay 'computes' for a row fed `token` at `position`: distinct ids, bf16 weights."""
    pairs = []
    for layer in range(layers):
        base = (31 * token + 7 * position + 3 * layer) % experts
        ids = torch.tensor([[(base + pick) % experts for pick in range(top_k)]], dtype=torch.int32)
        weights = torch.tensor([[(position % 5 + 1) / (pick + 2) for pick in range(top_k)]]).to(torch.bfloat16)
        pairs.append((ids, weights))
    return pairs


class _Routed:
    """A stub replay's step that first lands the stand-in routing of the rows it is fed."""

    def __init__(self, replay, landing, config) -> None:
        self.replay, self.landing, self.config = replay, landing, config

    def __call__(self) -> None:
        tokens, positions = self.replay.inputs.tolist()
        c = self.config
        for row, (token, position) in enumerate(zip(tokens, positions)):
            self.landing[row] = pack(_stand_in(token, position, c.n_layers, c.top_k, c.n_experts))[0]
        self.replay()


def _landing_capture(runner, engine):
    """Wrap the stub capture so every graph it makes has routing landings its replays write."""
    stub_capture = runner._capture

    def capture(batch, dispatcher, key, values):
        tokens = stub_capture(batch, dispatcher, key, values)
        layers = tuple(layer for layer, _, _ in dispatcher.pending_routing)
        words = words_per_token(len(layers), engine.config.top_k)
        captured = runner._graphs[key]
        for graph in (captured, *filter(None, [captured.block]), *captured.tails):
            size = graph.inputs.shape[1]
            graph.routing = tuple(torch.zeros((graph.steps, size, words), dtype=torch.int16) for _ in range(2))
            graph.routing_layers = layers
            graph.routing_views = tuple(landing.numpy() for landing in graph.routing)
            for instance, stub in enumerate(graph.graphs):
                work = stub.work
                replays = work.steps if isinstance(work, host_step._BlockReplay) else [work]
                routed = [_Routed(replay, graph.routing[instance][index], engine.config)
                          for index, replay in enumerate(replays)]
                if isinstance(work, host_step._BlockReplay):
                    work.steps = routed
                else:
                    stub.work = routed[0]
        return tokens

    runner._capture = capture


def _drive(engine, runner, prompts, max_tokens, steps_per_graph):
    resolved = flags.resolve([f"steps_per_graph={steps_per_graph}", "record_routing=on"], environ={})
    chunk = resolved["prefill_chunk"]
    scheduler = Scheduler(runner.max_slots, runner.capacity, max(chunk, 2048), chunk)
    dispatcher = Dispatcher(engine, resolved, timed=False)
    sequences = [Sequence(prompt, count) for prompt, count in zip(prompts, max_tokens)]
    for sequence in sequences:
        scheduler.add(sequence, 0.0)
    steps = []
    while scheduler.has_work():
        steps.extend(Engine._next_steps(scheduler, runner, dispatcher, time.perf_counter))
    return sequences, steps, dispatcher.routing.finish()


@pytest.mark.parametrize("run_ahead", [True, False])
@pytest.mark.parametrize("steps_per_graph", [1, 4])
@pytest.mark.parametrize("prompts,max_tokens,slots", [
    ([list(b"hello!")], [20], 1),  # one steady cohort: launches of 4, then the tails
    ([list(b"abcd"), list(b"wxyz!")], [7, 15], 2),  # a row ends early: the rest run eagerly from slot 1
])
def test_replayed_steps_record_what_their_graph_landed(tiny, prompts, max_tokens, slots, steps_per_graph,
                                                      run_ahead):
    capacity = max(len(prompt) for prompt in prompts) + max(max_tokens) - 1
    runner = stub_runner(tiny, slots, capacity, run_ahead)
    _landing_capture(runner, tiny)
    sequences, steps, recording = _drive(tiny, runner, prompts, max_tokens, steps_per_graph)
    assert list(recording.steps) == [step["step"] for step in steps] and recording.unrecorded == []
    by_id = {sequence.request_id: list(sequence.prompt) + list(sequence.generated) for sequence in sequences}
    replayed = 0
    c = tiny.config
    for index, step in enumerate(steps):
        rows = recording.ids[recording.step_rows(index)]
        if step["graph"] != "replay":
            for position in range(c.n_layers):  # eager: what the records observed
                assert step["moe"][position]["woken_observed"] == len(np.unique(rows[:, position]))
            continue
        replayed += 1
        for row, record in enumerate(step["rows"]):
            fed = by_id[record["request_id"]][record["start"]]
            expected = _stand_in(fed, record["start"], c.n_layers, c.top_k, c.n_experts)
            for position, (ids, weights) in enumerate(expected):
                assert (rows[row, position] == ids.numpy()[0]).all(), (step["step"], row, position)
                bits = recording.weight_bits[recording.step_rows(index)][row, position]
                assert (bits == weights.view(torch.int16).numpy()[0].view(np.uint16)).all()
    assert replayed >= 5
    if steps_per_graph > 1:
        assert any(step["span"] == steps_per_graph for step in steps)  # served steps were recorded too


def test_a_graph_without_routing_landings_names_the_steps_it_could_not_record(tiny):
    runner = stub_runner(tiny, 1, 32, True)  # the plain stub: its graphs land tokens and counts only
    _, steps, recording = _drive(tiny, runner, [list(b"hello!")], [12], 4)
    replayed = [step["step"] for step in steps if step["graph"] == "replay"]
    assert replayed and not set(replayed) & set(recording.steps.tolist())
    assert sum(count for _, count, _ in recording.unrecorded) == len(replayed)
    assert all(why == "a graph captured without routing landings" for _, _, why in recording.unrecorded)
