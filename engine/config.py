"""Model presets: frozen dataclasses resolved by name.

Shape legend: D = hidden, F = expert intermediate, E = routed experts, k = top-k,
Hq / Hkv = query / key-value heads, hd = head dim, W = window, B = summary block.

Knows nothing about weights or devices; `engine.model` builds a model from a config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.errors import UserError


@dataclass(frozen=True)
class LayerMask:
    """The attention mask of one layer: `causal`, `window` or `composite` (see DESIGN.md)."""

    kind: str = "causal"
    window: int = 0
    block: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("causal", "window", "composite"):
            raise ValueError(f"layer mask kind {self.kind!r} is not causal, window or composite")
        if self.kind != "causal" and self.window < 1:
            raise ValueError(f"{self.kind} mask needs window >= 1")
        if self.kind == "composite" and self.block < 1:
            raise ValueError("composite mask needs block >= 1")

    def describe(self) -> str:
        if self.kind == "window":
            return f"window(W={self.window})"
        if self.kind == "composite":
            return f"composite(W={self.window},B={self.block})"
        return "causal"


QK_NORMS = ("none", "per_head", "full")
ROUTERS = ("topk_softmax", "softmax_topk")
EXPERT_ACTIVATIONS = ("swiglu", "gpt_oss_clamped")


@dataclass(frozen=True)
class YarnScaling:
    """YaRN RoPE scaling (gpt-oss): low frequencies interpolated by `factor`, high ones kept, a ramp
    between the dimensions that turn `beta_fast` and `beta_slow` times over `original_max_position`;
    cos and sin are multiplied by `attention_factor` (so the scores by its square)."""

    factor: float
    original_max_position: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True  # round the ramp's ends to whole dimensions
    attention_factor: float | None = None  # None: 0.1 * ln(factor) + 1 (1 when factor <= 1)

    def __post_init__(self) -> None:
        if self.factor <= 0 or self.original_max_position < 1:
            raise ValueError(f"yarn scaling needs factor > 0 and original_max_position >= 1, got {self}")
        if self.beta_fast <= 0 or self.beta_slow <= 0:
            raise ValueError(f"yarn scaling needs beta_fast, beta_slow > 0, got {self}")

    @property
    def resolved_attention_factor(self) -> float:
        if self.attention_factor is not None:
            return self.attention_factor
        return 1.0 if self.factor <= 1 else 0.1 * math.log(self.factor) + 1.0


@dataclass(frozen=True)
class ModelConfig:
    name: str
    n_layers: int
    hidden: int  # D
    intermediate: int  # F, per expert
    n_experts: int  # E
    top_k: int  # k
    n_heads: int  # Hq
    n_kv_heads: int  # Hkv
    head_dim: int  # hd
    vocab_size: int
    max_seq_len: int  # the context
    layer_masks: tuple[LayerMask, ...] = field(default=())
    shared_expert: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    # RMSNorm's rounding: False (presets, Llama-style families) rounds the normalised value to the dtype and
    # multiplies by the weight in it, two roundings; True (gpt-oss) multiplies in float32, one rounding.
    norm_rounds_once: bool = False
    # Architecture features of the Hugging Face families (engine.hf_loader). The defaults are the
    # presets' own architecture, so every preset computes bit-identically with or without them.
    sinks: bool = True  # learned per-head attention sinks (gpt-oss); False: no sink column at all
    attention_bias: bool = False  # biases on q/k/v/o projections (gpt-oss)
    qk_norm: str = "none"  # RMSNorm of q and k before RoPE: per_head [hd] (Qwen3-MoE) or full [H*hd] (OLMoE)
    clip_qkv: float | None = None  # clamp q, k, v to +-clip after projection (OLMoE option)
    router: str = "topk_softmax"  # topk_softmax: softmax over the k chosen logits; softmax_topk: over all E
    router_bias: bool = False  # a bias on the router logits (gpt-oss)
    norm_topk_prob: bool = True  # softmax_topk only: renormalise the k chosen probabilities to sum to 1
    expert_activation: str = "swiglu"  # swiglu, or gpt_oss_clamped (alpha, limit below)
    activation_alpha: float = 1.702  # gpt_oss_clamped: glu = gate * sigmoid(alpha * gate)
    activation_limit: float = 7.0  # gpt_oss_clamped: gate <= limit, -limit <= up <= limit
    expert_bias: bool = False  # biases on w13 [E, 2F] and w2 [E, D] (gpt-oss)
    rope_scaling: YarnScaling | None = None  # None: plain RoPE at rope_theta
    tie_embeddings: bool = False  # the output head is the embedding matrix

    def __post_init__(self) -> None:
        positive = ("n_layers", "hidden", "intermediate", "n_experts", "top_k", "n_heads",
                    "n_kv_heads", "head_dim", "vocab_size", "max_seq_len")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{self.name}: {name} must be >= 1")
        if self.top_k > self.n_experts:
            raise ValueError(f"{self.name}: top_k {self.top_k} > n_experts {self.n_experts}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"{self.name}: n_heads must be a multiple of n_kv_heads")
        if self.head_dim % 2:
            raise ValueError(f"{self.name}: head_dim must be even for RoPE")
        if len(self.layer_masks) != self.n_layers:
            raise ValueError(f"{self.name}: {len(self.layer_masks)} layer masks for {self.n_layers} layers")
        choices = {"qk_norm": QK_NORMS, "router": ROUTERS, "expert_activation": EXPERT_ACTIVATIONS}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{self.name}: {name} {getattr(self, name)!r} is not one of {', '.join(allowed)}")
        if self.expert_bias and self.expert_activation != "gpt_oss_clamped":
            raise ValueError(f"{self.name}: expert biases come only with the gpt_oss_clamped activation "
                             f"(the family that has them); no other family is computed")
        if self.activation_limit <= 0:
            raise ValueError(f"{self.name}: activation_limit must be > 0")
        if self.clip_qkv is not None and self.clip_qkv <= 0:
            raise ValueError(f"{self.name}: clip_qkv must be > 0 or None")

    @property
    def plain_experts(self) -> bool:
        """True when the experts compute plain SwiGLU without biases: what every kernel arm computes."""
        return self.expert_activation == "swiglu" and not self.expert_bias

    @property
    def active_expert_bytes_per_token(self) -> int:
        """bf16 bytes of the k experts one token reads (w13 and w2)."""
        return self.top_k * 3 * self.hidden * self.intermediate * 2


def _alternating(n_layers: int, window: int, block: int) -> tuple[LayerMask, ...]:
    """Even layers use the composite mask, odd layers plain causal (as gpt-oss alternates
    sliding and full attention), so `fused_mask=decline` has both kinds to act on."""
    composite = LayerMask("composite", window, block)
    return tuple(composite if layer % 2 == 0 else LayerMask("causal") for layer in range(n_layers))


PRESETS: dict[str, ModelConfig] = {
    # Seconds on a CPU; for tests.
    "tiny": ModelConfig(
        name="tiny", n_layers=2, hidden=64, intermediate=32, n_experts=8, top_k=2,
        n_heads=2, n_kv_heads=1, head_dim=512, vocab_size=256, max_seq_len=512,
        layer_masks=_alternating(2, window=16, block=8),
    ),
    # The embedded default: byte vocab, 64 experts top-6, head_dim 512 with sinks and the
    # composite mask, 4096 context, so every flag has something to act on.
    "demo": ModelConfig(
        name="demo", n_layers=2, hidden=256, intermediate=48, n_experts=64, top_k=6,
        n_heads=2, n_kv_heads=1, head_dim=512, vocab_size=256, max_seq_len=4096,
        layer_masks=_alternating(2, window=128, block=64),
    ),
    # DeepSeek-V4-Flash-like width for kernel timing on an H200; random weights.
    "v4-shape": ModelConfig(
        name="v4-shape", n_layers=1, hidden=4096, intermediate=2048, n_experts=256, top_k=6,
        n_heads=8, n_kv_heads=1, head_dim=512, vocab_size=256, max_seq_len=16384,
        layer_masks=(LayerMask("composite", 1024, 64),),
    ),
}


def from_name(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise UserError(
            f"unknown model {name!r}: choose one of {', '.join(PRESETS)}"
        ) from None
