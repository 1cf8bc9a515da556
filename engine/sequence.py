"""One request in flight: its prompt, the tokens generated so far, its KV slot and its time stamps.

Plain Python, no torch. A sequence's request id comes from one process-wide counter and is never
reused, so concurrent copies of a request and repeated benchmark runs never share an id (an
incident: one id cloned across every concurrent copy and repetition made per-request numbers
meaningless). Time stamps are plain floats the caller passes in; this module reads no clock.

Knows nothing of scheduling policy (engine.scheduler) or of tensors (engine.batch_runner).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"

_request_ids = itertools.count()


def next_request_id() -> int:
    """The next id of the process; `next` on an itertools.count is atomic under the GIL."""
    return next(_request_ids)


@dataclass(eq=False)
class Sequence:
    prompt: tuple[int, ...]
    max_tokens: int  # tokens to generate, exactly
    request_id: int = field(default_factory=next_request_id)
    generated: list[int] = field(default_factory=list)
    status: str = WAITING
    slot: int | None = None  # the KV-cache row while admitted
    cached: int = 0  # tokens whose keys and values are in the cache (prompt first, then generated)
    arrived_at: float | None = None
    # Stamped BEFORE the step that first runs the sequence, so a sequence that finishes inside
    # that same step (a prefill-only request) still has a start time.
    first_scheduled_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    token_times: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.prompt = tuple(self.prompt)
        if not self.prompt:
            raise ValueError("a sequence needs at least one prompt token")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def prefilling(self) -> bool:
        return self.cached < self.prompt_len

    @property
    def finished(self) -> bool:
        return self.status == FINISHED

    @property
    def positions_needed(self) -> int:
        """Cache positions the whole request uses: the last generated token is never fed back."""
        return self.prompt_len + self.max_tokens - 1
