"""Which attention arm a layer takes, and with which mask. Plain Python.

`flash_512` selects the fused arm for head_dim-512 layers (other head dims always take the
fused arm with their mask honoured: the flag is about the 512 path of the incident).
`fused_mask`:
    honor    the fused arm applies the layer's mask
    decline  the fused arm declines to the unfused reference whenever a non-causal mask is present
    drop     the fused arm ignores the mask and computes plain causal attention (the incident)

Latent attention (MLA) layers have arms of their own, `mla_fused` (absorbed, over the latent cache) and
`mla_reference` (K and V decompressed per head): `flash_512=off` selects the reference (DeepSeek's
latent is 512 wide: the class the flag switches), and the fused arm declines a latent shape its kernel
does not take, saying why.
"""

from __future__ import annotations

from dataclasses import dataclass

FUSED, UNFUSED = "fused", "unfused"
FLASH_HEAD_DIM = 512
# The head dims the fused (Triton) attention kernels take: kernels.attention_common.SUPPORTED_HEAD_DIMS, which a
# test keeps equal (this module is plain Python and imports no kernel).
FUSED_HEAD_DIMS = (64, 128, 256, 512)


@dataclass(frozen=True)
class AttentionDecision:
    arm: str
    mask: str  # the layer's mask, described
    applied_mask: str  # the mask the chosen arm computes ("causal" when dropped)
    reason: str
    declined: bool  # the fused arm declined to the reference


def decide_attention(head_dim: int, mask_kind: str, mask_description: str, flash_512: bool,
                     fused_mask: str) -> AttentionDecision:
    if head_dim not in FUSED_HEAD_DIMS:
        return AttentionDecision(UNFUSED, mask_description, mask_description,
                                 f"head_dim {head_dim}: the fused kernels take head_dim "
                                 f"{', '.join(map(str, FUSED_HEAD_DIMS))}; the unfused reference computes it", False)
    if head_dim == FLASH_HEAD_DIM and not flash_512:
        return AttentionDecision(UNFUSED, mask_description, mask_description,
                                 "flash_512=off: head_dim-512 layers take the unfused reference", False)
    path = "head_dim-512 fused path" if head_dim == FLASH_HEAD_DIM else f"fused path (head_dim {head_dim})"
    if head_dim != FLASH_HEAD_DIM or mask_kind == "causal" or fused_mask == "honor":
        return AttentionDecision(FUSED, mask_description, mask_description,
                                 f"{path} applies the {mask_description} mask", False)
    if fused_mask == "decline":
        return AttentionDecision(UNFUSED, mask_description, mask_description,
                                 f"fused arm declined: {mask_description} mask present (fused_mask=decline)", True)
    return AttentionDecision(FUSED, mask_description, "causal",
                             f"fused_mask=drop: {mask_description} mask ignored, plain causal "
                             f"(reproduces the incident)", False)


# --------------------------------------------------------------------------------------------
# Latent attention (MLA) layers: engine.mla
# --------------------------------------------------------------------------------------------

MLA_FUSED, MLA_REFERENCE = "mla_fused", "mla_reference"
# The latent shapes kernels/attention_mla.py takes (its MIN_DIM, MAX_LATENT, MAX_ROPE; tests assert equal):
# powers of two, at least 16, the latent at most 512 and the RoPE key at most 128.
MLA_MIN_DIM, MLA_MAX_LATENT, MLA_MAX_ROPE = 16, 512, 128


def _power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def mla_kernel_declines(kv_lora_rank: int, rope_dim: int) -> str:
    """Why the fused MLA kernel does not take this latent shape ("" when it does)."""
    if not (_power_of_two(kv_lora_rank) and MLA_MIN_DIM <= kv_lora_rank <= MLA_MAX_LATENT):
        return f"kv_lora_rank {kv_lora_rank} is not a power of two in {MLA_MIN_DIM}..{MLA_MAX_LATENT}"
    if not (_power_of_two(rope_dim) and MLA_MIN_DIM <= rope_dim <= MLA_MAX_ROPE):
        return f"qk_rope_head_dim {rope_dim} is not a power of two in {MLA_MIN_DIM}..{MLA_MAX_ROPE}"
    return ""


def decide_latent_attention(kv_lora_rank: int, rope_dim: int, flash_512: bool) -> AttentionDecision:
    """The arm of a latent attention layer: the absorbed kernel over the latent cache (its values are
    512 wide at DeepSeek's rank: the head_dim-512 class `flash_512` switches), or the reference that
    decompresses K and V per head. Causal, so no mask policy applies (fused_mask has nothing to drop)."""
    if not flash_512:
        return AttentionDecision(MLA_REFERENCE, "causal", "causal",
                                 "flash_512=off: latent attention takes the reference (K and V decompressed "
                                 "per head)", False)
    why = mla_kernel_declines(kv_lora_rank, rope_dim)
    if why:
        return AttentionDecision(MLA_REFERENCE, "causal", "causal",
                                 f"fused MLA arm declined: {why}; K and V decompressed per head (the reference)",
                                 True)
    return AttentionDecision(MLA_FUSED, "causal", "causal",
                             f"absorbed MLA: q W_UK, attention over the latent cache of {kv_lora_rank} + {rope_dim} "
                             f"per token, W_UV after", False)


def decide_layer_attention(config, layer: int, flags) -> AttentionDecision:
    """Any layer's attention decision from its config (engine.config.ModelConfig) and resolved flags."""
    latent = config.latent_attention
    if latent is not None:
        return decide_latent_attention(latent.kv_lora_rank, latent.qk_rope_head_dim, flags["flash_512"])
    mask = config.layer_masks[layer]
    return decide_attention(config.head_dim, mask.kind, mask.describe(), flags["flash_512"], flags["fused_mask"])
