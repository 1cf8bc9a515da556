"""The decode step on a GPU with its glue fused: the same function as engine.model's torch forward
for one new token per sequence, in about a dozen launches per layer instead of ~90 small torch
kernels (casts, the fp32 copies of the router and LM head, RoPE pieces, index_put, topk, softmax).

Per step (B sequences, one token each; shapes as in engine.model):

    x, h    = embed[tokens], RMSNorm(...)            kernels.rms_norm (gather)        1 launch
    per layer:
      qkv   = h @ [wq; wk; wv]^T                     kernels.gemv (one packed weight)  1
      q     = RoPE(q); cache[k, v] <- RoPE(k), v     kernels.rope_cache                1
      a     = attention(q, cache)                    the dispatcher's attention arm
      o     = a @ wo^T                               kernels.gemv                      1
      x, h  = x + o, RMSNorm(...)                    kernels.rms_norm (residual)       1
      ids, w = topk-softmax(h @ router^T in fp32)    kernels.gemv + kernels.router     2
      e     = experts(h, ids, w)                     the dispatcher's MoE arm
      x, h  = x + e, RMSNorm(next norm)              kernels.rms_norm (residual)       1
    logits  = h @ head^T in fp32                     kernels.gemv                      1

Which kernel computes attention and the experts is still the dispatcher's decision: this module
only replaces the glue around the arms. Rows above kernels.gemv.MAX_ROWS (large decode batches)
take torch matmuls for the dense products. Rounding happens where the torch forward rounds, so the
two differ only in the order of fp32 sums (tests/test_decode_fused.py bounds it).

Eligible: a CUDA device (or `force` for the interpreter tests), one token per row, and a preset-style
architecture (no attention biases, q/k norms, clipping, YaRN, router bias or softmax-then-top-k):
the Hugging Face families keep the torch forward. Knows nothing of flags or scheduling.
"""

from __future__ import annotations

import torch

from engine.config import ModelConfig

_INV_FREQ: dict[tuple, torch.Tensor] = {}
_SINKS: dict[int, tuple] = {}
# Rows up to which the dense products take kernels.gemv; above it cuBLAS. On the H200 at D = 4096
# (bench/gemv_bench.py, bench/results/2026-11-29-h200-run7-fused) one row: gemv 11.0-12.5 us vs cuBLAS
# 12.9-13.2 us for the projections, 2.9-3.1 vs 10.8-17.6 us for the fp32 logits; from two rows
# cuBLAS's tensor-core kernels are faster than the FMA path.
GEMV_ROWS = 1


def eligible(config: ModelConfig, tokens: torch.Tensor, force: bool = False) -> bool:
    return ((tokens.is_cuda or force) and tokens.dim() == 2 and tokens.shape[1] == 1
            and not config.attention_bias and config.qk_norm == "none" and config.clip_qkv is None
            and config.rope_scaling is None and config.router == "topk_softmax" and not config.router_bias)


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
    from engine.model import rope_inverse_frequency  # engine.model imports this module

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


def forward_decode(config: ModelConfig, weights: dict[str, torch.Tensor], tokens: torch.Tensor,
                   start: torch.Tensor, key_length: int, slots: torch.Tensor | None, cache, hooks,
                   q_start: "int | torch.Tensor | None" = None) -> torch.Tensor:
    """tokens [B, 1] at positions start [B] (int64, on the device) -> logits [B, V] float32.
    Row b reads and writes cache row slots[b] (None: row b); attention reads `key_length` keys.
    `q_start` is what the attention hook receives as the query start (default `start`)."""
    from kernels.rms_norm import rms_norm
    from kernels.rope_cache import rope_cache
    from kernels.router import topk_softmax

    c = config
    batch = tokens.shape[0]
    inv_freq = _inverse_frequency(c, tokens.device)
    x, h = rms_norm(None, weights["layers.0.attn_norm"], c.norm_eps, table=weights["embed"],
                    index=tokens.reshape(-1))  # [B, D] each
    for layer in range(c.n_layers):
        p = f"layers.{layer}."
        q, start32 = rope_cache(_qkv(weights, p, h), inv_freq, start, slots, cache.k[layer], cache.v[layer],
                                c.n_heads)  # [B, Hq, hd]; k and v now in the cache; start as int32
        k_rows, v_rows = cache.rows(layer, batch, key_length, slots)  # [B, Tk, Hkv, hd]
        attended = hooks.attention(layer, q.view(batch, 1, c.n_heads, c.head_dim), k_rows, v_rows,
                                   _float_sinks(weights.get(p + "sinks")), start32 if q_start is None else q_start,
                                   key_length)  # [B, 1, Hq, hd]
        o = _dense(attended.reshape(batch, c.n_heads * c.head_dim), weights[p + "wo"])  # [B, D]
        x, h = rms_norm(x, weights[p + "moe_norm"], c.norm_eps, residual=o)
        ids, routing, woken = topk_softmax(_dense(h, weights[p + "router"], torch.float32), c.top_k, h.dtype,
                                           woken=True)
        expert_out = hooks.moe(layer, h, weights[p + "w13"], weights[p + "w2"], ids, routing, woken=woken)  # [B, D]
        next_norm = weights[f"layers.{layer + 1}.attn_norm"] if layer + 1 < c.n_layers else weights["norm"]
        x, h = rms_norm(x, next_norm, c.norm_eps, residual=expert_out)
    head = weights["embed"] if c.tie_embeddings else weights["lm_head"]
    return _dense(h, head, torch.float32)  # [B, V]
