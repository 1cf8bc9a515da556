"""Which attention check matches a model, and at what shape: for `moe-inspector check-attention` (its --model) and
the attention check screen (F3), from the model's config alone (no weights, no textual).

    sinks   learned sinks and a composite-masked layer: engine.compare.check_attention at the model's head_dim,
            heads, kv heads and its first masked layer's window and block
    mla     latent attention the fused MLA kernel takes: engine.compare_mla.check_mla at its latent dims
    decode  causal or window-only layers: engine.compare_decode.check_decode at its heads, window and sinks
    None    no fused arm to check (`why_not` says why in one line)
"""

from __future__ import annotations

from typing import Any

from engine.attention_dispatch import FUSED_HEAD_DIMS, mla_kernel_declines
from engine.config import ModelConfig

SINKS, MLA, DECODE = "sinks", "mla", "decode"


def attention_shape(c: ModelConfig, cuda: bool) -> dict[str, Any]:
    """The model's attention shape, and sizes the check can run at on a GPU (`cuda`) or the CPU."""
    latent = c.latent_attention
    if latent is not None:  # check_mla's shape: the model's latent dims, its heads (cut on a CPU) and a prefill
        cpu = not cuda
        from engine.compare_mla import latent_dims

        return {"head_dim": c.head_dim, "heads": min(c.n_heads, 8) if cpu else c.n_heads, "kv_heads": 1,
                **latent_dims(latent), "seq_len": min(c.max_seq_len, 48 if cpu else 1024)}
    if decode_applies(c):  # check_decode's shape: the model's dims, a cache capacity and a batch
        from engine import compare_decode

        dims = compare_decode.model_dims(c)
        device = "cuda" if cuda else "cpu"
        return {**dims, "seq_len": compare_decode.default_seq_len(device, dims["window"], c.max_seq_len),
                "batch": compare_decode.DEFAULTS[device]["batch"]}
    masked = next((mask for mask in c.layer_masks if mask.kind != "causal"), None)
    window = masked.window if masked is not None else 16
    block = masked.block if masked is not None and masked.block else 8
    if cuda:
        sizes = {"seq_len": min(c.max_seq_len, max(2048, 4 * window)), "window": window, "block": block,
                 "pad": 64}
    else:  # the interpreter: ~10 s at head_dim 512 for 96 tokens (measured on a 2-core CPU)
        sizes = {"seq_len": min(c.max_seq_len, 96), "window": min(window, 32), "block": min(block, 16), "pad": 5}
    return {"head_dim": c.head_dim, "heads": c.n_heads, "kv_heads": c.n_kv_heads, "model_window": window,
            "model_block": block, **sizes}


def model_attention(c: ModelConfig) -> str:
    """What the model's attention layers are: sinks or not, the first non-causal layer's mask, latent or not."""
    masked = next((mask for mask in c.layer_masks if mask.kind != "causal"), None)
    parts = ["latent attention (MLA)"] if c.latent_attention is not None else []
    parts.append("sinks" if c.sinks else "no sinks")
    if masked is None:
        parts.append("causal layers only")
    elif masked.kind == "composite":
        parts.append(f"composite mask W={masked.window}, B={masked.block}")
    else:
        parts.append(f"sliding window W={masked.window}")
    return ", ".join(parts)


def check_kind(c: ModelConfig) -> str | None:
    """The check that matches the attention the model runs: SINKS (the sinks kernel with the composite mask,
    `check-attention`), MLA (the absorbed latent kernel, `check-attention --mla`), DECODE (the decode kernel over
    causal or window-only layers, `check-attention --decode`), or None (`why_not`)."""
    if why_not(c):
        return None
    return MLA if c.latent_attention is not None else DECODE if decode_applies(c) else SINKS


def decode_applies(c) -> bool:
    """Layers the decode check takes: no latent attention, a fused head dim, no composite mask."""
    return (c.latent_attention is None and c.head_dim in FUSED_HEAD_DIMS
            and not any(mask.kind == "composite" for mask in c.layer_masks))


def why_not(c: ModelConfig) -> str | None:
    """Why no check matches the model's own attention, in one line (None: one does)."""
    latent = c.latent_attention
    if latent is not None:
        declined = mla_kernel_declines(latent.kv_lora_rank, latent.qk_rope_head_dim)
        return (f"nothing to check: the fused MLA kernel declines this latent shape ({declined}), so its layers run "
                f"the reference (K and V decompressed per head)") if declined else None
    if c.head_dim not in FUSED_HEAD_DIMS:
        return (f"head_dim {c.head_dim}: the fused attention kernel takes head_dim "
                f"{', '.join(map(str, FUSED_HEAD_DIMS))}, so this model's layers run the unfused reference and there is "
                f"no fused arm to check")
    if not c.sinks and not decode_applies(c):  # a composite mask without sinks
        return (f"nothing to check: its layers run the fused kernel with {_runs(c)}; check-attention checks sinks "
                f"with a composite mask, causal or window-only layers (--decode), or latent attention (--mla)")
    return None


def _runs(c) -> str:
    kinds = sorted({mask.describe() if mask.kind != "causal" else "causal" for mask in c.layer_masks})
    masks = f"a {kinds[0]} mask" if len(kinds) == 1 else f"{' and '.join(kinds)} masks"
    return f"{masks}, {'sinks' if c.sinks else 'no sinks'}"
