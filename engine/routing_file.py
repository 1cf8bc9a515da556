"""The routing file: a `RoutingRecording` (engine.routing_record) as safetensors, written atomically and read
back with every field checked.

Tensors (T routed tokens, S steps, L MoE layers, k experts per token):
    ids       [T, L, k]  U8 when E <= 256, else I16 (E <= 32768), else I32: the experts each token chose
    weights   [T, L, k]  BF16: their weights, as the router produced them (the CPU's float32 rounded to bf16)
    steps     [S]        I64: the run's step numbers
    offsets   [S + 1]    I64: step s routed rows offsets[s]:offsets[s + 1]
    phases    [S]        U8: 0 prefill, 1 decode, 2 mixed
Metadata (safetensors' string map): format, version, and JSON strings: `model` (the model as named), `moe`
(layers, experts, top_k), `header` (the run: engine.routing_record.run_header), `truncated` (the cap, or
null), `unrecorded` (steps whose routing did not reach the host, with why).

Reading never trusts the file: the header is read within MAX_HEADER_BYTES, every tensor's dtype, shape and
byte range are checked against the file's size before a byte of it is read, and then the contents (ids in
range and distinct per token, finite weights, offsets that add up). Anything wrong, or a file recorded on
another model (`check_model`), is a UserError naming the file and the mismatch: one line, exit 2.

Knows nothing of how the recording was made or what reads it.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import struct
from pathlib import Path

import numpy as np

from engine.atomic_file import atomic_write_bytes
from engine.errors import UserError
from engine.routing_record import PHASES, RoutingRecording

FORMAT = "moe-inspector routing"
VERSION = "1"
MAX_HEADER_BYTES = 16 << 20  # the JSON header: a recording's is a few KB (the prompt text is cut to 4096 chars)
_TENSORS = ("ids", "weights", "steps", "offsets", "phases")
_DTYPES = {"U8": np.uint8, "I16": np.int16, "I32": np.int32, "I64": np.int64, "BF16": np.uint16}
_ID_DTYPES = ("U8", "I16", "I32")


# (layer, expert) loads one summary holds: DeepSeek-V3 has 58 x 256; a header claiming 1000 layers of 2**20
# experts (a few KB of file) would take gigabytes
MAX_LOAD_CELLS = 1 << 24


def _id_dtype(experts: int) -> str:
    return "U8" if experts <= 256 else "I16" if experts <= 32768 else "I32"


def model_moe_layers(config) -> tuple[int, ...]:
    """The model's MoE layers (a family with dense layers has fewer than n_layers)."""
    layers = getattr(config, "moe_layers", None)
    return tuple(layers) if layers is not None else tuple(range(config.n_layers))


# --------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------

def save(recording: RoutingRecording, path: str | Path) -> Path:
    """Write `recording` to `path` (a temporary file beside it, renamed over it once complete: a crash or a kill
    leaves the old file whole). Refuses an empty recording."""
    import torch
    from safetensors.torch import save as to_bytes

    path = Path(path)
    if recording.n_steps == 0:
        raise UserError(f"{path}: the run recorded no routing (no step ran), nothing to write")
    if path.is_dir():
        raise UserError(f"{path} is a directory: name a file, e.g. {path / 'routing.safetensors'}")
    if not path.parent.is_dir():
        raise UserError(f"{path.parent} is not a directory: create it first, or write the routing elsewhere")
    id_dtype = {"U8": torch.uint8, "I16": torch.int16, "I32": torch.int32}[_id_dtype(recording.experts)]
    tensors = {
        "ids": torch.from_numpy(np.ascontiguousarray(recording.ids)).to(id_dtype),
        "weights": torch.from_numpy(np.ascontiguousarray(recording.weight_bits).view(np.int16)).view(torch.bfloat16),
        "steps": torch.from_numpy(np.ascontiguousarray(recording.steps, np.int64)),
        "offsets": torch.from_numpy(np.ascontiguousarray(recording.offsets, np.int64)),
        "phases": torch.from_numpy(np.ascontiguousarray(recording.phases, np.uint8)),
    }
    metadata = {
        "format": FORMAT, "version": VERSION,
        "model": json.dumps(str(recording.header.get("model", ""))),
        "moe": json.dumps({"layers": list(recording.layers), "experts": recording.experts,
                           "top_k": recording.top_k}),
        "header": json.dumps(recording.header, default=str),
        "truncated": json.dumps(recording.truncated),
        "unrecorded": json.dumps(recording.unrecorded),
    }
    data = to_bytes(tensors, metadata)
    try:
        atomic_write_bytes(path, data)  # a kill leaves the old file or the new one, and no temporary
    except OSError as error:
        raise UserError(f"{path}: cannot write the routing file ({error.strerror or error}); pick a writable "
                        f"place") from None
    return path


# --------------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------------

def _refuse(path: Path, problem: str) -> UserError:
    return UserError(f"{path}: {problem}")


def _read_header(handle, path: Path, size: int) -> tuple[dict, int]:
    if size < 8:
        raise _refuse(path, f"{size} bytes: truncated, or not a routing file (a safetensors file starts with an "
                            f"8-byte header length); record one with --record-routing")
    (length,) = struct.unpack("<Q", handle.read(8))
    if length > MAX_HEADER_BYTES or 8 + length > size:  # never printed: for a text file, its first 8 characters
        raise _refuse(path, f"its first 8 bytes do not give the length of a header inside its {size} bytes: "
                            f"truncated, or not a routing file; record one with --record-routing")
    raw = handle.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise _refuse(path, "the header is not JSON: not a safetensors routing file") from None
    if not isinstance(header, dict):
        raise _refuse(path, "the header is not a JSON object: not a safetensors routing file")
    return header, 8 + length


def _metadata(header: dict, path: Path) -> dict:
    metadata = header.get("__metadata__")
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        raise _refuse(path, f"not a routing file (no \"format\": \"{FORMAT}\" in its metadata); record one with "
                            f"--record-routing")
    if metadata.get("version") != VERSION:
        raise _refuse(path, f"routing file version {metadata.get('version')!r}; this build reads version {VERSION}")
    parsed = {}
    for name in ("model", "moe", "header", "truncated", "unrecorded"):
        value = metadata.get(name)
        if not isinstance(value, str):
            raise _refuse(path, f"metadata {name!r} is missing: a truncated or hand-made file")
        try:
            parsed[name] = json.loads(value)
        except (ValueError, RecursionError):
            raise _refuse(path, f"metadata {name!r} is not JSON") from None
    moe = parsed["moe"]
    if not (isinstance(moe, dict) and isinstance(moe.get("layers"), list)
            and all(isinstance(layer, int) and not isinstance(layer, bool) and 0 <= layer < 1 << 20
                    for layer in moe["layers"])
            and all(isinstance(moe.get(key), int) and not isinstance(moe.get(key), bool)
                    for key in ("experts", "top_k"))):
        raise _refuse(path, "metadata \"moe\" is not {layers: [...], experts: N, top_k: K}")
    if not 1 <= moe["top_k"] <= moe["experts"] <= 1 << 20 or not moe["layers"]:
        raise _refuse(path, f"metadata \"moe\" has {len(moe['layers'])} layers, {moe['experts']} experts, "
                            f"top-{moe['top_k']}: not a routing shape")
    if len(moe["layers"]) * moe["experts"] > MAX_LOAD_CELLS:  # the summary keeps a load per layer and expert
        raise _refuse(path, f"metadata \"moe\" has {len(moe['layers'])} layers of {moe['experts']} experts, more "
                            f"than the {MAX_LOAD_CELLS} (layer, expert) loads a summary holds: not a model's routing")
    if not isinstance(parsed["header"], dict):
        raise _refuse(path, "metadata \"header\" is not a JSON object")
    problem = _notes_problem(parsed)
    if problem is not None:
        raise _refuse(path, f"metadata {problem}: a hand-made or damaged file")
    return parsed


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _notes_problem(parsed: dict) -> str | None:
    """What in the run's notes the summary could not print (None: nothing): the prompt (count, tokens, text),
    the cap (truncated: its counts) and the unrecorded steps ([first, steps, why] each), as routing_record writes
    them."""
    prompt = parsed["header"].get("prompt", {})
    if not isinstance(prompt, dict) or not isinstance(prompt.get("tokens", []), list) \
            or not all(_count(token) for token in prompt.get("tokens", [])) \
            or not isinstance(prompt.get("text", ""), (str, type(None))):
        return "\"header\".prompt is not {count, tokens: [ids], text}"
    truncated = parsed["truncated"]
    if truncated is not None and not (isinstance(truncated, dict) and all(
            _count(truncated.get(key, 0)) for key in ("cap_bytes", "at_step", "dropped_steps", "dropped_tokens"))):
        return "\"truncated\" is not the cap's counts"
    unrecorded = parsed["unrecorded"]
    if not isinstance(unrecorded, list) or not all(
            isinstance(entry, list) and len(entry) == 3 and _count(entry[0]) and _count(entry[1])
            and isinstance(entry[2], str) for entry in unrecorded):
        return "\"unrecorded\" is not a list of [first step, steps, why]"
    return None


def _entry(header: dict, name: str, path: Path, data_bytes: int) -> tuple[str, tuple[int, ...], int, int]:
    entry = header.get(name)
    if not isinstance(entry, dict):
        raise _refuse(path, f"no tensor {name!r}: a truncated or hand-made file")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in _DTYPES:
        raise _refuse(path, f"tensor {name!r} has dtype {dtype!r}")
    if not (isinstance(shape, list) and len(shape) <= 4
            and all(isinstance(dim, int) and not isinstance(dim, bool) and 0 <= dim < 1 << 40 for dim in shape)):
        raise _refuse(path, f"tensor {name!r} has shape {str(shape)[:80]}")
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(isinstance(value, int) and not isinstance(value, bool) for value in offsets)):
        raise _refuse(path, f"tensor {name!r} has data_offsets {str(offsets)[:80]}")
    begin, end = offsets
    expected = math.prod(shape) * np.dtype(_DTYPES[dtype]).itemsize
    if not 0 <= begin <= end or end - begin != expected:
        raise _refuse(path, f"tensor {name!r}: {end - begin} bytes for shape {shape} in {dtype} ({expected})")
    if end > data_bytes:
        raise _refuse(path, f"truncated: tensor {name!r} ends at byte {end} of the data, the file holds "
                            f"{data_bytes}")
    return dtype, tuple(shape), begin, end


def load(path: str | Path) -> RoutingRecording:
    """A routing file, checked (the module docstring); a UserError names the file and what is wrong."""
    path = Path(path)
    try:
        handle = open(path, "rb")
    except FileNotFoundError:
        raise UserError(f"{path}: no such file; record one with `moe-inspector generate ... --record-routing "
                        f"{shlex.quote(str(path))}`") from None
    except IsADirectoryError:
        raise UserError(f"{path} is a directory, not a routing file") from None
    except OSError as error:
        raise UserError(f"{path}: cannot read it ({error.strerror or error})") from None
    with handle:
        size = os.fstat(handle.fileno()).st_size
        header, data_start = _read_header(handle, path, size)
        meta = _metadata(header, path)
        entries = {name: _entry(header, name, path, size - data_start) for name in _TENSORS}
        arrays = {}
        for name, (dtype, shape, begin, end) in entries.items():
            handle.seek(data_start + begin)
            raw = handle.read(end - begin)
            if len(raw) != end - begin:
                raise _refuse(path, f"truncated: tensor {name!r} is {len(raw)} of {end - begin} bytes")
            arrays[name] = (dtype, np.frombuffer(raw, dtype=_DTYPES[dtype]).reshape(shape))
    return _recording(path, meta, arrays)


def _recording(path: Path, meta: dict, arrays: dict) -> RoutingRecording:
    moe = meta["moe"]
    layers, experts, top_k = tuple(moe["layers"]), moe["experts"], moe["top_k"]
    ids_dtype, ids = arrays["ids"]
    weights_dtype, bits = arrays["weights"]
    expected = ("T", len(layers), top_k)
    if ids_dtype not in _ID_DTYPES or ids.ndim != 3 or ids.shape[1:] != expected[1:]:
        raise _refuse(path, f"ids are {ids_dtype} {list(ids.shape)}, not [tokens, {len(layers)} layers, top-{top_k}]")
    if weights_dtype != "BF16" or bits.shape != ids.shape:
        raise _refuse(path, f"weights are {weights_dtype} {list(bits.shape)}, not BF16 {list(ids.shape)}")
    for name, dtype in (("steps", "I64"), ("offsets", "I64"), ("phases", "U8")):
        if arrays[name][0] != dtype or arrays[name][1].ndim != 1:
            raise _refuse(path, f"{name} is {arrays[name][0]} {list(arrays[name][1].shape)}, not a {dtype} vector")
    steps, offsets, phases = arrays["steps"][1], arrays["offsets"][1], arrays["phases"][1]
    tokens = ids.shape[0]
    if len(offsets) != len(steps) + 1 or len(phases) != len(steps) or not len(steps):
        raise _refuse(path, f"{len(steps)} steps, {len(offsets)} offsets and {len(phases)} phases: they do not add up")
    if offsets[0] != 0 or offsets[-1] != tokens or np.any(np.diff(offsets) < 0):
        raise _refuse(path, f"offsets run {int(offsets[0])}..{int(offsets[-1])} (or backwards), not 0..{tokens}")
    if np.any(phases >= len(PHASES)):
        raise _refuse(path, f"a phase code {int(phases.max())} is not 0 prefill, 1 decode or 2 mixed")
    ids32 = ids.astype(np.int32)
    bad = np.argwhere((ids32 < 0) | (ids32 >= experts))
    if len(bad):
        row, layer, _ = (int(value) for value in bad[0])
        step = int(np.searchsorted(offsets, row, side="right")) - 1
        raise _refuse(path, f"expert id {int(ids32[tuple(bad[0])])} at step {int(steps[step])} (row {row}), MoE "
                            f"layer {layers[layer]} is out of range for {experts} experts ({len(bad)} such ids)")
    if top_k > 1 and tokens:
        ordered = np.sort(ids32, axis=2)
        repeated = np.argwhere(np.any(ordered[:, :, 1:] == ordered[:, :, :-1], axis=2))
        if len(repeated):
            row, layer = (int(value) for value in repeated[0])
            raise _refuse(path, f"row {row} of MoE layer {layers[layer]} picks an expert twice: not a top-{top_k} "
                                f"routing ({len(repeated)} such rows)")
    if np.any((bits & 0x7F80) == 0x7F80):
        raise _refuse(path, "a weight is infinite or NaN")
    header = dict(meta["header"])
    header.setdefault("model", meta["model"])
    truncated = meta["truncated"] if isinstance(meta["truncated"], dict) else None
    unrecorded = meta["unrecorded"] if isinstance(meta["unrecorded"], list) else []
    recording = RoutingRecording(layers=layers, experts=experts, top_k=top_k, steps=steps.astype(np.int64),
                                 offsets=offsets.astype(np.int64), phases=phases.astype(np.uint8), header=header,
                                 truncated=truncated, unrecorded=unrecorded)
    recording._ids, recording._bits = ids32, np.ascontiguousarray(bits)
    return recording


def describe_shape(layers: int, experts: int, top_k: int) -> str:
    return f"{layers} MoE layer{'s' if layers != 1 else ''}, {experts} experts, top-{top_k}"


def check_model(recording: RoutingRecording, config, path: str | Path, model_name: str | None = None) -> None:
    """A UserError naming the file and the mismatch unless the recording's routing shape (MoE layers, experts, k)
    is `config`'s."""
    layers = model_moe_layers(config)
    mine = (len(recording.layers), recording.experts, recording.top_k)
    theirs = (len(layers), config.n_experts, config.top_k)
    if mine != theirs or tuple(recording.layers) != layers:
        differ = [name for name, a, b in zip(("MoE layers", "experts", "k"), mine, theirs) if a != b] \
            or [f"MoE layer indices ({list(recording.layers)[:8]} against {list(layers)[:8]})"]
        recorded_on = recording.header.get("model") or "another model"
        raise UserError(f"{path}: recorded on {recorded_on} ({describe_shape(*mine)}), not the shape of "
                        f"{model_name or config.name} ({describe_shape(*theirs)}): {', '.join(differ)} differ; "
                        f"record the routing on this model, or give the model it was recorded on")
