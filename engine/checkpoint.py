"""Reading safetensors checkpoints: one file, several, or shards named by `model.safetensors.index.json`.

Every file's header is parsed (and checked against the file's size) when the checkpoint is opened,
so a truncated download is reported before anything is read, naming the file and the first tensor
it cuts off. Tensors are read lazily, one at a time or one leading-index slice (one expert) at a time,
through `safetensors.safe_open`; the caller copies each piece to its destination at once, so a
model is never held twice in memory.

Knows nothing of model families or the engine's layout (engine.hf_loader maps the names).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from engine.errors import UserError
from engine.json_input import parse_json
from engine.printable import printable

INDEX_FILE = "model.safetensors.index.json"

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
    "BOOL": torch.bool,
}
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
_ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "U8": 1, "I8": 1, "I16": 2, "I32": 4, "I64": 8, "BOOL": 1}
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors format's own limit
_MAX_DIMENSIONS = 8
MAX_INDEX_BYTES = 64 * 1024 * 1024  # a 671B model's index is ~9 MB


def require_regular_file(path: Path) -> None:
    """UserError unless `path` is a regular file: a FIFO under a weight's name would block a read forever."""
    if not path.is_file():
        raise UserError(f"{printable(str(path))}: not a regular file (a directory, a pipe, or a link that leads "
                        f"nowhere); a checkpoint's files are regular files")


def _shape_text(shape) -> str:
    return "[" + ", ".join(str(size) for size in shape) + "]"


@dataclass(frozen=True)
class TensorEntry:
    """One tensor's place in the checkpoint, from its file's header."""

    name: str
    file: Path
    dtype: str  # safetensors dtype code: F32, BF16, U8, ...
    shape: tuple[int, ...]


def _corrupt(path: Path, problem: str) -> UserError:
    return UserError(f"{printable(str(path))}: {problem}: the file is corrupt or not a safetensors file; "
                     f"download it again")


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_header(path: Path) -> dict[str, TensorEntry]:
    """The tensors one .safetensors file declares, checked against the file's size: a tensor whose
    bytes lie past the end of the file means the file is truncated, and the error names it.

    Every field is checked before it is used (a header is untrusted JSON): an object of entries, each
    with a string dtype, a shape of non-negative integers whose bytes are exactly its data_offsets'
    span, offsets inside the file. Nothing is allocated from a header's numbers; the 8-byte length
    that opens the file is never printed (for a text file it is its first 8 characters as a number)."""
    size = path.stat().st_size
    with path.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise UserError(f"{printable(str(path))}: {size} bytes, too short for a safetensors header: the file is "
                            f"truncated or not a safetensors file; download it again")
        (header_bytes,) = struct.unpack("<Q", prefix)
        if header_bytes > _MAX_HEADER_BYTES or 8 + header_bytes > size:
            raise UserError(f"{printable(str(path))}: its first 8 bytes do not give the length of a header inside "
                            f"its {size} bytes: the file is truncated or not a safetensors file; download it again")
        header = parse_json(handle.read(header_bytes), printable(str(path)), "the safetensors header",
                            "the file is corrupt; download it again")
    if not isinstance(header, dict):
        raise _corrupt(path, "the safetensors header is not a JSON object")
    data_bytes = size - 8 - header_bytes
    entries: dict[str, TensorEntry] = {}
    spans: list[tuple[int, int, str]] = []  # each tensor's data bytes, to refuse two that overlap
    for name, spec in header.items():
        if name == "__metadata__":  # the reader (safetensors) takes text values only, and names no tensor if not
            if spec is not None and (not isinstance(spec, dict)
                                     or not all(isinstance(value, str) for value in spec.values())):
                raise _corrupt(path, "the header's __metadata__ is not an object of text values")
            continue
        shown = printable(name)
        if not isinstance(spec, dict):
            raise _corrupt(path, f"tensor {shown} has a malformed header entry ({printable(repr(spec), 60)})")
        dtype, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
        if not isinstance(dtype, str) or not dtype:
            raise _corrupt(path, f"tensor {shown} has no dtype name")
        if not isinstance(shape, list) or len(shape) > _MAX_DIMENSIONS or not all(_is_count(extent) for extent in shape):
            raise _corrupt(path, f"tensor {shown} has a shape that is not a list of at most {_MAX_DIMENSIONS} "
                                 f"non-negative integers")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(offset) for offset in offsets)
                or offsets[0] > offsets[1]):
            raise _corrupt(path, f"tensor {shown} has data_offsets that are not [begin, end] with 0 <= begin <= end")
        begin, end = offsets
        if end > data_bytes:
            raise UserError(f"{printable(str(path))}: truncated: tensor {shown} needs bytes {begin}..{end} of the data "
                            f"but the file holds {data_bytes}; download the file again")
        if dtype in _ITEM_BYTES:
            expected = _ITEM_BYTES[dtype]
            for extent in shape:
                expected *= extent
            if end - begin != expected:
                raise UserError(f"{printable(str(path))}: tensor {shown} is {printable(dtype)} {_shape_text(shape)} "
                                f"({expected} bytes) but its header gives it {end - begin} bytes: the file is "
                                f"corrupt; download it again")
        entries[name] = TensorEntry(name, path, dtype, tuple(shape))
        spans.append((begin, end, shown))
    spans.sort()
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):  # the reader refuses it naming another tensor
        if begin < end:
            raise _corrupt(path, f"tensors {first} and {second} claim overlapping bytes of the data")
    return entries


# ------------------------------------------------------------------------------------------------
# The index and where its shards may lie
# ------------------------------------------------------------------------------------------------

def read_index(directory: Path) -> dict[str, str]:
    """The index's weight_map (tensor name -> shard file name), every entry a pair of strings."""
    path = directory / INDEX_FILE
    require_inside(directory, path, INDEX_FILE)
    size = path.stat().st_size
    if size > MAX_INDEX_BYTES:
        raise UserError(f"{printable(str(path))}: {size} bytes, more than a safetensors index holds "
                        f"({MAX_INDEX_BYTES}); download it again")
    data = parse_json(path.read_bytes(), printable(str(path)), "the index", "download it again")
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise UserError(f"{printable(str(path))}: not a safetensors index (an object whose weight_map maps tensor "
                        f"names to shard files); download it again")
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard:
            raise UserError(f"{printable(str(path))}: tensor {printable(name)} is mapped to "
                            f"{printable(repr(shard), 60)}, not a shard file name; download the index again")
    return weight_map


def _hub_blobs(directory: Path) -> Path | None:
    """The blob store of a Hugging Face hub cache, when `directory` is one of its snapshots: the hub
    stores `models--org--name/snapshots/REVISION/FILE` as links to `models--org--name/blobs/HASH`."""
    real = directory.resolve()
    if real.parent.name == "snapshots" and (real.parent.parent / "blobs").is_dir():
        return (real.parent.parent / "blobs").resolve()
    return None


def require_inside(directory: Path, path: Path, what: str) -> Path:
    """`path` when it resolves (symbolic links followed) inside `directory`, or inside the hub
    cache's blob store when `directory` is a hub snapshot; else UserError, before it is opened.

    Symbolic links are followed and then judged by where they lead: a link inside the checkpoint,
    or the hub cache's own links to its blobs, are kept; a link elsewhere (a hostile archive or
    repository can ship one to /etc/passwd or to another checkpoint) is refused like a `..` name."""
    root = directory.resolve()
    real = path.resolve()
    allowed = [root] + [blobs for blobs in [_hub_blobs(directory)] if blobs is not None]
    if any(real == base or base in real.parents for base in allowed):
        return path
    leads = f" (it leads to {printable(str(real))})" if real != path.absolute() else ""
    raise UserError(f"{printable(str(directory))}: {what} lies outside the checkpoint directory{leads}; it is not "
                    f"opened: keep every file of the checkpoint inside its directory")


def shard_path(directory: Path, file_name: str, tensor: str) -> Path:
    """Where the index's shard `file_name` lies: a relative name inside `directory`, or UserError
    naming the shard and saying it lies outside (`..`, an absolute path, a link leading out)."""
    what = f"the shard {printable(repr(file_name), 120)} ({INDEX_FILE} puts tensor {tensor} in it)"
    if "\x00" in file_name:
        raise UserError(f"{printable(str(directory))}: {what} has a NUL character in its name; download the index "
                        f"again")
    name = Path(file_name)
    if name.is_absolute() or ".." in name.parts or os.path.isabs(file_name):
        raise UserError(f"{printable(str(directory))}: {what} lies outside the checkpoint directory; it is not "
                        f"opened: an index names its shards relative to its own directory")
    return require_inside(directory, directory / name, what)


def nonfinite_allowed() -> bool:
    """The `nonfinite_weights` flag as a load sees it: its default or MOEI_NONFINITE_WEIGHTS (weights
    load before a session's [flags] or --set apply, so the environment is where it is set)."""
    from engine import flags as flag_registry

    return flag_registry.from_environment()["nonfinite_weights"] == "allow"


def check_finite(tensor: torch.Tensor, entry: TensorEntry, index: int | None = None) -> None:
    """UserError naming the tensor (and expert) when a float tensor holds NaN or inf."""
    if not tensor.is_floating_point():
        return
    finite = torch.isfinite(tensor)
    if bool(finite.all()):
        return
    nan = int(torch.isnan(tensor).sum())
    inf = int((~finite).sum()) - nan
    part = "" if index is None else f" (index {index} of its first dimension)"
    raise UserError(f"{printable(str(entry.file))}: tensor {printable(entry.name)}{part} holds {nan} NaN and {inf} "
                    f"infinite values: the weights are corrupt (a model with them computes garbage); download them "
                    f"again, or set MOEI_NONFINITE_WEIGHTS=allow to load them for an experiment")


class Checkpoint:
    """The tensors of the safetensors files in one directory, by name."""

    def __init__(self, directory: Path, entries: dict[str, TensorEntry]) -> None:
        self.directory = directory
        self.entries = entries
        self._handles: dict[Path, object] = {}
        # Float tensors holding NaN or inf are refused when read (the `nonfinite_weights` flag allows
        # them, for an experiment on what they do): such a model computes token 0 forever.
        self.allow_nonfinite = False

    @classmethod
    def open(cls, directory: str | Path) -> "Checkpoint":
        directory = Path(directory)
        index_path = directory / INDEX_FILE
        weight_map = None
        if os.path.lexists(index_path):  # a FIFO or a dangling link under the index's name: refused, not skipped
            require_regular_file(index_path)
            weight_map = read_index(directory)
            files = cls._files_from_index(directory, weight_map)
        else:
            files = sorted(directory.glob("*.safetensors"))
            for path in files:  # a FIFO, a directory or a dangling link under the name: say so, not "no file"
                require_regular_file(path)
            if not files:
                raise UserError(f"{directory}: no *.safetensors file (and no {INDEX_FILE}): the weights must be "
                                f"in safetensors format; convert .bin/.pt checkpoints with save_pretrained("
                                f"safe_serialization=True)")
            for path in files:
                require_inside(directory, path, f"{printable(path.name)} (a *.safetensors file)")
        entries: dict[str, TensorEntry] = {}
        for path in files:
            for name, entry in read_header(path).items():
                if name in entries:
                    raise UserError(f"{printable(str(path))}: tensor {printable(name)} is also in "
                                    f"{printable(entries[name].file.name)}: two files hold the same tensor; keep one "
                                    f"checkpoint per directory")
                entries[name] = entry
        if weight_map is not None:
            cls._check_index(index_path, weight_map, entries)
        return cls(directory, entries)

    @staticmethod
    def _files_from_index(directory: Path, weight_map: dict[str, str]) -> list[Path]:
        first_tensor: dict[str, str] = {}
        for name, shard in weight_map.items():
            first_tensor.setdefault(shard, name)
        files = []
        for file_name in sorted(first_tensor):
            tensor = printable(first_tensor[file_name])
            path = shard_path(directory, file_name, tensor)
            if not path.is_file():
                raise UserError(f"{printable(str(path))}: missing: {INDEX_FILE} puts tensor {tensor} (and others) in "
                                f"it; download every shard")
            files.append(path)
        return files

    @staticmethod
    def _check_index(index_path: Path, weight_map: dict[str, str], entries: dict[str, TensorEntry]) -> None:
        for name, file_name in weight_map.items():
            entry = entries.get(name)
            if entry is None or entry.file.name != Path(file_name).name:
                raise UserError(f"{printable(str(index_path.parent / file_name))}: {INDEX_FILE} puts tensor "
                                f"{printable(name)} in this file but it is "
                                f"{'in ' + printable(entry.file.name) if entry else 'in no shard'}: the index and the "
                                f"shards are from different checkpoints")

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def names(self) -> set[str]:
        return set(self.entries)

    def expect(self, name: str, shape: tuple[int, ...], dtypes: tuple[str, ...] = FLOAT_DTYPES,
               why: str = "") -> TensorEntry:
        """The entry of `name`, which must exist with this shape and one of these dtypes; else an error
        naming the file, the tensor and what the config makes of it."""
        entry = self.entries.get(name)
        if entry is None:
            raise UserError(f"{self.directory}: tensor {name} is missing from every safetensors file"
                            f"{' (' + why + ')' if why else ''}: the checkpoint is incomplete or of another "
                            f"architecture than config.json says")
        if entry.shape != tuple(shape):
            raise UserError(f"{entry.file}: tensor {name} has shape {_shape_text(entry.shape)} but config.json makes "
                            f"it {_shape_text(shape)}{' (' + why + ')' if why else ''}: the weights do not match "
                            f"config.json")
        if entry.dtype not in dtypes:
            raise UserError(f"{entry.file}: tensor {name} is {entry.dtype}, expected {' or '.join(dtypes)}: "
                            f"quantized or unusual dtypes other than gpt-oss MXFP4 experts are not supported")
        return entry

    def read(self, name: str, index: int | None = None) -> torch.Tensor:
        """The tensor (or its `[index]` slice along the first dimension), on the CPU in its stored dtype."""
        entry = self.entries[name]
        try:
            handle = self._handles.get(entry.file)
            if handle is None:
                handle = self._handles[entry.file] = safe_open(str(entry.file), framework="pt", device="cpu")
            tensor = handle.get_tensor(name) if index is None else handle.get_slice(name)[index]
        except (SafetensorError, OSError, RuntimeError, ValueError) as error:  # say which file and tensor
            raise UserError(f"{entry.file}: cannot read tensor {printable(name)}: {type(error).__name__}: "
                            f"{printable(str(error).splitlines()[0]) if str(error) else ''}; the file is corrupt or "
                            f"truncated, download it again") from None
        if not self.allow_nonfinite:
            check_finite(tensor, entry, index)
        return tensor

    def close(self) -> None:
        self._handles.clear()
