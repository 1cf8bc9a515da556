"""How the decode kernels launch: the switches that change timing and never a result.

`LaunchSettings` holds them; the launchers read `current()` at launch time (kernels.pdl,
kernels.streaming). The engine decides them from its resolved flags (`engine.flags.launch_settings`)
and `apply`s them when a run starts, so a run's flags decide and its results header says how it ran.
kernels/ never imports engine/: this module is the one place the engine hands its choice down.

Process-wide on purpose: a CUDA graph captures the launch options in force at its capture, and the
engine keys its graphs by every flag value, so a run under other settings captures its own graphs.
The defaults are the engine's defaults (every switch on), for callers that never apply any
(tests, bench scripts). Pure Python: imports without torch or triton.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

# The kernels whose first weight tile may load before their PDL wait: kernels.gemv's dense GEMV, MoE down
# (kernels.moe_gemv), the fused GEMVs of the router and the LM head (kernels.gemv_route, kernels.gemv_pick) and
# the trellis GEMV's two products (kernels.trellis_gemv: the id, the first step's codes and hyb's table).
PRELOADERS = ("gemv", "down", "fused", "trellis")


@dataclass(frozen=True)
class LaunchSettings:
    pdl: bool = True  # programmatic dependent launch where the GPU and Triton have it (kernels.pdl)
    pdl_preload: frozenset = frozenset(PRELOADERS)  # of PRELOADERS: which load a weight tile before the wait
    stream_weights: bool = True  # streamed weights load with L2 evict_first (kernels.streaming)

    def __post_init__(self) -> None:
        unknown = set(self.pdl_preload) - set(PRELOADERS)
        if unknown:
            raise ValueError(f"LaunchSettings: unknown preloaders {sorted(unknown)}; known: {', '.join(PRELOADERS)}")


_current = LaunchSettings()


def current() -> LaunchSettings:
    """The settings launches use now."""
    return _current


def apply(settings: LaunchSettings) -> LaunchSettings:
    """Make `settings` the ones launches use from now on; returns the previous ones."""
    global _current
    previous, _current = _current, settings
    return previous


@contextmanager
def using(settings: LaunchSettings) -> Iterator[LaunchSettings]:
    """`settings` for the launches inside the block, the previous ones after it."""
    previous = apply(settings)
    try:
        yield settings
    finally:
        apply(previous)
