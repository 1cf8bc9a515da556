"""The decode step on a GPU with its glue fused: the same function as engine.model's torch forward
for one new token per sequence, in a few launches per layer instead of ~90 small torch kernels
(casts, the fp32 copies of the router and LM head, RoPE pieces, index_put, topk, softmax).

Per step (B sequences, one token each; shapes as in engine.model). At B <= GEMV_ROWS (batch 1) the
dense products are GEMVs with the glue folded in (kernels.gemv_fused) where that measured faster: the
RMSNorm into the router's and the LM head's GEMV (a program sums x^2 along K, scales, and writes its
slice of the new x and h), and the top-k routing into the router's GEMV (done by the last of the
programs to arrive, kernels.arrivals). The fold of the norm and of RoPE + the cache write into the
qkv GEMV exists (FOLD_QKV) but is off: slower on the H200 than its three launches (see FOLD_QKV).
Above GEMV_ROWS the products are torch matmuls (cuBLAS) between kernels.rms_norm, rope_cache and
router launches.

                                                       launches at B = 1            B > GEMV_ROWS
    x       = embed[tokens]
    per layer:
      qkv   = RMSNorm(x) @ [wq; wk; wv]^T              rms_norm, kernels.gemv  2    rms_norm, matmul, 3
      q     = RoPE(q); cache[k, v] <- RoPE(k), v       rope_cache              1    rope_cache
                                                       (FOLD_QKV: gemv_fused
                                                       gather + rope, 1)
      a     = attention(q, cache)                      the dispatcher's attention arm
      o     = a @ wo^T                                 kernels.gemv            1    matmul            1
      x, h  = x + o, RMSNorm(x + o)                    gemv_fused (residual    1    rms_norm, matmul, 3
      ids, w = topk-softmax(h @ router^T in fp32)      + route: its last            topk_softmax
               and the count of woken experts          program routes)
      e     = experts(h, ids, w)                       the dispatcher's MoE arm
      x     = x + e                                    (into the next norm's GEMV)
    logits  = RMSNorm(x) @ head^T in fp32              gemv_fused (residual    1    rms_norm, matmul  2
              and, in a graphed step, each row's        + pick: its last program
              next token (argmax)                       takes the argmax)

  * between layers the norm's input is x + e, a residual add: folded only into a product of at most
    FOLD_RESIDUAL_MAX_N outputs (the router, the LM head), else rms_norm + gemv_fused (2 launches).

Step outputs (`StepOutputs`, the hooks' `outputs`: set by engine.batch_runner around a decode step): the
router's fold writes each layer's woken count into the step's output buffer, and the LM head's fold takes
each row's next token into it (and feeds the next replay's inputs), so a graphed step at B = 1 needs no
next_tokens launch and no copy gathering the counts.

v4-shape at B = 1 (one layer; attention 2 launches, the MoE arm 2): 10 Triton launches per graphed step (8
with FOLD_QKV) and no copy; 9 in a later step of a graph of several steps, whose first norm the step before's
LM head wrote (StepOutputs.carry); 14 launches and 2 copies before the folds (the norms in front of the router
and the LM head, topk_softmax and the graph's next_tokens had launches of their own; the woken count was
copied into the output buffer, and that buffer to the host).
Without a packed qkv weight the three projections are separate products between an rms_norm and a
rope_cache launch.

Which kernel computes attention and the experts is still the dispatcher's decision: this module
only replaces the glue around the arms. Rounding happens where the torch forward rounds, so the two
differ only in the order of fp32 sums, except that the norm folded into qkv multiplies g * x unrounded
where the torch forward rounds h = RMSNorm(x) * g to the dtype first: about one rounding of each
output (tests/test_decode_fused.py bounds both). The router and the LM head feed a top-k and an
argmax, which jump at near ties, so their folds round h first (kernels.gemv_fused's exact norm, a
second read of x): their logits are gemv(h) of the h they write, the same roundings as the torch
forward, in a different order of fp32 sums only.

Eligible: a CUDA device (or `force` for the interpreter tests), one token per row, and a preset-style
architecture (no attention biases, q/k norms, clipping, YaRN, router bias or softmax-then-top-k):
the Hugging Face families keep the torch forward. Knows nothing of flags or scheduling.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from engine.config import ModelConfig
from engine.rope import rope_inverse_frequency

_INV_FREQ: dict[tuple, torch.Tensor] = {}
_SINKS: dict[int, tuple] = {}
# Rows up to which the dense products take kernels.gemv; above it cuBLAS. On the H200 at D = 4096
# (bench/gemv_bench.py, bench/results/2026-11-29-h200-run7-fused) one row: gemv 11.0-12.5 us vs cuBLAS
# 12.9-13.2 us for the projections, 2.9-3.1 vs 10.8-17.6 us for the fp32 logits; from two rows
# cuBLAS's tensor-core kernels are faster than the FMA path.
GEMV_ROWS = 1
# Widest product (N) a residual-add RMSNorm is folded into (kernels.gemv_fused): every program of the
# fold reads the whole x, residual and norm weight from L2, 24 KB at D = 4096 in bf16 (40 KB with the
# exact norm's second read), so the router and the LM head (N = 256: 10 MB of L2 reads for 2 MB of
# weights) take it and the qkv projection
# between layers (N = 5120, 2560 programs: 63 MB against 42 MB) keeps its own rms_norm launch until
# a GPU run shows the fold paying there. A gather is folded at any width (one vector fewer).
FOLD_RESIDUAL_MAX_N = 1024
# Whether the qkv GEMV takes its RMSNorm (gather or residual) and RoPE + cache write at one row. Off:
# on the H200 (bench/gemv_fused_bench.py, run 17) the fold took 17.9 us per call steady against 16.2
# for rms_norm + gemv + rope_cache (single call 16.4 vs 13.8; in the v4 step 18.4 us): its 2560
# programs each read the embedding row and the norm weight and arrive on one counter per head. The
# router's fold (7.0 vs 8.1 us) and the LM head's (4.0 vs 4.9 us) pay and stay.
FOLD_QKV = False


@dataclass
class StepOutputs:
    """Where a decode step's folds write what the host reads at the step's sync (engine.batch_runner sets
    it as the hooks' `outputs` around a step). `observed` [B + layers] int64: each row's next token, then
    each layer's woken-expert count; `inputs` [2, B] int64: the next replay's tokens and positions, fed one
    position on (None: not fed). The forward sets `picked` when the LM head wrote the tokens, and writes a
    layer's count only where its router's fold runs (the caller checks `pending_woken` for the rest)."""

    observed: torch.Tensor
    inputs: torch.Tensor | None = None
    picked: bool = False
    # A graph of several decode steps chains them (engine.batch_runner): `carry`, [B, D] x and h buffers the LM
    # head's pick writes the next step's first norm into (kernels.gemv_fused.NextNorm: the picked tokens'
    # embedding rows, normed), where the step can (`carried_out` is then set); `carried`, this step's x and h so
    # written by the step before: its first norm is not launched.
    carry: tuple[torch.Tensor, torch.Tensor] | None = None
    carried: tuple[torch.Tensor, torch.Tensor] | None = None
    carried_out: bool = False


def carry_default() -> bool:
    """Whether a graph of several steps carries each step's first norm from the step before (StepOutputs.carry):
    unless MOEI_CARRY_NORM=0 (the benchmark's A/B)."""
    return os.environ.get("MOEI_CARRY_NORM", "1") != "0"


def carried_launches(launched: dict[str, int], carried_in: bool, carried_out: bool) -> dict[str, int]:
    """A step's launches (`launched`: one not chained) when it was `carried_in` (no first rms_norm) and
    `carried_out` (its LM head's pick norms the next step's rows: gemv_pick_norm for gemv_pick)."""
    counts = dict(launched)
    if carried_in:
        counts["rms_norm"] = counts.get("rms_norm", 0) - 1
    if carried_out:
        counts["gemv_pick"] = counts.get("gemv_pick", 0) - 1
        counts["gemv_pick_norm"] = counts.get("gemv_pick_norm", 0) + 1
    return {name: count for name, count in counts.items() if count}


def ineligible(config: ModelConfig) -> str:
    """Why a decode step of this architecture keeps engine.model's torch forward ("" when the fused glue
    computes it): each feature the fused step does not have. Per-head q/k norms (Qwen3-MoE) are folded into
    rope_cache; softmax-then-top-k renormalised is top-k-then-softmax, the same function."""
    missing = [feature for feature, present in (
        ("q/k/v/o biases", config.attention_bias), ("a q/k norm over the whole projection", config.qk_norm == "full"),
        ("clip_qkv", config.clip_qkv is not None), ("YaRN RoPE", config.rope_scaling is not None),
        ("a router bias", config.router_bias),
        ("an RMSNorm rounded once (gpt-oss)", config.norm_rounds_once),  # kernels.rms_norm rounds twice
        ("softmax-top-k routing without renormalisation", config.router == "softmax_topk" and not config.norm_topk_prob),
    ) if present]
    return ", ".join(missing)


def eligible(config: ModelConfig, tokens: torch.Tensor, force: bool = False) -> bool:
    return ((tokens.is_cuda or force) and tokens.dim() == 2 and tokens.shape[1] == 1 and not ineligible(config))


def pack_qkv(config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    """Lay each layer's wq, wk, wv out back to back in one buffer and make the dict's entries views
    of it, so the decode step reads them with one GEMV. Values are unchanged; memory is freed."""
    for layer in range(config.n_layers):
        p = f"layers.{layer}."
        names = [p + "wq", p + "wk", p + "wv"]
        if any(name not in weights for name in names) or packed_qkv(weights, p) is not None:
            continue
        packed = torch.cat([weights[name] for name in names], dim=0)
        start = 0
        for name in names:
            rows = weights[name].shape[0]
            weights[name] = packed[start:start + rows]
            start += rows


def packed_qkv(weights: dict[str, torch.Tensor], p: str) -> torch.Tensor | None:
    """The [Nq + Nk + Nv, D] matrix wq, wk, wv form when they lie back to back in memory, else None."""
    wq, wk, wv = weights[p + "wq"], weights[p + "wk"], weights[p + "wv"]
    if not (wq.is_contiguous() and wk.is_contiguous() and wv.is_contiguous()):
        return None
    size = wq.element_size()
    if wk.data_ptr() != wq.data_ptr() + wq.numel() * size or wv.data_ptr() != wk.data_ptr() + wk.numel() * size:
        return None
    if wq.untyped_storage().data_ptr() != wv.untyped_storage().data_ptr():
        return None
    rows = wq.shape[0] + wk.shape[0] + wv.shape[0]
    return torch.as_strided(wq, (rows, wq.shape[1]), (wq.shape[1], 1))


def _inverse_frequency(config: ModelConfig, device: torch.device) -> torch.Tensor:
    """The model's RoPE frequencies (engine.model.rope_inverse_frequency), computed once per device."""
    key = (config.rope_theta, config.head_dim, device)
    table = _INV_FREQ.get(key)
    if table is None:
        table = _INV_FREQ[key] = rope_inverse_frequency(config, device)
    return table


def _float_sinks(sinks: torch.Tensor | None) -> torch.Tensor | None:
    """The sinks in float32, as the attention kernels take them, converted once per weight (not once
    per step: a cast is a launch). An updated weight (a new version) converts again."""
    if sinks is None or sinks.dtype == torch.float32:
        return sinks
    entry = _SINKS.get(id(sinks))  # the entry holds the tensor, so its id is not reused while cached
    if entry is None or entry[0] is not sinks or entry[1] != sinks._version:
        entry = _SINKS[id(sinks)] = (sinks, sinks._version, sinks.float())
    return entry[2]


def _dense(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    from kernels.gemv import gemv

    if x.shape[0] <= GEMV_ROWS:
        return gemv(x, w, out_dtype)
    if out_dtype == torch.float32:
        return x.float() @ w.float().t()
    return x @ w.t()


def _qkv(weights: dict[str, torch.Tensor], p: str, h: torch.Tensor) -> torch.Tensor:
    packed = packed_qkv(weights, p)
    if packed is not None:
        return _dense(h, packed)
    return torch.cat([_dense(h, weights[p + name]) for name in ("wq", "wk", "wv")], dim=1)


def _fused_rows(rows: int) -> bool:
    """Whether the dense products of a step of `rows` rows are GEMVs with the glue folded in."""
    from kernels.gemv_fused import MAX_ROWS

    return rows <= min(GEMV_ROWS, MAX_ROWS)


def _folds(norm, w: torch.Tensor, rows: int) -> bool:
    """Whether the RMSNorm `norm` (a kernels.gemv_fused.Norm) goes into the GEMV of `w` at `rows` rows:
    a one-row-style step, and a gather anywhere but a residual add only into a narrow product (every
    program of the fold reads the whole x, residual and norm weight: FOLD_RESIDUAL_MAX_N)."""
    return _fused_rows(rows) and (norm.table is not None or w.shape[0] <= FOLD_RESIDUAL_MAX_N)


def _rms_norm(x: torch.Tensor | None, norm) -> tuple[torch.Tensor, torch.Tensor]:
    """The norm on its own (kernels.rms_norm): where it is not folded into the next GEMV."""
    from kernels.rms_norm import rms_norm

    if norm.table is not None:
        return rms_norm(None, norm.weight, norm.eps, table=norm.table, index=norm.index)
    return rms_norm(x, norm.weight, norm.eps, residual=norm.residual)


def forward_decode(config: ModelConfig, weights: dict[str, torch.Tensor], tokens: torch.Tensor,
                   start: torch.Tensor, key_length: int, slots: torch.Tensor | None, cache, hooks,
                   q_start: "int | torch.Tensor | None" = None) -> torch.Tensor:
    """tokens [B, 1] at positions start [B] (int64, on the device) -> logits [B, V] float32.
    Row b reads and writes cache row slots[b] (None: row b); attention reads `key_length` keys.
    `q_start` is what the attention hook receives as the query start (default `start`)."""
    from dataclasses import replace

    from kernels.gemv_fused import NextNorm, Norm, Pick, Rope, Route, gemv_fused, next_norm_fits
    from kernels.rope_cache import rope_cache
    from kernels.router import topk_softmax

    c = config
    batch = tokens.shape[0]
    outputs: StepOutputs | None = getattr(hooks, "outputs", None)
    inv_freq = _inverse_frequency(c, tokens.device)
    # Each RMSNorm is held as its input until the GEMV it feeds: folded into it, or run on its own.
    x = None  # [B, D] the residual stream, once written
    norm = Norm(weights["layers.0.attn_norm"], c.norm_eps, table=weights["embed"], index=tokens.reshape(-1))
    carried = None if outputs is None else outputs.carried  # x and h of this step's first norm, computed already
    for layer in range(c.n_layers):
        p = f"layers.{layer}."
        packed = packed_qkv(weights, p)
        normed = layer == 0 and carried is not None
        if normed:
            x, h = carried
        if packed is not None and FOLD_QKV and c.qk_norm == "none" and _fused_rows(batch):  # qkv, RoPE, cache write
            rope = Rope(inv_freq, start, slots, cache.k[layer], cache.v[layer], c.n_heads)
            if normed:
                folded = gemv_fused(h, packed, rope=rope)
            elif _folds(norm, packed, batch):
                folded = gemv_fused(x if norm.table is None else None, packed, norm=replace(norm, write_x=True),
                                    rope=rope)
                x = folded.x
            else:
                x, h = _rms_norm(x, norm)
                folded = gemv_fused(h, packed, rope=rope)
            q, start32 = folded.q, folded.position32
        else:
            if not normed:
                x, h = _rms_norm(x, norm)
            qk_norm = (weights[p + "q_norm"], weights[p + "k_norm"], c.norm_eps) if c.qk_norm == "per_head" else None
            q, start32 = rope_cache(_qkv(weights, p, h), inv_freq, start, slots, cache.k[layer], cache.v[layer],
                                    c.n_heads, qk_norm)
        # q [B, Hq, hd] rotated; k (rotated) and v in the cache; start32 the positions as int32
        k_rows, v_rows = cache.rows(layer, batch, key_length, slots)  # [B, Tk, Hkv, hd]
        attended = hooks.attention(layer, q.view(batch, 1, c.n_heads, c.head_dim), k_rows, v_rows,
                                   _float_sinks(weights.get(p + "sinks")), start32 if q_start is None else q_start,
                                   key_length)  # [B, 1, Hq, hd]
        o = _dense(attended.reshape(batch, c.n_heads * c.head_dim), weights[p + "wo"])  # [B, D]
        norm = Norm(weights[p + "moe_norm"], c.norm_eps, residual=o)
        router = weights[p + "router"]
        if _folds(norm, router, batch):  # the norm, the fp32 logits and the routing in one launch
            into = None if outputs is None else outputs.observed[batch + layer:batch + layer + 1]
            folded = gemv_fused(x, router, norm=replace(norm, write_x=True, write_h=True, exact=True),
                                route=Route(c.top_k, x.dtype, into=into))
            x, h, ids, routing, woken = folded.x, folded.h, folded.ids, folded.weights, folded.woken
        else:
            x, h = _rms_norm(x, norm)
            ids, routing, woken = topk_softmax(_dense(h, router, torch.float32), c.top_k, h.dtype, woken=True)
        expert_out = hooks.moe(layer, h, weights[p + "w13"], weights[p + "w2"], ids, routing, woken=woken)  # [B, D]
        next_norm = weights[f"layers.{layer + 1}.attn_norm"] if layer + 1 < c.n_layers else weights["norm"]
        norm = Norm(next_norm, c.norm_eps, residual=expert_out)
    head = weights["embed"] if c.tie_embeddings else weights["lm_head"]
    if _folds(norm, head, batch):
        pick = None
        if outputs is not None:
            following = None
            # the next step's first norm, as its own rms_norm launch would compute it (not under FOLD_QKV, whose
            # first norm is no launch of its own)
            if outputs.carry is not None and not FOLD_QKV and next_norm_fits(c.hidden):
                following = NextNorm(weights["embed"], weights["layers.0.attn_norm"], c.norm_eps, *outputs.carry)
            pick = Pick(outputs.observed[:batch], outputs.inputs, following)
        logits = gemv_fused(x, head, torch.float32, norm=replace(norm, exact=True), pick=pick).out  # [B, V]
        if pick is not None:
            outputs.picked = True
            outputs.carried_out = pick.next_norm is not None
        return logits
    x, h = _rms_norm(x, norm)
    return _dense(h, head, torch.float32)  # [B, V]
