"""The fingerprint of a quantize source, and the differences between two, in words.

`quantize` records one in the trellis directory's `source` entry (and in the partial directory's job.json);
`check-quant` compares it with the model it measures against, and a resumed quantize with the source it is
given, so neither silently mixes two models. A checkpoint directory's fingerprint is the sha256 of config.json
and, per safetensors file, its name, size and the sha256 of its bytes (read in 16 MiB pieces: the checkpoints
quantize handles on one machine hash at disk speed); a directory loaded with `--weights random` has no weight
files to hash: its config and seed. A preset's is its name, weights and seed (its weights follow from them).

Knows nothing of trellis codes, loading or the CLI.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from engine.checkpoint import require_regular_file
from engine.model_source import files_by_name, weight_files

_PIECE = 1 << 24


def _file_sha256(path: Path) -> str:
    require_regular_file(path)
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while piece := handle.read(_PIECE):
            digest.update(piece)
    return digest.hexdigest()


def fingerprint(model: str, weights: str, seed: int) -> dict:
    """The fingerprint of `model` (a preset name or a checkpoint directory) loaded with `weights` and `seed`."""
    directory = Path(model).expanduser()
    if not directory.is_dir():
        return {"preset": model, "weights": weights, "seed": seed}
    found = {"config_sha256": _file_sha256(directory / "config.json")}
    if weights == "random":
        return found | {"weights": "random", "seed": seed}
    # engine.model_source.weight_files' entries (as results headers list them), each with its bytes' hash
    found["files"] = [entry | {"sha256": _file_sha256(directory / entry["file"])} for entry in weight_files(directory)]
    return found


def differences(recorded: dict, current: dict) -> list[str]:
    """What differs between a recorded fingerprint and a current one, in words ([] when they match)."""
    if ("preset" in recorded) != ("preset" in current):
        kind = {True: "a preset", False: "a checkpoint directory"}
        return [f"the source was {kind['preset' in recorded]}, this is {kind['preset' in current]}"]
    words = []
    for key, what in (("preset", "preset"), ("weights", "weights"), ("seed", "seed")):
        if recorded.get(key) != current.get(key):
            words.append(f"{what} {recorded.get(key)} then, {current.get(key)} now")
    if recorded.get("config_sha256") != current.get("config_sha256"):
        words.append("config.json differs")
    then, now = files_by_name(recorded.get("files")), files_by_name(current.get("files"))
    for name in sorted(set(then) | set(now)):
        if name not in now:
            words.append(f"{name} is missing")
        elif name not in then:
            words.append(f"{name} is new")
        elif then[name].get("bytes") != now[name]["bytes"]:
            words.append(f"{name} was {then[name].get('bytes')} bytes, is {now[name]['bytes']}")
        elif then[name].get("sha256") != now[name]["sha256"]:
            words.append(f"{name}'s bytes differ (same size)")
    return words
