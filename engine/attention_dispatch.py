"""Which attention arm a layer takes, and with which mask. Plain Python.

`flash_512` selects the fused arm for head_dim-512 layers (other head dims always take the
fused arm with their mask honoured: the flag is about the 512 path of the incident).
`fused_mask`:
    honor    the fused arm applies the layer's mask
    decline  the fused arm declines to the unfused reference whenever a non-causal mask is present
    drop     the fused arm ignores the mask and computes plain causal attention (the incident)
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
