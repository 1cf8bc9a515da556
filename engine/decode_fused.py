"""The decode step on a GPU with its glue fused: the same function as engine.model's torch forward
for one new token per sequence, in a few launches per layer instead of about 90 small torch kernels.

`forward_decode(config, weights, tokens [B, 1], start [B], key_length, slots, cache, hooks)` returns
the logits [B, V] float32 and writes each layer's keys and values into the cache. At B <= GEMV_ROWS
the dense products are GEMVs (kernels.gemv) and the RMSNorm in front of the router and of the LM
head, the top-k routing and the argmax fold into their GEMVs (kernels.gemv_fused), and with the hooks'
`fold_qkv_norm` (the flag qkv_norm_fold) each attention norm into its q/k/v or latent GEMV, and with its
`l2_prefetch_windows` (the flag l2_prefetch) known weights are asked into L2 on a side stream meanwhile
(engine.l2_prefetch); above it they are
torch matmuls between kernels.rms_norm, rope_cache and router launches. With the hooks' `outputs`
(`StepOutputs`, set by engine.batch_runner around a graphed step) the folds write the step's next
tokens and woken counts straight into the step's host buffer. Rounding happens where the torch
forward rounds: the two differ only in the order of fp32 sums (tests/test_decode_fused.py,
tests/test_decode_fused_mla.py).

DeepSeek-V2/V3-family layers take engine.decode_fused_mla: latent attention (its projections, RoPE with
YaRN, the latent cache write; the arm stays the hooks'), shared experts and dense SwiGLU layers. The
routers fold softmax-then-top-k with or without renormalisation and routed_scaling_factor; the
group-limited routers (V2's group_limited_greedy, V3's sigmoid with its correction bias) take
rms_norm, the router's GEMV and kernels.router.group_topk, unfolded. gpt-oss's layers add biases (each added
in its product's epilogue, as torch adds it to the rounded product), YaRN's attention factor on RoPE's cos and
sin (rope_cache), a router bias in the router's fold, norms rounded once (`Norm.rounds_once`) and its clamped,
biased experts (engine.family_experts, handed to the hooks' `moe`). Qwen2-MoE's q/k/v biases take the same epilogue,
and its sigmoid-gated shared expert scales the shared MLP's output after it (SharedExpertsDecode's `gate`).

Does not decide which kernel computes attention and the experts (the dispatcher, through `hooks`),
and knows nothing of flags or scheduling. Eligible (`eligible`): a CUDA device (or `force` for the
interpreter tests), one token per row, and a shape the glue computes (`ineligible` says what it lacks: a head_dim
whose half is not a power of two). Per-head q/k norms (Qwen3-MoE) fold into rope_cache; OLMoE's norms over the
whole q and k projections and its clip_qkv take one kernels.qk_norm launch between the q/k/v GEMV and
rope_cache. The launch table per step, and why each fold is where it is:
docs/decode-step.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import decode_fused_mla
from engine.config import GROUPED_ROUTERS, ModelConfig
from engine.family_experts import family_experts
from engine.l2_prefetch import OFF as _NO_PREFETCH
from engine.l2_prefetch import L2Prefetch
from engine.rope import rope_inverse_frequency, yarn_inverse_frequency

_INV_FREQ: dict[tuple, torch.Tensor] = {}
_SINKS: dict[int, tuple] = {}
# Rows up to which the dense products take kernels.gemv; above it cuBLAS, whose tensor-core kernels are
# faster from two rows (bench/RESULTS.md, "The dense GEMV").
GEMV_ROWS = 1
# Widest product (N) a residual-add RMSNorm is folded into (kernels.gemv_fused): every program of the
# fold reads the whole x, residual and norm weight from L2, so the router and the LM head (N = 256) take
# it; the q/k/v projection (N = 5120) takes a fold of its own at QKV_FOLD_BLOCK (docs/decode-step.md).
FOLD_RESIDUAL_MAX_N = 1024
# The block (outputs, K elements a step) of a layer's attention norm folded into its q/k/v or latent GEMV (hooks'
# `fold_qkv_norm`, the flag qkv_norm_fold): a program reads x, the residual and the norm weight for its BLOCK_N
# outputs (L2 reads of 3 / BLOCK_N the weight's bytes), but fewer, longer programs lost: run 81
# (bench/experiments/qkv_fold.py), µs the chain adds a layer against rms_norm + gemv, at Qwen3-30B-A3B /
# DeepSeek-V2-Lite / v4-shape widths: 4 x 1024 -1.36 / -1.15 / -0.45, 8 x 1024 -1.30 / -0.83 / -0.49,
# 16 x 512 +0.32 / +0.67 / +2.17; the exact norm (h rounded first) gave back most of the gain.
QKV_FOLD_BLOCK = (4, 1024)


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
    computes it): each feature the fused step does not have. Every family's layers are computed (the module's
    docstring); what remains is a shape: rope_cache rotates whole heads whose half is a power of two."""
    half = config.head_dim // 2
    if config.latent_attention is None and half & (half - 1):
        return f"RoPE at head_dim {config.head_dim} (rope_cache takes head_dim / 2 a power of two)"
    return ""


def eligible(config: ModelConfig, tokens: torch.Tensor, force: bool = False) -> bool:
    return ((tokens.is_cuda or force) and tokens.dim() == 2 and tokens.shape[1] == 1 and not ineligible(config))


def pack_qkv(config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    """Lay each layer's wq, wk, wv out back to back in one buffer and make the dict's entries views
    of it, so the decode step reads them with one GEMV (latent attention: the query's first projection
    and wkv_a, engine.decode_fused_mla.pack_latent); their biases too, where the family has them, for that
    GEMV's epilogue. Values are unchanged; memory is freed."""
    if config.latent_attention is not None:
        decode_fused_mla.pack_latent(config, weights)
        return
    for layer in range(config.n_layers):
        p = f"layers.{layer}."
        decode_fused_mla.pack_rows(weights, [p + "wq", p + "wk", p + "wv"])
        decode_fused_mla.pack_rows(weights, [p + "bq", p + "bk", p + "bv"])  # where the family has them


def packed_qkv(weights: dict[str, torch.Tensor], p: str) -> torch.Tensor | None:
    """The [Nq + Nk + Nv, D] matrix wq, wk, wv form when they lie back to back in memory, else None."""
    return decode_fused_mla.packed_rows(weights, [p + "wq", p + "wk", p + "wv"])


def _inverse_frequency(config: ModelConfig, device: torch.device) -> torch.Tensor:
    """The model's RoPE frequencies (engine.rope: YaRN's where the config scales RoPE), computed once per device."""
    if config.rope_scaling is not None:
        return yarn_inverse_frequency(config, device)  # cached there
    key = (config.rope_theta, config.rotary_dim, device)
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


def dense(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None,
          bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, K] @ w [N, K]^T (+ bias [N], added to the rounded product as engine.model adds it) -> [B, N] in
    out_dtype (default x's) as the step computes its dense products: kernels.gemv up to GEMV_ROWS rows (the bias
    in its epilogue), torch matmuls above (float32 ones for float32 logits). Public: the sweep's neighbours
    (engine.sweep_neighbours) launch exactly what the step launches."""
    from kernels.gemv import gemv

    if x.shape[0] <= GEMV_ROWS:
        return gemv(x, w, out_dtype, bias=bias)
    if out_dtype == torch.float32:
        product = x.float() @ w.float().t()
        return product if bias is None else product + bias.float()
    return x @ w.t() if bias is None else x @ w.t() + bias


def _qkv(config: ModelConfig, weights: dict[str, torch.Tensor], p: str, layer_input: "_LayerInput") -> torch.Tensor:
    """[B, (Hq + 2 Hkv) hd]: q, k and v of the layer's input, their biases added where the family has them."""
    bias_names = [p + name for name in ("bq", "bk", "bv")] if config.attention_bias or config.qkv_bias else []
    packed = packed_qkv(weights, p)
    packed_bias = decode_fused_mla.packed_rows(weights, bias_names) if bias_names else None
    if packed is not None and bool(bias_names) == (packed_bias is not None):  # one GEMV, its biases in its epilogue
        return layer_input.product(packed, packed_bias)
    biases = [weights[name] for name in bias_names] or [None] * 3
    return torch.cat([layer_input.product(weights[p + name], bias)
                      for name, bias in zip(("wq", "wk", "wv"), biases)], dim=1)


def _whole_norm_and_clip(config: ModelConfig, weights: dict[str, torch.Tensor], p: str,
                         qkv: torch.Tensor) -> torch.Tensor:
    """OLMoE's q and k RMSNorms over the whole projection, then clip_qkv on q, k and v, in engine.model's order, in
    one launch in place (kernels.qk_norm): [B, (Hq + 2 Hkv) hd] -> the same. Other families: qkv untouched."""
    from kernels.qk_norm import qk_norm_clip

    c = config
    if c.qk_norm != "full" and c.clip_qkv is None:
        return qkv
    full = c.qk_norm == "full"
    return qk_norm_clip(qkv, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim,
                        weights[p + "q_norm"] if full else None, weights[p + "k_norm"] if full else None, c.norm_eps,
                        c.clip_qkv, rounds_once=c.norm_rounds_once)


def fused_rows(rows: int) -> bool:
    """Whether the dense products of a step of `rows` rows are GEMVs with the glue folded in."""
    from kernels.gemv_fused import MAX_ROWS

    return rows <= min(GEMV_ROWS, MAX_ROWS)


def _folds(norm, w: torch.Tensor, rows: int) -> bool:
    """Whether the RMSNorm `norm` (a kernels.gemv_fused.Norm) goes into the GEMV of `w` at `rows` rows:
    a one-row-style step, and a gather anywhere but a residual add only into a narrow product (every
    program of the fold reads the whole x, residual and norm weight: FOLD_RESIDUAL_MAX_N)."""
    return fused_rows(rows) and (norm.table is not None or w.shape[0] <= FOLD_RESIDUAL_MAX_N)


def qkv_fold_block(k_in: int) -> tuple[int, int]:
    """The (BLOCK_N, BLOCK_K) of a folded attention norm's GEMV at K = k_in: QKV_FOLD_BLOCK, BLOCK_K never wider
    than K. Public: the sweep's neighbours (engine.sweep_neighbours) launch what the step launches."""
    return QKV_FOLD_BLOCK[0], min(QKV_FOLD_BLOCK[1], 1 << max(0, k_in - 1).bit_length())


class _LayerInput:
    """A layer's input norm, held until its first product: `product(w)` is RMSNorm(x) @ w^T, with the norm folded into
    that GEMV (`fold`: a one-row step, the flag qkv_norm_fold) or run on its own first. `x` is then the residual
    stream after the norm's residual add (or gather); a second product reads h (or norms x again after a fold)."""

    def __init__(self, x: torch.Tensor | None, norm, fold: bool, h: torch.Tensor | None = None) -> None:
        self.x, self.norm, self.fold, self.h = x, norm, fold, h

    def product(self, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        from dataclasses import replace

        from kernels.gemv_fused import Norm, gemv_fused

        if self.h is None and self.fold:
            folded = gemv_fused(self.x, w, norm=replace(self.norm, write_x=True), bias=bias,
                                block=qkv_fold_block(w.shape[1]))
            self.x, self.fold = folded.x, False
            # a second product norms the new stream on its own
            self.norm = Norm(self.norm.weight, self.norm.eps, rounds_once=self.norm.rounds_once)
            return folded.out
        if self.h is None:
            self.x, self.h = _rms_norm(self.x, self.norm)
        return dense(self.h, w, bias=bias)


def _rms_norm(x: torch.Tensor | None, norm) -> tuple[torch.Tensor, torch.Tensor]:
    """The norm on its own (kernels.rms_norm): where it is not folded into the next GEMV."""
    from kernels.rms_norm import rms_norm

    if norm.table is not None:
        return rms_norm(None, norm.weight, norm.eps, table=norm.table, index=norm.index, rounds_once=norm.rounds_once)
    return rms_norm(x, norm.weight, norm.eps, residual=norm.residual, rounds_once=norm.rounds_once)


def _plain_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """h = RMSNorm(x) * weight of rows x [B, K] (kernels.rms_norm, no residual): latent attention's q_a norm."""
    from kernels.gemv_fused import Norm

    return _rms_norm(x, Norm(weight, eps))[1]


def forward_decode(config: ModelConfig, weights: dict[str, torch.Tensor], tokens: torch.Tensor,
                   start: torch.Tensor, key_length: int, slots: torch.Tensor | None, cache, hooks,
                   q_start: "int | torch.Tensor | None" = None) -> torch.Tensor:
    """tokens [B, 1] at positions start [B] (int64, on the device) -> logits [B, V] float32.
    Row b reads and writes cache row slots[b] (None: row b); attention reads `key_length` keys.
    `q_start` is what the attention hook receives as the query start (default `start`)."""
    from dataclasses import replace

    from kernels.gemv_fused import NextNorm, Norm, Pick, Route, gemv_fused, next_norm_fits
    from kernels.rope_cache import rope_cache
    from kernels.router import group_topk, topk_softmax

    c = config
    batch = tokens.shape[0]
    outputs: StepOutputs | None = getattr(hooks, "outputs", None)
    inv_freq = _inverse_frequency(c, tokens.device)
    rope_scale = 1.0 if c.rope_scaling is None else c.rope_scaling.resolved_attention_factor  # YaRN's, on cos and sin
    once = c.norm_rounds_once  # every norm's h rounded once (gpt-oss), as engine.model.rms_norm
    # Each RMSNorm is held as its input until the GEMV it feeds: folded into it, or run on its own.
    x = None  # [B, D] the residual stream, once written
    norm = Norm(weights["layers.0.attn_norm"], c.norm_eps, table=weights["embed"], index=tokens.reshape(-1),
                rounds_once=once)
    carried = None if outputs is None else outputs.carried  # x and h of this step's first norm, computed already
    dense_layers = set(c.dense_layers)
    gemv_rows = fused_rows(batch)
    moe_index = 0  # the MoE layer's ordinal: where its woken count goes in the step's outputs
    # The attention norms folded into the q/k/v GEMVs (hooks' fold_qkv_norm); the first layer's only where the
    # step before's LM head does not norm it (fold_first_norm: carry_norm off), so a carried step computes what a
    # step that norms on its own computes, to the bit
    fold_qkv = gemv_rows and bool(getattr(hooks, "fold_qkv_norm", False))
    fold_first = gemv_rows and bool(getattr(hooks, "fold_first_norm", fold_qkv))
    # The flag l2_prefetch: known weights asked into L2 on a side stream during latency-bound kernels (one row)
    opened = getattr(hooks, "l2_prefetch_windows", frozenset())
    prefetch = (L2Prefetch(opened, tokens.device) if opened and gemv_rows and c.latent_attention is None
                else _NO_PREFETCH)
    for layer in range(c.n_layers):
        p = f"layers.{layer}."
        if layer == 0 and carried is not None:  # this step's first norm, written by the step before's LM head
            layer_input = _LayerInput(carried[0], None, False, h=carried[1])
        else:
            layer_input = _LayerInput(x, norm, fold_first if layer == 0 else fold_qkv)
        if c.latent_attention is not None:
            o = decode_fused_mla.attention(c, weights, layer, layer_input.product, batch, dense, _plain_norm,
                                           inv_freq, start, key_length, slots, cache, hooks, q_start)  # [B, D]
        else:
            qk_norm = (weights[p + "q_norm"], weights[p + "k_norm"], c.norm_eps) if c.qk_norm == "per_head" else None
            qkv = _qkv(c, weights, p, layer_input)
            prefetch.during("attention", (weights[p + "wo"], weights.get(p + "router")))
            q, start32 = rope_cache(_whole_norm_and_clip(c, weights, p, qkv), inv_freq,
                                    start, slots, cache.k[layer], cache.v[layer], c.n_heads, qk_norm, rope_scale)
            # q [B, Hq, hd] rotated; k (rotated) and v in the cache; start32 the positions as int32
            k_rows, v_rows = cache.rows(layer, batch, key_length, slots)  # [B, Tk, Hkv, hd]
            attended = hooks.attention(layer, q.view(batch, 1, c.n_heads, c.head_dim), k_rows, v_rows,
                                       _float_sinks(weights.get(p + "sinks")), start32 if q_start is None else q_start,
                                       key_length)  # [B, 1, Hq, hd]
            o = dense(attended.reshape(batch, c.n_heads * c.head_dim), weights[p + "wo"],
                      bias=weights[p + "bo"] if c.attention_bias else None)  # [B, D]
            if layer + 1 < c.n_layers:
                prefetch.during("routing", (packed_qkv(weights, f"layers.{layer + 1}."),))
        x = layer_input.x  # the residual stream after the attention norm's add
        norm = Norm(weights[p + "moe_norm"], c.norm_eps, residual=o, rounds_once=once)
        if layer in dense_layers:  # a dense SwiGLU MLP: no router, no experts, no MoE record
            x, h = _rms_norm(x, norm)
            expert_out = decode_fused_mla.swiglu(h, weights[p + "mlp_gate_up"], weights[p + "mlp_down"], gemv_rows)
        else:
            router, router_bias = weights[p + "router"], weights.get(p + "router_bias")  # bias: gpt-oss
            # softmax over every expert, top k, not renormalised (DeepSeek-V2): the fold divides by the whole sum
            over_all = c.router == "softmax_topk" and not c.norm_topk_prob
            if c.router in GROUPED_ROUTERS:  # DeepSeek's group-limited routers: not folded (kernels.router.group_topk)
                x, h = _rms_norm(x, norm)
                logits = dense(h if router.dtype == h.dtype else h.to(router.dtype), router, torch.float32)  # [B, E]
                ids, routing, woken = group_topk(logits, c.top_k, c.n_group, c.topk_group, c.router, h.dtype,
                                                 bias=weights.get(p + "router_correction"),
                                                 norm_topk_prob=c.norm_topk_prob, scale=c.routed_scaling_factor,
                                                 woken=True)
            elif _folds(norm, router, batch):  # the norm, the fp32 logits and the routing in one launch
                into = None if outputs is None else outputs.observed[batch + moe_index:batch + moe_index + 1]
                folded = gemv_fused(x, router, norm=replace(norm, write_x=True, write_h=True, exact=True),
                                    bias=router_bias, route=Route(c.top_k, x.dtype, into=into, over_all=over_all,
                                                                  scale=c.routed_scaling_factor))
                x, h, ids, routing, woken = folded.x, folded.h, folded.ids, folded.weights, folded.woken
            else:
                x, h = _rms_norm(x, norm)
                ids, routing, woken = topk_softmax(dense(h, router, torch.float32, router_bias), c.top_k, h.dtype,
                                                   woken=True, over_all=over_all, scale=c.routed_scaling_factor)
            if c.shared_experts is not None:
                shared = decode_fused_mla.SharedExpertsDecode(weights[p + "shared_gate_up"], weights[p + "shared_down"],
                                                              gemv_rows, weights.get(p + "shared_gate"))
                expert_out = hooks.moe(layer, h, weights[p + "w13"], weights[p + "w2"], ids, routing, woken=woken,
                                       shared=shared)  # [B, D]
            else:  # gpt-oss's clamped, biased experts go to the hooks as `experts` (engine.family_experts)
                extras = family_experts(c, weights, layer)
                expert_out = hooks.moe(layer, h, weights[p + "w13"], weights[p + "w2"], ids, routing, woken=woken,
                                       **({} if extras is None else dict(experts=extras)))
            moe_index += 1
        next_norm = weights[f"layers.{layer + 1}.attn_norm"] if layer + 1 < c.n_layers else weights["norm"]
        norm = Norm(next_norm, c.norm_eps, residual=expert_out, rounds_once=once)
    head = weights["embed"] if c.tie_embeddings else weights["lm_head"]
    if _folds(norm, head, batch):
        pick = None
        if outputs is not None:
            following = None
            # the next step's first norm, as its own rms_norm launch would compute it
            # (with the first norm folded into the first GEMV there is no launch to save: nothing is carried)
            if outputs.carry is not None and next_norm_fits(c.hidden) and not fold_first:
                following = NextNorm(weights["embed"], weights["layers.0.attn_norm"], c.norm_eps, *outputs.carry,
                                     rounds_once=once)
            pick = Pick(outputs.observed[:batch], outputs.inputs, following)
        logits = gemv_fused(x, head, torch.float32, norm=replace(norm, exact=True), pick=pick).out  # [B, V]
        prefetch.join()
        if pick is not None:
            outputs.picked = True
            outputs.carried_out = pick.next_norm is not None
        return logits
    x, h = _rms_norm(x, norm)
    logits = dense(h, head, torch.float32)  # [B, V]
    prefetch.join()
    return logits
