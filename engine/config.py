"""Model presets: frozen dataclasses resolved by name.

Shape legend: D = hidden, F = expert intermediate, E = routed experts, k = top-k,
Hq / Hkv = query / key-value heads, hd = head dim, W = window, B = summary block.

Knows nothing about weights or devices; `engine.model` builds a model from a config.
"""

from __future__ import annotations

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
