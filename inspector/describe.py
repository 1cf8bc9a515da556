"""How the inspector says things in words, the same on every screen and in every command.

Knows nothing of widgets or argument parsing: plain values in, short strings out.
"""

from __future__ import annotations


def fill_text(pairs_per_woken: float, tile_m: int) -> str:
    """An m-tile's fill for people: a partial tile as a percentage ("75.0%"), a fuller expert as the
    tiles it fills ("1 full + 50%", "12 full"), never "1200.0%"."""
    if pairs_per_woken < tile_m:
        return f"{100 * pairs_per_woken / tile_m:.1f}%"
    tiles = pairs_per_woken / tile_m
    full = int(tiles)
    rest = round(100 * (tiles - full))
    if rest >= 100:  # 1.999 tiles: two full, not "1 full + 100%"
        full, rest = full + 1, 0
    return f"{full} full" + (f" + {rest}%" if rest else "")


def timing_method(record: dict, device_type: str) -> str:
    """How a record's µs was measured: the record's own words where it names them, else the engine's
    per-layer timer on this device (CUDA events on a GPU, the wall clock on a CPU)."""
    named = record.get("timing") or record.get("timing_method")
    if named:
        return str(named)
    if record.get("us") is None:
        return "not timed (the run was untimed, or this layer's time is not attributed)"
    replay = "a CUDA-graph replay; " if record.get("graph") == "replay" else ""
    if device_type == "cuda":
        return (f"{replay}CUDA events recorded around the layer's launch on the stream, read at the step's one "
                f"sync (device time of the layer)")
    return (f"{replay}wall clock (time.perf_counter) around the layer's call; a CPU runs it synchronously, so "
            f"this is the layer's compute")


def changed_flags(flags) -> str:
    """The flags of a ResolvedFlags not at their defaults, with where each came from; or that all are."""
    from engine.flags import DEFAULT

    changed = [flags.entry(name) for name, source in flags.sources.items() if source != DEFAULT]
    return ", ".join(changed) if changed else "all at their defaults"
