"""Exact host-side launch counters for the Triton kernels in this package.

Every public launcher calls `record(name)` once per kernel launch it makes, at launch time, so
the counts describe what was launched, not what was configured. Kernels replayed from a CUDA
graph do not pass through Python: the engine multiplies what a capture recorded by its replays.
"""

from __future__ import annotations

from collections import Counter

_COUNTS: Counter[str] = Counter()


def record(kernel_name: str, launches: int = 1) -> None:
    _COUNTS[kernel_name] += launches


def snapshot() -> dict[str, int]:
    """A copy of every kernel's launch count so far."""
    return dict(_COUNTS)


def since(before: dict[str, int]) -> dict[str, int]:
    """Launches made since `before` (a snapshot), kernels with none left out."""
    return {name: count - before.get(name, 0) for name, count in _COUNTS.items() if count != before.get(name, 0)}
