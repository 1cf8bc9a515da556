"""What travels from the engine's worker thread to the UI, and the typed messages the UI posts.

The worker never touches a widget and never calls into the UI thread: its `on_step` callback
only puts a plain event on an `EngineQueue`. A timer on the UI thread drains the queue every
`DRAIN_INTERVAL` seconds and turns what it found into a few batched Textual messages (all the
steps of one side that arrived since the last drain become one `StepsArrived`), so a fast
engine cannot flood the UI and a slow UI cannot slow the engine.

Knows nothing of widgets or screens; the screens handle the messages.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass
from typing import Any

from textual.message import Message

from engine.flags import ResolvedFlags
from engine.runtime import Generation

DRAIN_INTERVAL = 0.05  # seconds: fast enough to look live, slow enough to batch a decode burst

A, B = "A", "B"  # the two sides of a side-by-side run: the flags panel, and the reference configuration


# --------------------------------------------------------------------------------------------
# Engine -> UI queue (plain values, created on the worker thread)
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StepEvent:
    run_id: int
    side: str
    record: dict  # the engine's step record: step, phase, n_tokens, moe [...], attention [...], token
    token: int | None  # None: a prefill chunk of a prompt longer than prefill_chunk, which emits no token


@dataclass(frozen=True)
class SideDoneEvent:
    run_id: int
    side: str
    generation: Generation
    wall_s: float | None = None  # the side's generation, start to end (recorded in the session's results)


@dataclass(frozen=True)
class RunDoneEvent:
    run_id: int
    comparison: dict | None  # engine.sidebyside.compare(a, b), None when B never ran
    cancelled: bool


@dataclass(frozen=True)
class RunErrorEvent:
    run_id: int
    message: str


@dataclass(frozen=True)
class CheckDoneEvent:
    """The attention check finished: `result` is check_attention's dict, or `error` says why not."""

    result: dict | None
    error: str | None
    wall_s: float = 0.0
    cancelled: bool = False  # the screen was left: the check stopped after one of its parts


@dataclass(frozen=True)
class CheckProgressEvent:
    note: str  # the part of the check that finished: "references", "fused kernel", "sink -5"


@dataclass(frozen=True)
class ReplayStepEvent:
    """One step of the open session re-run: `result` is session_runner.run_step's line, or `error` says why not."""

    index: int
    result: dict | None
    error: str | None


@dataclass(frozen=True)
class BenchProgressEvent:
    note: str  # engine.bench's progress note: "pp16 rep 1"


@dataclass(frozen=True)
class BenchRowEvent:
    row: dict  # one row of engine.bench's JSON report, as it finished


@dataclass(frozen=True)
class BenchProfileEvent:
    row: dict  # a row of engine.bench's JSON report with its kernel shares (profiled after every timed row)


@dataclass(frozen=True)
class BenchDoneEvent:
    """The bench finished: `report` is the whole JSON report; else `refused` (a MeasurementError's
    reason) or `error` (bad input) says why there is no table; `cancelled` when the screen was left."""

    report: dict | None
    refused: str | None = None
    error: str | None = None
    cancelled: bool = False
    wall_s: float = 0.0
    config: str = "A"  # which configuration's bench this was (A, or B)
    last: bool = True  # False when another configuration's bench follows (A against B)


class EngineQueue:
    """A thread-safe mailbox: `put` from any thread, `drain` on the UI thread only."""

    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue()

    def put(self, event: Any) -> None:
        self._queue.put(event)

    def drain(self) -> list[Message]:
        """Everything queued so far, as messages; consecutive steps of one side are one message."""
        messages: list[Message] = []
        while True:
            try:
                event = self._queue.get_nowait()
            except queue.Empty:
                return messages
            if isinstance(event, StepEvent):
                last = messages[-1] if messages else None
                emitted = [] if event.token is None else [event.token]  # a step's record always, its token if any
                if isinstance(last, StepsArrived) and (last.run_id, last.side) == (event.run_id, event.side):
                    last.steps.append(event.record)
                    last.tokens.extend(emitted)
                else:
                    messages.append(StepsArrived(event.run_id, event.side, [event.record], emitted))
            elif isinstance(event, SideDoneEvent):
                messages.append(SideFinished(event.run_id, event.side, event.generation, event.wall_s))
            elif isinstance(event, RunDoneEvent):
                messages.append(RunFinished(event.run_id, event.comparison, event.cancelled))
            elif isinstance(event, RunErrorEvent):
                messages.append(RunFailed(event.run_id, event.message))
            elif isinstance(event, CheckDoneEvent):
                messages.append(AttentionCheckFinished(event.result, event.error, event.wall_s, event.cancelled))
            elif isinstance(event, CheckProgressEvent):
                messages.append(AttentionCheckProgressed(event.note))
            elif isinstance(event, ReplayStepEvent):
                messages.append(ReplayStepFinished(event.index, event.result, event.error))
            elif isinstance(event, BenchProgressEvent):
                last = messages[-1] if messages else None
                if isinstance(last, BenchProgressed):  # a burst of repetitions is one message
                    last.notes.append(event.note)
                else:
                    messages.append(BenchProgressed([event.note]))
            elif isinstance(event, BenchRowEvent):
                messages.append(BenchRowArrived(event.row))
            elif isinstance(event, BenchProfileEvent):
                messages.append(BenchProfileArrived(event.row))
            elif isinstance(event, BenchDoneEvent):
                messages.append(BenchFinished(event.report, event.refused, event.error, event.cancelled,
                                              event.wall_s, event.config, event.last))
            else:  # a bug in a producer: fail loudly rather than drop it
                raise TypeError(f"unknown engine event {event!r}")


# --------------------------------------------------------------------------------------------
# Messages (UI thread)
# --------------------------------------------------------------------------------------------

class RunStarted(Message, bubble=False):
    def __init__(self, run_id: int, prompt: str, max_tokens: int, flags_a: ResolvedFlags,
                 flags_b: ResolvedFlags) -> None:
        super().__init__()
        self.run_id, self.prompt, self.max_tokens = run_id, prompt, max_tokens
        self.flags_a, self.flags_b = flags_a, flags_b


class StepsArrived(Message, bubble=False):
    def __init__(self, run_id: int, side: str, steps: list[dict], tokens: list[int]) -> None:
        super().__init__()
        self.run_id, self.side, self.steps, self.tokens = run_id, side, steps, tokens


class SideFinished(Message, bubble=False):
    def __init__(self, run_id: int, side: str, generation: Generation, wall_s: float | None = None) -> None:
        super().__init__()
        self.run_id, self.side, self.generation, self.wall_s = run_id, side, generation, wall_s


class RunFinished(Message, bubble=False):
    def __init__(self, run_id: int, comparison: dict | None, cancelled: bool) -> None:
        super().__init__()
        self.run_id, self.comparison, self.cancelled = run_id, comparison, cancelled


class RunFailed(Message, bubble=False):
    def __init__(self, run_id: int, message: str) -> None:
        super().__init__()
        self.run_id, self.message = run_id, message


class FlagChanged(Message):
    """A flag of configuration A took a new valid value; `flags` is the whole new set."""

    def __init__(self, name: str, value: Any, flags: ResolvedFlags) -> None:
        super().__init__()
        self.name, self.value, self.flags = name, value, flags


class FlagRefused(Message):
    """A value the user typed was refused; `message` names the flag and the allowed values."""

    def __init__(self, name: str, text: str, message: str) -> None:
        super().__init__()
        self.name, self.text, self.message = name, text, message


class ConfigBChanged(Message):
    """Configuration B's overrides on top of A changed."""

    def __init__(self, overrides: dict[str, Any]) -> None:
        super().__init__()
        self.overrides = overrides


class AttentionCheckFinished(Message, bubble=False):
    def __init__(self, result: dict | None, error: str | None, wall_s: float = 0.0, cancelled: bool = False) -> None:
        super().__init__()
        self.result, self.error, self.wall_s, self.cancelled = result, error, wall_s, cancelled


class AttentionCheckProgressed(Message, bubble=False):
    def __init__(self, note: str) -> None:
        super().__init__()
        self.note = note


class ReplayStepFinished(Message, bubble=False):
    def __init__(self, index: int, result: dict | None, error: str | None) -> None:
        super().__init__()
        self.index, self.result, self.error = index, result, error


class BenchProgressed(Message, bubble=False):
    def __init__(self, notes: list[str]) -> None:
        super().__init__()
        self.notes = notes  # one per finished repetition since the last drain


class BenchRowArrived(Message, bubble=False):
    def __init__(self, row: dict) -> None:
        super().__init__()
        self.row = row


class BenchProfileArrived(Message, bubble=False):
    def __init__(self, row: dict) -> None:
        super().__init__()
        self.row = row


class BenchFinished(Message, bubble=False):
    def __init__(self, report: dict | None, refused: str | None, error: str | None, cancelled: bool,
                 wall_s: float, config: str = "A", last: bool = True) -> None:
        super().__init__()
        self.report, self.refused, self.error, self.cancelled, self.wall_s = report, refused, error, cancelled, wall_s
        self.config, self.last = config, last


class SessionChanged(Message):
    """The open session changed (a step recorded, saved as, or another session opened)."""

    def __init__(self, path: str, steps: int, note: str = "") -> None:
        super().__init__()
        self.path, self.steps, self.note = path, steps, note
