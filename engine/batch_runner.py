"""The model runner for scheduled batches: turns a `Batch` (engine.scheduler) into tensors, runs
one forward for all its rows, and returns each row's next token, with the step's clocks.

- Ragged rows in one launch per layer: each row's start position, cache row and real length
  travel as small index tensors (one host->device copy per step) in a `StepLayout`; the forward
  writes keys and values with index ops and hands attention per-row start positions. There is
  no loop over sequences on the host, so launches per step do not grow with the batch.
- A preallocated KV cache: `max_slots` rows of `capacity` positions, allocated once.
- CUDA graphs for decode steps on a GPU, one per batch size, captured the first time a decode
  cohort of that size occupies cache rows 0..B-1 (the scheduler hands out the lowest free slot,
  so a cohort that starts together stays there). The graph reads the whole cache (later keys are
  causally invisible), so its inputs are just the tokens and positions in a static buffer. The
  graph writes its own next inputs (its tokens, one position on), so while the cohort is steady
  a step copies nothing from the host; the host checks that the buffer holds what the scheduler
  feeds and copies only when it does not. A replay counts what the capture launched, once more
  (`Counters.replay`).
  Each size is captured twice (two instances, launched alternately), and each instance's kernels
  write the step's outputs -- its next tokens and every MoE layer's observed count -- straight into
  its own pinned host buffer (`landing`; engine.decode_fused.StepOutputs), read after the step's one
  sync (its end event): a launch copies nothing, and the step has no device-to-host copy of its own.
  The capture step itself runs eagerly (it is also the warm-up the capture needs), so every step
  computes something real. Steps a graph cannot serve run eagerly, and the step says why.
- The host path of a replayed step is kept short (the host-time target: host time per decode step at batch 1;
  bench/host_step.py measures it). Before the launch it does only what the launch needs: the graph
  for a (size, flags) pair (the last replay's, or a lookup on two ints), the inputs check, the
  start event, the replay and the end event. Everything else runs after the launch, while the
  device works: the dispatcher's step, the arm and kernel counts and the decision records copied from
  the capture's (`Dispatcher.replay`, one call), the step's launch count for its record (the capture's
  counts: nothing else on the path launches a kernel). The events are
  recorded on a stream object kept by the runner (checked each step against the current stream's
  id, so a caller may switch streams), and the events and the graph are driven through their C
  methods: torch's Python wrappers only default a stream (always passed here) and check input
  liveness (never asked for here). Engine.generate_batch runs its steps with Python's cyclic garbage
  collector off (engine.runtime.cyclic_gc_paused): a step makes no reference cycles, and a collection
  started inside a step would pause it for as long as traversing every object of the process takes.
- Run-ahead (CUDA, on by default; `run_ahead=False` or MOEI_RUN_AHEAD=0 turns it off): two replays in
  flight, so the device never waits for the host between the steps of a steady cohort. A replayed
  step whose next step is certain to replay the same graph (the caller's `reserve_next`,
  engine.scheduler: the same cohort, no row at its last token, nothing waiting) launches that next
  replay BEFORE its own sync, right after its own launch (or, itself launched ahead, as its first
  act): the device runs the next step straight after this one. The graph feeds itself, so the next
  replay needs nothing from the host. The two instances alternate, so the step in flight behind a
  step writes the other landing buffer; a step's sync is its own end event (`synchronize`), after
  which it reads its own landing buffer (the instance that writes it again is launched only after
  this read). The next `run` finds its step launched (`ahead`): it checks the Batch is the one
  launched (`_Ahead.feeds`: row by row against the previous step's rows and tokens; else raises: a
  bug, never a silent wrong step), does not launch again, and does everything else a replayed step
  does. Each step has its own start and end events: two pairs, a step launched ahead taking the other
  pair than the step in flight before it; a pair is recorded again only two launches later, after its
  step's sync read it.
  `drop_ahead` forgets a launched step that will not run. Not while steps are labelled for the profiler
  (a step's kernels would start inside the previous step's range).
  Device time of a replayed step: from its start event to its end event, so it includes the writes
  of its outputs to the host, the work the next replay waits behind.
  Host time (`StepTiming.host_us`, the bench's host µs/step) of a step launched ahead: the host's busy
  time per step, from the return of the previous step's sync to the start of this step's own wait for
  its sync: everything the host does once per step (the previous step's postprocess and record, this
  step's schedule and reservation check, the next step's launch, the bookkeeping) except waiting for
  the device. With two in flight the device waits for the host only when that exceeds the device time
  of the step it runs meanwhile. A step launched the usual way (nothing in flight: the first replay
  of a cohort, eager and capture steps, run-ahead off) reports the host time from its start to its
  launch, which the device idles through (`StepTiming.host_us` None: the caller measures it).

- Graphs of several steps (the flag steps_per_graph, K > 1): beside a size's one-step graph, the same step
  captured K times in a row into one graph (`DecodeGraph.block`: two instances, sharing the one-step graph's
  inputs, `turn` and `holds`), step k writing its outputs into row k of its instance's [K, B + layers] landing
  buffer and feeding step k + 1 on the device. A replayed step launches it when the scheduler reserves the K - 1
  steps after it (`reserve_next(batch, K - 1)`), and launches ahead the next such graph when it reserves
  K - 1 + K (else one step, else nothing). At the launch's sync the host reads all K steps' outputs; the later
  K - 1 steps are then `served`: the caller takes them all (`take_served`, which checks the scheduler's reserved
  cohort continues the graph's rows: `_Served.continues`; else raises, as `_Ahead.feeds`) and records each as
  a replay in one loop (engine.runtime.Engine._served_steps: the capture's records and launch counts, per
  step), without a launch or a wait; `run` refuses a step while they are untaken. Device time: the launch's
  over K, on each of its steps; host time of a served step: from the previous step's return (the launch's
  sync, for the first) to its own. A step's
  timing carries `span` (K, or 1) and `span_index`, so a consumer knows which launch computed it (the bench's
  steady window opens only where a launch begins).
  Beside it, graphs of K/2, K/4, ... down to 2 steps (`DecodeGraph.tails`): a launch takes the largest graph
  whose steps the scheduler reserves (`_largest_block`), so a run's last steps, fewer than K, go by a few
  launches rather than one each.
  Inside such a graph each one-row step but the last carries the next step's first norm
  (engine.decode_fused.StepOutputs.carry; unless MOEI_CARRY_NORM=0): its LM head's pick also writes the picked
  token's embedding row and its norm, so the next step launches no rms_norm (kernels.gemv_fused.NextNorm, the
  same bits). The capture checks each step's launches against the one-step graph's with that difference
  (engine.decode_fused.carried_launches) and the steps' records count them per step (`step_kernels`).

Knows nothing of scheduling policy, clocks beyond the step's own, or benchmarks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from engine import graphs as graph_capture
from engine.decode_fused import StepOutputs
from engine.flags import from_environment
from engine.graphs import DecodeGraph
from engine.model import KVCache, StepLayout, forward
from engine.scheduler import DECODE, Batch
from engine.trace import nvtx
from kernels import launches



_perf_counter = time.perf_counter  # the host path's clock, one global lookup per read


def run_ahead_default() -> bool:
    """The flag run_ahead where no run's flags are at hand (its default, or MOEI_RUN_AHEAD through the
    registry); a runner may still be told either way."""
    return from_environment()["run_ahead"]

@dataclass(slots=True)
class StepTiming:
    launched_at: float  # time.perf_counter() when the last launch (or the replay) was issued
    device_us: float | None  # CUDA events around the step's work; None on a CPU (no separate device clock)
    graph: str  # "replay", "capture" or "eager"
    eager_reason: str = ""  # why a GPU decode step did not replay a graph
    # Triton launches since the caller's snapshot (`run`'s kernels_before), counted before the step's
    # sync, while the device works; None when no snapshot was given.
    kernel_launches: dict[str, int] | None = None
    # The step's host time where the runner measures it: a step launched ahead, the host's busy time per
    # step (from the previous step's sync to this step's wait; module docstring). None: the caller's,
    # from the step's start to `launched_at`.
    host_us: float | None = None
    # The decode steps the launch that computed this step ran (a graph of several steps: the flag
    # steps_per_graph) and this step's index among them; device_us is then that launch's device time
    # over `span`. 1 and 0 for every other step.
    span: int = 1
    span_index: int = 0
    # Each row's logits [B, V] float32 on the host, where the run keeps them (the dispatcher's keep_logits).
    logits: torch.Tensor | None = None


class _Ahead:
    """A replayed step launched ahead, before the sync of the step in flight before it (`_launch_ahead`).

    `started` (the caller's clock) is stamped right before that launch; `launched_at` (perf_counter)
    right after it. `pair` is the step's own (events, records, wait, elapsed) and `turn` the instance
    launched, whose landing buffer holds its outputs. At the previous step's sync, `fed` and `tokens` are set to that
    step's rows and tokens: the replay launched computes each row's token one position on. `expected`,
    (request id, token, position) per row fed, is made from them when read, unless it was set."""

    __slots__ = ("captured", "step", "dispatcher", "started", "launched_at", "pair", "turn", "graph", "span", "fed",
                 "tokens", "offset", "_expected")

    def __init__(self, captured, step, dispatcher, started, launched_at, pair, turn, graph=None) -> None:
        self.captured, self.step, self.dispatcher = captured, step, dispatcher
        self.started, self.launched_at, self.pair, self.turn = started, launched_at, pair, turn
        self.graph = captured if graph is None else graph  # the graph launched: `captured` or one of its blocks
        self.span = self.graph.steps  # the steps the launch runs
        self.fed = self.tokens = self._expected = None
        self.offset = 1  # positions from the rows `fed` to this step's: the steps the launch before ran

    @property
    def expected(self) -> list[tuple[int, int, int]] | None:
        if self._expected is not None or self.tokens is None:
            return self._expected
        offset = self.offset
        return [(row.sequence.request_id, token, row.start + offset) for row, token in zip(self.fed, self.tokens)]

    @expected.setter
    def expected(self, value: list[tuple[int, int, int]] | None) -> None:
        self._expected = value

    def feeds(self, rows) -> bool:
        """Whether these rows are the step launched: `expected == [(row.sequence.request_id, row.tokens[0],
        row.start) for row in rows]`, compared row by row without making either list (host time per step)."""
        if self._expected is not None:
            return self._expected == [(row.sequence.request_id, row.tokens[0], row.start) for row in rows]
        return self.tokens is not None and _continue(rows, self.fed, self.tokens, self.offset)


class _Served:
    """A synced graph of several steps (`DecodeGraph.block`) whose later steps have not run yet: their
    tokens and woken counts are on the host already (`values`, one list per step of the graph). The caller
    takes them (`BatchRunner.take_served`) and serves them all at once (engine.runtime.Engine._served_steps),
    launching and waiting for nothing. `started` and `launched_at` are the launch's; `device_us` its device
    time over its steps."""

    __slots__ = ("captured", "block", "dispatcher", "first", "rows", "values", "started", "launched_at",
                 "device_us", "logits")

    def __init__(self, captured, block, dispatcher, first, rows, values, started, launched_at, device_us,
                 logits=None) -> None:
        self.captured, self.block = captured, block  # the one-step graph, and its graph of several steps launched
        self.dispatcher, self.first, self.rows, self.values = dispatcher, first, rows, values
        self.started, self.launched_at, self.device_us = started, launched_at, device_us
        self.logits = logits  # [steps, B, V] float32 on the host, where the run keeps them; else None

    def continues(self, cohort) -> bool:
        """Whether `cohort` (the scheduler's reserved sequences) are the graph's rows after its first step: the
        same sequences, in order, each one position on with the token that step computed as its last."""
        rows = self.rows
        if cohort is None or len(cohort) != len(rows):
            return False
        for sequence, row, token in zip(cohort, rows, self.values[0]):
            if sequence is not row.sequence or sequence.cached != row.start + 1 or sequence.generated[-1] != token:
                return False
        return True


def _largest_block(captured, reserve_next, batch, before: int):
    """The largest graph of several steps of `captured` (its `block`, then its `tails`) whose steps the scheduler
    reserves, `before` steps after `batch` first (-1: the block's first step is `batch` itself), or None. A
    refused reservation reserves nothing, so the sizes are asked largest first."""
    block = captured.block
    if reserve_next(batch, before + block.steps):
        return block
    for tail in captured.tails:
        if reserve_next(batch, before + tail.steps):
            return tail
    return None


def _continue(rows, fed, tokens, offset: int) -> bool:
    """Whether `rows` are the rows `fed`, each `offset` positions on and fed its token in `tokens` (which may
    run on past the rows): compared row by row without making a list (host time per step)."""
    if len(rows) != len(fed):
        return False
    for row, before, token in zip(rows, fed, tokens):
        if (row.tokens[0] != token or row.start != before.start + offset
                or row.sequence.request_id != before.sequence.request_id):
            return False
    return True


# (stream id, device index, device type) of a device's current stream: the one C call inside
# torch.cuda.current_stream, which then builds a new Stream object through Python layers each call.
# None where this torch build has no CUDA (or names it otherwise): then every step asks torch.
_current_stream_ident = getattr(torch._C, "_cuda_getCurrentStream", None)


def _stream_from(ident) -> torch.cuda.Stream:
    """The Stream object torch.cuda.current_stream would make for this ident."""
    return torch.cuda.Stream(stream_id=ident[0], device_index=ident[1], device_type=ident[2])


class BatchRunner:
    def __init__(self, engine, max_slots: int, capacity: int, graphs: bool | None = None,
                 run_ahead: bool | None = None) -> None:
        self.engine, self.max_slots, self.capacity = engine, max_slots, capacity
        self.device = engine.device
        self.cache = KVCache.allocate(engine.config, max_slots, capacity, engine.device, engine.dtype)
        cuda = self.device.type == "cuda"
        self.graphs_requested = graphs  # as asked: None (the default: on where CUDA is), True or False
        # an expert-parallel engine reads each MoE layer's exchange sizes on the host: no graph can hold a step
        expert_parallel = getattr(engine, "expert_group", None) is not None
        self.graphs_enabled = cuda and (graphs is None or graphs) and not expert_parallel
        self.graphs_note = ("on" if self.graphs_enabled else
                            "off (expert parallel: each MoE layer reads its exchange's sizes on the host)"
                            if cuda and expert_parallel else
                            "off (--graphs off)" if cuda else "off (CPU: no CUDA graphs)")
        # Keyed by (size, flags token): the token is a small int per distinct flag values, so a step's
        # lookup hashes two ints, not every flag (`_graph_key`).
        self._graphs: dict[tuple[int, int], DecodeGraph] = {}
        self._refused: dict[tuple[int, int], str] = {}  # why a graph cannot serve this (size, flags); "" = it can
        self.block_notes: dict[tuple[int, int], str] = {}  # why a graph of several steps was not captured
        self._flag_tokens: dict[tuple, int] = {}
        self._flags_key: tuple = (None, -1, False)  # (the last flags object seen, its token, keep_logits)
        # Two (start, end) event pairs, reused (`use_events`); None on a CPU.
        self._pairs: tuple | None = None
        self._events = self._records = None
        if cuda:
            self.use_events(lambda: torch.cuda.Event(enable_timing=True))
        self._device_index = (self.device.index if self.device.index is not None else torch.cuda.current_device()) \
            if cuda else None
        self._stream: torch.cuda.Stream | None = None  # the current stream, kept while its id stays the same
        self._stream_ident: tuple | None = None
        # The last replayed graph, with the dispatcher (the run) and batch size it was found for: a steady
        # cohort's next step finds it without a key or a dict lookup.
        self._last_replayed: tuple = (None, 0, None)
        self.input_copies = 0  # replays that had to copy their inputs in (a new cohort, or a first replay)
        self._pool = torch.cuda.graph_pool_handle() if self.graphs_enabled else None
        self.label_steps = False  # mark each step for torch.profiler (`moei.step.N`); off: no host cost
        # Launch a steady cohort's next replay before this step's sync (module docstring); CUDA graphs only.
        if run_ahead is None:
            run_ahead = run_ahead_default()
        self.run_ahead = self.graphs_enabled and run_ahead
        self.run_ahead_launches = 0  # replays launched ahead
        self.ahead: _Ahead | None = None  # the next step, launched already; None when not
        self.served: _Served | None = None  # the later steps of a synced graph of several steps; None when none
        self.synced_at: float | None = None  # perf_counter right after the last replayed step's sync

    def use_events(self, make: Callable[[], object]) -> None:
        """The two (start, end) event pairs from `make` (torch.cuda.Event on a GPU; bench/host_step.py
        passes stub events): each pair is (events, records, wait, elapsed), `records` the two events'
        record methods, `wait` the end event's synchronize and `elapsed` the ms from start to end. On a
        GPU these are the C methods the torch.cuda.Event wrappers call (the wrapper only looks the current
        stream up when none is passed, and elapsed_time only calls it); they are recorded on this device's
        current stream, passed explicitly (`_current_stream`): a lookup through torch's Python layers costs
        more. Eager and capture steps and a replay launched the usual way take the first pair; a step
        launched ahead the other pair than the step in flight before it."""
        pairs = []
        for _ in range(2):
            events = (make(), make())
            if isinstance(events[0], torch.cuda.Event):
                records = tuple(super(torch.cuda.Event, event).record for event in events)
                wait = super(torch.cuda.Event, events[1]).synchronize
                elapsed = partial(super(torch.cuda.Event, events[0]).elapsed_time, events[1])
            else:
                records, wait = tuple(event.record for event in events), events[1].synchronize
                elapsed = partial(events[0].elapsed_time, events[1])
            pairs.append((events, records, wait, elapsed))
        self._pairs = tuple(pairs)
        self._events, self._records = pairs[0][0], pairs[0][1]

    def run(self, batch: Batch, dispatcher, kernels_before: dict[str, int] | None = None,
            reserve_next: Callable[..., bool] | None = None, clock: Callable[[], float] = time.perf_counter
            ) -> tuple[list[int], StepTiming]:
        """One step: every row's next token (one sync) and the step's clocks; with `kernels_before` (a
        `launches.snapshot()`), also the Triton launches since it. With `reserve_next`
        (engine.scheduler.Scheduler.reserve_next), a replayed step may launch a graph of several steps
        (the flag steps_per_graph) once the scheduler reserves the steps after it, and a step whose next
        steps it reserves launches them before its own sync (run-ahead; `ahead` then holds that launch,
        its start stamped on `clock` before it); the caller's next `run` must be that step. The later steps of
        a synced graph of several steps (`served`) are the caller's to take (`take_served`) before it runs
        another step."""
        if self.served is not None:
            steps = f"{self.served.first + 1}..{self.served.first + len(self.served.values) - 1}"
            self.drop_ahead()
            raise RuntimeError(f"step {batch.step} run while steps {steps}, computed by a graph of several steps, "
                               f"were not taken (take_served): a bug in the caller")
        if not self.label_steps:
            ahead = self.ahead
            if ahead is not None:  # launched before the previous step's sync (as `_run`, one call fewer)
                self.ahead = None
                return self._run_ahead(batch, dispatcher, ahead, kernels_before, reserve_next, clock)
            return self._run(batch, dispatcher, kernels_before, reserve_next, clock)
        nvtx.push(f"step {batch.step} {batch.phase} n={batch.n_tokens}")  # a trace's NVTX range, when asked for
        try:
            with torch.profiler.record_function(f"moei.step.{batch.step}"):
                return self._run(batch, dispatcher, kernels_before, None, clock)  # no run-ahead: ranges per step
        finally:
            nvtx.pop()

    def drop_ahead(self) -> None:
        """Forget a launch made for steps that will not run (their run ended early, e.g. on an error): a
        step launched ahead, which the device still runs (within the slots' capacity, `reserve_next`) and
        whose outputs land in a buffer nothing reads, and the later steps of a synced graph of several
        steps; the graph's next replay copies its inputs in."""
        if self.ahead is not None:
            self.ahead.captured.holds = None
            self.ahead = None
        if self.served is not None:
            self.served.captured.holds = None
            self.served = None

    @property
    def captured_sizes(self) -> list[int]:
        return sorted(key[0] for key in self._graphs)

    def _run(self, batch: Batch, dispatcher, kernels_before, reserve_next, clock) -> tuple[list[int], StepTiming]:
        ahead = self.ahead
        if ahead is not None:  # launched before the previous step's sync
            self.ahead = None
            return self._run_ahead(batch, dispatcher, ahead, kernels_before, reserve_next, clock)
        rows = batch.rows
        reason, key, captured = "", None, None
        if self.graphs_enabled and batch.phase == DECODE:
            reason, key, captured = self._graph_for(rows, dispatcher)
            if captured is not None:
                return self._run_replay(batch, dispatcher, captured, kernels_before, reserve_next, clock)
        dispatcher.begin_step(batch.step, batch.phase, batch.n_tokens)
        records = self._records
        stream = None
        if records is not None:
            stream = self._current_stream()
            records[0](stream)
        graph_mode = "eager"
        if key is not None and not reason:
            graph_mode = "capture"
            next_tokens = self._capture(batch, dispatcher, key, [[row.tokens[0] for row in rows],
                                                                 [row.start for row in rows]])
        else:
            next_tokens = self._eager(batch, dispatcher)
        if records is not None:
            records[1](stream)
        launched_at = time.perf_counter()
        counted = None if kernels_before is None else launches.since(kernels_before)
        tokens = dispatcher.end_step_batch(next_tokens)
        logits = None
        if dispatcher.keep_logits:  # after the step's sync: the copy waits for nothing
            logits, dispatcher.step_logits = dispatcher.step_logits.float().cpu(), None
        events = self._events
        device_us = events[0].elapsed_time(events[1]) * 1e3 if events is not None else None
        return tokens, StepTiming(launched_at, device_us, graph_mode, reason, counted, logits=logits)

    def _run_replay(self, batch: Batch, dispatcher, captured: DecodeGraph, kernels_before, reserve_next=None,
                    clock=time.perf_counter) -> tuple[list[int], StepTiming]:
        """A replayed decode step launched the usual way (nothing in flight): the start event, the replay
        (and its input copy, if any) and the end event first; then the rest (`_finish_replay`). The replay
        is of the graph of several steps when there is one and the scheduler reserves the steps after this
        one, else of the one-step graph."""
        graph = captured
        if captured.block is not None and reserve_next is not None:
            graph = _largest_block(captured, reserve_next, batch, -1) or captured
        pair = self._pairs[0]
        records = pair[1]
        stream = self._current_stream()
        started = clock() if graph is not captured else None
        records[0](stream)
        turn = captured.turn
        if graph is captured:
            self._replay(captured, batch.rows)  # the instance of this turn
        else:
            self._replay(captured, batch.rows, graph)
        captured.turn = turn ^ 1
        records[1](stream)
        launched_at = _perf_counter()
        return self._finish_replay(batch, dispatcher, captured, turn, pair, launched_at, None, kernels_before,
                                   reserve_next, clock, stream, graph, started)

    def _run_ahead(self, batch: Batch, dispatcher, ahead: _Ahead, kernels_before, reserve_next, clock
                   ) -> tuple[list[int], StepTiming]:
        """A replayed decode step launched before the previous step's sync: not launched again; checked to
        be the step that was launched; then as `_run_replay`. Its host time is the host's busy time per
        step: from the previous step's sync (`synced_at`) to this step's wait."""
        rows = batch.rows
        if (batch.step != ahead.step or batch.phase != DECODE or dispatcher is not ahead.dispatcher
                or not ahead.feeds(rows)):
            ahead.captured.holds = None
            raise RuntimeError(f"step {batch.step} ({batch.phase}, {len(rows)} rows) is not the step launched "
                               f"ahead (step {ahead.step}, rows {ahead.expected}): the scheduler broke its "
                               f"reservation")
        return self._finish_replay(batch, dispatcher, ahead.captured, ahead.turn, ahead.pair, ahead.launched_at,
                                   self.synced_at, kernels_before, reserve_next, clock, None, ahead.graph,
                                   ahead.started)

    def _finish_replay(self, batch, dispatcher, captured, turn, pair, launched_at, busy_from, kernels_before,
                       reserve_next, clock, stream, launched=None, started=None) -> tuple[list[int], StepTiming]:
        """A launched replay of `launched` (`captured`, the default, or one of its graphs of several steps: its
        span), this step its first: when the steps after it are reserved, the next launch first (`_launch_ahead`,
        with the other event pair: the largest graph of several steps whose steps the scheduler all reserves, else
        one step); the step's bookkeeping while the device works; then its one sync (its end event: the replay and
        its outputs' writes done) and its outputs, read from its own landing buffer (with a span > 1, every
        step's: the later ones are `served`). `busy_from`: where the step's host time starts when the runner
        measures it (a step launched ahead: the previous step's sync), else None. `started`: the launch's start on
        the caller's clock."""
        rows = batch.rows
        step = batch.step
        launched = captured if launched is None else launched
        span = launched.steps
        if reserve_next is not None and self.run_ahead:
            graph = None
            if captured.block is not None:
                graph = _largest_block(captured, reserve_next, batch, span - 1)
            if graph is None and reserve_next(batch, span):
                graph = captured
            if graph is not None:
                pairs = self._pairs
                self._launch_ahead(captured, step + span, dispatcher, clock,
                                   self._current_stream() if stream is None else stream,
                                   pairs[1] if pair is pairs[0] else pairs[0], graph)
        # begin_step(step, DECODE, n_tokens) and replay, in one call: counts the replay's launches; a graph
        # replays one token per row (`_replay` feeds row.tokens[0]), so n_tokens is the row count
        kernels = launched.step_launches(0)  # the capture's (`captured.kernels`), or the block's first step's
        dispatcher.replay(captured.template, kernels, step, len(rows))
        dispatcher.counters.graph_launches += 1  # this step's launch (a later step of a graph of several: none)
        # launches.since(kernels_before): what the replay launched, counted by `Dispatcher.replay` (nothing else on
        # a replayed step's host path launches), without a pass over every kernel's count
        counted = None if kernels_before is None else dict(kernels)
        waited = _perf_counter()
        pair[2]()  # the step's sync: its end event
        self.synced_at = _perf_counter()
        device_us = pair[3]() * 1e3
        # the graph copied each step's logits out where the run keeps them: read before the instance runs again
        logits = None if launched.logits is None else launched.logits[turn][:, :len(rows)].clone()  # [span, B, V]
        routing = dispatcher.routing
        if routing is not None:  # every step's routing, landed by the graph: copied before the instance runs again
            views = launched.routing_views
            if views is not None:
                routing.append_block(step, launched.routing_layers, views[turn])
            else:
                routing.skip(step, span, "a graph captured without routing landings")
        if span == 1:
            tokens = dispatcher.end_replay(captured.landing[turn].tolist(), len(rows))
            last = tokens
        else:  # every step's outputs: this one's now, the later ones served from the host
            values = launched.landing[turn].tolist()
            tokens = dispatcher.end_replay(values[0], len(rows))
            device_us /= span
            self.served = _Served(captured, launched, dispatcher, step, rows, values, started, launched_at, device_us,
                                  logits)
            last = values[-1][:len(rows)]
        ahead = self.ahead
        if ahead is None:
            captured.holds = [(row.sequence.request_id, token, row.start + span) for row, token in zip(rows, last)]
        else:  # the graph replays again already: what it was fed, checked by the next step (`_Ahead.feeds`)
            ahead.fed, ahead.tokens, ahead.offset = rows, last, span
        host_us = None if busy_from is None else (waited - busy_from) * 1e6
        return tokens, StepTiming(launched_at, device_us, "replay", "", counted, host_us, span,
                                  logits=None if logits is None else logits[0])

    def take_served(self, dispatcher, cohort) -> _Served:
        """The later steps of the synced graph of several steps (`served`), for the caller to serve at once: from
        the values on the host, without a launch or a wait (engine.runtime.Engine._served_steps). `cohort` (the
        scheduler's reserved sequences) must continue the graph's rows (`_Served.continues`), and `dispatcher`
        be the launch's; else the launches in flight are dropped and a RuntimeError says the reservation broke."""
        served = self.served
        self.served = None
        if dispatcher is not served.dispatcher or not served.continues(cohort):
            served.captured.holds = None
            self.drop_ahead()
            raise RuntimeError(f"the reserved steps after step {served.first} are not steps "
                               f"{served.first + 1}..{served.first + len(served.values) - 1} of the graph launched "
                               f"at step {served.first}: the scheduler broke its reservation")
        return served

    def _launch_ahead(self, captured: DecodeGraph, step: int, dispatcher, clock, stream, pair,
                      graph: DecodeGraph | None = None) -> None:
        """Launch the reserved next steps' replay (`graph`: the one-step graph `captured` or its graph of
        several steps), before the sync of the launch in flight (whose outputs it writes into the other
        landing buffer), between the other pair's events. The graph feeds itself, so nothing is copied in."""
        graph = captured if graph is None else graph
        started = clock()
        captured.holds = None  # until that replay's outputs are known
        records = pair[1]
        records[0](stream)
        turn = captured.turn
        graph.launches[turn]()
        captured.turn = turn ^ 1
        records[1](stream)
        self.ahead = _Ahead(captured, step, dispatcher, started, _perf_counter(), pair, turn, graph)
        self.run_ahead_launches += 1

    def _current_stream(self) -> torch.cuda.Stream:
        """This device's current stream: the Stream object made the last time its id changed (a caller
        may switch streams between steps; each step checks the id, one C call)."""
        if _current_stream_ident is None:
            return torch.cuda.current_stream(self._device_index)
        ident = _current_stream_ident(self._device_index)
        if ident != self._stream_ident:
            self._stream, self._stream_ident = _stream_from(ident), ident
        return self._stream

    # ---------------------------------------------------------------------------------- eager

    def _eager(self, batch: Batch, dispatcher) -> torch.Tensor:
        rows, width = batch.rows, batch.width
        size = len(rows)
        ragged = any(len(row.tokens) != width for row in rows)
        contiguous = batch.slots == list(range(size))
        # Everything the layout needs in one host tensor, so one host->device copy per step.
        packed = [token for row in rows for token in (*row.tokens, *[0] * (width - len(row.tokens)))]  # [B*T]
        packed += [row.start for row in rows]  # [B]
        if not contiguous:
            packed += batch.slots  # [B]
        if ragged:
            packed += [index * width + column for index, row in enumerate(rows) for column in range(len(row.tokens))]
            packed += [len(row.tokens) - 1 for row in rows]  # [B]
        on_device = torch.tensor(packed, dtype=torch.int64).to(self.device)
        pieces = iter(on_device.split([size * width, size] + ([] if contiguous else [size])
                                      + ([batch.n_tokens, size] if ragged else [])))
        tokens = next(pieces).view(size, width)  # [B, T]
        start = next(pieces)  # [B]
        slots = None if contiguous else next(pieces)
        token_index, last_index = (next(pieces), next(pieces)) if ragged else (None, None)
        # A decode step in cache rows 0..B-1 reads the whole slot, exactly as its graph does, so an
        # eager decode step launches the same kernels as a replay (same tokens, same counters).
        key_length = self.capacity if batch.phase == DECODE and contiguous else batch.key_length
        layout = StepLayout(start, key_length, slots, token_index, last_index)
        return self._next_tokens(tokens, layout, dispatcher, batch.phase == DECODE)

    def _next_tokens(self, tokens: torch.Tensor, layout: StepLayout, dispatcher, decode: bool) -> torch.Tensor:
        """The forward of an eager step (or a capture's warm-up) and each row's next token [B], launching
        what a replay launches: on a GPU a decode step's folds write the tokens and woken counts into a
        buffer of their own (engine.decode_fused.StepOutputs, no feed), else the tokens come from
        kernels.next_tokens, the kernel a replayed step ends with where the LM head does not pick."""
        config, size = self.engine.config, tokens.shape[0]
        outputs = None
        if self.device.type == "cuda" and decode:
            outputs = dispatcher.outputs = StepOutputs(torch.empty(size + config.n_moe_layers, dtype=torch.int64,
                                                                   device=self.device))
        try:
            logits = forward(config, self.engine.weights, tokens, layout, self.cache, dispatcher)  # [B, V]
        finally:
            dispatcher.outputs = None
        if dispatcher.keep_logits:
            dispatcher.step_logits = logits
        if outputs is not None and outputs.picked:  # the LM head's GEMV took the argmax
            return outputs.observed[:size]
        if logits.is_cuda:
            from kernels.next_tokens import argmax_rows

            return argmax_rows(logits)
        return torch.argmax(logits, dim=-1)

    # ---------------------------------------------------------------------------------- graphs

    def _graph_key(self, size: int, dispatcher) -> tuple[int, int]:
        # A capture freezes the decisions of its flags: a run with other flags needs its own graph; a run that
        # keeps each step's logits needs graphs that copy them out. Whether the run records routing is a flag
        # (record_routing): a run that does gets graphs that land each step's routing (engine.graphs).
        flags = dispatcher.flags
        if self._flags_key[0] is not flags or self._flags_key[2] != dispatcher.keep_logits:
            values = (tuple(sorted(flags.values.items())), dispatcher.keep_logits)
            self._flags_key = (flags, self._flag_tokens.setdefault(values, len(self._flag_tokens)),
                               dispatcher.keep_logits)
        return (size, self._flags_key[1])

    def _graph_for(self, rows, dispatcher) -> tuple[str, tuple[int, int] | None, DecodeGraph | None]:
        """For a decode step's rows: why it cannot replay a graph ("" when it can), its graph key (None
        when the last replayed graph serves it), and its captured graph (None until captured)."""
        size = len(rows)
        for index in range(size):
            if rows[index].sequence.slot != index:
                return (f"decode rows sit in cache rows {[row.sequence.slot for row in rows]}, not 0..{size - 1}",
                        None, None)
        last = self._last_replayed
        if last[0] is dispatcher and last[1] == size:  # a steady cohort: the graph it replayed last step
            return "", None, last[2]
        key = self._graph_key(size, dispatcher)
        reason = self._refused.get(key)
        if reason is None:  # decided once per size and flags: host time matters at batch 1
            reason = self._refused[key] = self._capture_blocker(size, dispatcher)
        captured = None if reason else self._graphs.get(key)
        if captured is not None:
            self._last_replayed = (dispatcher, size, captured)
        return reason, key, captured

    def _capture_blocker(self, size: int, dispatcher) -> str:
        """Why decode steps of `size` rows under these flags cannot replay a graph ("" when they can)."""
        return graph_capture.capture_blocker(self, size, dispatcher)

    def _capture(self, batch: Batch, dispatcher, key: tuple, values: list[list[int]]) -> torch.Tensor:
        """This step run eagerly, then captured (engine.graphs.capture); each row's next token."""
        return graph_capture.capture(self, batch, dispatcher, key, values)

    def _replay(self, captured: DecodeGraph, rows, graph: DecodeGraph | None = None) -> None:
        """Issue one replay of `captured` (or of `graph`, its graph of several steps, which shares its inputs)
        for these decode rows, copying the inputs in only when the graph does not already hold them."""
        wanted = [(row.sequence.request_id, row.tokens[0], row.start) for row in rows]
        if captured.holds != wanted:  # a new cohort (or the first replay): copy the inputs in
            # nothing in flight reads `staging` (a launch the usual way: every earlier copy synced)
            captured.staging.numpy()[:] = [[row.tokens[0] for row in rows], [row.start for row in rows]]
            captured.feed()  # staging -> inputs, enqueued before the replay
            self.input_copies += 1
        captured.holds = None  # until this replay's outputs are known
        (captured if graph is None else graph).launches[captured.turn]()


_DecodeGraph = DecodeGraph  # the name bench/host_step.py's stubs and older tests use
