"""Model presets: frozen dataclasses resolved by name.

Shape legend: D = hidden, F = expert intermediate, E = routed experts, k = top-k,
Hq / Hkv = query / key-value heads, hd = head dim, W = window, B = summary block;
latent attention (MLA): R = kv_lora_rank, r = RoPE dims of the shared key, G = expert groups.

Knows nothing about weights or devices; `engine.model` builds a model from a config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.errors import UserError


@dataclass(frozen=True)
class LayerMask:
    """The attention mask of one layer: `causal`, `window` or `composite` (kernels.attention_common draws the
    visible-key rule of each)."""

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
# topk_softmax: softmax over the k chosen logits; softmax_topk: the softmax over all E, then the top k;
# softmax_group_topk (DeepSeek-V2 group_limited_greedy): the softmax over all E, the top k inside the
# topk_group groups of highest max score; sigmoid_group_topk (DeepSeek-V3): sigmoid scores, a correction
# bias for the choice only, the topk_group groups of highest top-2 sum. engine.routing computes them.
ROUTERS = ("topk_softmax", "softmax_topk", "softmax_group_topk", "sigmoid_group_topk")
GROUPED_ROUTERS = ("softmax_group_topk", "sigmoid_group_topk")
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
class LatentAttention:
    """Multi-head latent attention (DeepSeek-V2/V3). Per token the cache holds the normed latent
    c = RMSNorm(x W_DKV) [R] and one RoPE key k_r [r] shared by every head; a head's key is
    [c W_UK_h ; k_r] (qk_nope + r dims) and its value c W_UV_h (v_head_dim), W_UK and W_UV being
    the rows of kv_b [Hq * (qk_nope + v), R]. The query comes from q [D -> Hq * (qk_nope + r)], or
    through a rank-q_lora_rank bottleneck with its own RMSNorm."""

    kv_lora_rank: int  # R
    qk_nope_head_dim: int
    qk_rope_head_dim: int  # r
    v_head_dim: int
    q_lora_rank: int | None = None  # None: one q projection (DeepSeek-V2-Lite)
    rope_interleave: bool = True  # RoPE pairs (x0, x1), (x2, x3), ... as DeepSeek's checkpoints lay them out
    softmax_scale: float | None = None  # None: (qk_nope + r) ** -0.5; YaRN multiplies it by mscale^2
    norm_eps: float = 1e-6  # the q_a and kv_a RMSNorms: DeepSeek's default, not the model's rms_norm_eps

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"latent attention: {name} must be >= 1")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError("latent attention: q_lora_rank must be >= 1 or None")
        if self.qk_rope_head_dim % 2:
            raise ValueError("latent attention: qk_rope_head_dim must be even for RoPE")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def scale(self) -> float:
        return self.qk_head_dim ** -0.5 if self.softmax_scale is None else self.softmax_scale

    def cache_elements_per_token(self) -> int:
        """Elements one token adds to one layer's latent cache: R + r."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def naive_cache_elements_per_token(self, heads: int) -> int:
        """Elements one token would add with K and V decompressed per head: Hq * (qk_nope + r + v)."""
        return heads * (self.qk_head_dim + self.v_head_dim)


@dataclass(frozen=True)
class SharedExperts:
    """Experts every token runs beside the routed ones: one SwiGLU MLP of `intermediate` units (the
    `count` shared experts of DeepSeek side by side: count x moe_intermediate), its output scaled by
    sigmoid(x . gate) when `gated` (Qwen2-MoE). Outside the GEMV/grouped decision: always on."""

    count: int
    intermediate: int
    gated: bool = False

    def __post_init__(self) -> None:
        if self.count < 1 or self.intermediate < 1:
            raise ValueError(f"shared experts need count >= 1 and intermediate >= 1, got {self}")

    def describe(self) -> str:
        gate = ", sigmoid-gated" if self.gated else ""
        return f"{self.count} shared expert{'s' if self.count > 1 else ''} (F={self.intermediate}{gate})"


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
    # DeepSeek-V2/V3 and Qwen2-MoE (engine.mla, engine.routing); defaults: absent.
    qkv_bias: bool = False  # biases on q/k/v only, not o (Qwen2-MoE)
    latent_attention: LatentAttention | None = None  # MLA instead of q/k/v/o heads
    shared_experts: SharedExperts | None = None
    routed_scaling_factor: float = 1.0  # multiplies the routed experts' weights
    n_group: int = 1  # G: expert groups of the group-limited routers
    topk_group: int = 1  # groups a token's experts may come from
    dense_layers: tuple[int, ...] = ()  # layers with a dense SwiGLU MLP of `dense_intermediate` units, no experts
    dense_intermediate: int = 0

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
        self._check_deepseek_features()
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

    def _check_deepseek_features(self) -> None:
        mla = self.latent_attention
        if mla is not None:
            if self.head_dim != mla.qk_head_dim or self.n_kv_heads != self.n_heads:
                raise ValueError(f"{self.name}: latent attention needs head_dim = qk_nope + rope = {mla.qk_head_dim} "
                                 f"and n_kv_heads = n_heads (every head decompresses its own K and V)")
            if self.sinks or self.attention_bias or self.qkv_bias or self.qk_norm != "none" or self.clip_qkv:
                raise ValueError(f"{self.name}: latent attention takes no sinks, biases, q/k norms or clipping")
            if any(mask.kind != "causal" for mask in self.layer_masks):
                raise ValueError(f"{self.name}: latent attention layers are causal")
        if self.router in GROUPED_ROUTERS:
            if self.n_group < 1 or not 1 <= self.topk_group <= self.n_group or self.n_experts % self.n_group:
                raise ValueError(f"{self.name}: group-limited routing needs 1 <= topk_group <= n_group dividing "
                                 f"n_experts, got n_group={self.n_group}, topk_group={self.topk_group}, "
                                 f"E={self.n_experts}")
            per_group = self.n_experts // self.n_group
            if self.top_k > self.topk_group * per_group:
                raise ValueError(f"{self.name}: top_k {self.top_k} > the {self.topk_group} x {per_group} experts of "
                                 f"the groups a token may use")
            if self.router == "sigmoid_group_topk" and per_group < 2:
                raise ValueError(f"{self.name}: sigmoid group routing scores a group by its top-2 experts: "
                                 f"needs >= 2 experts per group, got {per_group}")
        elif (self.n_group, self.topk_group) != (1, 1):
            raise ValueError(f"{self.name}: n_group/topk_group apply only to a group-limited router")
        if self.routed_scaling_factor <= 0:
            raise ValueError(f"{self.name}: routed_scaling_factor must be > 0")
        if self.dense_layers:
            if any(not 0 <= layer < self.n_layers for layer in self.dense_layers) \
                    or len(set(self.dense_layers)) != len(self.dense_layers):
                raise ValueError(f"{self.name}: dense_layers {self.dense_layers} are not distinct layers "
                                 f"of 0..{self.n_layers - 1}")
            if len(self.dense_layers) == self.n_layers:
                raise ValueError(f"{self.name}: every layer is dense: not a Mixture-of-Experts model")
            if self.dense_intermediate < 1:
                raise ValueError(f"{self.name}: dense layers need dense_intermediate >= 1")
        if (self.shared_experts is not None or self.dense_layers) and not self.plain_experts:
            raise ValueError(f"{self.name}: shared experts and dense layers come with plain SwiGLU experts only")

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The layers with routed experts, in order: each has one MoE record and one woken count per step."""
        dense = set(self.dense_layers)
        return tuple(layer for layer in range(self.n_layers) if layer not in dense)

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - len(self.dense_layers)

    @property
    def rotary_dim(self) -> int:
        """Dimensions RoPE rotates: the head dim, or latent attention's shared RoPE key."""
        return self.head_dim if self.latent_attention is None else self.latent_attention.qk_rope_head_dim

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
