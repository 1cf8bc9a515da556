"""The calibration file that `moe_gate=measured` reads and `moe-inspector sweep` writes.

One JSON object per file: {"version": 1, "entries": [{"device", "k", "experts", "hidden",
"intermediate", "tile_m", "crossover_tokens", "measured_at", "commit", "timing"}]}; an entry calibrated from
a routing recording adds "routing" (file, sha256, model, MoE layers) and "layer_crossovers" ({layer: n}). The crossover is the
smallest measured token count from which the grouped arm beats the GEMV arm at every larger
measured width. Knows nothing of how the sweep measures.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

VERSION = 1


def calibration_path() -> Path:
    """MOEI_CALIBRATION if set, else ~/.cache/moe-inspector/calibration.json."""
    explicit = os.environ.get("MOEI_CALIBRATION")
    if explicit:
        return Path(explicit)
    return Path.home() / ".cache" / "moe-inspector" / "calibration.json"


def _key(entry: dict) -> tuple:
    return tuple(entry[name] for name in ("device", "k", "experts", "hidden", "intermediate", "tile_m"))


def load_entries(path: Path | None = None) -> list[dict]:
    path = calibration_path() if path is None else path
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(data, dict) or data.get("version") != VERSION:
        return []
    return [entry for entry in data.get("entries", []) if isinstance(entry, dict)]


def find_crossover(device: str, k: int, experts: int, hidden: int, intermediate: int, tile_m: int,
                   path: Path | None = None) -> int | None:
    """The measured crossover for exactly this routing shape on this device, or None. Only an entry timed the
    runtime's way (`"timing": "graph"`, engine.sweep) counts: an entry of a sweep that timed each arm as one cold
    eager call (before that field) put the crossover where the runtime does not run the arms; run the sweep again."""
    entry = find_entry(device, k, experts, hidden, intermediate, tile_m, path)
    return None if entry is None else int(entry["crossover_tokens"])


def find_entry(device: str, k: int, experts: int, hidden: int, intermediate: int, tile_m: int,
               path: Path | None = None) -> dict | None:
    """The entry `find_crossover` reads (its crossover_tokens an int), or None."""
    wanted = (device, k, experts, hidden, intermediate, tile_m)
    for entry in load_entries(path):
        try:
            if _key(entry) == wanted and entry.get("timing") == "graph":
                int(entry["crossover_tokens"])
                return entry
        except (KeyError, TypeError, ValueError):
            continue
    return None


def layer_crossovers(entry: dict | None, moe_layers: tuple[int, ...]) -> tuple[dict[int, int], str]:
    """A sweep calibrated from a routing recording (`moe-inspector sweep --routing FILE`) stores each MoE layer's
    crossover: ({layer: crossover}, the recording's file name) when the entry was recorded on these MoE layers,
    else ({}, "") (the entry's one crossover then serves every layer)."""
    routing = entry.get("routing") if isinstance(entry, dict) else None
    if not isinstance(routing, dict) or routing.get("layers") != list(moe_layers):
        return {}, ""
    crossovers = {}
    for layer, value in (entry.get("layer_crossovers") or {}).items():
        try:
            crossovers[int(layer)] = int(value)
        except (TypeError, ValueError):
            return {}, ""
    return crossovers, str(routing.get("file", "a recording"))


def save_entry(entry: dict, path: Path | None = None) -> Path:
    """Insert or replace the entry for its routing shape; written atomically."""
    path = calibration_path() if path is None else path
    entries = [old for old in load_entries(path) if _key(old) != _key(entry)]
    entries.append(entry)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as handle:
        json.dump({"version": VERSION, "entries": entries}, handle, indent=2)
        temporary = handle.name
    os.replace(temporary, path)
    return path
