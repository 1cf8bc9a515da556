"""Exact host-side launch counters for the Triton kernels in this package.

Every public launcher calls `record(name)` once per kernel launch it makes, at launch time, so
the counts describe what was launched, not what was configured. Kernels replayed from a CUDA
graph do not pass through Python: the engine multiplies what a capture recorded by its replays
(`record_many`, once per replay).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

_COUNTS: dict[str, int] = {}  # a plain dict: a Counter's item access is twice as slow
# record_many's calls not yet added into _COUNTS: id(counts) -> [counts, times]. A replayed step's host path records
# one captured mapping per step; adding it key by key was a tenth of a served step's host time, so it is counted
# here and added when the counts are read (`_totals`). The mappings are a capture's, never changed after it.
_PENDING: dict[int, list] = {}
# A read folds _PENDING into _COUNTS: a reader on another thread (the TUI's) must not lose a replay recorded meanwhile
_LOCK = threading.Lock()
# Launch name -> the name of the device kernel it launches (the @triton.jit function's), as a profiler reports it
_KERNEL_NAMES: dict[str, str] = {}
# While a log is open (`log_begin`), every launch name recorded, in order; None when none is open
_LOG: list[str] | None = None


def record(kernel_name: str, launches: int = 1, kernel=None) -> None:
    """Count `launches` launches of `kernel_name`. `kernel`: the @triton.jit function launched, whose name a
    profiler reports for it (`device_kernel_name`), registered the first time it is given."""
    with _LOCK:
        _COUNTS[kernel_name] = _COUNTS.get(kernel_name, 0) + launches
        if _LOG is not None and launches > 0:
            _LOG.extend([kernel_name] * launches)
        if kernel is not None and kernel_name not in _KERNEL_NAMES:
            function = getattr(kernel, "fn", kernel)
            _KERNEL_NAMES[kernel_name] = getattr(function, "__name__", str(function))


def device_kernel_name(kernel_name: str) -> str | None:
    """The device kernel a launch name launches, as a profiler names it; None when its launcher never said."""
    return _KERNEL_NAMES.get(kernel_name)


def log_begin() -> None:
    """Start recording launch names in order (the dispatcher brackets an arm's call: which kernels it launched,
    so a profile of its replays can be read back per layer). One log at a time: the engine's thread."""
    global _LOG
    with _LOCK:
        _LOG = []


def log_end() -> list[str]:
    """The launch names recorded since `log_begin`, in order; the log is closed."""
    global _LOG
    with _LOCK:
        logged, _LOG = _LOG or [], None
        return logged


def record_many(counts: Mapping[str, int], times: int = 1) -> None:
    """`record(name, count * times)` for every entry: what `times` replays of a captured graph launch. `counts`
    must not change afterwards (it is added when the counts are next read)."""
    with _LOCK:
        entry = _PENDING.get(id(counts))
        if entry is None:
            _PENDING[id(counts)] = [counts, times]  # holds `counts`: its id is not reused while pending
        else:
            entry[1] += times


def _totals() -> dict[str, int]:
    """Every kernel's count so far (a copy), the pending replays added in."""
    with _LOCK:
        totals = _COUNTS
        earlier = totals.get
        for counts, times in _PENDING.values():
            for name, count in counts.items():
                totals[name] = earlier(name, 0) + count * times
        _PENDING.clear()
        return dict(totals)


def snapshot() -> dict[str, int]:
    """A copy of every kernel's launch count so far."""
    return _totals()


def since(before: dict[str, int]) -> dict[str, int]:
    """Launches made since `before` (a snapshot), kernels with none left out."""
    earlier = before.get
    return {name: count - earlier(name, 0) for name, count in _totals().items() if count != earlier(name, 0)}
