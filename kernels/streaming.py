"""The L2 policy of weights a decode kernel streams once per call (kernels.gemv's dense weights, kernels.moe_gemv's
experts): `evict_first`, so that a step's ~380 MB of weights (v4-shape at one token) pass through L2 without
pushing out what the next steps read again -- the KV cache, the embedding rows, the router's and the LM head's
weights, the activations -- which the latency-bound kernels (attention, the norms, the routing) then find in L2
rather than DRAM. A hint only: the same loads, the same values (the interpreter ignores it).
MOEI_STREAM_WEIGHTS=0 drops it (the benchmark's A/B)."""

from __future__ import annotations

import os

import torch


def weight_eviction(device: torch.device) -> str:
    """The `eviction_policy` of a streamed weight's tl.load: "evict_first" on CUDA, "" (none) elsewhere or with
    MOEI_STREAM_WEIGHTS=0."""
    if device.type != "cuda" or os.environ.get("MOEI_STREAM_WEIGHTS", "1") == "0":
        return ""
    return "evict_first"
