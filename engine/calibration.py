"""The calibration file that `moe_gate=measured` reads and `moe-inspector sweep` writes.

One JSON object per file: {"version": 1, "entries": [{"device", "k", "experts", "hidden",
"intermediate", "tile_m", "crossover_tokens", "measured_at", "commit", "timing"}]}. The crossover is the
smallest measured token count from which the grouped arm beats the GEMV arm at every larger
measured width. Entries for trellis experts also carry "weight_format" (e.g. "trellis:hyb:K2"; an
entry without it is bf16's) and "dequant_crossover_tokens" (from which trellis_dequant beats
trellis_grouped, or null). Knows nothing of how the sweep measures.
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


BF16 = "bf16"


def trellis_format(code: str, bits_per_weight: int) -> str:
    """The weight_format of trellis experts in `code` at K bits per weight, e.g. "trellis:hyb:K2"."""
    return f"trellis:{code}:K{bits_per_weight}"


def _key(entry: dict) -> tuple:
    return tuple(entry[name] for name in ("device", "k", "experts", "hidden", "intermediate", "tile_m")) + (
        entry.get("weight_format", BF16),)


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
                   path: Path | None = None, weight_format: str = BF16, field: str = "crossover_tokens") -> int | None:
    """The measured crossover for exactly this routing shape and expert format on this device, or None. Only an
    entry timed the runtime's way (`"timing": "graph"`, engine.sweep) counts: an entry of a sweep that timed each
    arm as one cold eager call (before that field) put the crossover where the runtime does not run the arms; run
    the sweep again. `field`: "crossover_tokens" (GEMV -> grouped) or, for trellis experts,
    "dequant_crossover_tokens" (trellis_grouped -> trellis_dequant)."""
    wanted = (device, k, experts, hidden, intermediate, tile_m, weight_format)
    for entry in load_entries(path):
        try:
            if _key(entry) == wanted and entry.get("timing") == "graph":
                return int(entry[field])
        except (KeyError, TypeError, ValueError):
            continue
    return None


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
