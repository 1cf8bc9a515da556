"""Continuous batching: which sequences run in the next step, with which tokens at which positions.
Plain Python, no torch, so every policy decision is tested without a model or a GPU.

Policy (nano-vllm's, plus chunked prefill):
  1. Prefill first. Sequences already admitted but with part of their prompt uncached continue,
     oldest first; then waiting sequences are admitted, in arrival order, while a KV slot is free.
     Each row gets the next chunk of its prompt, at most `prefill_chunk` tokens, and the step at
     most `token_budget` tokens in all (the last row may get a shorter chunk to fit).
  2. Otherwise a decode step: every admitted sequence whose prompt is cached feeds its last token.
With `mixed` (the flag mixed_steps, on by default) a step that prefills also carries every decoding
sequence's next token, first and within the token budget (phase MIXED), so admitting a sequence does
not stall the ones decoding (as vLLM and SGLang schedule); without it such a step prefills alone and
the decoders wait. A row whose chunk reaches the end of its prompt emits the sequence's first
generated token; every decode row emits one token.

A slot is a row of the preallocated KV cache; a sequence keeps the lowest free slot from
admission until it finishes. Rows are ragged: each has its own start position (and, in prefill,
its own length). Knows nothing of tensors, clocks or models: the caller passes times and tokens.

A steady decode cohort (the same sequences, step after step) is scheduled without re-deciding:
once a decode step finds nothing to prefill or admit, the next steps reuse its cohort until a
sequence is added or finishes. `schedule` runs before every step's launch, so its cost is host
time per decode step (the host-time target).

Run-ahead and graphs of several steps (engine.batch_runner): a caller may launch a steady cohort's
next decode steps before this step's `postprocess`, but only once `reserve_next` said those steps are
certain (no row finishes before the last of them, none waits, the same cohort). A reservation is
binding: the next `schedule` calls return that cohort's decode steps even if a sequence was added
meanwhile (it is admitted after them), and a sequence finishing while a reservation stands is an
error, never a silent wrong step. A reservation may be extended while it stands (a graph of several
steps in flight, the next one launched ahead).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, fields

from engine.sequence import FINISHED, RUNNING, WAITING, Sequence

PREFILL, DECODE, MIXED = "prefill", "decode", "mixed"
MIN_PREFILL_CHUNK = 16


@dataclass(frozen=True, slots=True)  # slots: half the construction time, and one Row per sequence per step
class Row:
    """One sequence's share of a step."""

    sequence: Sequence
    start: int  # position of the first token fed
    tokens: tuple[int, ...]  # tokens fed, at positions start .. start + len - 1
    emits: bool  # the last position's logits give the sequence's next token

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass(frozen=True, slots=True)
class Batch:
    step: int
    phase: str  # PREFILL, DECODE or MIXED (decode rows first, then prefill chunks)
    rows: tuple[Row, ...]

    @property
    def n_tokens(self) -> int:
        return sum([len(row.tokens) for row in self.rows])

    @property
    def width(self) -> int:
        """T: the longest row; shorter rows are padded to it in the forward."""
        return max(len(row.tokens) for row in self.rows)

    @property
    def key_length(self) -> int:
        """Keys attention must read: every row's end position."""
        return max(row.end for row in self.rows)

    @property
    def slots(self) -> list[int]:
        return [row.sequence.slot for row in self.rows]


# A steady decode step's Batch and Rows, set through their slots: a frozen dataclass's __init__ sets
# each field with object.__setattr__, which was half the time of scheduling a steady decode step.
_new = object.__new__
_ROW_FIELDS = tuple(vars(Row)[item.name].__set__ for item in fields(Row))  # sequence, start, tokens, emits
_BATCH_FIELDS = tuple(vars(Batch)[item.name].__set__ for item in fields(Batch))  # step, phase, rows
assert [item.name for item in fields(Row)] == ["sequence", "start", "tokens", "emits"] and \
    [item.name for item in fields(Batch)] == ["step", "phase", "rows"], "update _decode_batch"


def _decode_batch(step: int, cohort: tuple[Sequence, ...]) -> Batch:
    """Batch(step, DECODE, tuple(Row(s, s.cached, (s.generated[-1],), True) for s in cohort))."""
    set_sequence, set_start, set_tokens, set_emits = _ROW_FIELDS
    rows = []
    for sequence in cohort:
        row = _new(Row)
        set_sequence(row, sequence)
        set_start(row, sequence.cached)
        set_tokens(row, (sequence.generated[-1],))
        set_emits(row, True)
        rows.append(row)
    set_step, set_phase, set_rows = _BATCH_FIELDS
    batch = _new(Batch)
    set_step(batch, step)
    set_phase(batch, DECODE)
    set_rows(batch, tuple(rows))
    return batch


class Scheduler:
    def __init__(self, max_slots: int, capacity: int, token_budget: int, prefill_chunk: int,
                 mixed: bool = False) -> None:
        if max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {max_slots}")
        if prefill_chunk < MIN_PREFILL_CHUNK:
            raise ValueError(f"prefill_chunk must be >= {MIN_PREFILL_CHUNK}, got {prefill_chunk}")
        if token_budget < prefill_chunk:
            raise ValueError(f"token_budget ({token_budget}) must be >= prefill_chunk ({prefill_chunk})")
        self.max_slots, self.capacity = max_slots, capacity
        self.token_budget, self.prefill_chunk = token_budget, prefill_chunk
        self.mixed = mixed
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admitted, in admission order
        self.free_slots = list(range(max_slots))
        self.steps = 0
        # The sequences of the last decode step while nothing can change the next step's rows but
        # their positions and tokens: none prefilling, none admissible, every one stamped. Cleared
        # when a sequence is added or finishes; None: decide the next step from scratch.
        self._cohort: tuple[Sequence, ...] | None = None
        # The cohort whose next decode steps were launched ahead (`reserve_next`), through step
        # `_reserved_through`: `schedule` returns its steps, whatever happened since. None when nothing is reserved.
        self._reserved: tuple[Sequence, ...] | None = None
        self._reserved_through = -1

    def add(self, sequence: Sequence, now: float | None = None) -> None:
        if sequence.positions_needed > self.capacity:
            raise ValueError(f"request {sequence.request_id} needs {sequence.positions_needed} cache positions "
                             f"(prompt {sequence.prompt_len} + {sequence.max_tokens} tokens - 1); a slot holds "
                             f"{self.capacity}")
        if sequence.status != WAITING or sequence.generated or sequence.cached:
            raise ValueError(f"request {sequence.request_id} was already run: make a new Sequence")
        sequence.arrived_at = now
        self.waiting.append(sequence)
        self._cohort = None  # it may be admitted at the next step

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, now: float | None = None) -> Batch:
        """The next step. `now` is stamped on sequences run for the first time, before the step runs."""
        cohort = self._cohort
        reserved = self._reserved
        if reserved is not None:  # launched ahead already: exactly that step, whatever was added since
            if self.steps >= self._reserved_through:  # the last step reserved
                self._reserved = None
            cohort = reserved
        if cohort is not None:  # a steady decode cohort: the same rows, one position on
            batch = _decode_batch(self.steps, cohort)
            self.steps += 1
            return batch
        if not self.has_work():
            raise RuntimeError("nothing to schedule: every sequence has finished")
        decoding = []
        if self.mixed:  # the decoders' tokens first, then prefill within what the budget leaves (at least one)
            decoding = [Row(sequence, sequence.cached, (sequence.generated[-1],), True) for sequence in self.running
                        if sequence.cached >= len(sequence.prompt)][:self.token_budget - 1]
        rows = self._prefill_rows(self.token_budget - len(decoding))
        phase = PREFILL
        if rows and decoding:
            phase, rows = MIXED, decoding + rows
        elif not rows:
            phase = DECODE
            rows = decoding or [Row(sequence, sequence.cached, (sequence.generated[-1],), True)
                                for sequence in self.running]
        for row in rows:
            if row.sequence.first_scheduled_at is None:
                row.sequence.first_scheduled_at = now
        if phase == DECODE and all(row.sequence.first_scheduled_at is not None for row in rows):
            # Nothing prefills and nothing can be admitted (none waits, or no slot is free): until a
            # sequence is added or finishes, every next step decodes these same sequences.
            self._cohort = tuple(self.running)
        batch = Batch(self.steps, phase, tuple(rows))
        self.steps += 1
        return batch

    def reserve_next(self, batch: Batch, steps: int = 1) -> bool:
        """Whether the `steps` steps after `batch` (the step just scheduled, before its `postprocess`) are
        certain to decode the same cohort, each one position on; if so they are reserved (`schedule`
        returns them next), so their launch may go ahead before `batch` is postprocessed. Certain only
        when `batch` is the steady cohort's decode step, nothing waits for admission, and every row still
        needs a token after the last of them (no sequence finishes before: tokens are generated up to
        `max_tokens` exactly, with no other stop condition). A standing reservation is extended (never
        shortened). A wrong guess would write past a slot's capacity (prompt + max_tokens - 1
        positions), so any doubt says no."""
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        cohort = self._cohort
        rows = batch.rows
        if (cohort is None or self.waiting or batch.phase != DECODE or batch.step != self.steps - 1
                or len(rows) != len(cohort) or (self._reserved is not None and self._reserved is not cohort)):
            return False
        last = self.capacity - steps  # the last step writes position `cached + steps`: `cached + steps >= capacity`
        needed = steps + 1  # this step's token and one per step reserved
        for row, sequence in zip(rows, cohort):
            cached = sequence.cached
            if (row.sequence is not sequence or not row.emits or sequence.status != RUNNING
                    or len(sequence.generated) + needed > sequence.max_tokens or row.start != cached or cached >= last):
                return False
        self._reserved = cohort
        self._reserved_through = max(self._reserved_through, batch.step + steps)
        return True

    @property
    def reserved(self) -> tuple[Sequence, ...] | None:
        """The cohort whose next decode steps are reserved (`reserve_next`), or None."""
        return self._reserved

    def serve_reserved(self, step: int, tokens: list[int], now: float | None = None) -> tuple[Sequence, ...]:
        """Decode step `step` of the reserved cohort, scheduled and postprocessed at once: what `schedule` and then
        `postprocess(batch, tokens, now)` do for it, without making its Batch (engine.runtime serves the later
        steps of a synced graph of several steps this way: their tokens are on the host already). Each sequence
        moves one position on with its token in `tokens` (which may run on past the cohort). Returns the cohort.
        `step` must be the next step and reserved; else a RuntimeError (the caller's bug, never a wrong step)."""
        reserved = self._reserved
        if reserved is None or step != self.steps:
            raise RuntimeError(f"step {step} is not the next reserved step (next step {self.steps}, reserved "
                               f"through {self._reserved_through if reserved is not None else None})")
        if step >= self._reserved_through:  # the last step reserved
            self._reserved = None
        self.steps = step + 1
        emit = self._emit
        for sequence, token in zip(reserved, tokens):
            sequence.cached += 1
            emit(sequence, token, now, None)
        return reserved

    def _emit(self, sequence: Sequence, token: int, now: float | None, finished: list | None) -> None:
        """A row's generated token: appended and stamped; the sequence finishes at its last."""
        generated = sequence.generated
        generated.append(int(token))
        sequence.token_times.append(now)
        if sequence.first_token_at is None:
            sequence.first_token_at = now
        if len(generated) == sequence.max_tokens:
            if self._reserved is not None:  # reserve_next never reserves a step after a last token
                raise RuntimeError(f"request {sequence.request_id} finished while its next step was "
                                   f"reserved (launched ahead)")
            sequence.status, sequence.finished_at = FINISHED, now
            self.running.remove(sequence)
            self._cohort = None
            self.free_slots.append(sequence.slot)
            self.free_slots.sort()
            if finished is not None:
                finished.append(sequence)

    def _prefill_rows(self, budget: int) -> list[Row]:
        rows: list[Row] = []
        for sequence in [s for s in self.running if s.cached < len(s.prompt)]:  # s.prefilling, inlined: every step
            if budget <= 0:
                return rows
            rows.append(self._chunk(sequence, budget))
            budget -= len(rows[-1].tokens)
        while self.waiting and self.free_slots and budget > 0:
            sequence = self.waiting.popleft()
            sequence.slot = self.free_slots.pop(0)  # lowest free slot: decode cohorts stay contiguous
            sequence.status = RUNNING
            self.running.append(sequence)
            rows.append(self._chunk(sequence, budget))
            budget -= len(rows[-1].tokens)
        return rows

    def _chunk(self, sequence: Sequence, budget: int) -> Row:
        length = min(self.prefill_chunk, budget, sequence.prompt_len - sequence.cached)
        tokens = sequence.prompt[sequence.cached:sequence.cached + length]
        return Row(sequence, sequence.cached, tokens, sequence.cached + length == sequence.prompt_len)

    def postprocess(self, batch: Batch, next_tokens: list[int], now: float | None = None) -> list[Sequence]:
        """Advance every row by the step's result (one token per row); return the sequences that finished."""
        if len(next_tokens) != len(batch.rows):
            raise ValueError(f"{len(next_tokens)} tokens for {len(batch.rows)} rows")
        finished = []
        emit = self._emit
        for row, token in zip(batch.rows, next_tokens):
            sequence = row.sequence
            sequence.cached = row.start + len(row.tokens)  # row.end, inlined: every step
            if row.emits:
                emit(sequence, token, now, finished)
        return finished
