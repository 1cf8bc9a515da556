"""The calibration file that `moe_gate=measured` reads and `moe-inspector sweep` writes.

One JSON object per file: {"version": 1, "entries": [{"device", "k", "experts", "hidden",
"intermediate", "tile_m", "crossover_tokens", "measured_at", "commit", "timing", "routing_weights"}]}; an entry
calibrated from a routing recording adds "routing" (file, sha256, model, MoE layers) and "layer_crossovers"
({layer: n}). The crossover is the smallest measured token count from which the grouped arm beats the GEMV arm
at every larger measured width. Entries for trellis experts also carry "weight_format" (e.g. "trellis:hyb:K2";
an entry without it is bf16's) and "dequant_crossover_tokens" (from which trellis_dequant beats
trellis_grouped, or null). Reads only entries timed as TIMED_AS says; knows nothing else of how the sweep
measures.

Reading never fails: a missing file means no calibration; a file that is not one (corrupt JSON,
wrong types, an entry without its keys) is reported once on the engine's log, and its unusable
entries are skipped, so `measured` falls back as it does without a calibration (the decision's
reason says so). Writing refuses to replace a file it cannot read (`check_writable`), since that
would drop whatever the file held; the sweep command checks it before measuring.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from engine.atomic_file import atomic_write_text
from engine.errors import UserError
from engine.json_input import parse_json

VERSION = 1
# What an entry must say of how its arms were timed to be read: the runtime's way (back to back in a CUDA graph)
# and with routing weights in the activations' dtype, as the runtime's router hands them to the arms (float32 ones
# compile another, slower down kernel: bench/RESULTS.md, "A/B and one arm, one number").
TIMED_AS = {"timing": "graph", "routing_weights": "bfloat16"}
KEY_FIELDS = ("device", "k", "experts", "hidden", "intermediate", "tile_m")
MAX_FILE_BYTES = 16 * 1024 * 1024  # a calibration entry is ~250 bytes
MAX_SIZE = 1 << 40  # a width, an expert count or a crossover beyond this is not a measurement
_reported: set[tuple] = set()


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
    return tuple(entry[name] for name in KEY_FIELDS) + (entry.get("weight_format", BF16),)



def _size(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_SIZE


def entry_problem(entry: object) -> str | None:
    """Why an entry cannot be used, or None."""
    if not isinstance(entry, dict):
        return "an entry is not an object"
    if not isinstance(entry.get("device"), str):
        return "an entry has no device name"
    for name in KEY_FIELDS[1:] + ("crossover_tokens",):
        if not _size(entry.get(name)):
            return f"an entry's {name} is {entry.get(name)!r}, not an integer in 1..{MAX_SIZE}"
    return None


def read_file(path: Path) -> list[dict]:
    """Every entry of the file ([] when there is none); UserError when the file is not a calibration
    file this version reads. Entries with a problem are kept out (`entry_problem`)."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return []
    except OSError as error:
        raise UserError(f"{path}: cannot read the calibration file ({error.strerror})") from None
    if path.is_dir():
        raise UserError(f"{path}: the calibration file is a directory")
    if size > MAX_FILE_BYTES:
        raise UserError(f"{path}: {size} bytes, more than a calibration file holds ({MAX_FILE_BYTES})")
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise UserError(f"{path}: cannot read the calibration file ({error.strerror})") from None
    data = parse_json(raw, str(path), "the calibration file")
    if not isinstance(data, dict) or data.get("version") != VERSION or not isinstance(data.get("entries", []), list):
        raise UserError(f"{path}: not a version-{VERSION} calibration file (an object with version and a list "
                        f"of entries)")
    return [entry for entry in data.get("entries", []) if entry_problem(entry) is None]


def load_entries(path: Path | None = None) -> list[dict]:
    """The usable entries; a file that is not a calibration file counts as none (reported once)."""
    path = calibration_path() if path is None else path
    try:
        return read_file(path)
    except UserError as error:
        try:
            stamp = path.stat().st_mtime_ns
        except OSError:
            stamp = None
        if (str(path), stamp) not in _reported:
            _reported.add((str(path), stamp))
            logging.getLogger("moe_inspector.engine").warning(
                f"calibration not used: {error}; moe_gate=measured falls back as without one "
                f"(`moe-inspector sweep` writes a new one once the file is moved away)")
        return []


def find_crossover(device: str, k: int, experts: int, hidden: int, intermediate: int, tile_m: int,
                   path: Path | None = None, weight_format: str = BF16, field: str = "crossover_tokens") -> int | None:
    """The measured crossover for exactly this routing shape and expert format on this device, or None. Only an
    entry timed the runtime's way (TIMED_AS, engine.sweep) counts: an entry of a sweep that timed each arm as one
    cold eager call, or with float32 routing weights (before those fields), put the crossover where the runtime
    does not run the arms; run the sweep again. `field`: "crossover_tokens" (GEMV -> grouped) or, for trellis experts,
    "dequant_crossover_tokens" (trellis_grouped -> trellis_dequant)."""
    entry = find_entry(device, k, experts, hidden, intermediate, tile_m, path, weight_format, field)
    return None if entry is None else int(entry[field])


def find_entry(device: str, k: int, experts: int, hidden: int, intermediate: int, tile_m: int,
               path: Path | None = None, weight_format: str = BF16, field: str = "crossover_tokens") -> dict | None:
    """The entry `find_crossover` reads (its `field` an int), or None."""
    wanted = (device, k, experts, hidden, intermediate, tile_m, weight_format)
    for entry in load_entries(path):
        try:
            if _key(entry) == wanted and all(entry.get(name) == value for name, value in TIMED_AS.items()):
                int(entry[field])
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


def check_writable(path: Path | None = None) -> None:
    """UserError when `save_entry` would replace a file it cannot read (and so drop its contents)."""
    path = calibration_path() if path is None else path
    try:
        read_file(path)
    except UserError as error:
        raise UserError(f"{error}; it is not replaced: move it away (or give --calibration another file)") from None


def save_entry(entry: dict, path: Path | None = None) -> Path:
    """Insert or replace the entry for its routing shape; written atomically. Entries of the file
    this version cannot use are kept as they were."""
    path = calibration_path() if path is None else path
    problem = entry_problem(entry)
    if problem is not None:
        raise ValueError(f"calibration entry {entry!r}: {problem}")  # the sweep's own bug, not input
    check_writable(path)
    old = []
    if path.exists():
        data = parse_json(path.read_bytes(), str(path), "the calibration file")
        old = data.get("entries", [])
    kept = [item for item in old if entry_problem(item) is not None or _key(item) != _key(entry)]
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps({"version": VERSION, "entries": [*kept, entry]}, indent=2) + "\n")
    return path
