"""Graphs of several decode steps (the flag steps_per_graph), on a CPU with the stub graphs of
bench/host_step.py: a replay of K steps computes what K one-step replays compute (each step fed by
the one before, on the "device"), is launched only when the scheduler reserves all K steps, and its
later steps are served from the host with their own records, counters and clocks."""

import time

import pytest

from engine import bench, flags
from engine.runtime import Dispatcher, Engine
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from graph_stubs import drive, host_step, stub_runner, without_clocks

_CLOCKS = ("started", "ended", "host_us", "device_us", "span", "span_index")


@pytest.fixture(scope="module")
def tiny():
    return Engine.load("tiny", "cpu", seed=0, weights="random")


def _drive(engine, runner, prompts, max_tokens, steps_per_graph, add_later=()):
    sequences, steps, _, counters = drive(engine, runner, prompts, max_tokens, add_later, steps_per_graph)
    return sequences, steps, counters


def _launches(steps):
    """Each launch's steps: lists of consecutive step records, split where span_index is 0."""
    groups = []
    for step in steps:
        if step["span_index"] == 0:
            groups.append([])
        groups[-1].append(step)
    return groups


CASES = [
    ([list(b"hello!")], 20, 1, []),  # one steady cohort: blocks, then single steps at the tail
    ([list(b"abcd"), list(b"wxyz!")], [7, 15], 2, []),  # one row ends early: then eager (slot 1)
    ([list(b"abcd"), list(b"efgh"), list(b"ijkl")], [6, 9, 17], 2, []),  # one waits for a slot
]


@pytest.mark.parametrize("race", [False, True])
@pytest.mark.parametrize("run_ahead", [True, False])
@pytest.mark.parametrize("prompts,max_tokens,slots,later", CASES)
@pytest.mark.parametrize("steps_per_graph", [2, 4])
def test_several_steps_per_graph_record_what_one_step_graphs_record(tiny, prompts, max_tokens, slots, later,
                                                                    steps_per_graph, run_ahead, race):
    capacity = max(len(prompt) for prompt in prompts) + max(
        max_tokens if isinstance(max_tokens, list) else [max_tokens]) - 1
    results = {}
    for steps in (1, steps_per_graph):
        runner = stub_runner(tiny, slots, capacity, run_ahead, race)
        sequences, records, counters = _drive(tiny, runner, prompts, max_tokens, steps, later)
        results[steps] = sequences, records, counters, runner
    one, several = results[1], results[steps_per_graph]
    assert [s.generated for s in several[0]] == [s.generated for s in one[0]]
    assert without_clocks(several[1], _CLOCKS) == without_clocks(one[1], _CLOCKS)  # records and launch counts alike
    assert several[2]["kernels"] == one[2]["kernels"] and several[2]["arms"] == one[2]["arms"]
    assert several[2]["graph_replays"] == one[2]["graph_replays"] == one[2]["graph_launches"]
    records = several[1]
    groups = _launches(records)
    blocks = [group for group in groups if group[0]["span"] == steps_per_graph]
    assert blocks, "no graph of several steps ran"
    assert {group[0]["span"] for group in groups} <= {steps_per_graph >> shift for shift in range(3)}  # K, K/2, K/4
    assert several[2]["graph_launches"] == one[2]["graph_launches"] - sum(len(group) - 1 for group in groups)
    for group in groups:
        assert len(group) == group[0]["span"] and [step["span_index"] for step in group] == list(range(len(group)))
        if len(group) > 1:
            ids = [row["request_id"] for row in group[0]["rows"]]
            numbers = [step["step"] for step in group]
            assert numbers == list(range(numbers[0], numbers[0] + len(group)))
            for step in group:  # the same cohort throughout, every row emitting: no row finishes inside
                assert step["graph"] == "replay" and [row["request_id"] for row in step["rows"]] == ids
                assert all(row["emitted"] is not None for row in step["rows"])
                assert step["device_us"] == pytest.approx(250.0 / len(group))  # the stub launch's 0.25 ms
                # stamped at the launch: the first step's start (launched ahead) or just after it
                assert group[0]["started"] <= step["started"] <= group[0]["ended"] and step["host_us"] > 0
    assert several[3].served is None and several[3].ahead is None


@pytest.mark.parametrize("run_ahead", [True, False])
def test_a_runs_last_steps_go_by_the_largest_graphs_that_fit(tiny, run_ahead):
    """K = 8 and 20 tokens: 19 decode steps after the prefill's. The first is the capture; 16 then go by two graphs
    of 8; the last two by a graph of 2 (a tail: `_DecodeGraph.tails`), not two launches of one step each. Without
    run-ahead too (each launch then reserves its own steps)."""
    runner = stub_runner(tiny, 1, 6 + 20 - 1, run_ahead)
    sequences, steps, counters = _drive(tiny, runner, [list(b"hello!")], 20, 8)
    assert [len(sequence.generated) for sequence in sequences] == [20]
    spans = [group[0]["span"] for group in _launches(steps) if group[0]["phase"] == "decode"]
    assert spans == [1, 8, 8, 2], spans
    assert counters["graph_launches"] == 3 and counters["graph_replays"] == 18


@pytest.mark.parametrize("run_ahead", [True, False])
def test_a_sequence_added_while_a_block_runs_is_admitted_after_the_reserved_steps(tiny, run_ahead):
    runner = stub_runner(tiny, 2, 4 + 18 - 1, run_ahead)
    sequences, steps, _ = _drive(tiny, runner, [list(b"abcd")], 18, 4, add_later=[(5, list(b"late"), 6)])
    assert [len(sequence.generated) for sequence in sequences] == [18, 6]
    admitted = next(index for index, step in enumerate(steps) if index > 5 and step["phase"] == "prefill")
    assert steps[admitted - 1]["span_index"] == steps[admitted - 1]["span"] - 1  # the block it waited for ended
    assert all(step["phase"] == "decode" and len(step["rows"]) == 1 for step in steps[6:admitted])
    # while it waited, nothing new was reserved: at most the block in flight and the one launched ahead
    assert admitted - 6 <= 2 * 4


def test_a_block_never_runs_past_a_sequences_last_token_or_the_slot(tiny):
    runner = stub_runner(tiny, 3, 4 + 20 - 1)
    sequences, steps, _ = _drive(tiny, runner, [list(b"abcd")] * 3, [20, 14, 5], 4)  # slots 0, 1 outlast slot 2
    last = {}
    for step in steps:
        for row in step["rows"]:
            last[row["request_id"]] = step["step"]
    blocks = [group for group in _launches(steps) if len(group) > 1]
    assert blocks, "no graph of several steps ran"
    for group in blocks:
        for row in group[0]["rows"]:  # a row's last step may end a block, never sit before its end
            assert last[row["request_id"]] >= group[-1]["step"]
        assert all(row["start"] < runner.capacity for step in group for row in step["rows"])
    # the edge: a graph whose last step is a sequence's last (the second sequence's 14th token)
    assert any(last[row["request_id"]] == group[-1]["step"] for group in blocks for row in group[0]["rows"])
    assert [len(sequence.generated) for sequence in sequences] == [20, 14, 5]


def test_each_step_of_a_block_returns_its_own_tokens(tiny):
    prompts = [list(range(3, 9)), list(range(4, 11))]
    runner = stub_runner(tiny, 2, 7 + 16 - 1, True, race=True)
    sequences, steps, _ = _drive(tiny, runner, prompts, 16, 4)
    replayed = {step["step"] for step in steps if step["graph"] == "replay"}
    checked = 0
    for prompt, sequence in zip(prompts, sequences):
        emitted = [(step["step"], row) for step in steps for row in step["rows"]
                   if row["request_id"] == sequence.request_id and row["emitted"] is not None]
        for index in range(1, len(emitted)):
            number, row = emitted[index]
            if number in replayed:
                fed = sequence.generated[index - 1]
                assert row["emitted"] == host_step.stand_in_token(fed, row["start"], tiny.config.vocab_size)
                checked += 1
    assert checked == 14 * 2


def _until_served(engine, slots):
    """A stub runner, its scheduler and dispatcher, stepped one scheduled step at a time from one 4-byte prompt
    (12 tokens, 4 steps per graph) until a graph's later steps wait to be served: (runner, scheduler, dispatcher,
    resolved flags, the launching step's record)."""
    runner = stub_runner(engine, slots, 4 + 12 - 1)
    resolved = flags.resolve(["steps_per_graph=4"], environ={})
    scheduler = Scheduler(slots, runner.capacity, 2048, resolved["prefill_chunk"])
    dispatcher = Dispatcher(engine, resolved, timed=False)
    scheduler.add(Sequence(list(b"abcd"), 12), 0.0)
    while runner.served is None:
        launching = Engine._batch_step(scheduler, runner, dispatcher, time.perf_counter)
    return runner, scheduler, dispatcher, resolved, launching


def test_a_step_that_is_not_the_blocks_next_is_refused_and_the_runner_recovers(tiny):
    runner, scheduler, dispatcher, resolved, launching = _until_served(tiny, 2)
    served = runner.served
    served.values[0][0] += 1  # the graph computed another token than the one its launching step returned
    with pytest.raises(RuntimeError, match="broke its reservation"):
        Engine._served_steps(scheduler, runner, dispatcher, time.perf_counter, launching)
    assert runner.served is None and runner.ahead is None and served.captured.holds is None
    again = tiny.generate_batch([list(b"abcd")], 12, resolved, runner=runner)
    fresh = stub_runner(tiny, 2, 4 + 12 - 1)
    tiny.generate_batch([list(b"abcd")], 12, resolved, runner=fresh)  # captures, as `runner` did
    assert again.tokens == tiny.generate_batch([list(b"abcd")], 12, resolved, runner=fresh).tokens


def test_a_run_that_ends_inside_a_block_drops_its_later_steps(tiny, monkeypatch):
    runner = stub_runner(tiny, 1, 4 + 16 - 1)
    resolved = flags.resolve(["steps_per_graph=4"], environ={})
    original, calls = Scheduler.serve_reserved, []

    def failing(self, step, tokens, now=None):
        calls.append(step)
        if len(calls) == 2:  # the third step of the first block (its second served from the host)
            raise KeyboardInterrupt
        return original(self, step, tokens, now)

    monkeypatch.setattr(Scheduler, "serve_reserved", failing)
    with pytest.raises(KeyboardInterrupt):
        tiny.generate_batch([list(b"abcd")], 16, resolved, runner=runner)
    assert runner.served is None and runner.ahead is None
    monkeypatch.setattr(Scheduler, "serve_reserved", original)
    again = tiny.generate_batch([list(b"abcd")], 16, resolved, runner=runner)
    one = stub_runner(tiny, 1, 4 + 16 - 1)
    single = flags.resolve(environ={})
    tiny.generate_batch([list(b"abcd")], 16, single, runner=one)
    assert again.tokens == tiny.generate_batch([list(b"abcd")], 16, single, runner=one).tokens


def test_the_steady_window_opens_only_where_a_launch_begins():
    def event(index, ended, span_index):
        return bench.StepEvent(float(index), ended, (7,), span_index == 0)

    # depth floor 3 is reached at event 2, the second step of a block of 4 (events 1..4)
    events = [event(0, 0.0, 0)] + [event(1 + k, 1.0 + 0.01 * k, k) for k in range(4)] + \
             [event(5 + k, 2.0 + 0.01 * k, k) for k in range(4)]
    window = bench.steady_window(events, [7], 3)
    # the window's steps are the next launch's; its time starts at the first step of the graph (its sync)
    assert window.first == 5 and window.started == events[1].ended and window.tokens == 4
    plain = [bench.StepEvent(float(index), float(index), (7,)) for index in range(6)]
    assert bench.steady_window(plain, [7], 3).first == 3  # one step per launch: as before


def test_5000_steps_in_graphs_of_eight_leave_no_cyclic_garbage_and_no_objects_behind(tiny):
    """As tests/test_graph_replay_host.py's one-step version, at the default steps_per_graph (8): the served
    steps' values and the launches ahead make no reference cycles either."""
    import gc

    runner = stub_runner(tiny, 1, 6 + 500 - 1)
    resolved = flags.resolve(environ={})
    assert resolved["steps_per_graph"] == 8
    tiny.generate_batch([list(b"hello!")], 500, resolved, runner=runner)  # the capture; caches warmed
    gc.collect()
    gc.disable()
    try:
        before = len(gc.get_objects())
        replayed = launched = 0
        for _ in range(10):
            result = tiny.generate_batch([list(b"hello!")], 500, resolved, runner=runner)
            replayed += result.counters["graph_replays"]
            launched += result.counters["graph_launches"]
            del result
        after = len(gc.get_objects())
        unreachable = gc.collect()
    finally:
        gc.enable()
    # 499 replayed steps a run: 62 graphs of 8 (496 steps), then at the tail a graph of 2 and a single step
    assert replayed == 10 * 499 and launched == 10 * (62 + 2)
    assert unreachable == 0
    assert after - before < 50, after - before


def test_a_served_steps_host_work_is_counted_in_its_own_host_time(tiny, monkeypatch):
    """The later steps of a graph are served in one loop; each step's host time still holds its own work: made
    2 ms slower per served step, every served step reports >= 2 ms and a launching step less, so a bench mean
    over the steps counts every served step's cost once."""
    original = Scheduler.serve_reserved

    def slow(self, step, tokens, now=None):
        time.sleep(0.002)
        return original(self, step, tokens, now)

    monkeypatch.setattr(Scheduler, "serve_reserved", slow)
    runner = stub_runner(tiny, 1, 6 + 40 - 1)
    _, steps, _ = _drive(tiny, runner, [list(b"hello!")], 40, 4)
    served = [step for step in steps if step["graph"] == "replay" and step["span_index"]]
    launching = [step for step in steps if step["graph"] == "replay" and not step["span_index"]]
    assert len(served) >= 20 and all(step["host_us"] >= 2000 for step in served)
    assert all(step["host_us"] < 2000 for step in launching)
    for before, step in zip(served, served[1:]):  # stamped in order, each where its own host time ends
        assert step["ended"] > before["ended"]


def test_a_step_run_while_a_graphs_later_steps_are_untaken_is_refused(tiny):
    runner, scheduler, dispatcher, _, _ = _until_served(tiny, 1)
    with pytest.raises(RuntimeError, match="were not taken"):
        Engine._batch_step(scheduler, runner, dispatcher, time.perf_counter)
    assert runner.served is None and runner.ahead is None


def test_a_blocks_later_steps_count_their_launches_in_groups(tiny):
    runner = stub_runner(tiny, 1, 6 + 20 - 1)
    _drive(tiny, runner, [list(b"hello!")], 20, 8)
    block = next(iter(runner._graphs.values())).block
    carried = {"a": 1, "b": 2}
    last = {"a": 1, "c": 1}
    block.step_kernels = (dict(carried), dict(carried), dict(carried), last)
    block.steps = 4
    block.__post_init__()
    assert block.later_kernels == ((carried, 2), (last, 1))  # steps 1, 2 alike; step 3 its own
