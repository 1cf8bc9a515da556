"""The DeepSeek-V2/V3 pieces of the fused decode step (engine.decode_fused): a latent attention layer's glue,
the shared experts and the dense SwiGLU layers, for one new token per sequence.

Latent attention (engine.mla's function, shapes there):

    [q | c, k_r] = h @ [Wq; Wkv_a]^T               one GEMV over the packed rows (`pack_latent`); with a
                                                   q_lora_rank, [q_a | c, k_r], then q = RMSNorm(q_a) Wq_b^T
    q, cache[c_n, k_r] <- RoPE(q_r), RMSNorm(c), RoPE(k_r)       kernels.mla_rope_cache, one launch
    a = hooks.latent_attention(q, latent cache)    the dispatcher's arm (mla_fused / mla_reference), recorded
    o = a @ Wo^T

RoPE takes the model's frequencies, YaRN's where the config scales RoPE, and YaRN's attention factor on cos and
sin (engine.model.rope_tables); the mscale^2 of DeepSeek's softmax scale is in LatentAttention.scale, which
the arm applies. The shared experts and the dense layers are a SwiGLU MLP each: at one row kernels.moe_gemv's
two launches over the MLP as a single expert of weight 1 (the gate-up GEMV with SiLU x up fused, then down),
above it torch matmuls, as the fused step's other dense products. With the flag shared_fold the dispatcher may
instead hand a layer's shared weights to the routed GEMV arm's own two launches (engine.dispatcher._shared_path).

Knows nothing of flags or dispatch: the hooks decide the attention arm and the routed experts' arm.
"""

from __future__ import annotations

from itertools import pairwise

import torch

from engine.config import ModelConfig

_ONES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _names(config: ModelConfig, p: str) -> list[str]:
    """The projections `pack_latent` lays back to back: the query's first one, then kv_a."""
    first = "wq" if config.latent_attention.q_lora_rank is None else "wq_a"
    return [p + first, p + "wkv_a"]


def packed_rows(weights: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor | None:
    """The [N1 + N2 + ..., D] matrix (or [N1 + N2 + ...] vector: biases) the named weights form when they lie back
    to back in memory, else None."""
    tensors = [weights[name] for name in names]
    if not all(tensor.is_contiguous() for tensor in tensors):
        return None
    size = tensors[0].element_size()
    for before, after in pairwise(tensors):
        if after.data_ptr() != before.data_ptr() + before.numel() * size:
            return None
        if after.untyped_storage().data_ptr() != before.untyped_storage().data_ptr():
            return None
    rows = sum(tensor.shape[0] for tensor in tensors)
    return torch.as_strided(tensors[0], (rows, *tensors[0].shape[1:]), tensors[0].stride())


def pack_rows(weights: dict[str, torch.Tensor], names: list[str]) -> None:
    """Lay the named [Ni, D] weights (or [Ni] biases) back to back in one buffer and make the dict's entries views
    of it. Values are unchanged; the old tensors are freed."""
    if any(name not in weights for name in names) or packed_rows(weights, names) is not None:
        return
    packed = torch.cat([weights[name] for name in names], dim=0)
    start = 0
    for name in names:
        rows = weights[name].shape[0]
        weights[name] = packed[start:start + rows]
        start += rows


def pack_latent(config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    """Each latent attention layer's query projection (wq, or wq_a) and wkv_a in one buffer: one GEMV reads both."""
    for layer in range(config.n_layers):
        pack_rows(weights, _names(config, f"layers.{layer}."))


def _swiglu_torch(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """engine.model.swiglu: h [N, D], gate_up [2F, D], down [D, F] -> [N, D]."""
    gate, up = (h @ gate_up.t()).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up) @ down.t()


def swiglu(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, gemv_rows: bool) -> torch.Tensor:
    """A dense SwiGLU MLP, h [N, D] -> [N, D]. `gemv_rows` (a one-row step): kernels.moe_gemv with the MLP as its
    one expert, weight 1 (two launches, each weight byte read once); else the torch form."""
    if not gemv_rows:
        return _swiglu_torch(h, gate_up, down)
    from kernels.moe_gemv import moe_gemv

    key = (h.shape[0], h.dtype, h.device)
    constants = _ONES.get(key)
    if constants is None:  # made by the eager step before a capture, so a graph copies nothing from the host
        constants = _ONES[key] = (torch.zeros((h.shape[0], 1), dtype=torch.int32, device=h.device),
                                  torch.ones((h.shape[0], 1), dtype=h.dtype, device=h.device))
    return moe_gemv(h, gate_up.unsqueeze(0), down.unsqueeze(0), *constants)


class SharedExpertsDecode:
    """A layer's shared experts as the fused step computes them: the hooks' `moe` adds shared(h) to the routed
    arm's output, as for engine.model.SharedMLP, or (shared_fold=on, the GEMV arm, one row, ungated) passes
    `gate_up` [2Fs, D] and `down` [D, Fs] into the routed launches (kernels.moe_gemv's `shared`), never calling it.
    `gate` [1, D] (Qwen2-MoE): the MLP's output times sigmoid(h . gate), in torch as SharedMLP computes it; the
    dispatcher keeps a gated one apart (its `gate` attribute)."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, gemv_rows: bool,
                 gate: torch.Tensor | None = None) -> None:
        self.gate_up, self.down, self.gemv_rows, self.gate = gate_up, down, gemv_rows, gate

    def __call__(self, h: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, D]
        out = swiglu(h, self.gate_up, self.down, self.gemv_rows and h.shape[0] == 1)
        return out if self.gate is None else torch.sigmoid(h @ self.gate.t()) * out


def attention(config: ModelConfig, weights: dict[str, torch.Tensor], layer: int, project, batch: int, dense,
              rms_norm, inv_freq: torch.Tensor, start: torch.Tensor, key_length: int, slots: torch.Tensor | None,
              cache, hooks, q_start) -> torch.Tensor:
    """A latent attention layer of the decode step for `batch` rows -> the attention output o [B, D], the token's
    latent cache entry written. `project(w)` is the layer's normed input times w^T (its input norm applied or folded
    into that GEMV: engine.decode_fused), `dense(x, w)` the step's dense product and `rms_norm(x, weight, eps)` its
    norm; q_start None: the positions as int32."""
    from kernels.mla_rope_cache import mla_rope_cache

    c, latent, p = config, config.latent_attention, f"layers.{layer}."
    first = latent.q_lora_rank if latent.q_lora_rank is not None else c.n_heads * latent.qk_head_dim
    names = _names(c, p)
    packed = packed_rows(weights, names)
    if packed is not None:
        projected = project(packed)  # [B, first + R + r]
        q, kv = projected[:, :first], projected[:, first:]
    else:
        q, kv = project(weights[names[0]]), project(weights[names[1]])
    if latent.q_lora_rank is not None:
        q = dense(rms_norm(q, weights[p + "q_a_norm"], latent.norm_eps), weights[p + "wq_b"])  # [B, Hq * (n + r)]
    scale = c.rope_scaling.resolved_attention_factor if c.rope_scaling is not None else 1.0
    q, start32 = mla_rope_cache(q, kv, weights[p + "kv_a_norm"], latent.norm_eps, inv_freq, scale, start, slots,
                                cache.k[layer], c.n_heads, latent.qk_nope_head_dim, latent.rope_interleave)
    latent_rows = cache.latent_rows(layer, batch, key_length, slots)  # [B, Tk, 1, R + r]
    attended = hooks.latent_attention(layer, q.view(batch, 1, c.n_heads, latent.qk_head_dim), latent_rows,
                                      weights[p + "wkv_b"], start32 if q_start is None else q_start,
                                      key_length)  # [B, 1, Hq, v]
    return dense(attended.reshape(batch, c.n_heads * latent.v_head_dim), weights[p + "wo"])
