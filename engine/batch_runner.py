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
  The graph also writes its next tokens and every MoE layer's observed-count output into one
  static buffer, so the step's one sync is a single device->host copy.
  The capture step itself runs eagerly (it is also the warm-up the capture needs), so every step
  computes something real. Steps a graph cannot serve run eagerly, and the step says why.
- The host path of a replayed step is kept short (issue 7: host time per decode step at batch 1;
  bench/host_step.py measures it). Before the launch it does only what the launch needs: the graph
  for a (size, flags) pair (the last replay's, or a lookup on two ints), the inputs check, the
  start event, the replay and the end event. Everything else runs after the launch, while the
  device works: the dispatcher's step (`begin_step`), the arm and kernel counts, the decision
  records copied from the capture's, the step's launch count for its record. The events are
  recorded on a stream object kept by the runner (checked each step against the current stream's
  id, so a caller may switch streams), and the events and the graph are driven through their C
  methods: torch's Python wrappers only default a stream (always passed here) and check input
  liveness (never asked for here).
- Run-ahead (CUDA, on by default; `run_ahead=False` turns it off): a replayed step whose next step
  is certain to replay the same graph (the caller's `reserve_next`, engine.scheduler: the same
  cohort, no row at its last token, nothing waiting) launches that next replay right after its own
  sync, before its bookkeeping (the dispatcher's observe, the scheduler's postprocess, the step
  record), so the device does not sit idle through them. The graph fed itself, so the next replay
  needs nothing from the host; the step's outputs (`observed`, which the next replay overwrites)
  were already read by the sync. The next `run` finds its step launched (`ahead`): it checks the
  Batch is the one launched (else raises: a bug, never a silent wrong step), does not launch again,
  and does everything else a replayed step does. Each step has its own start and end events around
  its own replay: a run-ahead replay records the other of two event pairs, since the step before
  reads its own pair after the launch. Not while steps are labelled for the profiler (a step's
  kernels would start inside the previous step's range).

Knows nothing of scheduling policy, clocks beyond the step's own, or benchmarks.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from engine import dispatch
from engine.arms import ARMS
from engine.attention_dispatch import UNFUSED, decide_attention
from engine.model import KVCache, StepLayout, forward
from engine.scheduler import DECODE, Batch
from kernels import launches



def run_ahead_default() -> bool:
    """Run-ahead unless MOEI_RUN_AHEAD=0 (the benchmark's A/B); a runner may still be told either way."""
    return os.environ.get("MOEI_RUN_AHEAD", "1") != "0"

@dataclass
class StepTiming:
    launched_at: float  # time.perf_counter() when the last launch (or the replay) was issued
    device_us: float | None  # CUDA events around the step's work; None on a CPU (no separate device clock)
    graph: str  # "replay", "capture" or "eager"
    eager_reason: str = ""  # why a GPU decode step did not replay a graph
    # Triton launches since the caller's snapshot (`run`'s kernels_before), counted before the step's
    # sync, while the device works; None when no snapshot was given.
    kernel_launches: dict[str, int] | None = None


class _Ahead:
    """A replayed step launched ahead, at the previous replayed step's sync (`BatchRunner._after_sync`).

    `started` (the caller's clock) and `host_started` (perf_counter) are stamped right after that sync,
    before this launch: the step's host time (`launched_at - host_started`, its `host_us`) is the host
    time from the previous step's sync to this step's launch (the stamps, the event records, the
    replay call), what the device waits for between the two steps."""

    __slots__ = ("captured", "step", "dispatcher", "started", "host_started", "launched_at", "events", "expected")

    def __init__(self, captured, step, dispatcher, started, host_started, launched_at, events) -> None:
        self.captured, self.step, self.dispatcher = captured, step, dispatcher
        self.started, self.host_started, self.launched_at, self.events = started, host_started, launched_at, events
        self.expected: list[tuple[int, int, int]] | None = None  # (request id, token, position) per row fed


@dataclass
class _DecodeGraph:
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor  # [2, B] int64 static: row 0 the tokens fed, row 1 their positions
    staging: torch.Tensor  # [2, B] int64 pinned host copy of the next inputs
    observed: torch.Tensor  # [B + MoE layers] int64 static output: the next tokens, then each layer's woken experts
    template: object  # the capture's Dispatcher: decisions, arm counts, observed-count outputs
    kernels: dict[str, int]  # Triton launches the capture recorded (and a replay repeats)
    # What `inputs` holds after the last replay (the graph feeds its own output one position on):
    # one (request id, token, position) per row; a step that matches needs no host->device copy.
    holds: list[tuple[int, int, int]] | None = None
    launch: Callable[[], None] = field(init=False, repr=False)  # graph.replay, without torch's Python layer

    def __post_init__(self) -> None:
        graph = self.graph
        # torch.cuda.CUDAGraph.replay checks input liveness when the capture asked for it (ours does
        # not: `_tracker` is None), then calls the C replay; call that directly.
        if isinstance(graph, torch.cuda.CUDAGraph) and getattr(graph, "_tracker", None) is None:
            self.launch = super(torch.cuda.CUDAGraph, graph).replay
        else:
            self.launch = graph.replay


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
        self._flag_tokens: dict[tuple, int] = {}
        self._flags_key: tuple = (None, -1)  # (the last flags object seen, its token)
        # The step's (start, end) events, reused: read after the step's sync, before the next step records them.
        self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else None
        # What records them: the C method each torch.cuda.Event.record wraps (the wrapper only looks the
        # current stream up when none is passed). They are recorded on this device's current stream,
        # passed explicitly (`_current_stream`): a lookup through torch's Python layers costs more.
        self._records = tuple(super(torch.cuda.Event, event).record for event in self._events) if cuda else None
        # A second pair for a step launched ahead: the step before reads its own pair after that launch.
        self._spare_events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) \
            if cuda else None
        self._spare_records = tuple(super(torch.cuda.Event, event).record for event in self._spare_events) \
            if cuda else None
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
        # Launch a steady cohort's next replay at this step's sync (module docstring); CUDA graphs only.
        if run_ahead is None:
            run_ahead = run_ahead_default()
        self.run_ahead = self.graphs_enabled and run_ahead
        self.run_ahead_launches = 0  # replays launched ahead
        self.ahead: _Ahead | None = None  # the next step, launched already; None when not
        self.synced_at: float | None = None  # perf_counter right after the last replayed step's sync
        # What `_after_sync` launches, set by a step whose next step was reserved: (graph, step number,
        # dispatcher, clock, stream, (events, records) of the other pair); None: nothing to launch.
        self._pending: tuple | None = None
        self._after_sync_call = self._after_sync  # the bound method, made once

    def run(self, batch: Batch, dispatcher, kernels_before: dict[str, int] | None = None,
            reserve_next: Callable[[Batch], bool] | None = None, clock: Callable[[], float] = time.perf_counter
            ) -> tuple[list[int], StepTiming]:
        """One step: every row's next token (one sync, in the dispatcher) and the step's clocks; with
        `kernels_before` (a `launches.snapshot()`), also the Triton launches since it. With
        `reserve_next` (engine.scheduler.Scheduler.reserve_next), a replayed step whose next step it
        reserves launches that step at its sync (run-ahead; `ahead` then holds it, its start stamped
        on `clock`); the caller's next `run` must be that step."""
        if not self.label_steps:
            return self._run(batch, dispatcher, kernels_before, reserve_next, clock)
        with torch.profiler.record_function(f"moei.step.{batch.step}"):
            return self._run(batch, dispatcher, kernels_before, None, clock)  # no run-ahead: ranges per step

    def drop_ahead(self) -> None:
        """Forget a step launched ahead that will not run (its run ended early, e.g. on an error): the
        device still runs it (within the slots' capacity, `reserve_next`), and the graph's next replay
        copies its inputs in."""
        if self.ahead is not None:
            self.ahead.captured.holds = None
            self.ahead = None
        self._pending = None

    @property
    def captured_sizes(self) -> list[int]:
        return sorted(key[0] for key in self._graphs)

    def _run(self, batch: Batch, dispatcher, kernels_before, reserve_next, clock) -> tuple[list[int], StepTiming]:
        ahead = self.ahead
        if ahead is not None:  # launched at the previous step's sync
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
        """A replayed decode step: the start event, the replay (and its input copy, if any) and the end
        event first; the step's bookkeeping while the device works; then the step's one sync."""
        rows = batch.rows
        records = self._records
        stream = None
        if records is not None:
            stream = self._current_stream()
            records[0](stream)
            self._replay(captured, rows)
            records[1](stream)
        else:
            self._replay(captured, rows)
        launched_at = time.perf_counter()
        return self._finish_replay(batch, dispatcher, captured, kernels_before, reserve_next, clock, launched_at,
                                   stream, self._events, self._spare_events, self._spare_records)

    def _run_ahead(self, batch: Batch, dispatcher, ahead: _Ahead, kernels_before, reserve_next, clock
                   ) -> tuple[list[int], StepTiming]:
        """A replayed decode step launched at the previous step's sync: not launched again; checked to be
        the step that was launched; then the same bookkeeping and sync as `_run_replay`."""
        rows = batch.rows
        if (batch.step != ahead.step or batch.phase != DECODE or dispatcher is not ahead.dispatcher
                or ahead.expected != [(row.sequence.request_id, row.tokens[0], row.start) for row in rows]):
            ahead.captured.holds = None
            raise RuntimeError(f"step {batch.step} ({batch.phase}, {len(rows)} rows) is not the step launched "
                               f"ahead (step {ahead.step}, rows {ahead.expected}): the scheduler broke its "
                               f"reservation")
        events = ahead.events
        if events is self._events:
            spare_events, spare_records = self._spare_events, self._spare_records
        else:
            spare_events, spare_records = self._events, self._records
        stream = self._current_stream() if spare_records is not None else None  # for a launch ahead of this step
        return self._finish_replay(batch, dispatcher, ahead.captured, kernels_before, reserve_next, clock,
                                   ahead.launched_at, stream, events, spare_events, spare_records)

    def _finish_replay(self, batch, dispatcher, captured, kernels_before, reserve_next, clock, launched_at,
                       stream, events, spare_events, spare_records) -> tuple[list[int], StepTiming]:
        """A launched replay's bookkeeping while the device works, then its one sync (which, when the
        next step is reserved, launches that step before anything else: `_after_sync`); `events` are
        this step's own pair, the spare pair the one a step launched ahead records."""
        rows = batch.rows
        dispatcher.begin_step(batch.step, DECODE, batch.n_tokens)
        dispatcher.replay(captured.template, captured.kernels)  # counts the replay's launches
        counted = None if kernels_before is None else launches.since(kernels_before)
        if reserve_next is not None and self.run_ahead and reserve_next(batch):
            self._pending = (captured, batch.step + 1, dispatcher, clock, stream, spare_events, spare_records)
        tokens = dispatcher.end_replay(captured.observed, len(rows), self._after_sync_call)
        ahead = self.ahead
        if ahead is None:
            captured.holds = [(row.sequence.request_id, token, row.start + 1) for row, token in zip(rows, tokens)]
        else:  # the graph replays again already: what it was fed, checked by the next step
            ahead.expected = [(row.sequence.request_id, token, row.start + 1) for row, token in zip(rows, tokens)]
        device_us = events[0].elapsed_time(events[1]) * 1e3 if events is not None else None
        return tokens, StepTiming(launched_at, device_us, "replay", "", counted)

    def _after_sync(self) -> None:
        """Right after a replayed step's sync (its outputs already read to the host): stamp it and, when
        the next step was reserved, launch that step's replay between its own start and end events. The
        graph holds that step's inputs already (it fed itself), so nothing is copied in."""
        synced = self.synced_at = time.perf_counter()
        pending = self._pending
        if pending is None:
            return
        self._pending = None
        captured, step, dispatcher, clock, stream, events, records = pending
        started = synced if clock is time.perf_counter else clock()
        captured.holds = None  # until that replay's outputs are known
        if records is not None:
            records[0](stream)
            captured.launch()
            records[1](stream)
        else:
            captured.launch()
        launched_at = time.perf_counter()
        self.ahead = _Ahead(captured, step, dispatcher, started, synced, launched_at, events)
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
        logits = forward(self.engine.config, self.engine.weights, tokens, layout, self.cache, dispatcher)  # [B, V]
        if logits.is_cuda:  # the kernel a replayed step ends with (kernels.next_tokens): same launches
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

    def _replay(self, captured: _DecodeGraph, rows) -> None:
        """Issue one replay of `captured` for these decode rows, copying the inputs in only when the
        graph does not already hold them."""
        wanted = [(row.sequence.request_id, row.tokens[0], row.start) for row in rows]
        if captured.holds != wanted:  # a new cohort (or the first replay): copy the inputs in
            captured.staging.numpy()[:] = [[row.tokens[0] for row in rows], [row.start for row in rows]]
            captured.inputs.copy_(captured.staging, non_blocking=True)  # the step's one sync waits for it
            self.input_copies += 1
        captured.holds = None  # until this replay's outputs are known
        captured.launch()

    def _capture(self, batch: Batch, dispatcher, key: tuple, values: list[list[int]]) -> torch.Tensor:
        """Run this step eagerly from static buffers (the warm-up a capture needs), then capture it."""
        from engine.runtime import Dispatcher  # runtime imports this module
        from kernels.next_tokens import argmax_rows, next_tokens as next_tokens_into  # Triton: GPU only

        config, weights, size = self.engine.config, self.engine.weights, len(batch.rows)
        inputs = torch.tensor(values, dtype=torch.int64, device=self.device)  # [2, B] static
        layout = StepLayout(inputs[1], self.capacity)  # rows 0..B-1, the whole cache as keys
        tokens = inputs[0].view(size, 1)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            # the eager step's own tail kernel, as `_eager` ends (so eager and graphed runs count alike)
            next_tokens = argmax_rows(forward(config, weights, tokens, layout, self.cache, dispatcher))
        torch.cuda.current_stream().wait_stream(side)

        template = Dispatcher(self.engine, dispatcher.flags, timed=False)
        template.begin_step(batch.step, DECODE, size)
        before = launches.snapshot()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                logits = forward(config, weights, tokens, layout, self.cache, template)  # [B, V]
                # One static output for the step's one sync: the next tokens, then each MoE layer's
                # woken-expert count (what `end_step_batch` concatenates on an eager step).
                woken = [count.long() for count in template.pending_woken]
                observed = torch.empty(size + len(woken), dtype=torch.int64, device=self.device)
                if woken:
                    torch.stack(woken, out=observed[size:])
                # The cohort's next step feeds these tokens one position on: the graph prepares its own
                # inputs, so a steady cohort needs no host->device copy (the host checks, see `holds`).
                # One kernel: argmax into `observed`, the same tokens into inputs[0], inputs[1] + 1.
                next_tokens_into(logits.float(), observed, inputs)
        except Exception as error:  # noqa: BLE001 - a kernel that cannot be captured: say so, run eagerly
            self._refused[key] = f"capture failed: {type(error).__name__}: {str(error).splitlines()[0][:160]}"
            observed = None
        kernels = launches.since(before)
        for name, count in kernels.items():  # captured, not launched: the replays will count them
            launches.record(name, -count)
        if observed is not None:
            staging = torch.empty((2, size), dtype=torch.int64, pin_memory=True)
            self._graphs[key] = _DecodeGraph(graph, inputs, staging, observed, template, kernels)
        return next_tokens
