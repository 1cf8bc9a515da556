"""The L2 policy of weights a decode kernel streams once per call (kernels.gemv's dense weights,
kernels.moe_gemv's experts): `evict_first`, so that a step's weights pass through L2 without pushing
out what the next steps read again (the KV cache, the embedding rows, the router's and the LM head's
weights, the activations), which the latency-bound kernels then find in L2 rather than DRAM
(docs/decode-step.md). A hint only: the same loads, the same values (the interpreter ignores it).
The flag `stream_weights` (kernels.settings) turns it off."""

from __future__ import annotations

import torch

from kernels import settings


def weight_eviction(device: torch.device, launch: settings.LaunchSettings | None = None) -> str:
    """The `eviction_policy` of a streamed weight's tl.load: "evict_first" on CUDA when the settings
    (None: the current ones) stream weights, else "" (none)."""
    if device.type != "cuda" or not (launch or settings.current()).stream_weights:
        return ""
    return "evict_first"
