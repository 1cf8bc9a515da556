"""Hugging Face-format MoE checkpoints: a directory with `config.json`, `*.safetensors` (one file, or
shards named by `model.safetensors.index.json`) and `tokenizer.json` becomes a `ModelConfig`, the
engine's weights and a tokenizer.

Families, by the `architectures` entry of config.json:
    GptOssForCausalLM    sinks; alternating sliding-window / full layers (`layer_types`); q/k/v/o
                         biases; a router bias; experts with interleaved gate/up columns, biases and
                         the clamped SwiGLU (alpha, limit); YaRN RoPE. Experts in float, or MXFP4
                         (`*_blocks` + `*_scales`), dequantized here.
    Qwen3MoeForCausalLM  q/k RMSNorm per head; softmax-then-top-k routing (`norm_topk_prob`)
    MixtralForCausalLM   top-k-then-softmax routing; an optional sliding window
    OlmoeForCausalLM     q/k RMSNorm over the full projection; optional clip_qkv; softmax-then-top-k
    Qwen2MoeForCausalLM  q/k/v biases; softmax-then-top-k; a shared expert scaled by a sigmoid gate; dense
                         layers from mlp_only_layers / decoder_sparse_step
    DeepseekV3ForCausalLM  multi-head latent attention (engine.mla); the sigmoid router with its correction
                         bias and group-limited top-k (n_group, topk_group: top-2-sum group scores),
                         norm_topk_prob, routed_scaling_factor; shared experts; dense layers before
                         first_k_dense_replace (and off moe_layer_freq); YaRN with the mscale softmax scale
    DeepseekV2ForCausalLM  the same attention and experts; softmax routing, topk_method greedy or
                         group_limited_greedy (max group scores); q_lora_rank null (V2-Lite) takes one q
                         projection

The engine's layout (engine.model.tensor_shapes) from the checkpoint's names (L layer, e expert;
`model.layers.L.` written `L.`):
    embed, norm, lm_head      model.embed_tokens.weight, model.norm.weight, lm_head.weight (embed when tied)
    attn_norm, moe_norm       L.input_layernorm.weight, L.post_attention_layernorm.weight
    wq wk wv wo (bq bk bv bo) L.self_attn.{q,k,v,o}_proj.weight (.bias)
    q_norm k_norm, sinks      L.self_attn.{q,k}_norm.weight, L.self_attn.sinks
    router (router_bias)      L.mlp.router.weight (.bias) | L.mlp.gate.weight | L.block_sparse_moe.gate.weight
    w13[e] = [gate_e; up_e]   L.mlp.experts.e.{gate,up}_proj.weight | Mixtral ...experts.e.{w1,w3}.weight |
                              gpt-oss L.mlp.experts.gate_up_proj[e].T, gate = even columns, up = odd
    w2[e]                     L.mlp.experts.e.down_proj.weight | Mixtral ...experts.e.w2.weight |
                              gpt-oss L.mlp.experts.down_proj[e].T
    b13, b2                   gpt-oss gate_up_proj_bias (de-interleaved), down_proj_bias
    bq bk bv (Qwen2-MoE)      L.self_attn.{q,k,v}_proj.bias (o has none)
    wq | wq_a q_a_norm wq_b   DeepSeek L.self_attn.q_proj.weight | L.self_attn.{q_a_proj, q_a_layernorm, q_b_proj}.weight
    wkv_a kv_a_norm wkv_b wo  L.self_attn.{kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}.weight
    router_correction         L.mlp.gate.e_score_correction_bias (DeepSeek-V3; kept in float32, as the router)
    shared_gate_up = [gate; up], shared_down   L.mlp.shared_experts.{gate,up,down}_proj.weight (DeepSeek) |
                              L.mlp.shared_expert.{gate,up,down}_proj.weight (Qwen2-MoE)
    shared_gate               L.mlp.shared_expert_gate.weight (Qwen2-MoE)
    mlp_gate_up = [gate; up], mlp_down   a dense layer's L.mlp.{gate,up,down}_proj.weight
DeepSeek-V3 checkpoints may hold num_nextn_predict_layers multi-token-prediction modules after the last
layer (model.layers.N...): speculative decoding, which this engine does not run; they are not read.
Every tensor's presence and shape is checked before the first is read, so a bad checkpoint loads nothing.

Reading is lazy (engine.checkpoint): one tensor, or one expert, at a time, copied to its destination
at once, with a progress bar on stderr. Anything this module does not map is an error that names
it: another architecture (a dense model), a feature these families do not have here (the config key
and its value), a tensor of the wrong shape, a tensor nothing uses. Never a model that computes
something else. Knows nothing of dispatch or generation.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch

from engine import trellis_checkpoint
from engine.checkpoint import Checkpoint, nonfinite_allowed, require_inside, require_regular_file
from engine.config import LatentAttention, LayerMask, ModelConfig, SharedExperts, YarnScaling
from engine.hf_config_checks import check_config_values, check_counts
from engine.json_input import parse_json
from engine.printable import printable
from engine.errors import UserError
from engine.hf_tokenizer import HFTokenizer
from engine.model import tensor_dtype, tensor_shapes
from engine.progress import Progress
from engine.tokenizer import ByteTokenizer

ARCHITECTURES = {
    "GptOssForCausalLM": "gpt-oss",
    "Qwen3MoeForCausalLM": "qwen3-moe",
    "MixtralForCausalLM": "mixtral",
    "OlmoeForCausalLM": "olmoe",
    "Qwen2MoeForCausalLM": "qwen2-moe",
    "DeepseekV3ForCausalLM": "deepseek-v3",
    "DeepseekV2ForCausalLM": "deepseek-v2",
}
MODEL_TYPES = {"gpt_oss": "GptOssForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
               "olmoe": "OlmoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
               "deepseek_v2": "DeepseekV2ForCausalLM"}  # for a config.json without `architectures`
LATENT_FAMILIES = ("deepseek-v3", "deepseek-v2")  # the families with multi-head latent attention
# Tensors a checkpoint may hold that the forward does not need (recomputed from config.json).
_IGNORABLE_SUFFIXES = (".rotary_emb.inv_freq",)

# e2m1 (FP4) code -> value: sign bit 3, exponent bits 2..1, mantissa bit 0 (OCP MX spec v1.0, table 5).
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCK = 32  # values per e8m0 scale
E8M0_BIAS, E8M0_NAN = 127, 255


@dataclass
class LoadedCheckpoint:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: HFTokenizer
    family: str


def load_checkpoint(directory: str | Path, device: torch.device, dtype: torch.dtype,
                    stream: TextIO | None = None, tokenizer=None) -> LoadedCheckpoint:
    """Config, weights (on `device` in `dtype`) and tokenizer of a Hugging Face checkpoint directory
    (`tokenizer`: the caller's, instead of the directory's tokenizer.json)."""
    directory = Path(directory)
    if trellis_checkpoint.is_trellis_directory(directory):  # experts in trellis codes, written by `quantize`
        config, family, weights = trellis_checkpoint.load_directory(directory, device, dtype, stream)
        if tokenizer is None:
            tokenizer = ByteTokenizer() if trellis_checkpoint.byte_tokenizer(directory) else \
                HFTokenizer(directory / "tokenizer.json")
        return LoadedCheckpoint(config, weights, tokenizer, family)
    config, family = read_config(directory)  # every size within its ceiling (engine.hf_config_checks)
    if tokenizer is None:
        tokenizer = HFTokenizer(directory / "tokenizer.json")
    if tokenizer.vocab_size > config.vocab_size:
        raise UserError(f"{directory / 'tokenizer.json'}: {tokenizer.vocab_size} tokens but config.json has "
                        f"vocab_size {config.vocab_size}: the tokenizer is not this model's")
    weights = load_weights(directory, config, family, device, dtype, stream)
    return LoadedCheckpoint(config, weights, tokenizer, family)


def load_weights(directory: str | Path, config: ModelConfig, family: str, device: torch.device, dtype: torch.dtype,
                 stream: TextIO | None = None) -> dict[str, torch.Tensor]:
    """The engine's weights of the checkpoint in `directory` (its `read_config`), without the tokenizer:
    for callers that feed token ids (bench/family_numerics.py, where `tokenizers` may be absent)."""
    directory = Path(directory)
    checkpoint = Checkpoint.open(directory)  # the headers only: bounded by the files' sizes
    try:
        # config.json's counts against the headers, before a loop or an allocation of their size
        check_counts(config.n_layers, config.n_experts, directory / "config.json", checkpoint.names())
        checkpoint.allow_nonfinite = nonfinite_allowed()
        return _load_weights(config, family, checkpoint, device, dtype, stream, _unread_layers(directory, family))
    finally:
        checkpoint.close()


def load_some(directory: str | Path, names: list[str], device: torch.device, dtype: torch.dtype
              ) -> dict[str, torch.Tensor]:
    """The engine tensors `names` (e.g. `layers.3.w13`) of the checkpoint in `directory`, as `load_weights` gives
    them, reading only the checkpoint tensors they come from. Why: check-quant needs one layer's experts of a
    source model that may not fit beside its quantized copy (a 30B model is 61 GB in bf16)."""
    directory = Path(directory)
    config, family = read_config(directory)
    checkpoint = Checkpoint.open(directory)
    try:
        checkpoint.allow_nonfinite = nonfinite_allowed()
        sources, shapes = weight_sources(config, family, checkpoint), tensor_shapes(config)
        unknown = [name for name in names if name not in sources]
        if unknown:
            raise UserError(f"{directory}: the {family} model has no tensor {unknown[0]}")
        _expect_sources(checkpoint, {name: sources[name] for name in names}, shapes)  # before a byte is read
        return {name: _read(config, checkpoint, name, sources[name], shapes[name], device, dtype)[0]
                for name in names}
    finally:
        checkpoint.close()


# ------------------------------------------------------------------------------------------------
# config.json -> ModelConfig
# ------------------------------------------------------------------------------------------------

class _Fields:
    """config.json's values, with errors that name the file and the key."""

    def __init__(self, values: dict, path: Path) -> None:
        self.values, self.path = values, path

    def get(self, key: str, default=None):
        value = self.values.get(key)
        return default if value is None else value

    def integer(self, key: str, default: int | None = None, *aliases: str) -> int:
        for name in (key, *aliases):
            value = self.values.get(name)
            if value is not None:
                break
        else:
            if default is None:
                raise UserError(f"{self.path}: no {key!r}: config.json must give it for this architecture")
            value = default
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise UserError(f"{self.path}: {key!r} is {value!r}, expected a non-negative integer")
        return value

    def fail(self, problem: str, fix: str) -> UserError:
        return UserError(f"{self.path}: {problem}: {fix}")


def read_config(directory: Path) -> tuple[ModelConfig, str]:
    """The engine's config and the family name of config.json in `directory`."""
    values, path = read_config_values(directory)
    if trellis_checkpoint.is_trellis_config(values):
        config, family, _ = trellis_checkpoint.read_config(values, path)
        return config, family
    fields = _Fields(values, path)
    family = _family(fields)
    name = f"{family}:{directory.resolve().name}"
    try:
        config = _FAMILY_CONFIGS[family](fields, name)
    except ValueError as error:  # ModelConfig's own validation, in config.json's words (the model's name kept)
        message = str(error)
        named = message.startswith(f"{name}: ")
        problem = _in_config_keys(message[len(name) + 2:] if named else message)
        raise UserError(f"{path}: {name + ': ' if named else ''}{problem}") from None
    return config, family


# ModelConfig's field names as config.json spells them, for its validation errors (the families share these keys;
# the experts' count and width have one per family).
_CONFIG_KEYS = {"n_layers": "num_hidden_layers", "hidden": "hidden_size", "n_heads": "num_attention_heads",
                "n_kv_heads": "num_key_value_heads", "vocab_size": "vocab_size",
                "max_seq_len": "max_position_embeddings", "top_k": "num_experts_per_tok",
                "n_experts": "the experts' count (num_experts, num_local_experts or n_routed_experts)",
                "intermediate": "the experts' width (moe_intermediate_size or intermediate_size)"}


def _in_config_keys(message: str) -> str:
    import re

    return re.sub(r"\b(" + "|".join(_CONFIG_KEYS) + r")\b", lambda match: _CONFIG_KEYS[match.group(1)], message)


MAX_CONFIG_BYTES = 16 * 1024 * 1024  # a config.json is a few KB


def read_config_values(directory: Path) -> tuple[dict, Path]:
    """config.json as a dict whose known fields have their types and sizes (engine.hf_config_checks)."""
    path = directory / "config.json"
    if not os.path.lexists(path):
        raise UserError(f"{path}: missing: a checkpoint directory needs config.json beside its *.safetensors "
                        f"(a model is a preset name or a Hugging Face-format directory)")
    require_regular_file(path)
    require_inside(directory, path, "config.json")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise UserError(f"{path}: more than {MAX_CONFIG_BYTES} bytes, not a config.json; download it again")
    values = parse_json(path.read_bytes(), str(path), "config.json", "download it again")
    if not isinstance(values, dict):
        raise UserError(f"{path}: expected a JSON object, got {type(values).__name__}")
    check_config_values(values, path)
    return values, path


def _family(fields: _Fields) -> str:
    architectures = fields.get("architectures") or []
    model_type = fields.get("model_type", "<no architectures, no model_type>")
    architecture = architectures[0] if architectures else MODEL_TYPES.get(model_type, model_type)
    supported = ", ".join(ARCHITECTURES)
    latent = ARCHITECTURES.get(architecture) in LATENT_FAMILIES
    if (fields.get("kv_lora_rank") or fields.get("q_lora_rank")) and not latent:
        raise fields.fail(f"architecture {architecture} declares multi-head latent attention (kv_lora_rank="
                          f"{fields.get('kv_lora_rank')}), which this engine computes only for "
                          f"DeepseekV3ForCausalLM and DeepseekV2ForCausalLM", f"supported architectures are {supported}")
    if architecture not in ARCHITECTURES:
        experts = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
        if not any(fields.get(key) for key in experts):
            raise fields.fail(f"architecture {architecture} is a dense model (no experts in config.json)",
                              f"this inspector runs Mixture-of-Experts models: {supported}")
        raise fields.fail(f"architecture {architecture} is not supported", f"supported architectures are {supported}")
    return ARCHITECTURES[architecture]


def _common(fields: _Fields, name: str, experts_key: str, intermediate_key: str, quantized: bool = False,
            shared: bool = False) -> dict:
    """The fields every family shares, checked for features none of them has here. `quantized`: the
    family reads its own quantization_config (gpt-oss MXFP4); for the others any is an error. `shared`:
    the family reads its own shared experts (Qwen2-MoE, DeepSeek); for the others they are an error."""
    hidden, heads = fields.integer("hidden_size"), fields.integer("num_attention_heads")
    n_experts = fields.integer(experts_key, None, "num_local_experts", "num_experts")  # absent: named, not "dense"
    if n_experts == 0:
        raise fields.fail(f"{experts_key} is 0: a dense model", "this inspector runs Mixture-of-Experts models")
    if not shared and (fields.get("shared_expert_intermediate_size") or fields.get("n_shared_experts")):
        raise fields.fail("shared experts are not supported for this architecture",
                          "use a model without shared experts, or a Qwen2-MoE or DeepSeek checkpoint")
    quantization = fields.get("quantization_config")
    if quantization is not None and not quantized:
        raise fields.fail(f"a quantized checkpoint (quant_method={quantization.get('quant_method')!r}) is not "
                          f"supported", "give a bf16, fp16 or fp32 checkpoint")
    if fields.get("partial_rotary_factor", 1.0) != 1.0:
        raise fields.fail(f"partial_rotary_factor {fields.get('partial_rotary_factor')} is not supported",
                          "only full-width RoPE is")
    return dict(
        name=name, n_layers=fields.integer("num_hidden_layers"), hidden=hidden,
        intermediate=fields.integer(intermediate_key), n_experts=n_experts,
        top_k=fields.integer("num_experts_per_tok", None, "experts_per_token"),
        n_heads=heads, n_kv_heads=fields.integer("num_key_value_heads", heads),
        head_dim=fields.integer("head_dim", hidden // heads if heads else 0),
        vocab_size=fields.integer("vocab_size"), max_seq_len=fields.integer("max_position_embeddings"),
        norm_eps=float(fields.get("rms_norm_eps", 1e-5)), tie_embeddings=bool(fields.get("tie_word_embeddings", False)),
    )


def _require_silu(fields: _Fields) -> None:
    if fields.get("hidden_act", "silu") != "silu":
        raise fields.fail(f"hidden_act {fields.get('hidden_act')!r} is not supported",
                          "the experts compute SwiGLU (silu)")


def _rope(fields: _Fields, default_theta: float,
          default_parameters: dict | None = None) -> tuple[float, YarnScaling | None]:
    """rope_theta and YaRN scaling, from `rope_parameters` (transformers 5) or `rope_scaling` + `rope_theta`."""
    parameters = fields.get("rope_parameters") or fields.get("rope_scaling") or default_parameters or {}
    if any(isinstance(value, dict) for value in parameters.values()):
        raise fields.fail("per-layer-type RoPE parameters are not supported", "give one rope_parameters dict")
    theta = float(parameters.get("rope_theta") or fields.get("rope_theta", default_theta))
    kind = parameters.get("rope_type") or parameters.get("type") or "default"
    if parameters.get("partial_rotary_factor", 1.0) != 1.0:
        raise fields.fail(f"partial_rotary_factor {parameters['partial_rotary_factor']} is not supported",
                          "only full-width RoPE is")
    if kind == "default":
        return theta, None
    if kind != "yarn":
        raise fields.fail(f"rope_type {kind!r} is not supported", "default and yarn RoPE are")
    max_positions = fields.integer("max_position_embeddings")
    original = int(parameters.get("original_max_position_embeddings") or fields.get("original_max_position_embeddings")
                   or max_positions)
    factor = float(parameters.get("factor") or max_positions / original)
    attention_factor = parameters.get("attention_factor")
    mscale, mscale_all_dim = parameters.get("mscale"), parameters.get("mscale_all_dim")
    if attention_factor is None and mscale and mscale_all_dim:  # as transformers' _compute_yarn_parameters
        def get_mscale(scale: float, m: float) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
        attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
    try:
        return theta, YarnScaling(factor=factor, original_max_position=original,
                                  beta_fast=float(parameters.get("beta_fast") or 32.0),
                                  beta_slow=float(parameters.get("beta_slow") or 1.0),
                                  truncate=bool(parameters.get("truncate", True)),
                                  attention_factor=None if attention_factor is None else float(attention_factor))
    except ValueError as error:
        raise fields.fail(f"rope parameters {parameters}: {error}", "fix rope_parameters") from None


def _uniform_masks(fields: _Fields, n_layers: int, window: int | None) -> tuple[LayerMask, ...]:
    if window is None:
        return tuple(LayerMask("causal") for _ in range(n_layers))
    if not isinstance(window, int) or window < 1:
        raise fields.fail(f"sliding_window {window!r} is not a positive integer", "fix config.json")
    return tuple(LayerMask("window", window) for _ in range(n_layers))


def _gpt_oss_config(fields: _Fields, name: str) -> ModelConfig:
    common = _common(fields, name, "num_local_experts", "intermediate_size", quantized=True)
    quantization = fields.get("quantization_config")
    if quantization is not None and quantization.get("quant_method") != "mxfp4":
        raise fields.fail(f"quant_method {quantization.get('quant_method')!r} is not supported",
                          "gpt-oss checkpoints load in float or MXFP4")
    n_layers, window = common["n_layers"], fields.integer("sliding_window", 128)
    layer_types = fields.get("layer_types") or ["sliding_attention" if layer % 2 == 0 else "full_attention"
                                                for layer in range(n_layers)]
    if len(layer_types) != n_layers:
        raise fields.fail(f"{len(layer_types)} layer_types for {n_layers} layers", "give one per layer")
    masks = []
    for layer, kind in enumerate(layer_types):
        if kind not in ("sliding_attention", "full_attention"):
            raise fields.fail(f"layer_types[{layer}] {kind!r} is not supported",
                              "gpt-oss layers are sliding_attention or full_attention")
        masks.append(LayerMask("window", window) if kind == "sliding_attention" else LayerMask("causal"))
    # transformers' GptOssConfig default, used when config.json gives no rope parameters
    default_yarn = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                    "original_max_position_embeddings": 4096}
    theta, yarn = _rope(fields, 150000.0, default_yarn)
    return ModelConfig(
        **common, layer_masks=tuple(masks), rope_theta=theta, rope_scaling=yarn, sinks=True,
        attention_bias=bool(fields.get("attention_bias", True)), router="topk_softmax", router_bias=True,
        norm_rounds_once=True,
        expert_activation="gpt_oss_clamped", expert_bias=True,
        activation_alpha=float(fields.get("swiglu_alpha", 1.702)),
        activation_limit=float(fields.get("swiglu_limit", 7.0)),
    )


def _qwen3_moe_config(fields: _Fields, name: str) -> ModelConfig:
    _require_silu(fields)
    common = _common(fields, name, "num_experts", "moe_intermediate_size")
    if fields.get("mlp_only_layers") or fields.get("decoder_sparse_step", 1) != 1:
        raise fields.fail(f"dense MLP layers (mlp_only_layers={fields.get('mlp_only_layers')}, decoder_sparse_step="
                          f"{fields.get('decoder_sparse_step')}) are not supported", "every layer must be MoE")
    window = fields.get("sliding_window") if fields.get("use_sliding_window", False) else None
    theta, yarn = _rope(fields, 10000.0)
    return ModelConfig(
        **common, layer_masks=_uniform_masks(fields, common["n_layers"], window), rope_theta=theta,
        rope_scaling=yarn, sinks=False, attention_bias=bool(fields.get("attention_bias", False)),
        qk_norm="per_head", router="softmax_topk", norm_topk_prob=bool(fields.get("norm_topk_prob", False)),
    )


def _mixtral_config(fields: _Fields, name: str) -> ModelConfig:
    _require_silu(fields)
    common = _common(fields, name, "num_local_experts", "intermediate_size")
    theta, yarn = _rope(fields, 1e6)
    return ModelConfig(
        **common, layer_masks=_uniform_masks(fields, common["n_layers"], fields.get("sliding_window")),
        rope_theta=theta, rope_scaling=yarn, sinks=False, router="topk_softmax",
    )


def _olmoe_config(fields: _Fields, name: str) -> ModelConfig:
    _require_silu(fields)
    common = _common(fields, name, "num_experts", "intermediate_size")
    theta, yarn = _rope(fields, 10000.0)
    clip = fields.get("clip_qkv")
    return ModelConfig(
        **common, layer_masks=_uniform_masks(fields, common["n_layers"], None), rope_theta=theta,
        rope_scaling=yarn, sinks=False, attention_bias=bool(fields.get("attention_bias", False)), qk_norm="full",
        clip_qkv=None if clip is None else float(clip), router="softmax_topk",
        norm_topk_prob=bool(fields.get("norm_topk_prob", False)),
    )


def _qwen2_moe_config(fields: _Fields, name: str) -> ModelConfig:
    _require_silu(fields)
    common = _common(fields, name, "num_experts", "moe_intermediate_size", shared=True)
    n_layers = common["n_layers"]
    shared = fields.integer("shared_expert_intermediate_size", 5632)  # transformers' Qwen2MoeConfig default
    if shared == 0:
        raise fields.fail("shared_expert_intermediate_size is 0: Qwen2-MoE always runs its shared expert",
                          "give its width")
    only = fields.get("mlp_only_layers") or []
    step = fields.integer("decoder_sparse_step", 1)
    if not isinstance(only, list) or any(isinstance(layer, bool) or not isinstance(layer, int) for layer in only) \
            or step < 1:
        raise fields.fail(f"mlp_only_layers {only!r} / decoder_sparse_step {step!r} are not a list of layers and an "
                          f"integer >= 1", "fix config.json")
    # as transformers' Qwen2MoeDecoderLayer: a layer is MoE unless listed in mlp_only_layers or off the sparse step
    dense = tuple(layer for layer in range(n_layers) if layer in only or (layer + 1) % step)
    masks = _uniform_masks(fields, n_layers, None)
    if fields.get("use_sliding_window", False):
        window = fields.integer("sliding_window")
        types = fields.get("layer_types") or [
            "sliding_attention" if (layer + 1) % 2 and layer < fields.integer("max_window_layers", 28)
            else "full_attention" for layer in range(n_layers)]  # transformers' default layer_types
        if len(types) != n_layers or any(kind not in ("sliding_attention", "full_attention") for kind in types):
            raise fields.fail(f"layer_types {types!r} is not one sliding_attention or full_attention per layer",
                              "fix config.json")
        masks = tuple(LayerMask("window", window) if kind == "sliding_attention" else LayerMask("causal")
                      for kind in types)
    theta, yarn = _rope(fields, 10000.0)
    return ModelConfig(
        **common, layer_masks=masks, rope_theta=theta, rope_scaling=yarn, sinks=False,
        qkv_bias=bool(fields.get("qkv_bias", True)), router="softmax_topk",
        norm_topk_prob=bool(fields.get("norm_topk_prob", False)),
        shared_experts=SharedExperts(1, shared, gated=True),
        dense_layers=dense, dense_intermediate=fields.integer("intermediate_size") if dense else 0,
    )


# transformers' DeepseekV3Config / DeepseekV2Config defaults, used where config.json leaves a key out
_DEEPSEEK_DEFAULTS = {
    "deepseek-v3": dict(n_group=8, topk_group=4, first_k_dense_replace=3, routed_scaling_factor=2.5,
                        norm_topk_prob=True, n_shared_experts=1, q_lora_rank=1536),
    "deepseek-v2": dict(n_group=None, topk_group=None, first_k_dense_replace=0, routed_scaling_factor=1.0,
                        norm_topk_prob=False, n_shared_experts=2, q_lora_rank=1536),
}


def _deepseek_router(fields: _Fields, family: str) -> dict:
    """The router's fields: V3's sigmoid group-limited top-k, V2's greedy or group-limited softmax top-k.
    Keys whose value selects something not computed here are errors naming key and value."""
    defaults = _DEEPSEEK_DEFAULTS[family]
    method, scoring = fields.get("topk_method"), fields.get("scoring_func")
    scale = fields.get("routed_scaling_factor", defaults["routed_scaling_factor"])
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0:
        raise fields.fail(f"routed_scaling_factor {scale!r} is not a number > 0", "fix config.json")
    norm = fields.get("norm_topk_prob", defaults["norm_topk_prob"])
    groups = {key: fields.get(key, defaults[key]) for key in ("n_group", "topk_group")}
    if family == "deepseek-v3":
        if method not in (None, "noaux_tc"):
            raise fields.fail(f"topk_method {method!r} is not implemented for DeepseekV3ForCausalLM",
                              "DeepSeek-V3 routes with noaux_tc (sigmoid scores, correction bias, group-limited top-k)")
        if scoring not in (None, "sigmoid"):
            raise fields.fail(f"scoring_func {scoring!r} is not implemented for DeepseekV3ForCausalLM",
                              "DeepSeek-V3 scores experts with sigmoid")
        kind = "sigmoid_group_topk"
    else:
        method = method or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise fields.fail(f"topk_method {method!r} is not implemented for DeepseekV2ForCausalLM",
                              "DeepSeek-V2 routes with greedy or group_limited_greedy")
        if scoring not in (None, "softmax"):
            raise fields.fail(f"scoring_func {scoring!r} is not implemented for DeepseekV2ForCausalLM",
                              "DeepSeek-V2 scores experts with softmax")
        if norm:
            raise fields.fail("norm_topk_prob true is not implemented for DeepseekV2ForCausalLM (transformers "
                              "ignores it, DeepSeek's own code renormalises instead of scaling)",
                              "DeepSeek-V2 checkpoints set it false")
        if method == "greedy":
            return dict(router="softmax_topk", norm_topk_prob=False, routed_scaling_factor=float(scale))
        kind = "softmax_group_topk"
    for key, value in groups.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise fields.fail(f"{key} {value!r} is not an integer >= 1", f"{kind} routing needs n_group and topk_group")
    return dict(router=kind, norm_topk_prob=bool(norm), routed_scaling_factor=float(scale), **groups)


def _latent_attention(fields: _Fields, family: str, heads: int) -> LatentAttention:
    q_lora_rank = fields.values.get("q_lora_rank", _DEEPSEEK_DEFAULTS[family]["q_lora_rank"])
    if q_lora_rank is not None:
        q_lora_rank = fields.integer("q_lora_rank")
        if q_lora_rank == 0:
            raise fields.fail("q_lora_rank is 0", "give null for one q projection, or the rank")
    if fields.get("attention_bias", False):
        raise fields.fail("attention_bias true is not implemented with multi-head latent attention",
                          "DeepSeek checkpoints have no attention biases")
    if fields.integer("num_key_value_heads", heads) != heads:
        raise fields.fail(f"num_key_value_heads {fields.get('num_key_value_heads')} differs from num_attention_heads "
                          f"{heads}: latent attention decompresses one K and V per query head", "fix config.json")
    interleave = fields.get("rope_interleave", True) if family == "deepseek-v3" else True  # V2: complex RoPE pairs
    nope, rope = fields.integer("qk_nope_head_dim", 128), fields.integer("qk_rope_head_dim", 64)
    scale = (nope + rope) ** -0.5
    parameters = fields.get("rope_parameters") or fields.get("rope_scaling") or {}
    kind = parameters.get("rope_type") or parameters.get("type") or "default"
    if kind != "default" and parameters.get("mscale_all_dim"):  # as DeepSeek's yarn_get_mscale, squared
        factor = float(parameters["factor"])
        mscale = 1.0 if factor <= 1 else 0.1 * float(parameters["mscale_all_dim"]) * math.log(factor) + 1.0
        scale *= mscale * mscale
    try:
        return LatentAttention(kv_lora_rank=fields.integer("kv_lora_rank", 512), qk_nope_head_dim=nope,
                               qk_rope_head_dim=rope, v_head_dim=fields.integer("v_head_dim", 128),
                               q_lora_rank=q_lora_rank, rope_interleave=bool(interleave), softmax_scale=scale)
    except ValueError as error:
        raise fields.fail(str(error), "fix config.json") from None


def _deepseek_config(fields: _Fields, name: str, family: str) -> ModelConfig:
    _require_silu(fields)
    if fields.get("mlp_bias", False):
        raise fields.fail("mlp_bias true is not implemented", "DeepSeek checkpoints have no MLP biases")
    common = _common(fields, name, "n_routed_experts", "moe_intermediate_size", shared=True)
    n_layers = common["n_layers"]
    latent = _latent_attention(fields, family, common["n_heads"])
    common.update(head_dim=latent.qk_head_dim, n_kv_heads=common["n_heads"])
    first_dense = fields.integer("first_k_dense_replace", _DEEPSEEK_DEFAULTS[family]["first_k_dense_replace"])
    frequency = fields.integer("moe_layer_freq", 1)
    if frequency < 1:
        raise fields.fail("moe_layer_freq is 0", "give 1 (every layer after the dense ones is MoE)")
    # as DeepSeek's code: layer L is MoE when L >= first_k_dense_replace and L % moe_layer_freq == 0
    dense = tuple(layer for layer in range(n_layers) if layer < first_dense or layer % frequency)
    shared_count = fields.integer("n_shared_experts", _DEEPSEEK_DEFAULTS[family]["n_shared_experts"])
    theta, yarn = _rope(fields, 10000.0)
    return ModelConfig(
        **common, layer_masks=_uniform_masks(fields, n_layers, None), rope_theta=theta, rope_scaling=yarn,
        sinks=False, latent_attention=latent, **_deepseek_router(fields, family),
        shared_experts=SharedExperts(shared_count, shared_count * common["intermediate"]) if shared_count else None,
        dense_layers=dense, dense_intermediate=fields.integer("intermediate_size") if dense else 0,
    )


_FAMILY_CONFIGS = {"gpt-oss": _gpt_oss_config, "qwen3-moe": _qwen3_moe_config, "mixtral": _mixtral_config,
                   "olmoe": _olmoe_config, "qwen2-moe": _qwen2_moe_config,
                   "deepseek-v3": lambda fields, name: _deepseek_config(fields, name, "deepseek-v3"),
                   "deepseek-v2": lambda fields, name: _deepseek_config(fields, name, "deepseek-v2")}


def _unread_layers(directory: Path, family: str) -> int:
    """Layers a checkpoint may hold past num_hidden_layers that the forward does not run: DeepSeek-V3's
    multi-token-prediction modules (num_nextn_predict_layers). 0 for every other family."""
    if family != "deepseek-v3":
        return 0
    values = read_config_values(directory)[0]  # read_config checked it already
    count = values.get("num_nextn_predict_layers") or 0
    return count if isinstance(count, int) and not isinstance(count, bool) and count > 0 else 0


# ------------------------------------------------------------------------------------------------
# Where each engine tensor comes from
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Direct:
    """One checkpoint tensor of the engine tensor's own shape."""

    name: str


@dataclass(frozen=True)
class _PerExpert:
    """One checkpoint tensor per expert and part: engine[e] = cat(part_0[e], part_1[e], ...) along rows."""

    patterns: tuple[str, ...]  # each with {e}


@dataclass(frozen=True)
class _Rows:
    """2-D checkpoint tensors stacked along rows: engine = cat(part_0, part_1, ...) (a dense MLP's
    [gate; up]), each part an equal share of the engine tensor's rows."""

    names: tuple[str, ...]


@dataclass(frozen=True)
class _GptOssFused:
    """gpt-oss float experts, all experts in one tensor, transposed from the engine's layout:
    gate_up_proj [E, D, 2F] (gate = even columns, up = odd) -> w13 [E, 2F, D];
    down_proj [E, F, D] -> w2 [E, D, F]; gate_up_proj_bias [E, 2F] (interleaved) -> b13 [E, 2F]."""

    name: str
    kind: str  # "gate_up", "down" or "gate_up_bias"


@dataclass(frozen=True)
class _Mxfp4:
    """gpt-oss MXFP4 experts: {prefix}_blocks [E, R, C/32, 16] uint8 (two e2m1 codes a byte, low nibble
    first) and {prefix}_scales [E, R, C/32] uint8 (e8m0) -> [E, R, C]; gate_up rows interleave gate
    (even) and up (odd) and are split into w13's gate-then-up rows."""

    prefix: str
    interleaved_rows: bool


def _layer_sources(config: ModelConfig, family: str, checkpoint: Checkpoint, layer: int) -> dict[str, object]:
    hf, p = f"model.layers.{layer}.", f"layers.{layer}."
    attention = hf + "self_attn."
    sources: dict[str, object] = {
        p + "attn_norm": _Direct(hf + "input_layernorm.weight"),
        p + "moe_norm": _Direct(hf + "post_attention_layernorm.weight"),
        p + "wq": _Direct(attention + "q_proj.weight"), p + "wk": _Direct(attention + "k_proj.weight"),
        p + "wv": _Direct(attention + "v_proj.weight"), p + "wo": _Direct(attention + "o_proj.weight"),
    }
    if family in LATENT_FAMILIES:
        return _latent_layer_sources(config, layer)
    if config.attention_bias:
        sources.update({p + "bq": _Direct(attention + "q_proj.bias"), p + "bk": _Direct(attention + "k_proj.bias"),
                        p + "bv": _Direct(attention + "v_proj.bias"), p + "bo": _Direct(attention + "o_proj.bias")})
    elif config.qkv_bias:
        sources.update({p + "bq": _Direct(attention + "q_proj.bias"), p + "bk": _Direct(attention + "k_proj.bias"),
                        p + "bv": _Direct(attention + "v_proj.bias")})
    if config.qk_norm != "none":
        sources.update({p + "q_norm": _Direct(attention + "q_norm.weight"),
                        p + "k_norm": _Direct(attention + "k_norm.weight")})
    if config.sinks:
        sources[p + "sinks"] = _Direct(attention + "sinks")
    if family == "gpt-oss":
        experts = hf + "mlp.experts."
        sources.update({p + "router": _Direct(hf + "mlp.router.weight"),
                        p + "router_bias": _Direct(hf + "mlp.router.bias"),
                        p + "b2": _Direct(experts + "down_proj_bias"),
                        p + "b13": _GptOssFused(experts + "gate_up_proj_bias", "gate_up_bias")})
        if experts + "gate_up_proj_blocks" in checkpoint or experts + "down_proj_blocks" in checkpoint:
            sources.update({p + "w13": _Mxfp4(experts + "gate_up_proj", interleaved_rows=True),
                            p + "w2": _Mxfp4(experts + "down_proj", interleaved_rows=False)})
        else:
            sources.update({p + "w13": _GptOssFused(experts + "gate_up_proj", "gate_up"),
                            p + "w2": _GptOssFused(experts + "down_proj", "down")})
    elif family == "mixtral":
        moe = hf + "block_sparse_moe."
        sources.update({p + "router": _Direct(moe + "gate.weight"),
                        p + "w13": _PerExpert((moe + "experts.{e}.w1.weight", moe + "experts.{e}.w3.weight")),
                        p + "w2": _PerExpert((moe + "experts.{e}.w2.weight",))})
    elif layer in config.dense_layers:  # qwen2-moe
        sources.update(_dense_mlp_sources(hf, p))
    else:  # qwen3-moe, olmoe, qwen2-moe
        sources.update(_expert_sources(hf, p))
        if family == "qwen2-moe":
            shared = hf + "mlp.shared_expert."
            sources.update({p + "shared_gate_up": _Rows((shared + "gate_proj.weight", shared + "up_proj.weight")),
                            p + "shared_down": _Direct(shared + "down_proj.weight"),
                            p + "shared_gate": _Direct(hf + "mlp.shared_expert_gate.weight")})
    return sources


def _expert_sources(hf: str, p: str) -> dict[str, object]:
    moe = hf + "mlp."
    return {p + "router": _Direct(moe + "gate.weight"),
            p + "w13": _PerExpert((moe + "experts.{e}.gate_proj.weight", moe + "experts.{e}.up_proj.weight")),
            p + "w2": _PerExpert((moe + "experts.{e}.down_proj.weight",))}


def _dense_mlp_sources(hf: str, p: str) -> dict[str, object]:
    mlp = hf + "mlp."
    return {p + "mlp_gate_up": _Rows((mlp + "gate_proj.weight", mlp + "up_proj.weight")),
            p + "mlp_down": _Direct(mlp + "down_proj.weight")}


def _latent_layer_sources(config: ModelConfig, layer: int) -> dict[str, object]:
    """A DeepSeek-V2/V3 layer: latent attention, then a dense MLP or the routed + shared experts."""
    hf, p = f"model.layers.{layer}.", f"layers.{layer}."
    attention = hf + "self_attn."
    sources: dict[str, object] = {
        p + "attn_norm": _Direct(hf + "input_layernorm.weight"),
        p + "moe_norm": _Direct(hf + "post_attention_layernorm.weight"),
        p + "wkv_a": _Direct(attention + "kv_a_proj_with_mqa.weight"),
        p + "kv_a_norm": _Direct(attention + "kv_a_layernorm.weight"),
        p + "wkv_b": _Direct(attention + "kv_b_proj.weight"), p + "wo": _Direct(attention + "o_proj.weight"),
    }
    if config.latent_attention.q_lora_rank is None:
        sources[p + "wq"] = _Direct(attention + "q_proj.weight")
    else:
        sources.update({p + "wq_a": _Direct(attention + "q_a_proj.weight"),
                        p + "q_a_norm": _Direct(attention + "q_a_layernorm.weight"),
                        p + "wq_b": _Direct(attention + "q_b_proj.weight")})
    if layer in config.dense_layers:
        sources.update(_dense_mlp_sources(hf, p))
        return sources
    sources.update(_expert_sources(hf, p))
    if config.router == "sigmoid_group_topk":
        sources[p + "router_correction"] = _Direct(hf + "mlp.gate.e_score_correction_bias")
    if config.shared_experts is not None:
        shared = hf + "mlp.shared_experts."
        sources.update({p + "shared_gate_up": _Rows((shared + "gate_proj.weight", shared + "up_proj.weight")),
                        p + "shared_down": _Direct(shared + "down_proj.weight")})
    return sources


def weight_sources(config: ModelConfig, family: str, checkpoint: Checkpoint) -> dict[str, object]:
    """Engine tensor name -> where it comes from, for every tensor `tensor_shapes(config)` lists."""
    sources: dict[str, object] = {"embed": _Direct("model.embed_tokens.weight"), "norm": _Direct("model.norm.weight")}
    if not config.tie_embeddings:
        sources["lm_head"] = _Direct("lm_head.weight")
    for layer in range(config.n_layers):
        sources.update(_layer_sources(config, family, checkpoint, layer))
    missing = set(tensor_shapes(config)) ^ set(sources)
    assert not missing, f"mapping and tensor_shapes disagree on {sorted(missing)}"  # a bug here, not bad input
    return sources


# ------------------------------------------------------------------------------------------------
# Reading
# ------------------------------------------------------------------------------------------------

def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 -> float32. blocks [..., G, 16] uint8, two e2m1 codes a byte (element 2i in the low nibble,
    2i+1 in the high); scales [..., G] uint8, e8m0 (2^(s - 127)) for each block of 32 elements.
    Returns [..., G * 32]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != MXFP4_BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not fit scales {tuple(scales.shape)}")
    table = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    low, high = (blocks & 0x0F).long(), (blocks >> 4).long()  # [..., G, 16]
    values = torch.stack([table[low], table[high]], dim=-1).flatten(-2)  # [..., G, 32]: low, high, low, ...
    exponents = scales.to(torch.int32) - E8M0_BIAS  # [..., G]
    values = torch.ldexp(values, exponents[..., None].to(torch.float32))
    return values.flatten(-2)  # [..., G*32]


def _copy(destination: torch.Tensor, source: torch.Tensor) -> None:
    destination.copy_(source)  # casts dtype and moves device in one step; the CPU piece is then dropped


def _fill(destination: torch.Tensor, engine_name: str, source, checkpoint: Checkpoint) -> list[str]:
    """Read `source` into `destination` (the engine's shape, dtype and device); the checkpoint names used."""
    shape = tuple(destination.shape)
    why = f"engine tensor {engine_name}"
    if isinstance(source, _Direct):
        checkpoint.expect(source.name, shape, why=why)
        _copy(destination, checkpoint.read(source.name))
        return [source.name]
    if isinstance(source, _Rows):
        rows = shape[0] // len(source.names)
        for part, name in enumerate(source.names):
            checkpoint.expect(name, (rows, shape[1]), why=why)
            _copy(destination[part * rows:(part + 1) * rows], checkpoint.read(name))
        return list(source.names)
    if isinstance(source, _PerExpert):
        experts, rows = shape[0], shape[1] // len(source.patterns)
        names = []
        for expert in range(experts):
            for part, pattern in enumerate(source.patterns):
                name = pattern.format(e=expert)
                checkpoint.expect(name, (rows, shape[2]), why=why)
                _copy(destination[expert, part * rows:(part + 1) * rows], checkpoint.read(name))
                names.append(name)
        return names
    if isinstance(source, _GptOssFused):
        experts = shape[0]
        if source.kind == "gate_up_bias":  # [E, 2F], interleaved
            checkpoint.expect(source.name, shape, why=why)
            interleaved = checkpoint.read(source.name)
            half = shape[1] // 2
            _copy(destination[:, :half], interleaved[:, 0::2])
            _copy(destination[:, half:], interleaved[:, 1::2])
            return [source.name]
        stored = (experts, shape[2], shape[1])  # the transpose of the engine's [E, rows, cols]
        checkpoint.expect(source.name, stored, why=why)
        half = shape[1] // 2
        for expert in range(experts):  # one expert at a time: never a second full copy
            piece = checkpoint.read(source.name, expert)  # [cols, rows]
            if source.kind == "gate_up":
                _copy(destination[expert, :half], piece[:, 0::2].t())
                _copy(destination[expert, half:], piece[:, 1::2].t())
            else:
                _copy(destination[expert], piece.t())
        return [source.name]
    if isinstance(source, _Mxfp4):
        experts, rows, columns = shape
        if columns % MXFP4_BLOCK:
            raise UserError(f"{checkpoint.directory}: {source.prefix}_blocks: {columns} columns are not a multiple "
                            f"of the MXFP4 block of {MXFP4_BLOCK}")
        groups = columns // MXFP4_BLOCK
        blocks_name, scales_name = source.prefix + "_blocks", source.prefix + "_scales"
        checkpoint.expect(blocks_name, (experts, rows, groups, MXFP4_BLOCK // 2), ("U8",), why=why)
        checkpoint.expect(scales_name, (experts, rows, groups), ("U8",), why=why)
        for expert in range(experts):
            scales = checkpoint.read(scales_name, expert)  # [R, G]
            if (scales == E8M0_NAN).any():
                raise UserError(f"{checkpoint.entries[scales_name].file}: tensor {scales_name} holds the e8m0 NaN "
                                f"scale 255 (expert {expert}): the checkpoint is corrupt")
            values = dequantize_mxfp4(checkpoint.read(blocks_name, expert), scales)  # [R, C] float32
            if source.interleaved_rows:
                _copy(destination[expert, :rows // 2], values[0::2])
                _copy(destination[expert, rows // 2:], values[1::2])
            else:
                _copy(destination[expert], values)
        return [blocks_name, scales_name]
    raise TypeError(f"unknown weight source {source!r}")


def _expected(source, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...], tuple[str, ...] | None]]:
    """(checkpoint name, shape, dtypes or None for the float ones) of every tensor `_fill` reads for `source`."""
    if isinstance(source, _Direct):
        return [(source.name, shape, None)]
    if isinstance(source, _Rows):
        return [(name, (shape[0] // len(source.names), shape[1]), None) for name in source.names]
    if isinstance(source, _PerExpert):
        rows = shape[1] // len(source.patterns)
        return [(pattern.format(e=expert), (rows, shape[2]), None)
                for expert in range(shape[0]) for pattern in source.patterns]
    if isinstance(source, _GptOssFused):
        return [(source.name, shape if source.kind == "gate_up_bias" else (shape[0], shape[2], shape[1]), None)]
    if isinstance(source, _Mxfp4):
        if shape[2] % MXFP4_BLOCK:
            return []  # `_fill` refuses it, naming the block size
        groups = shape[2] // MXFP4_BLOCK
        return [(source.prefix + "_blocks", (shape[0], shape[1], groups, MXFP4_BLOCK // 2), ("U8",)),
                (source.prefix + "_scales", (shape[0], shape[1], groups), ("U8",))]
    raise TypeError(f"unknown weight source {source!r}")


def _unread(name: str, n_layers: int, unread_layers: int) -> bool:
    """A tensor of the layers past the last that the forward does not run (`_unread_layers`)."""
    if not unread_layers or not name.startswith("model.layers."):
        return False
    layer = name.split(".")[2]
    return layer.isdigit() and n_layers <= int(layer) < n_layers + unread_layers


def _expect_sources(checkpoint: Checkpoint, sources: dict[str, object], shapes: dict[str, tuple[int, ...]]
                    ) -> set[str]:
    """Every checkpoint tensor `sources` read, present with its shape and dtype; their names."""
    used: set[str] = set()
    for engine_name, source in sources.items():
        for name, shape, dtypes in _expected(source, shapes[engine_name]):
            if dtypes is None:
                checkpoint.expect(name, shape, why=f"engine tensor {engine_name}")
            else:
                checkpoint.expect(name, shape, dtypes, why=f"engine tensor {engine_name}")
            used.add(name)
    return used


def _read(config: ModelConfig, checkpoint: Checkpoint, engine_name: str, source, shape: tuple[int, ...],
          device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, list[str]]:
    """One engine tensor on `device` (its kept dtype, `tensor_dtype`) and the checkpoint names it read."""
    destination = torch.empty(shape, dtype=tensor_dtype(config, engine_name, dtype), device=device)
    return destination, _fill(destination, engine_name, source, checkpoint)


def _load_weights(config: ModelConfig, family: str, checkpoint: Checkpoint,
                  device: torch.device, dtype: torch.dtype, stream: TextIO | None,
                  unread_layers: int = 0) -> dict[str, torch.Tensor]:
    sources = weight_sources(config, family, checkpoint)
    shapes = tensor_shapes(config)
    # Every tensor's presence, shape and dtype first, and no tensor left over: a bad checkpoint loads nothing.
    used = _expect_sources(checkpoint, sources, shapes)
    _refuse_unused(config, family, checkpoint, used, unread_layers)
    if config.tie_embeddings and "lm_head.weight" in checkpoint:
        _check_tied_head(checkpoint)
    weights: dict[str, torch.Tensor] = {}
    progress = Progress(len(sources), f"loading {checkpoint.directory.name}",
                        stream=sys.stderr if stream is None else stream)
    try:
        for engine_name, source in sources.items():
            weights[engine_name], read = _read(config, checkpoint, engine_name, source, shapes[engine_name], device,
                                               dtype)
            used.update(read)
            progress.advance(note=engine_name)
    finally:
        progress.close()
    return weights


def _check_tied_head(checkpoint: Checkpoint) -> None:
    """A checkpoint whose config.json ties the output head to the embedding may store lm_head.weight anyway, but
    then it must be the embedding: one that differs is a head config.json says is not there (readers differ on
    which they use), refused before a weight is loaded."""
    head, embed = checkpoint.entries["lm_head.weight"], checkpoint.entries.get("model.embed_tokens.weight")
    if embed is None or head.shape != embed.shape or head.dtype != embed.dtype or not torch.equal(
            checkpoint.read("lm_head.weight"), checkpoint.read("model.embed_tokens.weight")):
        raise UserError(f"{head.file}: tensor lm_head.weight is not the embedding (model.embed_tokens.weight), and "
                        f"config.json sets tie_word_embeddings: the checkpoint and its config disagree; set "
                        f"tie_word_embeddings to false if the head is its own")


def _refuse_unused(config: ModelConfig, family: str, checkpoint: Checkpoint, used: set[str],
                   unread_layers: int) -> None:
    ignorable = {"lm_head.weight"} if config.tie_embeddings else set()  # some tied checkpoints store it anyway
    unused = sorted(name for name in checkpoint.names() - used - ignorable
                    if not name.endswith(_IGNORABLE_SUFFIXES) and not _unread(name, config.n_layers, unread_layers))
    if unused:
        entry = checkpoint.entries[unused[0]]
        raise UserError(f"{entry.file}: tensor {printable(unused[0])}"
                        f"{f' (and {len(unused) - 1} more)' if len(unused) > 1 else ''} is not used by the {family} "
                        f"mapping of config.json: the checkpoint has a feature config.json does not declare, or one "
                        f"this engine does not support; nothing was loaded")
