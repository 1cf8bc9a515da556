"""Where a model comes from, and what a run records of it: a preset, or a Hugging Face-format checkpoint
directory (its safetensors files, or random weights of its family and shape drawn from `config.json`).

`describe_checkpoint` is the provenance every results header and report carries (path, family, a hash of
config.json, and the weights' source: files with their sizes, or random with the seed and where drawn);
`check_fits` refuses a model larger than the memory it would go to, before a byte is loaded or drawn.
Knows nothing of generation.
"""

from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path

import torch

from engine.checkpoint import require_regular_file
from engine.config import ModelConfig
from engine.errors import UserError

# Memory a model may take of what is free: the KV cache, activations and the graphs' pools need the rest.
FIT_SHARE = 0.9


def model_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of every weight of `config` in `dtype` (engine.model.tensor_shapes), computed without allocating."""
    from engine.model import tensor_shapes

    element = torch.empty((), dtype=dtype).element_size()
    return sum(math.prod(shape) for shape in tensor_shapes(config).values()) * element


def free_bytes(device: torch.device) -> int | None:
    """Memory free on `device` now: the GPU's (cudaMemGetInfo), or the host's available memory; None if unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB"


def check_fits(config: ModelConfig, device: torch.device, dtype: torch.dtype, where: str,
               fix: str = "use a smaller model or fewer layers (num_hidden_layers in config.json), or free memory"
               ) -> int:
    """The model's bytes; a UserError naming both sizes, and `fix`, when they exceed FIT_SHARE of what `device` has
    free."""
    needed = model_bytes(config, dtype)
    free = free_bytes(device)
    if free is not None and needed > FIT_SHARE * free:
        place = "the GPU" if device.type == "cuda" else "this machine"
        raise UserError(f"{where}: the model's weights take {gib(needed)} in {str(dtype).replace('torch.', '')}, "
                        f"more than {FIT_SHARE:.0%} of the {gib(free)} free on {place}: {fix}")
    return needed


def config_hash(directory: Path) -> str:
    """sha256 of config.json's bytes, the first 16 hex digits."""
    return hashlib.sha256((directory / "config.json").read_bytes()).hexdigest()[:16]


SAMPLE_BYTES = 1 << 16  # each of the five pieces `sample_sha256` reads


def sample_sha256(path: Path) -> str:
    """sha256 of five 64 KiB pieces of a file (its start, which holds a safetensors header's first bytes, its
    quarters and its end), the first 16 hex digits: a few hundred KB read however large the file. Why: a checkpoint
    fine-tuned in place keeps every file's name and size; this tells it apart without hashing gigabytes."""
    require_regular_file(path)
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as handle:
        for offset in sorted({0, size // 4, size // 2, 3 * size // 4, max(0, size - SAMPLE_BYTES)}):
            handle.seek(offset)
            digest.update(handle.read(SAMPLE_BYTES))
    return digest.hexdigest()[:16]


def weight_files(directory: Path) -> list[dict]:
    """The safetensors files of a checkpoint directory: name, size in bytes and `sample_sha256`."""
    return [{"file": path.name, "bytes": path.stat().st_size, "sample_sha256": sample_sha256(path)}
            for path in sorted(directory.glob("*.safetensors"))]


def files_by_name(files) -> dict[str, dict]:
    """A recorded list of weight files (`weight_files`' entries, read back from a file that may be damaged or
    hand-edited) by name; entries without a string name are skipped, anything but a list is no files."""
    if not isinstance(files, list):
        return {}
    return {entry["file"]: entry for entry in files if isinstance(entry, dict) and isinstance(entry.get("file"), str)}


def describe_checkpoint(directory: Path, family: str, weights: str, seed: int, device: torch.device) -> dict:
    """What a results header records of a checkpoint directory's model."""
    source = ({"source": "random", "seed": seed, "drawn_on": device.type}
              if weights == "random" else {"source": "files", "files": weight_files(directory)})
    return {"path": str(directory.resolve()), "family": family, "config_sha256": config_hash(directory),
            "weights": source}


def model_config(model: str, base: str | Path | None = None) -> ModelConfig:
    """The config of `model` without loading a weight: a preset by name, else a checkpoint directory's
    config.json (a relative path taken from `base`, e.g. a session file's directory)."""
    from engine.config import PRESETS, from_name

    if model in PRESETS:
        return PRESETS[model]
    path = resolve_model_path(model, base)
    if path.is_dir():
        from engine.hf_loader import read_config

        return read_config(path)[0]
    refuse_missing_directory(model, base)
    return from_name(model)  # the unknown-model error, naming the presets


def refuse_missing_directory(model: str, base: str | Path | None = None) -> None:
    """UserError for a model that is neither a preset nor a directory but reads as a path (a separator in it, or
    a file of that name): the same line from every command (a bare unknown word gets from_name's, naming the
    presets)."""
    from engine.config import PRESETS

    if model in PRESETS:
        return
    if base is not None and (os.sep in model or "/" in model):
        path = resolve_model_path(model, base)
        raise UserError(f"model {model}: {path} {not_a_directory(path)} (a relative path is taken from the session "
                        f"file's directory); give a preset ({', '.join(PRESETS)}) or a checkpoint directory")
    if os.sep in model or "/" in model or os.path.lexists(model):  # lexists: a broken link is named as one
        raise UserError(f"--model {model}: {not_a_directory(Path(model))}; give a preset ({', '.join(PRESETS)}) or a "
                        f"Hugging Face-format checkpoint directory (config.json, *.safetensors, tokenizer.json)")


def not_a_directory(path: Path) -> str:
    """Why `path` is no checkpoint directory, in the words a refusal uses: missing, or a file."""
    if not os.path.lexists(path):
        return "does not exist"
    if os.path.islink(path) and not os.path.exists(path):
        return "is a link that leads nowhere (broken, or a loop)"
    return "is a file, not a directory"


def resolve_model_path(model: str, base: str | Path | None = None) -> Path:
    """A model given as a path: relative ones are taken from `base` when given (a session's directory). A blank
    name is refused: as a path it would be the current directory (or the session's)."""
    if not model.strip():
        from engine.config import PRESETS

        raise UserError(f"{'model' if base is not None else '--model'} is empty: give a preset "
                        f"({', '.join(PRESETS)}) or a checkpoint directory (./ for the current one)")
    path = Path(model).expanduser()
    return path if path.is_absolute() or base is None else Path(base) / path
