"""Reading safetensors checkpoints: one file, several, or shards named by `model.safetensors.index.json`.

Every file's header is parsed (and checked against the file's size) when the checkpoint is opened,
so a truncated download is reported before anything is read, naming the file and the first tensor
it cuts off. Tensors are read lazily, one at a time or one leading-index slice (one expert) at a time,
through `safetensors.safe_open`; the caller copies each piece to its destination at once, so a
model is never held twice in memory.

Knows nothing of model families or the engine's layout (engine.hf_loader maps the names).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from engine.errors import UserError

INDEX_FILE = "model.safetensors.index.json"

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
    "BOOL": torch.bool,
}
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
_ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "U8": 1, "I8": 1, "I16": 2, "I32": 4, "I64": 8, "BOOL": 1}
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors format's own limit


def _shape_text(shape) -> str:
    return "[" + ", ".join(str(size) for size in shape) + "]"


@dataclass(frozen=True)
class TensorEntry:
    """One tensor's place in the checkpoint, from its file's header."""

    name: str
    file: Path
    dtype: str  # safetensors dtype code: F32, BF16, U8, ...
    shape: tuple[int, ...]


def read_header(path: Path) -> dict[str, TensorEntry]:
    """The tensors one .safetensors file declares, checked against the file's size: a tensor whose
    bytes lie past the end of the file means the file is truncated, and the error names it."""
    size = path.stat().st_size
    with path.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise UserError(f"{path}: {size} bytes, too short for a safetensors header: the file is truncated "
                            f"or not a safetensors file; download it again")
        (header_bytes,) = struct.unpack("<Q", prefix)
        if header_bytes > _MAX_HEADER_BYTES or 8 + header_bytes > size:
            raise UserError(f"{path}: the header claims {header_bytes} bytes but the file has {size}: the file is "
                            f"truncated or not a safetensors file; download it again")
        try:
            header = json.loads(handle.read(header_bytes))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise UserError(f"{path}: the safetensors header is not valid JSON ({error}): the file is corrupt; "
                            f"download it again") from None
    data_bytes = size - 8 - header_bytes
    entries: dict[str, TensorEntry] = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = spec["dtype"], tuple(spec["shape"]), spec["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise UserError(f"{path}: tensor {name} has a malformed header entry {spec!r}: the file is corrupt; "
                            f"download it again") from None
        if end > data_bytes:
            raise UserError(f"{path}: truncated: tensor {name} needs bytes {begin}..{end} of the data but the file "
                            f"holds {data_bytes}; download the file again")
        if dtype in _ITEM_BYTES:
            expected = _ITEM_BYTES[dtype]
            for extent in shape:
                expected *= extent
            if end - begin != expected:
                raise UserError(f"{path}: tensor {name} is {dtype} {_shape_text(shape)} ({expected} bytes) but "
                                f"its header gives it {end - begin} bytes: the file is corrupt; download it again")
        entries[name] = TensorEntry(name, path, dtype, shape)
    return entries


class Checkpoint:
    """The tensors of the safetensors files in one directory, by name."""

    def __init__(self, directory: Path, entries: dict[str, TensorEntry]) -> None:
        self.directory = directory
        self.entries = entries
        self._handles: dict[Path, object] = {}

    @classmethod
    def open(cls, directory: str | Path) -> "Checkpoint":
        directory = Path(directory)
        index_path = directory / INDEX_FILE
        if index_path.is_file():
            files = cls._files_from_index(index_path)
        else:
            files = sorted(directory.glob("*.safetensors"))
            if not files:
                raise UserError(f"{directory}: no *.safetensors file (and no {INDEX_FILE}): the weights must be "
                                f"in safetensors format; convert .bin/.pt checkpoints with save_pretrained("
                                f"safe_serialization=True)")
        entries: dict[str, TensorEntry] = {}
        for path in files:
            for name, entry in read_header(path).items():
                if name in entries:
                    raise UserError(f"{path}: tensor {name} is also in {entries[name].file.name}: two files hold "
                                    f"the same tensor; keep one checkpoint per directory")
                entries[name] = entry
        if index_path.is_file():
            cls._check_index(index_path, entries)
        return cls(directory, entries)

    @staticmethod
    def _files_from_index(index_path: Path) -> list[Path]:
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as error:
            raise UserError(f"{index_path}: not a safetensors index with a weight_map ({error}); "
                            f"download it again") from None
        files = []
        for file_name in sorted(set(weight_map.values())):
            path = index_path.parent / file_name
            if not path.is_file():
                tensor = next(name for name, shard in weight_map.items() if shard == file_name)
                raise UserError(f"{path}: missing: {INDEX_FILE} puts tensor {tensor} (and others) in it; "
                                f"download every shard")
            files.append(path)
        return files

    @staticmethod
    def _check_index(index_path: Path, entries: dict[str, TensorEntry]) -> None:
        weight_map = json.loads(index_path.read_text())["weight_map"]
        for name, file_name in weight_map.items():
            entry = entries.get(name)
            if entry is None or entry.file.name != file_name:
                raise UserError(f"{index_path.parent / file_name}: {INDEX_FILE} puts tensor {name} in this file but "
                                f"it is {'in ' + entry.file.name if entry else 'in no shard'}: the index and the "
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
            if index is None:
                return handle.get_tensor(name)
            return handle.get_slice(name)[index]
        except (SafetensorError, OSError, RuntimeError, ValueError) as error:  # say which file and tensor
            raise UserError(f"{entry.file}: cannot read tensor {name}: {type(error).__name__}: "
                            f"{str(error).splitlines()[0] if str(error) else ''}; the file is corrupt or truncated, "
                            f"download it again") from None

    def close(self) -> None:
        self._handles.clear()
