"""The records a run emits, typed: what every consumer (the TUI's dispatch log, sessions' results, the
bench, JSON output, traces) may read. They are plain dicts at run time (a TypedDict is a dict), made once
per layer per step on the host path, copied per replayed step; these classes are their contract.

Shape of a run: one `StepRecord` per step; in it, one `MoeRecord` per MoE layer and one `AttentionRecord`
per attention layer, in layer order, and one `RowRecord` per sequence the step ran.
"""

from __future__ import annotations

from typing import TypedDict


class MoeRecord(TypedDict, total=False):
    step: int
    layer: int
    phase: str  # prefill, decode or mixed
    n_tokens: int  # rows the experts see this step (every sequence's tokens in it)
    k: int
    experts: int
    tile_m: int
    woken_predicted: float  # uniform routing: E * (1 - (1 - k/E)^n)
    woken_observed: int | None  # distinct experts the router chose (filled at the step's sync)
    pairs_per_woken: float  # predicted
    pairs_per_woken_observed: float
    fill: float  # predicted m-tile fill
    boundary: int | None  # the policy's n at which the grouped arm takes over
    policy: str
    decided_arm: str
    executed_arm: str  # differs on a CPU (the reference arm emulates) or for experts no kernel computes
    variant: int | None
    reason: str
    execution_note: str  # why the executed arm differs from the decided one ("" when it does not)
    us: float | None  # the arm's µs, measured as `us_method` says; None when not timed
    us_method: str | None
    arm_kernels: list[str]  # the device kernels the arm launched, in order (a GPU's; [] on a CPU)
    graph: str  # "replay" on a replayed step's copy of its capture's record
    # only for the families that have them (engine.routing.record_fields):
    routing: str  # a group-limited router, in words
    shared_experts: str  # the shared experts: always on, outside the arm's decision and the woken count
    shared_path: str  # "routed launches" (inside the GEMV arm's, flag shared_fold) or "apart" (after the arm)
    shared_reason: str  # why shared_path: the fold's shape, or the first condition that kept them apart
    forward: str  # why the step ran engine.model's torch forward, not engine.decode_fused's glue
    weight_format: str  # the experts' storage: "bf16", "fp32", or "trellis hyb K=2 V=2 L=16" (engine.weight_format)
    bits_per_weight: float  # trellis: K plus the row scales
    expert_bytes: int  # w13 + w2 of one expert, as stored: what a woken expert costs the step to read
    bytes_moved: int | None  # expert weight bytes the decided arm moves (engine.dispatch.moved_bytes)


class AttentionRecord(TypedDict, total=False):
    step: int
    layer: int
    phase: str
    n_tokens: int
    head_dim: int
    decided_arm: str
    executed_arm: str
    mask: str  # the layer's mask
    applied_mask: str  # the mask the arm computes ("causal" when fused_mask=drop ignores it)
    declined: bool  # the fused arm declined to the reference
    reason: str
    execution_note: str
    us: float | None
    us_method: str | None
    arm_kernels: list[str]
    graph: str
    # latent attention (MLA) layers only:
    attention: str  # "latent"
    kv_cache_bytes_per_token: int  # the latent cache's bytes per token per layer (R + r values)
    naive_kv_cache_bytes_per_token: int  # K and V decompressed per head: Hq * (n + r + v) values
    forward: str  # as MoeRecord's


class RowRecord(TypedDict):
    request_id: int
    slot: int
    start: int  # position of the row's first token
    tokens: int  # tokens the row fed
    emitted: int | None  # the token it generated (None: a prefill chunk before the prompt's end)
    prefill: bool  # the row fed prompt tokens


class StepRecord(TypedDict, total=False):
    step: int
    phase: str
    n_tokens: int
    moe: list[MoeRecord]
    attention: list[AttentionRecord]
    started: float  # the caller's clock, before the step's launch
    ended: float  # after its sync (a served step: when its tokens were handed on)
    host_us: float  # see engine.bench's host-time note
    device_us: float | None  # CUDA events around the launch (over its span), None on a CPU
    graph: str  # eager, capture or replay
    eager_reason: str  # why a GPU decode step did not replay a graph
    kernel_launches: dict[str, int] | None
    span: int  # decode steps the launch that computed this step ran
    span_index: int  # this step's index among them
    rows: list[RowRecord]
    token: int | None  # Engine.generate only: the one sequence's token this step
