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


# A MoE record's shared_path (engine.dispatcher) in the arm's words: the flag shared_fold folds them into its launches.
SHARED_PATH_WORDS = {"routed launches": "folded", "apart": "apart"}


def shared_path_text(record: dict) -> str:
    """A MoE record's shared experts beside its arm, "shared folded" (in the GEMV arm's launches) or "shared
    apart" (after the arm); "" for a layer without shared experts (Qwen3-MoE, Mixtral: their rows are unchanged)."""
    path = record.get("shared_path")
    return "" if not path else f"shared {SHARED_PATH_WORDS.get(path, path)}"


def shared_reason_text(record: dict) -> str:
    """The shared experts' path and why, as a reason's tail: "shared experts apart: shared_fold=off: ..."; "" for
    a layer without shared experts."""
    if not record.get("shared_path"):
        return ""
    why = record.get("shared_reason")
    return f"shared experts {SHARED_PATH_WORDS.get(record['shared_path'], record['shared_path'])}" + (
        f": {why}" if why else "")


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
