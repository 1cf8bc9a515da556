"""The kernel arms the engine can run, and their exact launch counters.

An arm is a registered object: a name, the family it serves (moe, attention or latent_attention), which devices
it supports, and a launch function. The engine bumps an arm's counter each time it actually
executes it (never when it only decided it), and counts the Triton kernel launches underneath
through `kernels.launches`. Kernels are imported lazily, so the CPU path never needs Triton.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from engine import mla
from kernels import launches
from kernels.reference import attention_reference, mla_decompressed_reference, moe_reference
from kernels.trellis_reference import TrellisMatrix, moe_trellis_reference


def _moe_gemv(x, w13, w2, ids, weights, *, tile_m, variant):
    from kernels.moe_gemv import moe_gemv
    return moe_gemv(x, w13, w2, ids, weights)


def _moe_grouped(x, w13, w2, ids, weights, *, tile_m, variant):
    from kernels.moe_grouped import moe_grouped
    return moe_grouped(x, w13, w2, ids, weights, tile_m=tile_m, variant=variant)


def _moe_torch_grouped_mm(x, w13, w2, ids, weights, *, tile_m, variant):
    from kernels.moe_peer import moe_torch_grouped_mm
    return moe_torch_grouped_mm(x, w13, w2, ids, weights)


def _moe_reference(x, w13, w2, ids, weights, *, tile_m, variant):
    if isinstance(w13, TrellisMatrix):  # trellis-coded experts: decoded per woken expert
        return moe_trellis_reference(x, w13, w2, ids, weights)
    return moe_reference(x, w13, w2, ids, weights)


def _moe_trellis_gemv(x, w13, w2, ids, weights, *, tile_m, variant):
    from kernels.trellis_gemv import moe_trellis_gemv
    return moe_trellis_gemv(x, w13, w2, ids, weights)


def _moe_trellis_grouped(x, w13, w2, ids, weights, *, tile_m, variant):
    from kernels.trellis_grouped import moe_trellis_grouped
    return moe_trellis_grouped(x, w13, w2, ids, weights, tile_m=tile_m)


def _moe_trellis_dequant(x, w13, w2, ids, weights, *, tile_m, variant):
    from kernels.trellis_grouped import moe_trellis_dequant
    return moe_trellis_dequant(x, w13, w2, ids, weights, tile_m=tile_m)


def _on_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def _grouped_mm_supported(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        from kernels.moe_peer import grouped_mm_available
    except ImportError:
        return False
    return grouped_mm_available(device)


def _attention_fused(q, k, v, sinks, spec, q_start, key_padding):
    # A small query chunk (decode: one query) goes to the split-KV decode kernel whatever the key
    # length (a short cache too: the prefill kernel with one query cost 17.7 us on the H200, for 1 of
    # its 64 rows); a chunk whose (Hq / Hkv) x Tq rows exceed one decode program goes to prefill.
    from kernels.attention_decode import MAX_ROWS, flash_decode
    if q.shape[1] <= 4 and (q.shape[2] // max(k.shape[2], 1)) * q.shape[1] <= MAX_ROWS:
        return flash_decode(q, k, v, sinks, spec, q_start, key_padding)
    from kernels.attention import flash_attention
    return flash_attention(q, k, v, sinks, spec, q_start, key_padding)


def _attention_unfused(q, k, v, sinks, spec, q_start, key_padding):
    return attention_reference(q, k, v, sinks, spec, q_start, key_padding)


def _mla_fused(config, q, latent_cache, kv_b, q_start):
    """The absorbed form (engine.mla): q W_UK, the Triton walk over the latent cache, then W_UV. At decode widths
    (B * T <= kernels.mla_absorb.MAX_ROWS query rows) each per-head product is one launch (kernels.mla_absorb)
    where the einsum and its copies and concatenation are several; the W_UV product merges the key splits itself
    (no combine launch)."""
    from kernels import mla_absorb
    from kernels.attention_mla import mla_decode, mla_split
    latent = config.latent_attention
    batch, steps, heads = q.shape[:3]
    rows = batch * steps
    if rows > mla_absorb.MAX_ROWS:
        out_latent = mla_decode(mla.absorb_query(config, q, kv_b), latent_cache, latent.kv_lora_rank, latent.scale,
                                q_start)  # [B, T, Hq, R]
        return mla.unabsorb_output(config, out_latent, kv_b)
    nope, value = latent.qk_nope_head_dim, latent.v_head_dim
    absorbed = mla_absorb.absorb(q.reshape(rows, heads, q.shape[3]), kv_b, nope, value)  # [B*T, Hq, R + r]
    splits = mla_split(absorbed.view(batch, steps, heads, -1), latent_cache, latent.kv_lora_rank, latent.scale,
                       q_start, consumer_merges=True)  # out [B, T, Hq, R] written, or partials unabsorb merges
    return mla_absorb.unabsorb(splits.out.view(rows, heads, latent.kv_lora_rank), kv_b, nope, value,
                               splits).view(batch, steps, heads, value)


def _mla_reference(config, q, latent_cache, kv_b, q_start):
    """The naive form: K and V decompressed per head from the latents (kernels.reference)."""
    w_uk, w_uv = mla.split_kv_b(config, kv_b)
    return mla_decompressed_reference(q, latent_cache, w_uk, w_uv, config.latent_attention.scale, q_start)


@dataclass(frozen=True)
class Arm:
    name: str
    family: str  # "moe", "attention" or "latent_attention" (MLA layers: launch(config, q, cache, kv_b, q_start))
    supports: Callable[[torch.device], bool]
    launch: Callable
    weight_format: str = "bf16"  # the experts a MoE arm multiplies: "bf16" tensors or "trellis" stacks


ARMS: dict[str, Arm] = {arm.name: arm for arm in (
    Arm("gemv", "moe", _on_cuda, _moe_gemv),
    Arm("grouped", "moe", _on_cuda, _moe_grouped),
    Arm("torch_grouped_mm", "moe", _grouped_mm_supported, _moe_torch_grouped_mm),
    Arm("reference", "moe", lambda device: True, _moe_reference),  # either format
    Arm("trellis_gemv", "moe", _on_cuda, _moe_trellis_gemv, "trellis"),
    Arm("trellis_grouped", "moe", _on_cuda, _moe_trellis_grouped, "trellis"),
    Arm("trellis_dequant", "moe", _on_cuda, _moe_trellis_dequant, "trellis"),
    Arm("fused", "attention", _on_cuda, _attention_fused),
    Arm("unfused", "attention", lambda device: True, _attention_unfused),
    Arm("mla_fused", "latent_attention", _on_cuda, _mla_fused),
    Arm("mla_reference", "latent_attention", lambda device: True, _mla_reference),
)}


class Counters:
    """Executed-arm counts (per arm; grouped per variant) and Triton kernel launches, for one run."""

    def __init__(self) -> None:
        # a plain dict, not a Counter: `replay` adds to it on every replayed step, and a Counter's item
        # access is twice as slow
        self.arms: dict[str, int] = {}
        self.graph_replays = 0  # decode steps a CUDA-graph replay served
        self.graph_launches = 0  # graph launches: fewer than the steps where a graph runs several (steps_per_graph)
        self._kernel_baseline = launches.snapshot()

    def bump(self, label: str, times: int = 1) -> None:
        arms = self.arms
        arms[label] = arms.get(label, 0) + times

    def replay(self, arms: Mapping[str, int], kernels: Mapping[str, int], times: int = 1) -> None:
        """`times` CUDA-graph replays of one step: every arm and kernel the capture launched, launched once
        more per replay. On the host path of every replayed step, so plain loops (Counter.update is a slower
        Python loop)."""
        counts = self.arms
        earlier = counts.get
        for label, launched in arms.items():
            counts[label] = earlier(label, 0) + launched * times
        launches.record_many(kernels, times)
        self.graph_replays += times

    def to_json(self) -> dict:
        bf16 = [name for name in ARMS if ARMS[name].family == "moe" and ARMS[name].weight_format == "bf16"]
        arms = {name: 0 for name in bf16 if name != "grouped"}
        arms.update({f"grouped_v{variant}": 0 for variant in (0, 1, 2)})
        trellis = [name for name in ARMS if ARMS[name].weight_format == "trellis"]
        if any(self.arms.get(name) for name in trellis):  # a run on trellis experts lists all three
            arms.update({name: 0 for name in trellis})
        arms.update({name: 0 for name in ARMS if ARMS[name].family == "attention"})
        latent = [name for name in ARMS if ARMS[name].family == "latent_attention"]
        if any(name in self.arms for name in latent):  # an MLA model's run: both of its arms, counted or not
            arms.update({name: 0 for name in latent})
        arms.update(self.arms)
        counts = {"arms": arms, "kernels": launches.since(self._kernel_baseline)}
        if self.graph_replays:  # only runs that replayed graphs carry them: generate's layout is unchanged
            counts["graph_replays"] = self.graph_replays
            counts["graph_launches"] = self.graph_launches
        return counts
