"""Checks of a Hugging Face checkpoint's config.json before anything is built from it.

config.json is untrusted input: every field engine.hf_loader (or a family it maps) reads has a
JSON type here (`FIELD_TYPES`, also inside `rope_scaling` / `rope_parameters` and
`quantization_config`), and every size a ceiling (`SIZE_LIMITS`) far beyond any released model, so
a wrong type or a number like 10**9 is one line naming the key, never a TypeError or an allocation.
With the checkpoint's headers at hand, `check_counts` also compares the layer and expert counts
config.json declares with the layers and experts whose tensors the checkpoint holds, before a
per-layer or per-expert loop of the declared length is run (4096 layers of 65536 experts, each
within its ceiling, would otherwise be half a billion names to look up).

Plain functions over the parsed JSON and the checkpoint's tensor names; knows nothing of families.
"""

from __future__ import annotations

import re
from pathlib import Path

from engine.errors import UserError
from engine.printable import printable

INT, NUMBER, BOOL, TEXT, OBJECT = "an integer", "a number", "true or false", "a string", "an object"
TEXT_LIST, INT_LIST = "a list of strings", "a list of integers"

# key -> expected JSON type; null is always allowed (the loader reads null as "not given").
FIELD_TYPES: dict[str, str] = {
    "architectures": TEXT_LIST, "model_type": TEXT, "hidden_act": TEXT, "torch_dtype": TEXT, "dtype": TEXT,
    "hidden_size": INT, "num_hidden_layers": INT, "intermediate_size": INT, "moe_intermediate_size": INT,
    "num_experts": INT, "num_local_experts": INT, "n_routed_experts": INT, "moe_num_experts": INT,
    "num_experts_per_tok": INT, "experts_per_token": INT, "num_attention_heads": INT, "num_key_value_heads": INT,
    "head_dim": INT, "vocab_size": INT, "max_position_embeddings": INT, "sliding_window": INT,
    "original_max_position_embeddings": INT, "decoder_sparse_step": INT, "shared_expert_intermediate_size": INT,
    "n_shared_experts": INT, "first_k_dense_replace": INT, "moe_layer_freq": INT, "n_group": INT, "topk_group": INT,
    "kv_lora_rank": INT, "q_lora_rank": INT, "qk_rope_head_dim": INT, "qk_nope_head_dim": INT, "v_head_dim": INT,
    "rms_norm_eps": NUMBER, "rope_theta": NUMBER, "swiglu_alpha": NUMBER, "swiglu_limit": NUMBER, "clip_qkv": NUMBER,
    "partial_rotary_factor": NUMBER, "routed_scaling_factor": NUMBER,
    "tie_word_embeddings": BOOL, "attention_bias": BOOL, "norm_topk_prob": BOOL, "use_sliding_window": BOOL,
    "rope_scaling": OBJECT, "rope_parameters": OBJECT, "quantization_config": OBJECT,
    "layer_types": TEXT_LIST, "mlp_only_layers": INT_LIST, "scoring_func": TEXT, "topk_method": TEXT,
}
ROPE_TYPES: dict[str, str] = {
    "rope_type": TEXT, "type": TEXT, "rope_theta": NUMBER, "factor": NUMBER, "beta_fast": NUMBER, "beta_slow": NUMBER,
    "original_max_position_embeddings": INT, "attention_factor": NUMBER, "mscale": NUMBER, "mscale_all_dim": NUMBER,
    "truncate": BOOL, "partial_rotary_factor": NUMBER,
}
QUANTIZATION_TYPES: dict[str, str] = {"quant_method": TEXT}
# Numbers that only mean something above zero (a theta of 0 rotates nothing; an eps of -1 divides by a negative
# mean square); the loader read 0 as "not given" for some of them, silently replacing it by a default.
POSITIVE = frozenset({"rms_norm_eps", "rope_theta", "factor", "original_max_position_embeddings"})

# Ceilings on sizes: every released MoE model sits orders of magnitude below (DeepSeek-V3: 61 layers,
# 256 experts, hidden 7168, vocab 129280; context windows up to a few million tokens).
SIZE_LIMITS: dict[str, int] = {
    "num_hidden_layers": 4096, "hidden_size": 1 << 18, "intermediate_size": 1 << 20, "moe_intermediate_size": 1 << 20,
    "num_experts": 1 << 16, "num_local_experts": 1 << 16, "n_routed_experts": 1 << 16, "moe_num_experts": 1 << 16,
    "num_experts_per_tok": 1 << 16, "experts_per_token": 1 << 16, "num_attention_heads": 1 << 14,
    "num_key_value_heads": 1 << 14, "head_dim": 1 << 14, "vocab_size": 1 << 24, "max_position_embeddings": 1 << 31,
    "sliding_window": 1 << 31, "original_max_position_embeddings": 1 << 31,
}
DEFAULT_SIZE_LIMIT = 1 << 40


def _has_type(value, expected: str) -> bool:
    if expected == INT:
        return isinstance(value, int) and not isinstance(value, bool)
    if expected == NUMBER:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if expected == BOOL:
        return isinstance(value, bool)
    if expected == TEXT:
        return isinstance(value, str)
    if expected == OBJECT:
        return isinstance(value, dict)
    if expected == TEXT_LIST:
        return isinstance(value, list) and all(isinstance(item, str) for item in value)
    if expected == INT_LIST:
        return isinstance(value, list) and all(_has_type(item, INT) for item in value)
    raise AssertionError(expected)


def _check_table(values: dict, types: dict[str, str], path: Path, prefix: str = "") -> None:
    for key, expected in types.items():
        value = values.get(key)
        if value is None:
            continue
        if not _has_type(value, expected):
            raise UserError(f"{printable(str(path))}: {prefix}{key!r} is {printable(repr(value), 60)}, expected "
                            f"{expected}: fix config.json")
        if key in POSITIVE and not value > 0:
            raise UserError(f"{printable(str(path))}: {prefix}{key!r} is {printable(repr(value), 60)}, and it must be "
                            f"above 0: fix config.json")
        if expected == INT:
            limit = SIZE_LIMITS.get(key, DEFAULT_SIZE_LIMIT) if not prefix else DEFAULT_SIZE_LIMIT
            if not -limit <= value <= limit:
                raise UserError(f"{printable(str(path))}: {prefix}{key!r} is {value}, more than {limit} (far beyond any "
                                f"released model): config.json is corrupt or not this model's")


def check_config_values(values: dict, path: Path) -> None:
    """Every known field of config.json (and of its rope and quantization objects) has its type and
    a size within its ceiling; UserError naming the key otherwise."""
    _check_table(values, FIELD_TYPES, path)
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(values.get(key), dict) and not any(isinstance(item, dict) for item in values[key].values()):
            _check_table(values[key], ROPE_TYPES, path, f"{key}.")
    if isinstance(values.get("quantization_config"), dict):
        _check_table(values["quantization_config"], QUANTIZATION_TYPES, path, "quantization_config.")
    both = [values.get(key) for key in ("rope_parameters", "rope_scaling")]
    if all(isinstance(table, dict) and table for table in both) and _rope_kind(both[0]) != _rope_kind(both[1]):
        raise UserError(f"{printable(str(path))}: rope_parameters says rope_type {_rope_kind(both[0])!r} and "
                        f"rope_scaling says {_rope_kind(both[1])!r}; readers differ on which wins: keep one of them")


def _rope_kind(table: dict) -> str:
    return str(table.get("rope_type") or table.get("type") or "default")


_LAYER = re.compile(r"^model\.layers\.(\d{1,9})\.")
_EXPERT = re.compile(r"^model\.layers\.\d{1,9}\..*\.experts\.(\d{1,9})\.")


def held_counts(names) -> tuple[int, int]:
    """(layers, per-expert tensors' experts) whose tensors `names` holds: one past the largest index
    (0 when there are none)."""
    layers = experts = 0
    for name in names:
        match = _LAYER.match(name)
        if match:
            layers = max(layers, int(match.group(1)) + 1)
            expert = _EXPERT.match(name)
            if expert:
                experts = max(experts, int(expert.group(1)) + 1)
    return layers, experts


def check_counts(n_layers: int, n_experts: int, path: Path, names) -> None:
    """config.json's layer and expert counts against the tensors the checkpoint holds, before any
    loop of those lengths: a count the checkpoint does not hold is one line naming both. Experts are
    compared only where the checkpoint stores them one tensor each (not gpt-oss's fused tensors)."""
    layers, experts = held_counts(names)
    if layers and n_layers > layers:
        raise UserError(f"{printable(str(path))}: num_hidden_layers is {n_layers}, and the checkpoint holds "
                        f"tensors of {layers} layers (0..{layers - 1}): the weights do not match config.json")
    if experts and n_experts > experts:
        raise UserError(f"{printable(str(path))}: the expert count is {n_experts}, and the checkpoint holds "
                        f"per-expert tensors of {experts} experts (0..{experts - 1}): the weights do not match "
                        f"config.json")
