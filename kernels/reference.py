"""Deliberately naive torch references that every kernel in kernels/ must match.

Shape legend:
    T  = tokens (rows of x)            k = experts per token (top-k)
    E  = routed experts                D = hidden size          F = expert intermediate size
    B  = batch (sequences)             Tq / Tk = query / key positions of one sequence
    Hq / Hkv = query / key-value heads (Hq % Hkv == 0, grouped-query attention)
    hd = head dim

This module knows nothing about models, flags or dispatch: it computes the math in float32
and returns the caller's dtype. It is also the CPU path of the engine (the `reference` arms).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


# --------------------------------------------------------------------------------------------
# MoE
# --------------------------------------------------------------------------------------------

def moe_reference(
    x: torch.Tensor,  # [T, D]
    w13: torch.Tensor,  # [E, 2F, D]  rows 0..F-1 gate, F..2F-1 up
    w2: torch.Tensor,  # [E, D, F]
    topk_ids: torch.Tensor,  # [T, k] int
    topk_weights: torch.Tensor,  # [T, k] float
) -> torch.Tensor:  # [T, D]
    """SwiGLU experts: out[t] = sum_j w[t,j] * w2[e] @ (silu(gate_e x_t) * (up_e x_t)), e = ids[t,j].

    Loops over the experts that were woken, in float32, so it is slow and obviously right.
    """
    T, D = x.shape
    E, two_f, _ = w13.shape
    f = two_f // 2
    out = torch.zeros(T, D, dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1).long()  # [T*k]
    flat_weights = topk_weights.reshape(-1).float()  # [T*k]
    flat_tokens = torch.arange(T, device=x.device).repeat_interleave(topk_ids.shape[1])  # [T*k]
    for expert in torch.unique(flat_ids).tolist():
        pair = (flat_ids == expert).nonzero(as_tuple=True)[0]  # pairs routed to this expert
        tokens = flat_tokens[pair]
        xe = x[tokens].float()  # [P, D]
        gate_up = xe @ w13[expert].float().t()  # [P, 2F]
        hidden = F.silu(gate_up[:, :f]) * gate_up[:, f:]  # [P, F]
        down = hidden @ w2[expert].float().t()  # [P, D]
        out.index_add_(0, tokens, down * flat_weights[pair, None])
    return out.to(x.dtype)


def moe_reference_gpt_oss(
    x: torch.Tensor,  # [T, D]
    w13: torch.Tensor,  # [E, 2F, D]  rows 0..F-1 gate, F..2F-1 up
    w2: torch.Tensor,  # [E, D, F]
    topk_ids: torch.Tensor,  # [T, k] int
    topk_weights: torch.Tensor,  # [T, k] float
    b13: torch.Tensor | None,  # [E, 2F] gate then up, like w13's rows; None = no bias
    b2: torch.Tensor | None,  # [E, D]
    alpha: float,
    limit: float,
) -> torch.Tensor:  # [T, D]
    """gpt-oss experts: biases and the clamped SwiGLU.

        gate, up = split(w13_e x + b13_e);  gate = min(gate, limit);  up = clamp(up, -limit, limit)
        out[t] = sum_j w[t,j] * (w2_e @ ((up + 1) * gate * sigmoid(alpha * gate)) + b2_e)

    The down bias sits inside the routing weight. Same naive walk over woken experts as
    `moe_reference`, in float32.
    """
    T, D = x.shape
    f = w13.shape[1] // 2
    out = torch.zeros(T, D, dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1).long()  # [T*k]
    flat_weights = topk_weights.reshape(-1).float()  # [T*k]
    flat_tokens = torch.arange(T, device=x.device).repeat_interleave(topk_ids.shape[1])  # [T*k]
    for expert in torch.unique(flat_ids).tolist():
        pair = (flat_ids == expert).nonzero(as_tuple=True)[0]
        tokens = flat_tokens[pair]
        gate_up = x[tokens].float() @ w13[expert].float().t()  # [P, 2F]
        if b13 is not None:
            gate_up = gate_up + b13[expert].float()
        gate = gate_up[:, :f].clamp(max=limit)  # [P, F]
        up = gate_up[:, f:].clamp(-limit, limit)
        hidden = (up + 1) * (gate * torch.sigmoid(alpha * gate))  # [P, F]
        down = hidden @ w2[expert].float().t()  # [P, D]
        if b2 is not None:
            down = down + b2[expert].float()
        out.index_add_(0, tokens, down * flat_weights[pair, None])
    return out.to(x.dtype)


# --------------------------------------------------------------------------------------------
# Attention masks and sinks
# --------------------------------------------------------------------------------------------

MASK_KINDS = ("causal", "window", "composite", "none")


@dataclass(frozen=True)
class MaskSpec:
    """Which keys a query may see.

    kind:
        causal     j <= i
        window     j <= i and i - j < window
        composite  j <= i and (i - j < window or j % block == 0)   (window plus block-start
                   "summary" tokens; not expressible as a relative window)
        none       every key (the "unmasked" reference of the magnitude check)
    Key padding (a per-key bool, True = padded) is applied on top of every kind but `none`.
    """

    kind: str = "causal"
    window: int = 0
    block: int = 0

    def __post_init__(self) -> None:
        if self.kind not in MASK_KINDS:
            raise ValueError(f"mask kind {self.kind!r} is not one of {MASK_KINDS}")
        if self.kind in ("window", "composite") and self.window < 1:
            raise ValueError(f"mask kind {self.kind!r} needs window >= 1, got {self.window}")
        if self.kind == "composite" and self.block < 1:
            raise ValueError(f"composite mask needs block >= 1, got {self.block}")

    def describe(self) -> str:
        if self.kind == "window":
            return f"window(W={self.window})"
        if self.kind == "composite":
            return f"composite(W={self.window},B={self.block})"
        return self.kind


def visible_mask(
    spec: MaskSpec,
    query_positions: torch.Tensor,  # [Tq] absolute positions of the queries
    key_positions: torch.Tensor,  # [Tk]
    key_padding: torch.Tensor | None = None,  # [Tk] bool, True = padded
) -> torch.Tensor:  # [Tq, Tk] bool, True = visible
    i = query_positions[:, None]
    j = key_positions[None, :]
    if spec.kind == "none":
        return torch.ones(i.shape[0], j.shape[1], dtype=torch.bool, device=i.device)
    visible = j <= i
    if spec.kind == "window":
        visible = visible & (i - j < spec.window)
    elif spec.kind == "composite":
        visible = visible & ((i - j < spec.window) | (j % spec.block == 0))
    if key_padding is not None:
        visible = visible & ~key_padding[None, :]
    return visible


def attention_reference(
    q: torch.Tensor,  # [B, Tq, Hq, hd]
    k: torch.Tensor,  # [B, Tk, Hkv, hd]
    v: torch.Tensor,  # [B, Tk, Hkv, hd]
    sinks: torch.Tensor | None,  # [Hq] learned logits (may hold +-inf), None = no sink
    spec: MaskSpec,
    q_start: torch.Tensor | int = 0,  # [B] or int: absolute position of each sequence's first query
    key_padding: torch.Tensor | None = None,  # [B, Tk] bool, True = padded
    scale: float | None = None,
) -> torch.Tensor:  # [B, Tq, Hq, hd]
    """Unfused attention with sinks: fp32 scores materialised, the mask explicit, the sink a
    concatenated column.

    p_ij = exp(s_ij) / (exp(sigma_h) + sum_{visible j} exp(s_ij)); a row that sees no key and
    has no sink (or sigma = -inf) gives 0; sigma = +inf takes all the mass, so the row gives 0.
    """
    B, Tq, Hq, hd = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    group = Hq // Hkv
    scale = 1.0 / math.sqrt(hd) if scale is None else scale
    q_start_t = torch.as_tensor(q_start, device=q.device).reshape(-1).expand(B)
    out = torch.empty(B, Tq, Hq, hd, dtype=torch.float32, device=q.device)
    key_positions = torch.arange(Tk, device=q.device)
    for b in range(B):
        query_positions = q_start_t[b] + torch.arange(Tq, device=q.device)
        pad = None if key_padding is None else key_padding[b]
        visible = visible_mask(spec, query_positions, key_positions, pad)  # [Tq, Tk]
        qb = q[b].float().transpose(0, 1)  # [Hq, Tq, hd]
        kb = k[b].float().transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, Tk, hd]
        vb = v[b].float().transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, Tk, hd]
        scores = (qb @ kb.transpose(1, 2)) * scale  # [Hq, Tq, Tk]
        scores = scores.masked_fill(~visible[None], float("-inf"))
        if sinks is None:
            sink_column = torch.full((Hq, Tq, 1), float("-inf"), device=q.device)
        else:
            sink_column = sinks.float().reshape(Hq, 1, 1).expand(Hq, Tq, 1)
        with_sink = torch.cat([scores, sink_column], dim=-1)  # [Hq, Tq, Tk+1]
        row_max = with_sink.amax(dim=-1, keepdim=True)
        # A row with nothing visible and no sink has max -inf; a +inf sink has max +inf.
        # Both give all-zero probabilities over the keys.
        finite_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        weights = torch.exp(with_sink - finite_max)
        if torch.isposinf(row_max).any():
            weights = torch.where(torch.isposinf(row_max), torch.zeros_like(weights), weights)
            weights[..., -1] = torch.where(
                torch.isposinf(row_max[..., 0]), torch.ones_like(weights[..., -1]), weights[..., -1]
            )
        denominator = weights.sum(dim=-1, keepdim=True)
        probs = torch.where(denominator > 0, weights / denominator.clamp_min(1e-30), 0.0)
        out[b] = (probs[..., :Tk] @ vb).transpose(0, 1)  # [Tq, Hq, hd]
    return out.to(q.dtype)


# --------------------------------------------------------------------------------------------
# Multi-head latent attention (MLA)
# --------------------------------------------------------------------------------------------

def _causal_visible(q_start: torch.Tensor | int, batch: int, query_len: int, key_len: int,
                    device: torch.device) -> torch.Tensor:  # [B, 1, Tq, Tk] bool
    starts = torch.as_tensor(q_start, device=device).reshape(-1).expand(batch).long()  # [B]
    positions = starts[:, None] + torch.arange(query_len, device=device)[None, :]  # [B, Tq]
    keys = torch.arange(key_len, device=device)
    return (keys[None, None, :] <= positions[:, :, None])[:, None]


def mla_latent_reference(
    q: torch.Tensor,  # [B, Tq, Hq, R + r] absorbed queries: q_nope W_UK, then the rotated q_rope
    cache: torch.Tensor,  # [B, Tk, 1, R + r] latents c, then rotated RoPE keys k_r
    kv_lora_rank: int,  # R
    scale: float,
    q_start: torch.Tensor | int = 0,  # [B] or int: position of each sequence's first query
) -> torch.Tensor:  # [B, Tq, Hq, R]
    """Causal attention over the latent cache, in float32: s = (q[:R] . c + q[R:] . k_r) * scale,
    out = softmax(s) @ c (the values are the latents). Every row sees key 0 at least (causal, q_start >= 0).
    What kernels.attention_mla computes."""
    batch, query_len, _, _ = q.shape
    q32, cache32 = q.float(), cache[:, :, 0].float()  # [B, Tq, Hq, R + r], [B, Tk, R + r]
    scores = torch.einsum("bthd,bkd->bhtk", q32, cache32) * scale  # [B, Hq, Tq, Tk]
    visible = _causal_visible(q_start, batch, query_len, cache.shape[1], q.device)
    probabilities = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    out = torch.einsum("bhtk,bkr->bthr", probabilities, cache32[..., :kv_lora_rank])
    return out.to(q.dtype)


def mla_decompressed_reference(
    q: torch.Tensor,  # [B, Tq, Hq, n + r] queries: no-RoPE part, then the rotated RoPE part
    cache: torch.Tensor,  # [B, Tk, 1, R + r] latents c, then rotated RoPE keys k_r
    w_uk: torch.Tensor,  # [Hq, n, R] the key rows of kv_b per head
    w_uv: torch.Tensor,  # [Hq, v, R] the value rows of kv_b per head
    scale: float,
    q_start: torch.Tensor | int = 0,  # [B] or int
) -> torch.Tensor:  # [B, Tq, Hq, v]
    """The naive form of latent attention, in float32: every head's keys [c W_UK_h^T ; k_r] and values
    c W_UV_h^T decompressed from the cache (Hq * (n + r + v) values per token), then causal softmax
    attention. No host synchronisation (a CUDA graph may capture it)."""
    batch, query_len, _, _ = q.shape
    nope, kv_lora_rank = w_uk.shape[1], w_uk.shape[2]
    latent, k_rope = cache[:, :, 0, :kv_lora_rank].float(), cache[:, :, 0, kv_lora_rank:].float()  # [B, Tk, R], [B, Tk, r]
    k_nope = torch.einsum("bkr,hnr->bkhn", latent, w_uk.float())  # [B, Tk, Hq, n]
    values = torch.einsum("bkr,hvr->bkhv", latent, w_uv.float())  # [B, Tk, Hq, v]
    q32 = q.float()
    scores = (torch.einsum("bthn,bkhn->bhtk", q32[..., :nope], k_nope)
              + torch.einsum("bthr,bkr->bhtk", q32[..., nope:], k_rope)) * scale  # [B, Hq, Tq, Tk]
    visible = _causal_visible(q_start, batch, query_len, cache.shape[1], q.device)
    probabilities = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("bhtk,bkhv->bthv", probabilities, values).to(q.dtype)
