"""Checkpoint directories with trellis-coded experts (docs/trellis.md): config.json, dense.safetensors,
one experts-LLLLL.safetensors per layer, quantization.json, and tokenizer.json where the source had one.

Reading: `is_trellis_config` tells engine.hf_loader which directories are these; `read_config` gives the engine's
ModelConfig (named after the source, marked with the code: `quantized_name`) and the code; `load_weights` gives the
weights dict in which each layer's `w13` and `w2` are kernels.trellis_reference.TrellisMatrix stacks (what the
trellis arms receive), every other tensor a dense tensor. Every tensor's dtype and shape is checked against
config.json first, so a mismatch is one UserError naming the file and the tensor, and nothing is half loaded.

config.json's model entry is checked field by field (type, range, no unknown key) and every seed against its
range before any weight loads. `read_layer_file` gives `quantize` the same checks for one layer file it would keep.

Writing: the pieces engine.trellis_job assembles (config.json's entry, the layer and dense files), each
written to a temporary name and renamed, so a file is whole or absent; a write the system refuses (a full disk)
is a WriteError naming the file and the system's reason, its temporary file removed.

Knows nothing of the Viterbi search, dispatch or generation.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from engine.checkpoint import FLOAT_DTYPES, Checkpoint, read_header
from engine.config import LatentAttention, LayerMask, ModelConfig, SharedExperts, YarnScaling
from engine.errors import UserError
from engine.hf_config_checks import SIZE_LIMITS
from engine.printable import printable
from engine.progress import Progress
from kernels.trellis_reference import (HYB_INDEX_BITS, TILE, TrellisCode, TrellisMatrix, hadamard_signs)

FORMAT_KEY = "moe_inspector"
# quantize's --seed: engine.limits.MAX_SEED (a torch generator's seed), not imported from there: engine.limits
# reaches engine.model_source, which loads checkpoints of this format (a cycle); tests keep the two equal
MAX_SEED = 2**63 - 1
FORMAT_NAME = "trellis-experts"
FORMAT_VERSION = 1
QUANT_METHOD = "trellis"
DENSE_FILE = "dense.safetensors"
REPORT_FILE = "quantization.json"
MATRICES = ("w13", "w2")


def layer_file(layer: int) -> str:
    return f"experts-{layer:05d}.safetensors"


def codes_name(matrix: str) -> str:
    """`layers.L.w13` -> its packed codes' tensor name."""
    return f"{matrix}.trellis_codes"


def scales_name(matrix: str) -> str:
    return f"{matrix}.trellis_scales"


def table_name(layer: int) -> str:
    return f"layers.{layer}.trellis_table"


def expert_matrices(config: ModelConfig) -> list[str]:
    """Engine names of the matrices a trellis checkpoint codes: every MoE layer's routed w13 and w2. Dense layers
    (DeepSeek's first_k_dense_replace, Qwen2-MoE's mlp_only_layers) and shared experts are not coded: they stay in
    dense.safetensors in bf16."""
    return [f"layers.{layer}.{matrix}" for layer in config.moe_layers for matrix in MATRICES]


# --------------------------------------------------------------------------------------------
# config.json
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MatrixLayout:
    """config.json's entry for one coded matrix stack."""

    shape: tuple[int, int, int]  # (E, N, C)
    left_seed: int
    right_seed: int
    left_block: int
    right_block: int

    def to_json(self) -> dict:
        return {"shape": list(self.shape), "left_seed": self.left_seed, "right_seed": self.right_seed,
                "left_block": self.left_block, "right_block": self.right_block}


@dataclass(frozen=True)
class TrellisLayout:
    """What config.json says the experts are: the code, the quantizer's seed and each matrix's layout."""

    code: TrellisCode
    seed: int
    matrices: dict[str, MatrixLayout]

    def quantization_config(self) -> dict:
        return {"quant_method": QUANT_METHOD, "code": self.code.code, "bits_per_weight": self.code.K,
                "weights_per_step": self.code.V, "state_bits": self.code.L, "tile": TILE,
                "hyb_index_bits": HYB_INDEX_BITS, "seed": self.seed,
                "matrices": {name: layout.to_json() for name, layout in self.matrices.items()}}


# ModelConfig's fields that hold a nested config dataclass (or None): dataclasses.asdict writes them as objects,
# and config_from_json must build them back, or the engine meets a dict where it reads `.qk_head_dim`
_NESTED_CONFIGS = {"rope_scaling": YarnScaling, "latent_attention": LatentAttention, "shared_experts": SharedExperts}
# tuple fields: JSON gives lists back, and a frozen config compares and hashes with tuples
_TUPLE_FIELDS = ("dense_layers",)


# Ranges of the model entry's numbers, by key (nested: `rope_scaling.factor`); a number not listed is finite, and an
# integer not listed is within 0..2**40. Sizes have engine.hf_config_checks' ceilings for the fields they come from.
_LARGEST = 1 << 40
_INTEGER_RANGES: dict[str, tuple[int, int]] = {
    "n_layers": (1, SIZE_LIMITS["num_hidden_layers"]), "hidden": (1, SIZE_LIMITS["hidden_size"]),
    "intermediate": (1, SIZE_LIMITS["moe_intermediate_size"]), "n_experts": (1, SIZE_LIMITS["num_experts"]),
    "top_k": (1, SIZE_LIMITS["num_experts_per_tok"]), "n_heads": (1, SIZE_LIMITS["num_attention_heads"]),
    "n_kv_heads": (1, SIZE_LIMITS["num_key_value_heads"]), "head_dim": (1, SIZE_LIMITS["head_dim"]),
    "vocab_size": (1, SIZE_LIMITS["vocab_size"]), "max_seq_len": (1, SIZE_LIMITS["max_position_embeddings"]),
    "n_group": (1, SIZE_LIMITS["num_experts"]), "topk_group": (1, SIZE_LIMITS["num_experts"]),
    "dense_layers": (0, SIZE_LIMITS["num_hidden_layers"] - 1),
    "dense_intermediate": (0, SIZE_LIMITS["intermediate_size"]),
    "layer_masks.window": (0, SIZE_LIMITS["sliding_window"]), "layer_masks.block": (0, SIZE_LIMITS["sliding_window"]),
    "rope_scaling.original_max_position": (1, SIZE_LIMITS["original_max_position_embeddings"]),
    "latent_attention.kv_lora_rank": (1, SIZE_LIMITS["hidden_size"]),
    "latent_attention.q_lora_rank": (1, SIZE_LIMITS["hidden_size"]),
    "latent_attention.qk_nope_head_dim": (1, SIZE_LIMITS["head_dim"]),
    "latent_attention.qk_rope_head_dim": (1, SIZE_LIMITS["head_dim"]),
    "latent_attention.v_head_dim": (1, SIZE_LIMITS["head_dim"]),
    "shared_experts.count": (1, SIZE_LIMITS["num_experts"]),
    "shared_experts.intermediate": (1, SIZE_LIMITS["n_routed_experts"] * SIZE_LIMITS["moe_intermediate_size"]),
}
# numbers that must be > 0 (an eps of 0 divides by zero; a theta of 0 or below has no frequencies)
_POSITIVE_NUMBERS = {"rope_theta", "norm_eps", "activation_limit", "routed_scaling_factor", "clip_qkv",
                     "rope_scaling.factor", "rope_scaling.beta_fast", "rope_scaling.beta_slow",
                     "rope_scaling.attention_factor", "latent_attention.softmax_scale", "latent_attention.norm_eps"}


def _is_number(value) -> bool:
    """A finite JSON number (not true or false; an integer too large for a float is not finite)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _model_error(path: Path, key: str, value, expected: str) -> UserError:
    return UserError(f"{path}: {FORMAT_KEY}.model.{key} is {printable(repr(value), 60)}, expected {expected}: the "
                     f"file is damaged; quantize the model again")


def _check_model_value(value, hint, key: str, path: Path) -> None:
    """`value` (JSON) against the type hint of the config field `key` (its dotted path in the model entry), and
    the field's range; UserError naming the file and the key otherwise."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        kinds = [kind for kind in typing.get_args(hint) if kind is not type(None)]
        if value is None and len(kinds) < len(typing.get_args(hint)):
            return
        hint = kinds[0]
    if typing.get_origin(hint) is tuple:
        if not isinstance(value, (list, tuple)):  # JSON's lists; config_to_json's own values keep the tuples
            raise _model_error(path, key, value, "a list")
        for item in value:
            _check_model_value(item, typing.get_args(hint)[0], key, path)
        return
    if dataclasses.is_dataclass(hint):
        _check_model_entry(value, hint, path, f"{key}.")
        return
    if hint is bool:
        if not isinstance(value, bool):
            raise _model_error(path, key, value, "true or false")
    elif hint is str:
        if not isinstance(value, str):
            raise _model_error(path, key, value, "a string")
    elif hint is int:
        low, high = _INTEGER_RANGES.get(key, (0, _LARGEST))
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise _model_error(path, key, value, f"an integer from {low} to {high}")
    elif hint is float:
        positive = key in _POSITIVE_NUMBERS
        if not _is_number(value) or (positive and value <= 0):
            raise _model_error(path, key, value, "a number > 0" if positive else "a finite number")
    else:  # a field of a type this reader does not know: a bug, caught by the tests
        raise AssertionError(f"{key}: {hint}")


def _check_model_entry(values, kind, path: Path, prefix: str = "") -> None:
    """Every field of `kind` (ModelConfig or a config nested in it) in `values`: present unless it has a default,
    of its type and within its range; no other key."""
    if not isinstance(values, dict):
        raise UserError(f"{path}: {FORMAT_KEY}.model{'.' + prefix.rstrip('.') if prefix else ''} must be an object "
                        f"of the engine's model config")
    fields = {field.name: field for field in dataclasses.fields(kind)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise UserError(f"{path}: {FORMAT_KEY}.model has unknown key {printable(repr(prefix + unknown[0]), 80)}: "
                        f"written by another version of moe-inspector; quantize the model again")
    hints = typing.get_type_hints(kind)
    for name, field in fields.items():
        if name not in values:
            if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
                raise UserError(f"{path}: {FORMAT_KEY}.model has no {prefix + name!r}: the file is damaged; "
                                f"quantize the model again")
            continue
        _check_model_value(values[name], hints[name], prefix + name, path)


def config_to_json(config: ModelConfig) -> dict:
    """A ModelConfig as plain JSON values (`config_from_json` reads it back equal)."""
    values = dataclasses.asdict(config)
    values["layer_masks"] = [dataclasses.asdict(mask) for mask in config.layer_masks]
    return values


def config_from_json(values: dict, path: Path) -> ModelConfig:
    """`config_to_json`'s values -> the ModelConfig, its nested configs (layer masks, YaRN, latent attention,
    shared experts) rebuilt as their dataclasses; UserError naming `path` for anything else."""
    _check_model_entry(values, ModelConfig, path)  # types and ranges first: the config's own checks compare them
    try:
        fields = dict(values)
        fields["layer_masks"] = tuple(LayerMask(**mask) for mask in values.get("layer_masks", ()))
        for name, kind in _NESTED_CONFIGS.items():
            if fields.get(name) is not None:
                fields[name] = kind(**fields[name])
        for name in _TUPLE_FIELDS:
            if name in fields:
                fields[name] = tuple(fields[name])
        return ModelConfig(**fields)
    except (TypeError, ValueError) as error:
        raise UserError(f"{path}: {FORMAT_KEY}.model is not a valid model config ({error}); quantize the model "
                        f"again") from None


def is_trellis_config(values: dict) -> bool:
    """True for a config.json this module reads (our key, or a trellis quantization_config)."""
    quantization = values.get("quantization_config")
    return FORMAT_KEY in values or (isinstance(quantization, dict) and quantization.get("quant_method") == QUANT_METHOD)


# The sign seeds are hashed mod 2**64 (kernels.trellis_reference.hadamard_signs): a seed outside 0..2**64-1 would
# be masked into that range, another seed than the one written
MAX_SIGN_SEED = 2**64 - 1


def _integer(entry: dict, key: str, path: Path, where: str, low: int | None = None, high: int | None = None) -> int:
    value = entry.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(f"{path}: {where}.{key} is {printable(repr(value), 60)}, expected an integer: the file is "
                        f"damaged; quantize the model again")
    if (low is not None and value < low) or (high is not None and value > high):
        raise UserError(f"{path}: {where}.{key} is {printable(value, 60)}, outside {low}..{high}: the file is "
                        f"damaged; quantize the model again")
    return value


def read_config(values: dict, path: Path) -> tuple[ModelConfig, str, TrellisLayout]:
    """config.json's values (already parsed) -> the engine's config, the family label and the layout."""
    entry = values.get(FORMAT_KEY)
    if not isinstance(entry, dict) or entry.get("format") != FORMAT_NAME:
        raise UserError(f"{path}: a trellis quantization_config without the {FORMAT_KEY!r} entry (format "
                        f"{FORMAT_NAME!r}): only directories written by `moe-inspector quantize` load")
    version = entry.get("version")
    if version != FORMAT_VERSION:
        raise UserError(f"{path}: {FORMAT_KEY}.version {version!r}, this moe-inspector reads version "
                        f"{FORMAT_VERSION}: quantize the model again")
    config = config_from_json(entry.get("model"), path)
    quantization = values.get("quantization_config")
    if not isinstance(quantization, dict) or quantization.get("quant_method") != QUANT_METHOD:
        raise UserError(f"{path}: quantization_config.quant_method must be {QUANT_METHOD!r}")
    where = "quantization_config"
    if quantization.get("tile", TILE) != TILE or quantization.get("hyb_index_bits", HYB_INDEX_BITS) != HYB_INDEX_BITS:
        raise UserError(f"{path}: {where} declares tile {quantization.get('tile')} / hyb_index_bits "
                        f"{quantization.get('hyb_index_bits')}; this format has tile {TILE}, hyb_index_bits "
                        f"{HYB_INDEX_BITS}")
    try:
        code = TrellisCode(str(quantization.get("code")), _integer(quantization, "bits_per_weight", path, where),
                           _integer(quantization, "weights_per_step", path, where),
                           _integer(quantization, "state_bits", path, where))
    except ValueError as error:
        raise UserError(f"{path}: {where}: {error}") from None
    matrices_entry = quantization.get("matrices")
    if not isinstance(matrices_entry, dict):
        raise UserError(f"{path}: {where}.matrices must map each coded matrix to its layout")
    matrices: dict[str, MatrixLayout] = {}
    for name in expert_matrices(config):
        item = matrices_entry.get(name)
        if not isinstance(item, dict):
            raise UserError(f"{path}: {where}.matrices has no entry for {name}: every MoE layer's w13 and w2 are "
                            f"coded")
        shape = item.get("shape")
        seeds = [_integer(item, key, path, f"{where}.matrices.{name}", 0, MAX_SIGN_SEED)
                 for key in ("left_seed", "right_seed")]
        blocks = [_integer(item, key, path, f"{where}.matrices.{name}") for key in ("left_block", "right_block")]
        whole = isinstance(shape, list) and all(isinstance(size, int) and not isinstance(size, bool) for size in shape)
        layout = MatrixLayout(tuple(shape) if whole else (), *seeds, *blocks)
        expected = _dense_shape(config, name)
        if layout.shape != expected:
            raise UserError(f"{path}: {where}.matrices.{name}.shape is {printable(repr(shape), 60)} but the model "
                            f"config makes it {list(expected)}: the file is damaged; quantize the model again")
        _check_blocks(name, layout, config, path)
        matrices[name] = layout
    extra = sorted(set(matrices_entry) - set(matrices))
    if extra:
        raise UserError(f"{path}: {where}.matrices names {extra[0]}, which the model config does not have")
    seed = _integer(quantization, "seed", path, where, 0, MAX_SEED)  # the --seed quantize was given
    config = dataclasses.replace(config, name=quantized_name(config.name, code))
    return config, f"trellis {code.code} K={code.K}", TrellisLayout(code, seed, matrices)


def quantized_name(source_name: str, code: TrellisCode) -> str:
    """The loaded model's name: its source's (what config.json's model entry keeps) marked with the experts' code,
    `mixtral:m+trellis-hyb-K2`, so headers, the TUI and reports tell it from the source. Computed on reading, so
    directories written before the mark was added get it too; a name already marked is left as it is."""
    mark = f"+trellis-{code.code}-K{code.K}"
    return source_name if source_name.endswith(mark) else source_name + mark


def _dense_shape(config: ModelConfig, matrix: str) -> tuple[int, int, int]:
    if matrix.endswith(".w13"):
        return config.n_experts, 2 * config.intermediate, config.hidden
    return config.n_experts, config.hidden, config.intermediate


def _check_blocks(name: str, layout: MatrixLayout, config: ModelConfig, path: Path) -> None:
    _, rows, columns = layout.shape
    # w13's rows rotate within gate and within up: its block divides F
    row_limit = config.intermediate if name.endswith(".w13") else rows
    for side, block, size in (("left_block", layout.left_block, row_limit), ("right_block", layout.right_block, columns)):
        if block < 1 or block & (block - 1) or size % block:
            raise UserError(f"{path}: quantization_config.matrices.{name}.{side} is {block}, not a power of two "
                            f"dividing {size}: the file is damaged; quantize the model again")
    if rows % TILE or columns % TILE:
        raise UserError(f"{path}: {name} is [{rows}, {columns}], not a multiple of the {TILE} x {TILE} tile")


# --------------------------------------------------------------------------------------------
# Reading the tensors
# --------------------------------------------------------------------------------------------

def _expect(checkpoint: Checkpoint, name: str, shape: tuple[int, ...], dtype: str, why: str):
    entry = checkpoint.entries.get(name)
    if entry is not None and entry.dtype != dtype:
        raise UserError(f"{entry.file}: tensor {name} is {entry.dtype}, the trellis format stores it as {dtype} "
                        f"({why}): the file is damaged or not written by `moe-inspector quantize`")
    return checkpoint.expect(name, shape, (dtype,), why=why)


def _finite(tensor: torch.Tensor, name: str, checkpoint: Checkpoint) -> torch.Tensor:
    if not torch.isfinite(tensor).all():
        raise UserError(f"{checkpoint.entries[name].file}: tensor {name} holds NaN or infinite values: the file is "
                        f"damaged; quantize the model again")
    return tensor


def load_weights(directory: Path, config: ModelConfig, layout: TrellisLayout, device: torch.device,
                 dtype: torch.dtype, stream: TextIO | None = None) -> dict:
    """The weights of a trellis directory: dense tensors on `device` in `dtype`, each layer's w13 and w2 a
    TrellisMatrix on `device`. Checks every tensor's presence, dtype and shape before reading any."""
    from engine.model import tensor_shapes

    checkpoint = Checkpoint.open(directory)
    try:
        shapes = tensor_shapes(config)
        coded = set(layout.matrices)
        code = layout.code
        for name, shape in shapes.items():
            if name not in coded:
                checkpoint.expect(name, shape, FLOAT_DTYPES, why=f"a dense tensor of {config.name}")
        expected = set(shapes) - coded | _expect_coded(checkpoint, layout, config.moe_layers)
        _refuse_unused(checkpoint, expected, code)
        weights: dict = {}
        progress = Progress(len(shapes), f"loading {directory.name}", stream=sys.stderr if stream is None else stream)
        try:
            for name in shapes:
                if name in coded:
                    weights[name] = _read_matrix(checkpoint, name, layout, device)
                else:
                    weights[name] = checkpoint.read(name).to(device=device, dtype=dtype)
                progress.advance(note=name)
        finally:
            progress.close()
        return weights
    finally:
        checkpoint.close()


def _expect_coded(checkpoint: Checkpoint, layout: TrellisLayout, layers) -> set[str]:
    """Checks the dtype and shape of the coded tensors of `layers` (codes, scales, hyb's table); their names."""
    code = layout.code
    names: set[str] = set()
    for layer in layers:
        for name in (f"layers.{layer}.{matrix}" for matrix in MATRICES):
            experts, rows, columns = layout.matrices[name].shape
            _expect(checkpoint, codes_name(name), (experts, rows // TILE, columns // TILE, code.words_per_tile), "I32",
                    f"{code.describe()} codes of {name} [{experts}, {rows}, {columns}]")
            _expect(checkpoint, scales_name(name), (experts, rows), "F32", f"row scales of {name}")
            names |= {codes_name(name), scales_name(name)}
        if code.needs_table:
            _expect(checkpoint, table_name(layer), (1 << HYB_INDEX_BITS, 2), "F32", "the hyb code table")
            names.add(table_name(layer))
    return names


def _refuse_unused(checkpoint: Checkpoint, expected: set[str], code: TrellisCode) -> None:
    unused = sorted(checkpoint.names() - expected)
    if unused:
        raise UserError(f"{checkpoint.entries[unused[0]].file}: tensor {unused[0]} is not part of a {code.describe()} "
                        f"checkpoint of this config.json: the directory mixes files of two checkpoints")


def read_layer_file(path: Path, layer: int, layout: TrellisLayout) -> dict[str, TrellisMatrix]:
    """One layer's experts file, alone, with every check `load_weights` applies to it (its tensors' names, dtypes
    and shapes against `layout`, finite scales and table): its w13 and w2 on the CPU. What `quantize` checks a
    layer file a killed run left with before it keeps it. UserError naming the file otherwise; a link is refused
    (quantize writes its files itself)."""
    if path.is_symlink():
        raise UserError(f"{printable(str(path))}: a link (to {printable(os.readlink(path), 80)}), not a file quantize "
                        f"wrote")
    if not path.is_file():
        raise UserError(f"{printable(str(path))}: not a regular file")
    checkpoint = Checkpoint(path.parent, read_header(path))
    try:
        _refuse_unused(checkpoint, _expect_coded(checkpoint, layout, (layer,)), layout.code)
        return {name: _read_matrix(checkpoint, name, layout, torch.device("cpu"))
                for name in (f"layers.{layer}.{matrix}" for matrix in MATRICES)}
    finally:
        checkpoint.close()


def _read_matrix(checkpoint: Checkpoint, name: str, layout: TrellisLayout, device: torch.device) -> TrellisMatrix:
    matrix = layout.matrices[name]
    _, rows, columns = matrix.shape
    layer = int(name.split(".")[1])
    table = None
    if layout.code.needs_table:
        table = _finite(checkpoint.read(table_name(layer)), table_name(layer), checkpoint)
    scales = _finite(checkpoint.read(scales_name(name)), scales_name(name), checkpoint)
    try:
        return TrellisMatrix(layout.code, checkpoint.read(codes_name(name)), scales, table,
                             hadamard_signs(matrix.left_seed, rows), hadamard_signs(matrix.right_seed, columns),
                             matrix.left_block, matrix.right_block, matrix.left_seed, matrix.right_seed).to(device)
    except ValueError as error:  # shapes were checked; this is a bug's guard, still one line
        raise UserError(f"{checkpoint.entries[codes_name(name)].file}: {name}: {error}") from None


def _config_values(directory: Path) -> dict | None:
    try:
        values = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return values if isinstance(values, dict) else None


def source_of(directory: Path) -> dict:
    """The `source` entry `quantize` recorded in a trellis directory's config.json (the model it quantized, its
    weights and seed); {} when the file, the entry or the source is missing or not an object."""
    entry = (_config_values(Path(directory)) or {}).get(FORMAT_KEY)
    source = entry.get("source") if isinstance(entry, dict) else None
    return source if isinstance(source, dict) else {}


def is_trellis_directory(directory: Path) -> bool:
    values = _config_values(Path(directory))
    return values is not None and is_trellis_config(values)


def load_directory(directory: Path, device: torch.device, dtype: torch.dtype, stream: TextIO | None = None
                   ) -> tuple[ModelConfig, str, dict]:
    """(config, family label, weights) of a trellis directory (`read_config`, `load_weights`)."""
    directory = Path(directory)
    values = _config_values(directory)
    if values is None:
        raise UserError(f"{directory / 'config.json'}: missing or not a JSON object")
    config, family, layout = read_config(values, directory / "config.json")
    return config, family, load_weights(directory, config, layout, device, dtype, stream)


def random_weights(directory: Path, config: ModelConfig, seed: int, device: torch.device, dtype: torch.dtype) -> dict:
    """`--weights random` for a trellis directory: random dense tensors (engine.model.random_weights_on)
    and random trellis stacks of config.json's code, seeds and blocks (every packed stream is a valid path),
    drawn on `device`: a v4-shape trellis model without quantizing one."""
    from engine.model import random_weights_on
    from kernels.trellis_reference import random_trellis_matrix

    values = _config_values(Path(directory))
    _, _, layout = read_config(values, Path(directory) / "config.json")
    weights = random_weights_on(config, seed, device, dtype)
    for index, (name, matrix) in enumerate(layout.matrices.items()):
        experts, rows, columns = matrix.shape
        del weights[name]  # the dense draw's expert stack goes before the coded one is drawn
        drawn = random_trellis_matrix(experts, rows, columns, layout.code, seed=seed * 1000 + index, device=device,
                                      row_block=matrix.left_block)
        weights[name] = TrellisMatrix(layout.code, drawn.codes, drawn.scales, drawn.table,
                                      hadamard_signs(matrix.left_seed, rows).to(device),
                                      hadamard_signs(matrix.right_seed, columns).to(device), matrix.left_block,
                                      matrix.right_block, matrix.left_seed, matrix.right_seed)
    return weights


def byte_tokenizer(directory: Path) -> bool:
    """True when a trellis directory's config.json says its model reads byte tokens (a preset source)."""
    values = _config_values(Path(directory))
    entry = values.get(FORMAT_KEY) if values is not None else None
    return isinstance(entry, dict) and entry.get("tokenizer") == "bytes"


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------

class WriteError(UserError):
    """A file of the directory could not be written (a full disk, a quota, an I/O error): the message names the
    file and the system's reason; nothing is left under its name or its temporary one."""


def _write_failed(path: Path, temporary: Path, error: Exception) -> WriteError:
    try:  # the piece written so far: it holds space the user needs back, and no name points at it
        temporary.unlink(missing_ok=True)
    except OSError:
        pass
    if isinstance(error, OSError):
        reason = error.strerror or str(error)
    else:  # safetensors reports an I/O error as text: "... No space left on device (os error 28)"
        number = re.search(r"os error (\d+)", str(error))
        reason = os.strerror(int(number.group(1))) if number else printable(str(error).splitlines()[0], 160)
    return WriteError(f"{printable(str(path))}: cannot write it ({reason})")


def _temporary(path: Path) -> Path:
    """`path`'s temporary name, emptied first: a leftover there (a killed run's, or a link) is never written
    through."""
    temporary = path.with_name(path.name + ".tmp")
    temporary.unlink(missing_ok=True)
    return temporary


def _replace(temporary: Path, final: Path) -> None:
    with open(temporary, "rb") as handle:  # on disk before the rename makes it visible
        os.fsync(handle.fileno())
    os.replace(temporary, final)


def write_bytes(path: Path, data: bytes) -> None:
    """A file, whole or absent (written to a temporary name, then renamed); WriteError if the system refuses."""
    temporary = path.with_name(path.name + ".tmp")
    try:
        temporary = _temporary(path)
        temporary.write_bytes(data)
        _replace(temporary, path)
    except OSError as error:
        raise _write_failed(path, temporary, error) from None


def write_json(path: Path, values: dict) -> None:
    write_bytes(path, (json.dumps(values, indent=1) + "\n").encode())


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """A safetensors file, whole or absent (written to a temporary name, then renamed); WriteError if the system
    refuses."""
    temporary = path.with_name(path.name + ".tmp")
    # clones: safetensors refuses tensors that share memory (the engine's wq, wk, wv are views of one buffer)
    tensors = {name: tensor.detach().cpu().clone() for name, tensor in tensors.items()}
    try:
        temporary = _temporary(path)
        save_file(tensors, str(temporary), metadata={"format": "pt"})
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(temporary, 0o666 & ~mask)  # safetensors creates its file 0600; a plain open() would give this mode
        _replace(temporary, path)
    except (OSError, SafetensorError) as error:
        raise _write_failed(path, temporary, error) from None


def layer_tensors(layer: int, w13: TrellisMatrix, w2: TrellisMatrix) -> dict[str, torch.Tensor]:
    """The tensors of experts-LLLLL.safetensors."""
    tensors: dict[str, torch.Tensor] = {}
    for matrix, stack in ((f"layers.{layer}.w13", w13), (f"layers.{layer}.w2", w2)):
        tensors[codes_name(matrix)] = stack.codes
        tensors[scales_name(matrix)] = stack.scales
    if w13.code.needs_table:
        if not torch.equal(w13.table.cpu(), w2.table.cpu()):
            raise ValueError(f"layer {layer}: w13 and w2 must share the hyb table")
        tensors[table_name(layer)] = w13.table
    return tensors


def matrix_layout(stack: TrellisMatrix) -> MatrixLayout:
    return MatrixLayout(stack.shape, stack.left_seed, stack.right_seed, stack.left_block, stack.right_block)


def config_json(config: ModelConfig, layout: TrellisLayout, source: dict, tokenizer: str) -> dict:
    """config.json of a trellis directory."""
    return {FORMAT_KEY: {"format": FORMAT_NAME, "version": FORMAT_VERSION, "source": source, "tokenizer": tokenizer,
                         "model": config_to_json(config)},
            "quantization_config": layout.quantization_config()}


def expert_bytes(config: ModelConfig, code: TrellisCode) -> int:
    """Packed bytes of one expert (w13 + w2), what a woken expert costs a step to read."""
    from kernels.trellis_reference import packed_bytes_per_expert

    return (packed_bytes_per_expert(code, 2 * config.intermediate, config.hidden)
            + packed_bytes_per_expert(code, config.hidden, config.intermediate))


def bf16_expert_bytes(config: ModelConfig) -> int:
    return 3 * config.hidden * config.intermediate * 2
