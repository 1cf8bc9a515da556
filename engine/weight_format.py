"""What the experts of a layer are stored in, for the decision records and the byte counts: bf16 (or
another float dtype) tensors, or trellis-coded stacks (kernels.trellis_reference.TrellisMatrix).

`expert_format(weights, layer)` names the format, its bits per weight and the bytes one woken expert
(w13 and w2) costs a step to read, so a record says how many bytes the layer moved. Plain values from
shapes; knows nothing of dispatch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.trellis_reference import TrellisMatrix

_FLOAT_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}


@dataclass(frozen=True)
class ExpertFormat:
    name: str  # "bf16", "fp32", or "trellis hyb K=2 V=2 L=16" (TrellisCode.describe)
    bits_per_weight: float  # trellis: the codes' K plus the row scales
    bytes_per_expert: int  # w13 + w2 of one expert
    coded: bool  # trellis-coded (a TrellisMatrix) rather than dense tensors


def matrices_format(w13, w2) -> ExpertFormat:
    """The format of one layer's expert stacks w13 [E, 2F, D] and w2 [E, D, F]."""
    if isinstance(w13, TrellisMatrix):
        weights = w13.shape[1] * w13.shape[2] + w2.shape[1] * w2.shape[2]
        total = w13.bytes_per_expert + w2.bytes_per_expert
        code = w13.code
        return ExpertFormat(code.describe(), round(8 * total / weights, 4), total, True)
    element = w13.element_size()
    total = (w13[0].numel() + w2[0].numel()) * element
    return ExpertFormat(_FLOAT_NAMES.get(w13.dtype, str(w13.dtype).removeprefix("torch.")), 8 * element, total, False)


def expert_format(weights: dict, layer: int) -> ExpertFormat:
    return matrices_format(weights[f"layers.{layer}.w13"], weights[f"layers.{layer}.w2"])
