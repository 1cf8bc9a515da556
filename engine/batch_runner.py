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
- The host path of a replayed step is kept short (issue 7: host time per decode step at batch 1;
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
  captured K times in a row into one graph (`_DecodeGraph.block`: two instances, sharing the one-step graph's
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
  Beside it, graphs of K/2, K/4, ... down to 2 steps (`_DecodeGraph.tails`): a launch takes the largest graph
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

import os
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch

from engine import dispatch
from engine.arms import ARMS
from engine.attention_dispatch import UNFUSED, decide_attention
from engine.decode_fused import StepOutputs, carried_launches, carry_default
from engine.model import KVCache, StepLayout, forward
from engine.scheduler import DECODE, Batch
from kernels import launches



_perf_counter = time.perf_counter  # the host path's clock, one global lookup per read


def run_ahead_default() -> bool:
    """Run-ahead unless MOEI_RUN_AHEAD=0 (the benchmark's A/B); a runner may still be told either way."""
    return os.environ.get("MOEI_RUN_AHEAD", "1") != "0"

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
    """A synced graph of several steps (`_DecodeGraph.block`) whose later steps have not run yet: their
    tokens and woken counts are on the host already (`values`, one list per step of the graph). The caller
    takes them (`BatchRunner.take_served`) and serves them all at once (engine.runtime.Engine._served_steps),
    launching and waiting for nothing. `started` and `launched_at` are the launch's; `device_us` its device
    time over its steps."""

    __slots__ = ("captured", "block", "dispatcher", "first", "rows", "values", "started", "launched_at",
                 "device_us")

    def __init__(self, captured, block, dispatcher, first, rows, values, started, launched_at, device_us) -> None:
        self.captured, self.block = captured, block  # the one-step graph, and its graph of several steps launched
        self.dispatcher, self.first, self.rows, self.values = dispatcher, first, rows, values
        self.started, self.launched_at, self.device_us = started, launched_at, device_us

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


def _launcher(graph) -> Callable[[], None]:
    """graph.replay without torch's Python layer: torch.cuda.CUDAGraph.replay checks input liveness when
    the capture asked for it (ours does not: `_tracker` is None), then calls the C replay."""
    if isinstance(graph, torch.cuda.CUDAGraph) and getattr(graph, "_tracker", None) is None:
        return super(torch.cuda.CUDAGraph, graph).replay
    return graph.replay


@dataclass
class _DecodeGraph:
    """A captured decode step: two instances of it, launched alternately, each of whose kernels write the
    step's outputs straight into its own pinned host buffer, so a launch copies nothing."""

    graphs: tuple  # two torch.cuda.CUDAGraph instances of the step
    inputs: torch.Tensor  # [2, B] int64 static: row 0 the tokens fed, row 1 their positions
    staging: torch.Tensor  # [2, B] int64 pinned host copy of the next inputs
    # per instance, [B + MoE layers] int64 pinned: the next tokens, then each layer's woken experts; a step
    # reads its own after its sync while the next step in flight writes the other
    landing: tuple
    template: object  # the capture's Dispatcher: decisions, arm counts, observed-count outputs
    kernels: dict[str, int]  # Triton launches the capture recorded (and a replay repeats)
    # What `inputs` holds after the last replay (the graph feeds its own output one position on):
    # one (request id, token, position) per row; a step that matches needs no host->device copy.
    holds: list[tuple[int, int, int]] | None = None
    turn: int = 0  # the instance / landing buffer of the next launch (alternates per launch)
    steps: int = 1  # decode steps one launch runs; a block's landing buffers are [steps, B + MoE layers]
    # The graph of `steps_per_graph` steps beside this one-step graph (same inputs, its own two instances and
    # landing buffers; its `kernels` are per step), or None. Its launches take this graph's `turn` and `holds`.
    block: "_DecodeGraph | None" = None
    # Graphs of fewer steps beside `block`, halving down to 2 (K / 2, K / 4, ...: a run's last steps, fewer than
    # K, still go by few launches), largest first; like `block`, or empty.
    tails: tuple = ()
    # A block's launches per step when they differ from `kernels` (a step whose first norm the step before carried:
    # engine.decode_fused.StepOutputs.carry), else None; and the buffers its graphs write and read besides.
    step_kernels: tuple[dict[str, int], ...] | None = None
    buffers: tuple = ()
    launches: tuple[Callable[[], None], ...] = field(init=False, repr=False)  # per turn
    feed: Callable[[], object] | None = field(init=False, repr=False)  # enqueue staging -> inputs
    # The launches of steps 1 .. steps - 1 (served from the host after the launch's sync), as (launches, steps)
    # groups of consecutive equal ones: what serving them counts, one group at a time.
    later_kernels: tuple[tuple[dict[str, int], int], ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        groups: list[list] = []
        for index in range(1, self.steps):
            kernels = self.step_launches(index)
            if groups and groups[-1][0] == kernels:
                groups[-1][1] += 1
            else:
                groups.append([kernels, 1])
        self.later_kernels = tuple((kernels, times) for kernels, times in groups)
        inputs = self.inputs
        # Tensor.copy_ is a C method: the partial costs one call; non_blocking from pinned host memory, so it
        # is only enqueued on the current stream (the replay's).
        self.feed = None if inputs is None else partial(inputs.copy_, self.staging, non_blocking=True)
        self.launches = tuple(_launcher(graph) for graph in self.graphs)

    def step_launches(self, index: int) -> dict[str, int]:
        """The launches of this graph's step `index` (`kernels`, unless a step before carried its first norm)."""
        return self.kernels if self.step_kernels is None else self.step_kernels[index]


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
        self.graphs_enabled = cuda and (graphs is None or graphs)
        self.graphs_note = ("on" if self.graphs_enabled else
                            "off (--graphs off)" if cuda else "off (CPU: no CUDA graphs)")
        # Keyed by (size, flags token): the token is a small int per distinct flag values, so a step's
        # lookup hashes two ints, not every flag (`_graph_key`).
        self._graphs: dict[tuple[int, int], _DecodeGraph] = {}
        self._refused: dict[tuple[int, int], str] = {}  # why a graph cannot serve this (size, flags); "" = it can
        self.block_notes: dict[tuple[int, int], str] = {}  # why a graph of several steps was not captured
        self._flag_tokens: dict[tuple, int] = {}
        self._flags_key: tuple = (None, -1)  # (the last flags object seen, its token)
        # Two (start, end) event pairs, reused (`use_events`); None on a CPU.
        self._pairs: tuple | None = None
        self._events = self._records = None
        if cuda:
            self.use_events(lambda: torch.cuda.Event(enable_timing=True))
        self._device_index = (self.device.index if self.device.index is not None else torch.cuda.current_device()) \
            if cuda else None
        self._stream: torch.cuda.Stream | None = None  # the current stream, kept while its id stays the same
        self._stream_ident: tuple | None = None
        # The last replayed graph, with the flags object and batch size it was found for: a steady
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
        with torch.profiler.record_function(f"moei.step.{batch.step}"):
            return self._run(batch, dispatcher, kernels_before, None, clock)  # no run-ahead: ranges per step

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
        events = self._events
        device_us = events[0].elapsed_time(events[1]) * 1e3 if events is not None else None
        return tokens, StepTiming(launched_at, device_us, graph_mode, reason, counted)

    def _run_replay(self, batch: Batch, dispatcher, captured: _DecodeGraph, kernels_before, reserve_next=None,
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
        if span == 1:
            tokens = dispatcher.end_replay(captured.landing[turn].tolist(), len(rows))
            last = tokens
        else:  # every step's outputs: this one's now, the later ones served from the host
            values = launched.landing[turn].tolist()
            tokens = dispatcher.end_replay(values[0], len(rows))
            device_us /= span
            self.served = _Served(captured, launched, dispatcher, step, rows, values, started, launched_at, device_us)
            last = values[-1][:len(rows)]
        ahead = self.ahead
        if ahead is None:
            captured.holds = [(row.sequence.request_id, token, row.start + span) for row, token in zip(rows, last)]
        else:  # the graph replays again already: what it was fed, checked by the next step (`_Ahead.feeds`)
            ahead.fed, ahead.tokens, ahead.offset = rows, last, span
        host_us = None if busy_from is None else (waited - busy_from) * 1e6
        return tokens, StepTiming(launched_at, device_us, "replay", "", counted, host_us, span)

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

    def _launch_ahead(self, captured: _DecodeGraph, step: int, dispatcher, clock, stream, pair,
                      graph: _DecodeGraph | None = None) -> None:
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
            outputs = dispatcher.outputs = StepOutputs(torch.empty(size + config.n_layers, dtype=torch.int64,
                                                                   device=self.device))
        try:
            logits = forward(config, self.engine.weights, tokens, layout, self.cache, dispatcher)  # [B, V]
        finally:
            dispatcher.outputs = None
        if outputs is not None and outputs.picked:  # the LM head's GEMV took the argmax
            return outputs.observed[:size]
        if logits.is_cuda:
            from kernels.next_tokens import argmax_rows

            return argmax_rows(logits)
        return torch.argmax(logits, dim=-1)

    # ---------------------------------------------------------------------------------- graphs

    def _graph_key(self, size: int, dispatcher) -> tuple[int, int]:
        # A capture freezes the decisions of its flags: a run with other flags needs its own graph.
        flags = dispatcher.flags
        if self._flags_key[0] is not flags:
            values = tuple(sorted(flags.values.items()))
            self._flags_key = (flags, self._flag_tokens.setdefault(values, len(self._flag_tokens)))
        return (size, self._flags_key[1])

    def _graph_for(self, rows, dispatcher) -> tuple[str, tuple[int, int] | None, _DecodeGraph | None]:
        """For a decode step's rows: why it cannot replay a graph ("" when it can), its graph key (None
        when the last replayed graph serves it), and its captured graph (None until captured)."""
        size = len(rows)
        for index in range(size):
            if rows[index].sequence.slot != index:
                return (f"decode rows sit in cache rows {[row.sequence.slot for row in rows]}, not 0..{size - 1}",
                        None, None)
        last = self._last_replayed
        if last[0] is dispatcher.flags and last[1] == size:  # a steady cohort: the graph it replayed last step
            return "", None, last[2]
        key = self._graph_key(size, dispatcher)
        reason = self._refused.get(key)
        if reason is None:  # decided once per size and flags: host time matters at batch 1
            reason = self._refused[key] = self._capture_blocker(size, dispatcher)
        captured = None if reason else self._graphs.get(key)
        if captured is not None:
            self._last_replayed = (dispatcher.flags, size, captured)
        return reason, key, captured

    def _capture_blocker(self, size: int, dispatcher) -> str:
        config, flags = self.engine.config, dispatcher.flags
        decision = dispatch.decide(dispatch.GateInputs(
            n_tokens=size, k=config.top_k, n_experts=config.n_experts, tile_m=flags["tile_m"],
            policy=flags["moe_gate"], decode_floor=flags["decode_floor"], moe_max_tokens=flags["moe_max_tokens"],
            grouped_variant=flags["grouped_variant"], measured_crossover=dispatcher.crossover))
        if not config.plain_experts:
            return "this family's experts (biases, clamped SwiGLU) run on the reference arm, which syncs the host"
        if decision.arm == dispatch.REFERENCE or not ARMS[decision.arm].supports(self.device):
            return "the MoE reference arm syncs the host (torch.unique), which a CUDA graph cannot capture"
        for mask in config.layer_masks:
            attention = decide_attention(config.head_dim, mask.kind, mask.describe(), flags["flash_512"],
                                         flags["fused_mask"])
            if attention.arm == UNFUSED:
                return "the unfused attention reference syncs the host, which a CUDA graph cannot capture"
        return ""

    def _replay(self, captured: _DecodeGraph, rows, graph: _DecodeGraph | None = None) -> None:
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

    def _capture(self, batch: Batch, dispatcher, key: tuple, values: list[list[int]]) -> torch.Tensor:
        """Run this step eagerly from static buffers (the warm-up a capture needs), then capture it: the
        one-step graph, and with the flag steps_per_graph > 1 the graph of that many steps beside it."""
        config, size = self.engine.config, len(batch.rows)
        inputs = torch.tensor(values, dtype=torch.int64, device=self.device)  # [2, B] static
        layout = StepLayout(inputs[1], self.capacity)  # rows 0..B-1, the whole cache as keys
        tokens = inputs[0].view(size, 1)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # as an eager step computes its tokens (eager and graphed runs count alike)
            next_tokens = self._next_tokens(tokens, layout, dispatcher, True)
        torch.cuda.current_stream().wait_stream(side)

        # Two instances of the step, launched alternately (run-ahead keeps two in flight). Each writes the step's
        # outputs straight into its own pinned host buffer, which the host reads after the step's sync: the
        # next tokens, then each MoE layer's woken-expert count (what `end_step_batch` concatenates on an eager
        # step). The folds write there where they run (engine.decode_fused.StepOutputs: the router's count,
        # the LM head's argmax, which also feeds the next replay its inputs); what they did not write is
        # copied or written there after the forward. A launch then copies nothing (bench/probe_launch.py:
        # a Triton store into pinned host memory, and a device-to-host copy captured in a graph, both land).
        landing = tuple(torch.empty(size + config.n_layers, dtype=torch.int64, pin_memory=True) for _ in range(2))
        try:
            graphs, template, per_step = self._capture_instances(batch, dispatcher, inputs, tokens, layout,
                                                                 [observed.view(1, -1) for observed in landing])
            counted = per_step[0][0]
        except Exception as error:  # noqa: BLE001 - a kernel that cannot be captured: say so, run eagerly
            self._refused[key] = f"capture failed: {type(error).__name__}: {str(error).splitlines()[0][:160]}"
            return next_tokens
        staging = torch.empty((2, size), dtype=torch.int64, pin_memory=True)
        captured = self._graphs[key] = _DecodeGraph(graphs, inputs, staging, landing, template, counted)
        steps = dispatcher.flags["steps_per_graph"]
        if steps > 1:
            # The graph of several steps: the same step captured `steps` times in a row, each step's outputs in
            # its own row of the instance's landing buffer, each step feeding the next its inputs on the device;
            # then, for a run's last steps, graphs of half as many, down to 2 (`tails`).
            # Each step but the last may carry the next one's first norm (the LM head's pick writes it into these
            # buffers, one pair per instance, shared by the graphs, which never run at once); the launches of each
            # step are checked against the one-step graph's.
            carry = tuple((torch.empty((size, config.hidden), dtype=self.engine.dtype, device=self.device),
                           torch.empty((size, config.hidden), dtype=self.engine.dtype, device=self.device))
                          for _ in range(2)) if carry_default() else (None, None)
            blocks = []
            while steps > 1:
                block = self._capture_block(batch, dispatcher, key, inputs, tokens, layout, staging, template, counted,
                                            steps, carry)
                if block is None:
                    break
                blocks.append(block)
                steps //= 2
            if blocks:
                captured.block, captured.tails = blocks[0], tuple(blocks[1:])
        return next_tokens

    def _capture_block(self, batch: Batch, dispatcher, key, inputs, tokens, layout, staging, template,
                       counted: dict[str, int], steps: int, carry: tuple) -> "_DecodeGraph | None":
        """The graph of `steps` steps (`_DecodeGraph.block` or one of its `tails`), or None with a note in
        `block_notes` (the one-step graph and any larger graph captured serve)."""
        size = inputs.shape[1]
        landings = tuple(torch.empty((steps, size + self.engine.config.n_layers), dtype=torch.int64,
                                     pin_memory=True) for _ in range(2))
        try:
            graphs, _, per_step = self._capture_instances(batch, dispatcher, inputs, tokens, layout, landings, carry)
            expected = [carried_launches(counted, index > 0 and per_step[index - 1][1], carried_out)
                        for index, (_, carried_out) in enumerate(per_step)]
            if [launched for launched, _ in per_step] != expected:
                raise RuntimeError(f"{steps} steps launch {[launched for launched, _ in per_step]}, not {expected}")
        except Exception as error:  # noqa: BLE001 - the one-step graph serves; the steps say span 1
            self.block_notes[key] = (f"graph of {steps} steps not captured: {type(error).__name__}: "
                                     f"{str(error).splitlines()[0][:160]}")
            return None
        chained = any(carried_out for _, carried_out in per_step)
        return _DecodeGraph(graphs, inputs, staging, landings, template, counted, steps=steps,
                            step_kernels=tuple(expected) if chained else None, buffers=carry)

    def _capture_instances(self, batch: Batch, dispatcher, inputs, tokens, layout, landings: list,
                           carry: tuple = (None, None)) -> tuple[tuple, object, list[tuple[dict[str, int], bool]]]:
        """One graph per landing buffer [steps, B + MoE layers], each the decode step captured `steps` times in
        a row, step k writing its outputs into row k; the first step's template dispatcher (its decisions and
        outputs, which a replay copies per step) and, per step of an instance, its launches and whether its LM
        head carried the next step's first norm into that instance's `carry` buffers (x, h; None: no carry)."""
        from engine.runtime import Dispatcher  # runtime imports this module
        from kernels.next_tokens import next_tokens as next_tokens_into  # Triton: GPU only

        config, weights, size = self.engine.config, self.engine.weights, inputs.shape[1]
        graphs, templates, counted = [], [], []
        for landing, buffers in zip(landings, carry):
            steps = []  # made before the capture: nothing of a dispatcher's set-up belongs in the graph
            for index, observed in enumerate(landing):
                template = Dispatcher(self.engine, dispatcher.flags, timed=False)
                template.begin_step(batch.step + index, DECODE, size)
                steps.append((template, observed))
            per_step = []
            captured_from = launches.snapshot()
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=self._pool):
                    carried = None
                    for index, (template, observed) in enumerate(steps):
                        before = launches.snapshot()
                        template.outputs = outputs = StepOutputs(
                            observed, inputs, carry=buffers if index + 1 < len(steps) else None, carried=carried)
                        try:
                            logits = forward(config, weights, tokens, layout, self.cache, template)  # [B, V]
                        finally:
                            template.outputs = None
                        woken = template.pending_woken
                        if len(woken) != config.n_layers:
                            raise RuntimeError(f"{len(woken)} woken counts for {config.n_layers} layers")
                        if any(count.data_ptr() != observed[size + layer].data_ptr()
                               for layer, count in enumerate(woken)):
                            observed[size:].copy_(torch.stack([count.long() for count in woken]), non_blocking=True)
                        # The cohort's next step feeds these tokens one position on: the graph prepares its own
                        # inputs (for its own next step, or the next replay), so a steady cohort needs no
                        # host->device copy (the host checks, see `holds`). One kernel where the LM head did not:
                        # argmax into `observed`, the same tokens into inputs[0], inputs[1] + 1.
                        if not outputs.picked:
                            next_tokens_into(logits.float(), observed, inputs)
                        per_step.append((launches.since(before), outputs.carried_out))
                        carried = buffers if outputs.carried_out else None
            finally:
                for name, count in launches.since(captured_from).items():  # captured, not launched: replays count them
                    launches.record(name, -count)
            counted.append(per_step)
            graphs.append(graph)
            templates.append(steps[0][0])
        if counted[0] != counted[1]:
            raise RuntimeError(f"the two instances launch {counted[0]} and {counted[1]}")
        return tuple(graphs), templates[0], counted[0]
