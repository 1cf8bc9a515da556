"""The host side of a CUDA-graph decode step, on a CPU: the batch runner takes its graph path with
the stub graph of bench/host_step.py (a replay does nothing; the template holds the records an
eager forward through it made). What a replayed step records must be the capture's decisions,
renumbered, with every field a consumer reads; replays are counted; a steady cohort copies no inputs.
One step per graph launch (steps_per_graph=1) throughout; graphs of several steps, whose later steps
are served from the host: tests/test_graph_steps_host.py."""

import time
from types import SimpleNamespace

import pytest

from engine import batch_runner, flags
from engine.batch_runner import BatchRunner, _DecodeGraph
from engine.runtime import Engine
from graph_stubs import drive, host_step, stub_runner, without_clocks

ONE_STEP = "steps_per_graph=1"  # one replayed step per launch: the single-step run-ahead these tests pin


@pytest.fixture(scope="module")
def tiny():
    return Engine.load("tiny", "cpu", seed=0, weights="random")


def _stubbed_run(engine, prompt, tokens, run_ahead=True):
    runner = BatchRunner(engine, 1, len(prompt) + tokens - 1, graphs=True)
    host_step.stub_graphs(runner, run_ahead)
    copies = []
    original = runner._replay

    def replay(captured, rows, *graph):  # count the host->device input copies a replay makes
        holds = captured.holds
        original(captured, rows, *graph)
        copies.append(holds != [(row.sequence.request_id, row.tokens[0], row.start) for row in rows])

    runner._replay = replay
    return (engine.generate_batch([prompt], tokens, flags.resolve([ONE_STEP], environ={}), runner=runner, timed=False),
            copies, runner)


@pytest.mark.parametrize("run_ahead", [True, False])
def test_replayed_steps_carry_the_capture_records_renumbered(tiny, run_ahead):
    result, copies, runner = _stubbed_run(tiny, list(b"hello!"), 12, run_ahead)
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
    # the first replay copies its inputs in; the steady cohort never (with run-ahead, the steps after
    # the first replay are launched at the sync before them, not through `_replay`)
    assert copies == ([True] if run_ahead else [True] + [False] * 9)
    assert runner.input_copies == 1
    assert runner.run_ahead_launches == (9 if run_ahead else 0)


def test_a_new_cohort_reuses_the_graph_and_copies_its_inputs_once(tiny):
    runner = BatchRunner(tiny, 1, 16, graphs=True)
    host_step.stub_graphs(runner)
    resolved = flags.resolve([ONE_STEP], environ={})
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
    resolved = flags.resolve([ONE_STEP], environ={})
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
    captured = _DecodeGraph((Graph(), Graph()), None, None, (None, None), None, {})
    captured.launches[0]()
    captured.launches[1]()
    assert calls == ["replayed", "replayed"]


# ------------------------------------------------------------------------------------------------ run-ahead

from engine.scheduler import Scheduler  # noqa: E402
from engine.sequence import Sequence  # noqa: E402

_CLOCKS = ("started", "ended", "host_us")  # wall-clock fields: the only ones run-ahead may change


_stub_runner, _drive = stub_runner, drive


def _without_clocks(steps):
    return without_clocks(steps, _CLOCKS)


@pytest.mark.parametrize("prompts,max_tokens,slots", [
    ([list(b"hello!")], 12, 1),  # one steady cohort
    ([list(b"abcd"), list(b"wxyz!")], [5, 9], 2),  # one row ends early: then eager (slot 1)
    ([list(b"abcd"), list(b"efgh"), list(b"ijkl")], [5, 7, 12], 2),  # one waits for a slot
])
def test_run_ahead_records_tokens_and_counters_match_it_off(tiny, prompts, max_tokens, slots):
    capacity = max(len(prompt) for prompt in prompts) + max(max_tokens if isinstance(max_tokens, list)
                                                          else [max_tokens]) - 1
    results = {}
    for run_ahead in (False, True):
        runner = _stub_runner(tiny, slots, capacity, run_ahead)
        sequences, steps, launched, counters = _drive(tiny, runner, prompts, max_tokens)
        results[run_ahead] = ([s.generated for s in sequences], _without_clocks(steps), counters,
                              runner.input_copies, launched, runner.run_ahead_launches, steps)
    off, on = results[False], results[True]
    assert on[:4] == off[:4]  # tokens, every record field but the clocks, counters, input copies
    assert off[5] == 0 and off[4] == [] and on[5] == len(on[4]) > 0
    for launch in on[4]:
        assert launch["waiting"] == 0  # never while something waits for admission
        assert all(left >= 1 for left in launch["left"])  # the launched step is never past a last token
        assert all(position < capacity for position in launch["positions"])  # inside every slot
    for step in on[6]:
        assert step["host_us"] > 0 and step["ended"] > step["started"]
    launched_steps = {launch["after"] + 1 for launch in on[4]}
    assert all(on[6][index]["graph"] == "replay" for index in launched_steps)


def test_no_run_ahead_from_any_sequences_last_step(tiny):
    """A step at which a sequence finishes never launches the next: the cohort changes there."""
    runner = _stub_runner(tiny, 3, 4 + 8 - 1, True)
    sequences, steps, launched, _ = _drive(tiny, runner, [list(b"abcd")] * 3, [4, 6, 8])
    last_steps = {}
    for step in steps:
        for row in step["rows"]:
            last_steps[row["request_id"]] = step["step"]
    launching = {launch["after"] for launch in launched}
    assert launching and not launching & set(last_steps.values())
    assert launching == {step["step"] for step in steps if step["graph"] == "replay"} - set(last_steps.values())
    assert [len(sequence.generated) for sequence in sequences] == [4, 6, 8]


def test_no_run_ahead_while_a_sequence_waits_for_admission(tiny):
    runner = _stub_runner(tiny, 1, 4 + 8 - 1, True)
    sequences, steps, launched, _ = _drive(tiny, runner, [list(b"abcd"), list(b"efgh")], 8)
    first, second = (sequence.request_id for sequence in sequences)
    first_steps = {step["step"] for step in steps if step["rows"][0]["request_id"] == first}
    assert launched and all(launch["after"] not in first_steps for launch in launched)  # the second waited
    assert all(launch["after"] + 1 not in first_steps for launch in launched)


def test_a_sequence_added_after_a_launch_ahead_waits_one_step(tiny):
    """The launched step is binding: a sequence added meanwhile is admitted at the step after it."""
    runner = _stub_runner(tiny, 2, 4 + 8 - 1, True)
    sequences, steps, launched, _ = _drive(tiny, runner, [list(b"abcd")], 8, add_later=[(3, list(b"wxyz"), 4)])
    assert [len(sequence.generated) for sequence in sequences] == [8, 4]
    assert steps[3]["graph"] == "replay" and runner.ahead is None
    assert any(launch["after"] == 3 for launch in launched)
    assert steps[4]["graph"] == "replay" and [row["request_id"] for row in steps[4]["rows"]] == [
        sequences[0].request_id]  # the launched step, as launched
    assert steps[5]["phase"] == "prefill"  # then the new sequence is admitted


def _until_launched_ahead(engine, slots, race=False):
    """A stub runner, its scheduler and dispatcher, stepped from one 4-byte prompt (8 tokens) until a
    step is launched ahead: (runner, scheduler, dispatcher, resolved flags)."""
    from engine.runtime import Dispatcher

    runner = _stub_runner(engine, slots, 4 + 8 - 1, True, race)
    resolved = flags.resolve([ONE_STEP], environ={})
    scheduler = Scheduler(slots, runner.capacity, 2048, resolved["prefill_chunk"])
    dispatcher = Dispatcher(engine, resolved, timed=False)
    scheduler.add(Sequence(list(b"abcd"), 8), 0.0)
    while runner.ahead is None:
        Engine._batch_step(scheduler, runner, dispatcher, time.perf_counter)
    return runner, scheduler, dispatcher, resolved


def test_a_step_that_is_not_the_launched_one_is_refused(tiny):
    runner, scheduler, dispatcher, resolved = _until_launched_ahead(tiny, 1)
    runner.ahead.expected = [(-1, 0, 0)]
    with pytest.raises(RuntimeError, match="not the step launched ahead"):
        Engine._batch_step(scheduler, runner, dispatcher, time.perf_counter)


def test_a_run_that_ends_early_drops_its_launched_step(tiny, monkeypatch):
    runner = _stub_runner(tiny, 1, 4 + 8 - 1, True)
    resolved = flags.resolve([ONE_STEP], environ={})
    original, calls = Scheduler.postprocess, []

    def failing(self, batch, tokens, now=None):
        calls.append(batch.step)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return original(self, batch, tokens, now)

    monkeypatch.setattr(Scheduler, "postprocess", failing)
    with pytest.raises(KeyboardInterrupt):
        tiny.generate_batch([list(b"abcd")], 8, resolved, runner=runner)
    assert runner.ahead is None and runner.run_ahead_launches > 0
    monkeypatch.setattr(Scheduler, "postprocess", original)
    again = tiny.generate_batch([list(b"abcd")], 8, resolved, runner=runner)
    off = _stub_runner(tiny, 1, 4 + 8 - 1, False)
    tiny.generate_batch([list(b"abcd")], 8, resolved, runner=off)  # captures: the next run replays, as `again`
    assert again.tokens == tiny.generate_batch([list(b"abcd")], 8, resolved, runner=off).tokens


def test_run_ahead_is_off_without_graphs_and_on_by_default_with_them(tiny):
    assert BatchRunner(tiny, 1, 16).run_ahead is False  # CPU: no graphs, nothing to run ahead
    stubbed = _stub_runner(tiny, 1, 16, True)
    assert stubbed.run_ahead is True


# ------------------------------------------------------------------------------- two replays in flight

def _replayed_tokens_follow_the_stand_in(engine, prompts, sequences, steps):
    """Every token a replayed step returned is the stand-in of the token and position its row fed: the
    step's own outputs, not the step in flight behind it (that would skip one), nor stale ones."""
    replayed = {step["step"] for step in steps if step["graph"] == "replay"}
    checked = 0
    for prompt, sequence in zip(prompts, sequences):
        emitted = [(step["step"], row) for step in steps for row in step["rows"]
                   if row["request_id"] == sequence.request_id and row["emitted"] is not None]
        assert [row["emitted"] for _, row in emitted] == sequence.generated
        for index in range(1, len(emitted)):
            number, row = emitted[index]
            if number in replayed:
                fed = sequence.generated[index - 1]
                assert row["start"] == len(prompt) + index - 1
                assert row["emitted"] == host_step.stand_in_token(fed, row["start"], engine.config.vocab_size)
                checked += 1
    return checked


@pytest.mark.parametrize("race", [False, True])  # the device waited for, or ahead of the wait (StubStream)
@pytest.mark.parametrize("lengths", [[6], [5, 7, 4]])
def test_two_in_flight_each_step_returns_its_own_tokens(tiny, lengths, race):
    prompts = [list(range(3 + index, 3 + index + length)) for index, length in enumerate(lengths)]
    runner = _stub_runner(tiny, len(prompts), max(lengths) + 12 - 1, True, race)
    sequences, steps, launched, _ = _drive(tiny, runner, prompts, 12)
    assert [step["graph"] for step in steps] == ["eager", "capture"] + ["replay"] * 10
    assert _replayed_tokens_follow_the_stand_in(tiny, prompts, sequences, steps) == 10 * len(prompts)
    # the next replay was launched before each wait: two pending at the steady waits, never more
    assert max(runner.stub_stream.depths) == 2 and runner.run_ahead_launches == 9
    assert [len(sequence.generated) for sequence in sequences] == [12] * len(prompts)


def test_run_ahead_off_keeps_one_replay_in_flight(tiny, monkeypatch):
    monkeypatch.setenv("MOEI_RUN_AHEAD", "0")
    prompts = [list(b"hello!")]
    runner = _stub_runner(tiny, 1, 6 + 12 - 1, None)  # None: as MOEI_RUN_AHEAD says
    assert runner.run_ahead is False
    sequences, steps, launched, _ = _drive(tiny, runner, prompts, 12)
    assert launched == [] and runner.run_ahead_launches == 0 and runner.ahead is None
    assert set(runner.stub_stream.depths) == {1}
    assert _replayed_tokens_follow_the_stand_in(tiny, prompts, sequences, steps) == 10
    monkeypatch.delenv("MOEI_RUN_AHEAD")
    assert _stub_runner(tiny, 1, 16, None).run_ahead is True


class _TrackedEvent(host_step._StubEvent):
    """A stub event that fails when recorded again before its pair's time was read."""

    def __init__(self, stream, log):
        super().__init__(stream)
        self.unread, self.log = False, log

    def record(self, stream=None):
        assert not self.unread, "an event recorded again before its step read it"
        self.unread = True
        self.log.append(self)

    def elapsed_time(self, other):
        assert self.unread and other.unread
        self.unread = other.unread = False
        return super().elapsed_time(other)


def test_each_step_in_flight_has_its_own_event_pair(tiny):
    runner = _stub_runner(tiny, 1, 6 + 12 - 1, True)
    log = []
    runner.use_events(lambda: _TrackedEvent(runner.stub_stream, log))
    _drive(tiny, runner, [list(b"hello!")], 12)
    pairs = [(id(log[index]), id(log[index + 1])) for index in range(0, len(log), 2)]
    assert len(pairs) == 12 and len(set(pairs)) == 2
    replays = pairs[2:]  # the launched-ahead steps alternate: each takes the other pair than the one in flight
    assert all(first != second for first, second in zip(replays, replays[1:]))


def test_host_time_of_a_step_launched_ahead_is_busy_time_without_the_wait(tiny, monkeypatch):
    """The stub replay runs at the wait (the device's time, as the host sees it): made slow, it must
    lengthen the loop and not the host time of a step launched ahead."""
    slow = 0.004
    original = host_step._Replay.__call__

    def slow_replay(self):
        time.sleep(slow)
        original(self)

    monkeypatch.setattr(host_step._Replay, "__call__", slow_replay)
    runner = _stub_runner(tiny, 1, 6 + 12 - 1, True)
    _, steps, launched, _ = _drive(tiny, runner, [list(b"hello!")], 12)
    ahead = [steps[launch["after"] + 1] for launch in launched]
    assert len(ahead) == 9
    assert steps[-1]["ended"] - steps[1]["ended"] > 10 * slow  # the replays' time, spent in the waits
    for previous, step in zip(steps[2:], ahead):
        assert 0 < step["host_us"] < slow * 1e6
        assert step["started"] < previous["ended"]  # stamped before its launch, before the previous sync


def test_a_scheduler_that_breaks_its_reservation_is_refused_and_the_runner_recovers(tiny):
    runner, scheduler, dispatcher, resolved = _until_launched_ahead(tiny, 2)
    captured = runner.ahead.captured
    scheduler._reserved = None  # a scheduler that forgets what it reserved: the next step admits this one
    scheduler.add(Sequence(list(b"wxyz"), 4), 0.0)
    with pytest.raises(RuntimeError, match="not the step launched ahead"):
        Engine._batch_step(scheduler, runner, dispatcher, time.perf_counter)
    assert runner.ahead is None and captured.holds is None  # the next replay of the graph copies its inputs
    again = tiny.generate_batch([list(b"abcd")], 8, resolved, runner=runner)
    fresh = _stub_runner(tiny, 2, 4 + 8 - 1, True)
    tiny.generate_batch([list(b"abcd")], 8, resolved, runner=fresh)  # captures, as `runner` did
    assert again.tokens == tiny.generate_batch([list(b"abcd")], 8, resolved, runner=fresh).tokens


@pytest.mark.parametrize("race", [False, True])
def test_drop_ahead_leaves_the_launched_step_to_the_device_and_the_runner_consistent(tiny, race):
    runner, scheduler, dispatcher, resolved = _until_launched_ahead(tiny, 1, race)
    captured = runner.ahead.captured
    # in flight (or, the device ahead of the waits, run already)
    assert any(isinstance(work, host_step._Replay) for work in runner.stub_stream.queue) != race
    runner.drop_ahead()
    assert runner.ahead is None and captured.holds is None
    runner.drop_ahead()  # twice: nothing left to drop
    # the next run: its first replay copies its inputs in behind the dropped replay, then feeds itself
    copies = runner.input_copies
    again = tiny.generate_batch([list(b"abcd")], 8, resolved, runner=runner)
    assert runner.input_copies == copies + 1
    assert _replayed_tokens_follow_the_stand_in(tiny, [list(b"abcd")], again.sequences, again.steps) == 7


# ------------------------------------------------------------------------------------------------ cyclic GC

import gc  # noqa: E402

from engine import runtime  # noqa: E402


def _gc_states(engine, prompt, tokens, **kwargs):
    """Whether the cyclic collector was on at each clock read of a batch run (the first is the
    arrival stamp, before the steps)."""
    seen = []

    def clock():
        seen.append(gc.isenabled())
        return time.perf_counter()

    result = engine.generate_batch([prompt], tokens, flags.resolve([ONE_STEP], environ={}), clock=clock, **kwargs)
    return result, seen


def test_a_batch_run_steps_with_the_cyclic_collector_off_and_turns_it_back_on(tiny, monkeypatch):
    assert gc.isenabled()
    runner = _stub_runner(tiny, 1, 4 + 8 - 1, True)
    result, seen = _gc_states(tiny, list(b"abcd"), 8, runner=runner)
    assert seen[0] and not any(seen[1:]) and len(seen) > len(result.steps)
    assert gc.isenabled()
    # an error inside a step: turned back on all the same
    monkeypatch.setattr(Scheduler, "postprocess", lambda *args, **kwargs: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        tiny.generate_batch([list(b"abcd")], 8, flags.resolve([ONE_STEP], environ={}), runner=runner)
    assert gc.isenabled() and runner.ahead is None
    monkeypatch.undo()
    gc.disable()  # off before the run: left off
    try:
        _, seen = _gc_states(tiny, list(b"abcd"), 8, runner=runner)
        assert not any(seen) and not gc.isenabled()
    finally:
        gc.enable()


def test_overlapping_runs_turn_the_collector_back_on_when_the_last_ends():
    assert gc.isenabled()
    first, second = runtime.cyclic_gc_paused(), runtime.cyclic_gc_paused()
    first.__enter__()
    second.__enter__()  # e.g. another thread's run
    assert not gc.isenabled()
    first.__exit__(None, None, None)
    assert not gc.isenabled()  # the second still steps
    second.__exit__(None, None, None)
    assert gc.isenabled()


def test_5000_replayed_steps_leave_no_cyclic_garbage_and_no_objects_behind(tiny):
    """Why the collector may be off while a run steps: a step makes no reference cycles, so reference
    counting frees all it drops. Ten runs of 500 tokens (5000 steps, 4990 replayed, run-ahead on) with
    the collector off throughout: a collection afterwards finds nothing, and once the runs' results are
    dropped the process holds as many tracked objects as before them."""
    runner = _stub_runner(tiny, 1, 6 + 500 - 1, True)
    resolved = flags.resolve([ONE_STEP], environ={})
    tiny.generate_batch([list(b"hello!")], 500, resolved, runner=runner)  # the capture; caches warmed
    gc.collect()
    gc.disable()  # nothing is collected between the runs either: the collection below sees every cycle
    try:
        before, launched = len(gc.get_objects()), runner.run_ahead_launches
        replayed = 0
        for _ in range(10):
            result = tiny.generate_batch([list(b"hello!")], 500, resolved, runner=runner)
            replayed += sum(step["graph"] == "replay" for step in result.steps)
            del result
        after = len(gc.get_objects())
        unreachable = gc.collect()
    finally:
        gc.enable()
    assert replayed == 10 * 499 and runner.run_ahead_launches - launched == 10 * 498
    assert unreachable == 0
    assert after - before < 50, after - before  # not a few per step: nothing per step is kept


# ------------------------------------------------------------------------------------------------ per-step bookkeeping

def test_the_launched_step_check_is_the_expected_list_compared_row_by_row():
    from engine.scheduler import Row

    first, second = Sequence([1, 2], 9), Sequence([3], 9)
    fed = (Row(first, 4, (7,), True), Row(second, 2, (8,), True))
    one_step = SimpleNamespace(steps=1)  # the graph launched: only its span is read here
    ahead = batch_runner._Ahead(one_step, 5, None, 0.0, 0.0, None, 0)
    assert ahead.expected is None and not ahead.feeds(fed)  # before the previous step's sync: nothing fed
    ahead.fed, ahead.tokens = fed, [11, 12]
    assert ahead.expected == [(first.request_id, 11, 5), (second.request_id, 12, 3)]
    launched = (Row(first, 5, (11,), True), Row(second, 3, (12,), True))
    others = [launched[:1], (launched[1], launched[0]), (Row(first, 5, (10,), True), launched[1]),
              (Row(first, 6, (11,), True), launched[1]), (launched[0], Row(Sequence([3], 9), 3, (12,), True))]
    for rows in (launched, *others):
        wanted = [(row.sequence.request_id, row.tokens[0], row.start) for row in rows]
        assert ahead.feeds(rows) == (ahead.expected == wanted) == (rows is launched)
    ahead.expected = [(-1, 0, 0)]  # set: compared as set
    assert ahead.expected == [(-1, 0, 0)] and not ahead.feeds(launched)


def test_a_replayed_step_counts_the_capture_launches_without_a_pass_over_every_kernel(tiny, monkeypatch):
    """A replayed step's kernel_launches are the capture's (`Dispatcher.replay` counted them); launches.since,
    a pass over every kernel's count, runs only for eager and capture steps."""
    from kernels import launches

    calls = []
    since = launches.since
    monkeypatch.setattr(launches, "since", lambda before: calls.append(1) or since(before))
    result, _, _ = _stubbed_run(tiny, list(b"hello!"), 12)
    graphs = [step["graph"] for step in result.steps]
    assert graphs == ["eager", "capture"] + ["replay"] * 10 and len(calls) == 2 + 1  # + the run's counters
    for step in result.steps[2:]:
        assert step["kernel_launches"] == {name: tiny.config.n_layers for name in host_step.KERNELS_PER_LAYER}
    assert len({id(step["kernel_launches"]) for step in result.steps}) == len(result.steps)  # one dict each
