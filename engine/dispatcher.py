"""The engine's per-layer hooks for one run (`Dispatcher`): for every MoE and attention layer of a step it
decides the arm (engine.dispatch, engine.attention_dispatch), executes it (engine.arms), counts it and makes
the layer's decision record; at the step's one sync it fills in what the device observed (woken experts,
timings). A replayed CUDA-graph step copies the records its capture made (`replay`, `replayed_records`).

Knows nothing of scheduling, graphs' launches or generation loops.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Callable

import torch

from engine import calibration, dispatch, l2_prefetch, mla, routing, routing_file, routing_record
from engine.arms import ARMS, Counters
from engine.attention_dispatch import MLA_REFERENCE, UNFUSED, decide_attention, decide_layer_attention
from engine.devices import device_label
from engine.flags import ResolvedFlags, launch_settings
from engine.records import AttentionRecord, MoeRecord
from engine.trace import layer_range_name, nvtx
from engine.weight_format import matrices_format
from kernels import launches, settings as kernel_settings
from kernels.reference import MaskSpec

log = logging.getLogger("moe_inspector.engine")

PREFILL, DECODE, MIXED = "prefill", "decode", "mixed"
NO_ROWS = "none"  # a MoE record's executed arm when no row reached the layer (an expert-parallel rank's)

# (MoE pairs, woken experts) -> pairs per woken expert, rounded to 3 digits (`_pairs_per_woken`)
_PAIRS_PER_WOKEN: dict[tuple[int, int], float] = {}


def _pairs_per_woken(pairs: int, woken: int) -> float:
    """MoE pairs per woken expert, rounded to 3 digits: a decimal conversion, made once per (pairs, woken)."""
    ratio = _PAIRS_PER_WOKEN.get((pairs, woken))
    if ratio is None:
        if len(_PAIRS_PER_WOKEN) >= 4096:
            _PAIRS_PER_WOKEN.clear()
        # an expert-parallel rank may receive no rows: no expert woken, no pairs
        ratio = _PAIRS_PER_WOKEN[(pairs, woken)] = round(pairs / woken, 3) if woken else 0.0
    return ratio


@functools.lru_cache(maxsize=64)
def _fold_reason(shared_intermediate: int, intermediate: int) -> str:
    """A folded record's shared_reason, made once per shape (records are made on every eager step's host path)."""
    return (f"shared_fold=on: the GEMV arm's gate-up and down compute them as {-(-shared_intermediate // intermediate)} "
            f"extra pairs of F={intermediate} per row (Fs={shared_intermediate}), weight 1, summed after the routed "
            f"pairs; the arm's µs and kernels include them")


class _Timer:
    """Per-call timing: CUDA events on a GPU (read after the step's one sync), the wall clock on
    a CPU, where work is synchronous."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def start(self):
        if self.cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            return (begin, end)
        return time.perf_counter()

    def stop(self, handle):
        if self.cuda:
            handle[1].record()
            return handle
        return (time.perf_counter() - handle) * 1e6

    def microseconds(self, stopped) -> float:
        return stopped[0].elapsed_time(stopped[1]) * 1e3 if self.cuda else stopped


class Dispatcher:
    """The engine's per-run layer hooks: decides, executes, counts and records."""

    def __init__(self, engine, flags: ResolvedFlags, timed: bool, keep_logits: bool = False) -> None:
        self.engine, self.flags, self.timed = engine, flags, timed
        kernel_settings.apply(launch_settings(flags))  # the kernels launch as this run's flags say
        # Whether the run keeps each step's logits (compare, the TUI's side-by-side error): the runner copies
        # them to the host at the step's sync (graphs copy them out themselves), else they never leave the device.
        self.keep_logits = keep_logits
        self.step_logits: torch.Tensor | None = None  # an eager step's [B, V] logits until the runner reads them
        self.counters = Counters()
        # engine.decode_fused.StepOutputs while the batch runner has a decode step's folds write its outputs
        self.outputs = None
        # engine.decode_fused reads them: a one-row step's attention norms inside the q/k/v GEMVs (the flag
        # qkv_norm_fold); the first layer's only where carry_norm is off (else the step before's LM head norms it)
        self.fold_qkv_norm = bool(flags["qkv_norm_fold"])
        self.fold_first_norm = self.fold_qkv_norm and not flags["carry_norm"]
        self.l2_prefetch_windows = l2_prefetch.windows(flags["l2_prefetch"])  # engine.decode_fused reads it too
        self.timer = _Timer(engine.device)
        self.engaged: set[tuple] = set()
        self.engagements: list[str] = []
        config = engine.config
        entry = calibration.find_entry(device_label(engine.device), config.top_k, config.n_experts,
                                       config.hidden, config.intermediate, flags["tile_m"])
        self.crossover = None if entry is None else int(entry["crossover_tokens"])
        # A calibration from a routing recording (sweep --routing): each MoE layer's own crossover, and the file
        self.layer_crossovers, self.crossover_file = calibration.layer_crossovers(
            entry, routing_file.model_moe_layers(config))
        self.family_fields = routing.record_fields(config)  # shared experts, group-limited routing: said per record
        # With the flag record_routing: each step's top-k ids and weights per MoE layer (engine.routing_record),
        # copied to the host with the step's one sync (eager) or by the graph itself (engine.graphs).
        self.routing = (routing_record.RoutingRecorder(config.n_experts, config.top_k,
                                                       flags["routing_cap_mb"] << 20)
                        if flags.values.get("record_routing") else None)
        self._routing_staging: torch.Tensor | None = None  # pinned [rows, W] int16, reused by eager steps
        self._trellis_gates: dict[str, dict] = {}  # calibration.trellis_format -> the gate's fields
        self.begin_step(0, PREFILL, 0)

    def begin_step(self, step: int, phase: str, n_tokens: int) -> None:
        self.step, self.phase, self.n_tokens = step, phase, n_tokens
        self.moe_records: list[MoeRecord] = []
        self.attention_records: list[AttentionRecord] = []
        self.pending_woken: list[torch.Tensor] = []
        self.pending_times: list[tuple[dict, object]] = []
        self.pending_routing: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (layer, ids, weights) when recorded
        self._replay_records = None  # what `replayed_records` copies from this dispatcher's records, made once
        self._template: Dispatcher | None = None  # the capture a replayed step replays (`replay`)

    def _engage(self, family: str, arm: str, variant, shape_class: str, message: str) -> None:
        key = (family, arm, variant, shape_class)
        if key not in self.engaged:
            self.engaged.add(key)
            self.engagements.append(message)
            log.info(message)

    def _run(self, record: dict, launch: Callable):
        """The arm's call. On a GPU the record lists the device kernels it launched, in order (`arm_kernels`:
        engine.layer_timing reads a replay's profile back per layer with them); timed, its µs come at the
        step's sync (`us_method` says how)."""
        logged = self.engine.device.type == "cuda"
        if logged:
            launches.log_begin()
        if nvtx.enabled:  # a trace was asked for: the layer's NVTX range (host-walked steps only, never a replay)
            nvtx.push(layer_range_name(record))
        try:
            if not self.timed:
                return launch()
            handle = self.timer.start()
            out = launch()
            self.pending_times.append((record, self.timer.stop(handle)))
            record["us_method"] = "cuda events around the call (eager step)" if self.timer.cuda else "cpu wall clock"
            return out
        finally:
            if nvtx.enabled:
                nvtx.pop()
            if logged:
                record["arm_kernels"] = [launches.device_kernel_name(name) or name for name in launches.log_end()]

    def moe(self, layer, h, w13, w2, topk_ids, topk_weights, experts=None, woken=None, shared=None):
        """A MoE layer: on an expert-parallel engine (`engine.expert_group`), the exchange and this rank's
        experts (engine.expert_parallel, which calls `moe_arm` on the rows it receives); else `moe_arm`."""
        if getattr(self.engine, "expert_group", None) is not None:
            from engine import expert_parallel

            return expert_parallel.moe(self, layer, h, w13, w2, topk_ids, topk_weights, experts, shared)
        return self.moe_arm(layer, h, w13, w2, topk_ids, topk_weights, experts, woken, shared)

    def moe_arm(self, layer, h, w13, w2, topk_ids, topk_weights, experts=None, woken=None, shared=None, *,
                k: int | None = None, n_experts: int | None = None, record_routing: bool = True):
        """The gate's decision, the arm's call, its count and its record for h [n, D] and topk_ids [n, k].
        `k`, `n_experts`: what the gate reads (default the model's top_k and E; an expert-parallel rank gives
        its rows' 1 and its local experts). `record_routing` False: the caller records the layer's routing.
        `experts`: a family's expert math that the plain SwiGLU arms do not compute (engine.family_experts,
        gpt-oss's biased, clamped SwiGLU): the GEMV arm's clamped epilogue where the gate picks GEMV, else the
        reference arm, and the record says so.
        `woken`: the number of distinct experts in topk_ids (0-d int64) when the caller's routing kernel
        already counted it (engine.decode_fused); else it is counted here. `shared`: the layer's shared
        experts (engine.model.SharedMLP, engine.decode_fused_mla.SharedExpertsDecode: `gate_up`, `down`), run on
        every token, outside the decision and the woken count: inside the GEMV arm's two launches where
        `_shared_path` allows (the flag shared_fold; the arm's µs then include them), else after the arm, apart
        and untimed, with an add (the record's `shared_path` and `shared_reason` say which and why)."""
        config, flags, device = self.engine.config, self.flags, self.engine.device
        n = h.shape[0]
        top_k = config.top_k if k is None else k
        experts_count = config.n_experts if n_experts is None else n_experts
        local = (top_k, experts_count) != (config.top_k, config.n_experts)
        crossover, source = (self.local_crossover(top_k, experts_count) if local else self.crossover), ""
        if layer in self.layer_crossovers and not local:
            crossover, source = self.layer_crossovers[layer], f"recorded routing ({self.crossover_file}, layer {layer})"
        gate = dispatch.GateInputs(
            n_tokens=n, k=top_k, n_experts=experts_count, tile_m=flags["tile_m"],
            policy=flags["moe_gate"], decode_floor=flags["decode_floor"], moe_max_tokens=flags["moe_max_tokens"],
            grouped_variant=flags["grouped_variant"], measured_crossover=crossover, measured_source=source)
        stored = matrices_format(w13, w2)
        decision = dispatch.decide(dataclasses.replace(gate, **self.trellis_gate(w13, w2)) if stored.coded else gate)
        arm = ARMS[decision.arm]
        clamped_gemv = experts is not None and decision.arm == dispatch.GEMV and arm.supports(device)
        if clamped_gemv:  # the GEMV arm has the gpt-oss epilogue (kernels.moe_gemv.moe_gemv_clamped)
            executed, note = arm, f"gemv computes {experts.description} (its clamped epilogue)"
        elif experts is not None:
            executed = ARMS[dispatch.REFERENCE]
            note = (f"{decision.arm} computes plain SwiGLU experts: the reference arm computes {experts.description}"
                    if decision.arm != dispatch.REFERENCE else "")
        elif arm.supports(device):
            executed, note = arm, ""
        else:
            executed = ARMS[dispatch.REFERENCE]
            note = (f"{decision.arm} cannot run on {device.type}: the reference arm computes the same function"
                    + (" (it dequantizes the woken experts)" if stored.coded else "")
                    if decision.arm != dispatch.REFERENCE else "")
        predicted = dispatch.woken_experts(n, top_k, experts_count)
        record = {
            "step": self.step, "layer": layer, "phase": self.phase, "n_tokens": n, "k": top_k,
            "experts": experts_count, "tile_m": flags["tile_m"], "woken_predicted": round(predicted, 2),
            "woken_observed": None,
            "pairs_per_woken": round(dispatch.pairs_per_woken_expert(n, top_k, experts_count), 3),
            "fill": round(dispatch.tile_fill(n, top_k, experts_count, flags["tile_m"]), 4),
            "boundary": decision.boundary, "policy": flags["moe_gate"],
            "decided_arm": decision.arm, "executed_arm": executed.name, "variant": decision.variant,
            "reason": decision.reason, "execution_note": note, "us": None, "us_method": None, "arm_kernels": [],
            "weight_format": stored.name, "bits_per_weight": stored.bits_per_weight,
            "expert_bytes": stored.bytes_per_expert,
            # the decided arm's traffic under uniform routing, the figure the trellis gate's reason states
            "bytes_moved": round(dispatch.moved_bytes(decision.arm, n, top_k, experts_count, stored.bytes_per_expert,
                                                      6 * self.engine.config.hidden * self.engine.config.intermediate,
                                                      woken=predicted)),
        }
        if self.family_fields:
            record.update(self.family_fields)
        fold = False
        if "shared_experts" in self.family_fields:
            fold, why = self._shared_path(shared, executed.name, experts, h, w13, local)
            record["shared_path"], record["shared_reason"] = ("routed launches" if fold else "apart"), why
        if n == 0:  # nothing routed here (an expert-parallel rank): no expert woken, no kernel to count them
            self.pending_woken.append(torch.zeros((), dtype=torch.int64, device=h.device))
        elif woken is not None:
            self.pending_woken.append(woken)
        elif h.is_cuda:  # one launch (kernels.router); the torch form is three
            from kernels.router import count_distinct

            self.pending_woken.append(count_distinct(topk_ids, experts_count))
        else:
            woken = torch.zeros(experts_count, device=h.device, dtype=torch.int32)
            woken.scatter_(0, topk_ids.reshape(-1).long(), 1)
            self.pending_woken.append(woken.sum())
        if n == 0:  # an expert-parallel rank that no pair reached: nothing launches, nothing is counted
            record.update(executed_arm=NO_ROWS, execution_note="no pair reached this rank's experts: nothing launched",
                          us=0.0, us_method="nothing launched")
            self.moe_records.append(record)
            return h.new_zeros(h.shape)  # [0, D]
        label = executed.name if executed.name != dispatch.GROUPED else f"grouped_v{decision.variant}"
        self.counters.bump(label)
        shape = (f"{n} row{'' if n == 1 else 's'} of one expert each over {experts_count} local experts" if local else
                 f"{n} token{'' if n == 1 else 's'} x top-{top_k} of {experts_count} experts")
        self._engage("moe", executed.name, decision.variant, self.phase,
                     f"MoE: {label} engaged ({self.phase}, {shape}; m-tiles {100 * record['fill']:.1f}% full at TILE_M={flags['tile_m']}"
                     + (f"; decided {decision.arm}" if executed.name != decision.arm else "") + ")")
        self.moe_records.append(record)
        if self.routing is not None and record_routing:  # held until the step's sync (or, captured, packed by the graph)
            self.pending_routing.append((layer, topk_ids, topk_weights))
        if clamped_gemv:
            from kernels.moe_gemv import moe_gemv_clamped

            return self._run(record, lambda: moe_gemv_clamped(h, w13, w2, topk_ids, topk_weights, experts.b13,
                                                              experts.b2, experts.alpha, experts.limit))
        if experts is not None:
            return self._run(record, lambda: experts(h, w13, w2, topk_ids, topk_weights))
        if fold:  # the shared experts as extra pairs of the routed launches, weight 1: no add, no launch of their own
            from kernels.moe_gemv import moe_gemv

            return self._run(record, lambda: moe_gemv(h, w13, w2, topk_ids, topk_weights,
                                                      shared=(shared.gate_up, shared.down)))
        routed = self._run(record, lambda: executed.launch(h, w13, w2, topk_ids, topk_weights,
                                                           tile_m=flags["tile_m"], variant=decision.variant))
        return routed if shared is None else routed + shared(h)

    def _shared_path(self, shared, executed: str, experts, h: torch.Tensor, w13, local: bool) -> tuple[bool, str]:
        """(fold, why): whether this MoE layer's shared experts ride the routed arm's launches
        (kernels.moe_gemv's `shared`: the GEMV arm at a one-row decode step, the flag shared_fold on) or run apart
        after it; the first reason that keeps them apart, else what the fold does."""
        if shared is None:
            return False, ("expert parallel: every rank runs them on the layer's rows after the exchange" if local
                           else "no shared experts were handed to this layer's arm")
        if not self.flags["shared_fold"]:
            return False, "shared_fold=off: their own launches, added after the routed arm"
        if getattr(shared, "gate", None) is not None:
            return False, "sigmoid-gated (Qwen2-MoE): the gate's per-token scale is not in the routed launches"
        if experts is not None:
            return False, f"the routed experts are {experts.description}: the fold takes plain SwiGLU experts"
        if executed != dispatch.GEMV:
            return False, f"the {executed} arm runs the routed experts: only the GEMV arm takes them in"
        if self.phase != DECODE or h.shape[0] != 1:
            return False, (f"a {self.phase} step of {h.shape[0]} rows: the fold is for one-row decode (each row "
                           f"would read the shared weights again, where the torch products read them once)")
        if shared.gate_up.dtype != h.dtype or shared.down.dtype != h.dtype:
            return False, f"shared weights in {shared.gate_up.dtype}, activations in {h.dtype}"
        return True, _fold_reason(shared.down.shape[1], w13.shape[1] // 2)

    def latent_attention(self, layer, q, latent_cache, kv_b, q_start, length):
        """A latent attention (MLA) layer: engine.attention_dispatch decides the arm (mla_fused, or
        mla_reference: flash_512=off, a latent shape the kernel declines, or a CPU, which computes the same
        function); the record carries the latent cache's bytes per token beside the naive cache's."""
        config, device = self.engine.config, self.engine.device
        decision = decide_layer_attention(config, layer, self.flags)
        arm = ARMS[decision.arm]
        executed = arm if arm.supports(device) else ARMS[MLA_REFERENCE]
        note = "" if executed is arm else f"{decision.arm} cannot run on {device.type}: the reference computes " \
                                          f"the same function (K and V decompressed per head)"
        latent_bytes, naive_bytes = mla.cache_bytes_per_token(config, self.engine.dtype.itemsize)
        record = {
            "step": self.step, "layer": layer, "phase": self.phase, "n_tokens": self.n_tokens,
            "head_dim": config.head_dim, "attention": "latent",
            "decided_arm": decision.arm, "executed_arm": executed.name, "mask": decision.mask,
            "applied_mask": decision.applied_mask, "declined": decision.declined, "reason": decision.reason,
            "execution_note": note, "us": None, "us_method": None, "arm_kernels": [],
            "kv_cache_bytes_per_token": latent_bytes, "naive_kv_cache_bytes_per_token": naive_bytes,
            "forward": self.family_fields.get("forward", ""),
        }
        self.counters.bump(executed.name)
        self._engage("attention", executed.name, "latent", self.phase,
                     f"attention: {executed.name} engaged ({self.phase}, latent cache {latent_bytes} B per token "
                     f"per layer against {naive_bytes} B decompressed)"
                     + (f"; decided {decision.arm}" if executed is not arm else ""))
        self.attention_records.append(record)
        return self._run(record, lambda: executed.launch(config, q, latent_cache[:, :length], kv_b, q_start))

    def local_crossover(self, k: int, n_experts: int) -> int | None:
        """The measured crossover of an expert-parallel rank's own shape (k rows of n_experts local experts),
        looked up once per shape: a calibration swept at the model's E does not hold for E / W."""
        cache = self.__dict__.setdefault("_local_crossovers", {})
        if (k, n_experts) not in cache:
            config = self.engine.config
            entry = calibration.find_entry(device_label(self.engine.device), k, n_experts, config.hidden,
                                           config.intermediate, self.flags["tile_m"])
            cache[(k, n_experts)] = None if entry is None else int(entry["crossover_tokens"])
        return cache[(k, n_experts)]

    def trellis_gate(self, w13, w2) -> dict:
        """The GateInputs fields of trellis experts (engine.dispatch): their format, packed and bf16 bytes per
        expert, and this format's calibration on this GPU (one lookup per format per run)."""
        label = calibration.trellis_format(w13.code.code, w13.code.K)
        cached = self._trellis_gates.get(label)
        if cached is None:
            config = self.engine.config
            shape = (device_label(self.engine.device), config.top_k, config.n_experts, config.hidden,
                     config.intermediate, self.flags["tile_m"])
            cached = self._trellis_gates[label] = {
                "weight_format": dispatch.TRELLIS, "expert_bytes": w13.bytes_per_expert + w2.bytes_per_expert,
                "dense_expert_bytes": 2 * 3 * config.hidden * config.intermediate,
                "measured_crossover": calibration.find_crossover(*shape, weight_format=label),
                "measured_dequant_crossover": calibration.find_crossover(
                    *shape, weight_format=label, field="dequant_crossover_tokens"),
            }
        return cached

    def attention(self, layer, q, k_cache, v_cache, sinks, q_start, length):
        config, flags, device = self.engine.config, self.flags, self.engine.device
        layer_mask = config.layer_masks[layer]
        decision = decide_attention(config.head_dim, layer_mask.kind, layer_mask.describe(), flags["flash_512"],
                                    flags["fused_mask"])
        spec = (MaskSpec("causal") if decision.applied_mask == "causal"
                else MaskSpec(layer_mask.kind, layer_mask.window, layer_mask.block))
        arm = ARMS[decision.arm]
        executed = arm if arm.supports(device) else ARMS[UNFUSED]
        note = "" if executed is arm else f"{decision.arm} cannot run on {device.type}: the unfused reference " \
                                          f"computes its semantics ({decision.applied_mask} mask)"
        record = {
            "step": self.step, "layer": layer, "phase": self.phase, "n_tokens": self.n_tokens,
            "head_dim": config.head_dim,
            "decided_arm": decision.arm, "executed_arm": executed.name, "mask": decision.mask,
            "applied_mask": decision.applied_mask, "declined": decision.declined, "reason": decision.reason,
            "execution_note": note, "us": None, "us_method": None, "arm_kernels": [],
        }
        self.counters.bump(executed.name)
        self._engage("attention", executed.name, decision.applied_mask, self.phase,
                     f"attention: {executed.name} engaged ({self.phase}, {decision.mask} mask, applies "
                     f"{decision.applied_mask})" + (f"; decided {decision.arm}" if executed is not arm else ""))
        self.attention_records.append(record)
        return self._run(record, lambda: executed.launch(q, k_cache[:, :length], v_cache[:, :length], sinks, spec,
                                                         q_start, None))

    def end_step(self, next_token: torch.Tensor) -> int:
        """The step's one sync: the next token and every observed count together."""
        return self.end_step_batch(next_token.reshape(1))[0]

    def end_step_batch(self, next_tokens: torch.Tensor) -> list[int]:
        """The step's one sync for a batch: each row's next token [B] and every observed count."""
        rows = next_tokens.numel()
        staged = self._stage_routing() if self.pending_routing else None  # enqueued before the sync below
        values = torch.cat([next_tokens.reshape(-1).long(), torch.stack(self.pending_woken).long()]).tolist()
        self._observe(values[rows:])
        if staged is not None:
            self.routing.append(self.step, self.phase, *staged)
            self.pending_routing = []
        for record, stopped in self.pending_times:
            record["us"] = round(self.timer.microseconds(stopped), 1)
        return values[:rows]

    def end_replay(self, values: list[int], rows: int) -> list[int]:
        """A replayed step's outputs, read by the batch runner at the step's one sync: `values`
        [B + MoE layers] is the graph's static output as copied to the host (the next tokens, then each
        layer's woken experts, as `end_step_batch` concatenates them). The step's records are made here,
        the capture's with what the replay observed (`replayed_records`)."""
        self.moe_records, self.attention_records = self.replayed_records(self._template, self.step, values, rows)
        return values[:rows]

    def _stage_routing(self) -> tuple[tuple[int, ...], "object"]:
        """The step's routing packed ([n, W] int16: engine.routing_record.pack) and, on a GPU, its copy into a
        pinned buffer enqueued (non-blocking): the step's one sync, after it, waits for it too. (MoE layers,
        the rows as a numpy array to read after that sync.)"""
        layers = tuple(layer for layer, _, _ in self.pending_routing)
        packed = routing_record.pack([(ids, weights) for _, ids, weights in self.pending_routing])  # [n, W]
        if not packed.is_cuda:
            return layers, packed.numpy()
        staging = self._routing_staging
        if staging is None or staging.shape[0] < packed.shape[0] or staging.shape[1] != packed.shape[1]:
            rows = 1 << max(0, packed.shape[0] - 1).bit_length()
            staging = self._routing_staging = torch.empty((rows, packed.shape[1]), dtype=torch.int16,
                                                          pin_memory=True)
        host = staging[:packed.shape[0]]
        host.copy_(packed, non_blocking=True)
        return layers, host.numpy()

    def _observe(self, woken_counts: list[int]) -> None:
        for record, woken in zip(self.moe_records, woken_counts):
            record["woken_observed"] = woken
            record["pairs_per_woken_observed"] = _pairs_per_woken(record["n_tokens"] * record["k"], woken)

    def replay(self, template: "Dispatcher", kernels: dict[str, int], step: int, n_tokens: int,
               times: int = 1) -> None:
        """Step `step` is a CUDA-graph replay of the step `template` captured: begins it, as
        `begin_step(step, DECODE, n_tokens)` would, and counts the capture's arms and launches (`kernels`)
        again, since a replayed kernel never passes through Python (`times` replays: `Counters.replay`). The
        step's records come with its outputs (`end_replay`). Runs on the host path of every step that launches
        a replay (the batch runner calls it once the replay is issued); the later steps of a graph of several
        steps are counted and recorded together (`Engine._served_steps`)."""
        self.step, self.phase, self.n_tokens = step, DECODE, n_tokens
        self.pending_times = []
        self._replay_records = None
        self._template = template
        self.pending_routing = []  # a replay's routing lands with its outputs (engine.graphs), not through here
        self.counters.replay(template.counters.arms, kernels, times)
        self.pending_woken = template.pending_woken  # read, never extended: the step records no layer

    @staticmethod
    def replayed_records(template: "Dispatcher", step: int, values: list[int], rows: int
                         ) -> tuple[list[dict], list[dict]]:
        """Replayed step `step`'s (MoE, attention) records: the capture's (`template`'s), renumbered to this
        step, each MoE record with the woken experts its layer observed (`values`: as `end_replay`'s). Each
        is one copy of a dict prepared once per capture."""
        prepared = template._replay_records
        if prepared is None:
            prepared = template._replay_records = (
                [dict(record, graph="replay", phase=DECODE) for record in template.moe_records],
                [dict(record, graph="replay", phase=DECODE) for record in template.attention_records])
        moe = []
        for record, woken in zip(prepared[0], values[rows:]):
            record = record.copy()
            record["step"], record["woken_observed"] = step, woken
            record["pairs_per_woken_observed"] = _pairs_per_woken(record["n_tokens"] * record["k"], woken)
            moe.append(record)
        attention = []
        for record in prepared[1]:
            record = record.copy()
            record["step"] = step
            attention.append(record)
        return moe, attention

    def step_record(self) -> dict:
        return {"step": self.step, "phase": self.phase, "n_tokens": self.n_tokens,
                "moe": self.moe_records, "attention": self.attention_records}
