"""A decoder-only MoE transformer in the DeepSeek-V3/V4 and gpt-oss style, in one file.

Shape legend: B = sequences, T = new tokens per sequence this step, N = B*T, D = hidden,
F = expert intermediate, E = experts, k = top-k, Hq/Hkv = heads, hd = head dim, V = vocab,
S = cache capacity (context).

RMSNorm -> attention (RoPE, learned per-head sinks, a per-layer mask) -> RMSNorm -> MoE
(top-k router, SwiGLU experts w13[E,2F,D], w2[E,D,F]). Which kernel computes attention and the
experts is not decided here: `forward` asks `layer_hooks` (the engine's dispatcher) for each
layer. Knows nothing of flags, tokenization or generation loops.

On a GPU, a step of one token per row (decode) takes engine.decode_fused instead: the same function
with the glue around the arms (norms, projections, RoPE and the cache write, routing) in a dozen
launches; tests/test_decode_fused.py bounds the difference to the order of fp32 sums.

The Hugging Face families (engine.hf_loader) switch on features of the config, each absent from the
presets: q/k/v/o biases, q/k RMSNorm (per head or over the full projection), clip_qkv, no sinks,
YaRN RoPE, a router bias and softmax-then-top-k routing, tied embeddings, and gpt-oss experts
(biases and the clamped SwiGLU), which only the reference arm computes: `forward` hands them to the
hooks as `FamilyExperts`. DeepSeek-V2/V3 and Qwen2-MoE add: multi-head latent attention
(engine.mla; the cache holds latents, the hooks' `latent_attention` picks the arm), the group-limited
routers (engine.routing), routed_scaling_factor, shared experts beside the routed ones (handed to the
hooks' `moe` as `shared`: always on, outside the arm decision) and dense SwiGLU layers (`dense_layers`,
no experts, no MoE record).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Protocol

import torch

from engine import decode_fused, mla, routing
from engine.config import GROUPED_ROUTERS, ModelConfig, SharedExperts
from engine.family_experts import FamilyExperts, family_experts
from engine.rope import apply_rope, rope_inverse_frequency, yarn_inverse_frequency


def tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight's name and shape; the checkpoint layout."""
    c = config
    shapes: dict[str, tuple[int, ...]] = {"embed": (c.vocab_size, c.hidden)}
    dense = set(c.dense_layers)
    for layer in range(c.n_layers):
        p = f"layers.{layer}."
        shapes[p + "attn_norm"] = (c.hidden,)
        if c.latent_attention is not None:
            shapes.update(mla.tensor_shapes(c, p))
        else:
            shapes.update({
                p + "wq": (c.n_heads * c.head_dim, c.hidden),
                p + "wk": (c.n_kv_heads * c.head_dim, c.hidden),
                p + "wv": (c.n_kv_heads * c.head_dim, c.hidden),
                p + "wo": (c.hidden, c.n_heads * c.head_dim),
            })
        if c.sinks:
            shapes[p + "sinks"] = (c.n_heads,)
        shapes[p + "moe_norm"] = (c.hidden,)
        if layer in dense:  # a dense SwiGLU MLP (gate rows then up rows), no router, no experts
            shapes.update({p + "mlp_gate_up": (2 * c.dense_intermediate, c.hidden),
                           p + "mlp_down": (c.hidden, c.dense_intermediate)})
        else:
            shapes.update({
                p + "router": (c.n_experts, c.hidden),
                p + "w13": (c.n_experts, 2 * c.intermediate, c.hidden),
                p + "w2": (c.n_experts, c.hidden, c.intermediate),
            })
            if c.router == "sigmoid_group_topk":
                shapes[p + "router_correction"] = (c.n_experts,)
            if c.shared_experts is not None:  # named apart from w13/w2: they are not routed (bench counts those k/E)
                shared = c.shared_experts.intermediate
                shapes.update({p + "shared_gate_up": (2 * shared, c.hidden), p + "shared_down": (c.hidden, shared)})
                if c.shared_experts.gated:
                    shapes[p + "shared_gate"] = (1, c.hidden)
        if c.attention_bias:
            shapes.update({p + "bq": (c.n_heads * c.head_dim,), p + "bk": (c.n_kv_heads * c.head_dim,),
                           p + "bv": (c.n_kv_heads * c.head_dim,), p + "bo": (c.hidden,)})
        elif c.qkv_bias:
            shapes.update({p + "bq": (c.n_heads * c.head_dim,), p + "bk": (c.n_kv_heads * c.head_dim,),
                           p + "bv": (c.n_kv_heads * c.head_dim,)})
        if c.qk_norm == "per_head":
            shapes.update({p + "q_norm": (c.head_dim,), p + "k_norm": (c.head_dim,)})
        elif c.qk_norm == "full":
            shapes.update({p + "q_norm": (c.n_heads * c.head_dim,), p + "k_norm": (c.n_kv_heads * c.head_dim,)})
        if c.router_bias and layer not in dense:
            shapes[p + "router_bias"] = (c.n_experts,)
        if c.expert_bias and layer not in dense:
            shapes.update({p + "b13": (c.n_experts, 2 * c.intermediate), p + "b2": (c.n_experts, c.hidden)})
    shapes["norm"] = (c.hidden,)
    if not c.tie_embeddings:
        shapes["lm_head"] = (c.vocab_size, c.hidden)
    return shapes


def tensor_dtype(config: ModelConfig, name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a weight is kept in: `dtype`, except DeepSeek-V3's router and its correction bias, which
    stay float32 (as transformers keeps them: the bias decides near ties of the sigmoid scores)."""
    if config.router == "sigmoid_group_topk" and name.endswith(("router", "router_correction")):
        return torch.float32
    return dtype


def _init_std(name: str, shape: tuple[int, ...]) -> float | None:
    """None = ones (norm weights). Sinks are logits of order one; matrices 1/sqrt(fan_in)."""
    if name.endswith("norm"):
        return None
    if name.endswith("sinks") or name == "embed":
        return 1.0
    return 1.0 / math.sqrt(shape[-1])


def random_weights(config: ModelConfig, seed: int, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Deterministic weights: every tensor drawn on the CPU from its own generator, seeded by
    (seed, tensor name), then moved. The same preset and seed give bit-identical weights on
    every machine, whatever the order of creation. Large tensors are drawn one expert at a time
    so the host never holds more than one expert in float32 beyond the destination."""
    weights: dict[str, torch.Tensor] = {}
    requested = dtype
    for name, shape in tensor_shapes(config).items():
        dtype = tensor_dtype(config, name, requested)
        std = _init_std(name, shape)
        if std is None:
            weights[name] = torch.ones(shape, dtype=dtype, device=device)
            continue
        generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
        if len(shape) == 3:
            destination = torch.empty(shape, dtype=dtype, device=device)
            for expert in range(shape[0]):
                block = torch.randn(shape[1:], generator=generator) * std
                destination[expert].copy_(block.to(dtype))
            weights[name] = destination
        else:
            weights[name] = (torch.randn(shape, generator=generator) * std).to(device=device, dtype=dtype)
    return weights


class LayerHooks(Protocol):
    """What `forward` asks of the engine for each layer."""

    def attention(self, layer: int, q, k_cache, v_cache, sinks, q_start: "int | torch.Tensor",
                  length: int) -> torch.Tensor: ...

    def moe(self, layer: int, h: torch.Tensor, w13, w2, topk_ids, topk_weights,
            experts: "FamilyExperts | None" = None, woken: torch.Tensor | None = None,
            shared: "SharedMLP | None" = None) -> torch.Tensor:
        """`experts` is passed only for layers whose experts are not plain SwiGLU (see FamilyExperts);
        `woken`, the distinct experts in topk_ids, only when the caller's routing kernel counted them;
        `shared`, the layer's shared experts, only for families that have them: the hooks add shared(h)
        to the routed sum, whatever arm they pick for the routed experts."""

    def latent_attention(self, layer: int, q: torch.Tensor, latent_cache: torch.Tensor, kv_b: torch.Tensor,
                         q_start: "int | torch.Tensor", length: int) -> torch.Tensor:
        """Multi-head latent attention (engine.mla): q [B, T, Hq, qk_nope + r], latent_cache [B, S, 1, R + r]
        (keys 0..length-1 read), kv_b [Hq * (qk_nope + v), R] -> [B, T, Hq, v]."""


@dataclass
class KVCache:
    """Preallocated per-layer key/value storage: k[layer], v[layer] are [B, S, Hkv, hd]."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]

    @classmethod
    def allocate(cls, config: ModelConfig, batch: int, capacity: int, device, dtype) -> "KVCache":
        """Latent attention layers hold one [B, S, 1, R + r] tensor (the latent, then the RoPE key) in
        k[layer]; v[layer] is a view of its first R columns (the values are the latents themselves)."""
        if config.latent_attention is not None:
            shape = (batch, capacity, 1, config.latent_attention.cache_elements_per_token())
            latents = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
            return cls(latents, [latent[..., :config.latent_attention.kv_lora_rank] for latent in latents])
        shape = (batch, capacity, config.n_kv_heads, config.head_dim)
        return cls([torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)],
                   [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)])

    def rows(self, layer: int, batch: int, key_length: int, slots: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values batch row b reads, [B, Tk, Hkv, hd] each: views of cache rows 0..B-1 when
        `slots` is None (row b is cache row b), else copies of rows slots[b] up to `key_length`."""
        if slots is None:
            return self.k[layer][:batch], self.v[layer][:batch]
        return (self.k[layer][:, :key_length].index_select(0, slots),
                self.v[layer][:, :key_length].index_select(0, slots))

    def latent_rows(self, layer: int, batch: int, key_length: int, slots: torch.Tensor | None) -> torch.Tensor:
        """A latent attention layer's rows [B, Tk, 1, R + r], as `rows` reads them (the values are in them)."""
        if slots is None:
            return self.k[layer][:batch]
        return self.k[layer][:, :key_length].index_select(0, slots)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, rounds_once: bool = False) -> torch.Tensor:
    """x [..., D] normalised in float32, times weight [D], in x's dtype. Where it rounds follows the family
    (ModelConfig.norm_rounds_once): the normalised value to x's dtype, then its product with the weight
    (Llama-style, the presets), or only the float32 product (gpt-oss: `(weight * normed).to(dtype)`)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if rounds_once:
        return (normed * weight.float()).to(x.dtype)
    return normed.to(x.dtype) * weight


def rope_tables(config: ModelConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, hd/2] for integer positions [T]."""
    if config.rope_scaling is not None:
        return _yarn_rope_tables(config, positions)
    angles = positions.float()[:, None] * rope_inverse_frequency(config, positions.device)[None, :]
    return angles.cos(), angles.sin()


def _yarn_rope_tables(config: ModelConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """YaRN (arXiv 2309.00071), written as transformers' `_compute_yarn_parameters` computes it, so the
    frequencies agree to the last bit: dimensions that turn fewer than `beta_slow` times over the
    original context are interpolated (divided by `factor`), more than `beta_fast` times kept, a
    linear ramp between; cos and sin carry the attention factor."""
    angles = positions.float()[:, None] * yarn_inverse_frequency(config, positions.device)[None, :]  # [T, hd/2]
    scale = config.rope_scaling.resolved_attention_factor
    return angles.cos() * scale, angles.sin() * scale


def route(h: torch.Tensor, router: torch.Tensor, k: int, bias: torch.Tensor | None = None,
          kind: str = "topk_softmax", norm_topk_prob: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of the router logits (plus `bias`). `topk_softmax`: the weights are the softmax over the k
    chosen logits (the presets, gpt-oss; Mixtral's softmax-top-k-renormalise is the same function).
    `softmax_topk`: the softmax over all E, then the top k, renormalised to sum 1 only when
    `norm_topk_prob` (Qwen3-MoE, OLMoE)."""
    logits = h.float() @ router.float().t()  # [N, E]
    if bias is not None:
        logits = logits + bias.float()
    if kind == "softmax_topk":
        top_probabilities, top_ids = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)  # [N, k]
        if norm_topk_prob:
            top_probabilities = top_probabilities / top_probabilities.sum(dim=-1, keepdim=True)
        return top_ids.to(torch.int32), top_probabilities
    top_logits, top_ids = torch.topk(logits, k, dim=-1)  # [N, k]
    return top_ids.to(torch.int32), torch.softmax(top_logits, dim=-1)


def _attention_inputs(config: ModelConfig, weights: dict[str, torch.Tensor], p: str, h: torch.Tensor,
                      batch: int, steps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [B, T, D] -> q [B, T, Hq, hd], k, v [B, T, Hkv, hd], before RoPE: projections, their biases,
    clip_qkv and the q/k RMSNorm as the config asks."""
    c = config
    q, k, v = h @ weights[p + "wq"].t(), h @ weights[p + "wk"].t(), h @ weights[p + "wv"].t()  # [B, T, H*hd]
    if c.attention_bias or c.qkv_bias:
        q, k, v = q + weights[p + "bq"], k + weights[p + "bk"], v + weights[p + "bv"]
    if c.qk_norm == "full":  # OLMoE: over the whole projection, before clipping and the head split
        q = rms_norm(q, weights[p + "q_norm"], c.norm_eps, c.norm_rounds_once)
        k = rms_norm(k, weights[p + "k_norm"], c.norm_eps, c.norm_rounds_once)
    if c.clip_qkv is not None:
        q, k, v = (tensor.clamp(-c.clip_qkv, c.clip_qkv) for tensor in (q, k, v))
    q = q.view(batch, steps, c.n_heads, c.head_dim)  # [B, T, Hq, hd]
    k = k.view(batch, steps, c.n_kv_heads, c.head_dim)  # [B, T, Hkv, hd]
    v = v.view(batch, steps, c.n_kv_heads, c.head_dim)
    if c.qk_norm == "per_head":  # Qwen3-MoE: each head on its own
        q = rms_norm(q, weights[p + "q_norm"], c.norm_eps, c.norm_rounds_once)
        k = rms_norm(k, weights[p + "k_norm"], c.norm_eps, c.norm_rounds_once)
    return q, k, v


def _attention_output(config: ModelConfig, weights: dict[str, torch.Tensor], p: str,
                      attended: torch.Tensor) -> torch.Tensor:
    """attended [B, T, Hq, hd] -> [B, T, D]."""
    batch, steps = attended.shape[:2]
    out = attended.reshape(batch, steps, -1) @ weights[p + "wo"].t()
    return out + weights[p + "bo"] if config.attention_bias else out


def swiglu(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """A dense SwiGLU MLP: h [N, D], gate_up [2F, D] (gate rows, then up rows), down [D, F] -> [N, D]."""
    gate, up = (h @ gate_up.t()).chunk(2, dim=-1)  # [N, F] each
    return (torch.nn.functional.silu(gate) * up) @ down.t()


@dataclass(frozen=True)
class SharedMLP:
    """A layer's shared experts (config.SharedExperts) with their weights: every token runs them. `forward`
    hands them to the hooks' `moe` as `shared=`; the dispatcher adds shared(h) to whichever routed arm ran, or,
    ungated at a one-row decode step on the GEMV arm with shared_fold=on, computes them inside its launches."""

    spec: SharedExperts
    gate_up: torch.Tensor  # [2Fs, D]
    down: torch.Tensor  # [D, Fs]
    gate: torch.Tensor | None  # [1, D]: Qwen2-MoE scales the output by sigmoid(h . gate)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, D]
        out = swiglu(h, self.gate_up, self.down)
        return out if self.gate is None else torch.sigmoid(h @ self.gate.t()) * out


def _route(config: ModelConfig, weights: dict[str, torch.Tensor], p: str, h: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """h [N, D] -> topk_ids [N, k] int32, topk_weights [N, k] float32, routed_scaling_factor applied."""
    c = config
    if c.router in GROUPED_ROUTERS:
        topk_ids, topk_weights = routing.group_limited_topk(h, weights[p + "router"], c.top_k, c.n_group,
                                                            c.topk_group, c.router, weights.get(p + "router_correction"),
                                                            c.norm_topk_prob)
    else:
        topk_ids, topk_weights = route(h, weights[p + "router"], c.top_k, weights.get(p + "router_bias"), c.router,
                                       c.norm_topk_prob)
    if c.routed_scaling_factor != 1.0:
        topk_weights = topk_weights * c.routed_scaling_factor
    return topk_ids, topk_weights


def _experts(config: ModelConfig, weights: dict[str, torch.Tensor], layer: int, h: torch.Tensor,
             hooks: "LayerHooks") -> torch.Tensor:
    """h [N, D] (normed) -> the layer's feed-forward output [N, D]: the routed experts' sum, computed by
    whatever arm the hooks pick, plus the shared experts where the family has them; or, in a dense layer,
    its SwiGLU MLP (no routing, no hook)."""
    c, p = config, f"layers.{layer}."
    if layer in c.dense_layers:
        return swiglu(h, weights[p + "mlp_gate_up"], weights[p + "mlp_down"])
    topk_ids, topk_weights = _route(c, weights, p, h)
    extras = family_experts(c, weights, layer)
    if c.shared_experts is not None:
        shared = SharedMLP(c.shared_experts, weights[p + "shared_gate_up"], weights[p + "shared_down"],
                           weights.get(p + "shared_gate"))
        return hooks.moe(layer, h, weights[p + "w13"], weights[p + "w2"], topk_ids, topk_weights.to(h.dtype),
                         shared=shared)
    if extras is None:
        return hooks.moe(layer, h, weights[p + "w13"], weights[p + "w2"], topk_ids, topk_weights.to(h.dtype))
    return hooks.moe(layer, h, weights[p + "w13"], weights[p + "w2"], topk_ids, topk_weights.to(h.dtype),
                     experts=extras)


def output_head(config: ModelConfig, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """The [V, D] matrix of the logits: the embedding itself when tied."""
    return weights["embed"] if config.tie_embeddings else weights["lm_head"]


@dataclass(frozen=True)
class StepLayout:
    """Where the rows of a ragged batch sit; built on the host (engine.batch_runner), so `forward`
    needs no host loop over sequences and no device->host sync to place them.

    start        [B] int64   position of each row's first token; rows may differ (ragged)
    key_length   int         keys attention reads; >= every row's start + its real length
                             (the whole cache under a CUDA graph: later keys are causally invisible)
    slots        [B] int64   the cache row each batch row reads and writes; None = row b is cache row b
    token_index  [N] int64   flat indices into B*T of the real tokens when some rows are shorter than T;
                             None = every token is real. Only real tokens are routed to the experts and
                             written to the cache; padding rows are computed and dropped.
    last_index   [B] int64   the column of each row's last real token; None = T - 1
    """

    start: torch.Tensor
    key_length: int
    slots: torch.Tensor | None = None
    token_index: torch.Tensor | None = None
    last_index: torch.Tensor | None = None


def forward(config: ModelConfig, weights: dict[str, torch.Tensor], tokens: torch.Tensor,
            start: "int | torch.Tensor | StepLayout", cache: KVCache, hooks: LayerHooks) -> torch.Tensor:
    """tokens [B, T] -> logits of each row's last (real) position [B, V] (fp32).

    `start` an int: every row at positions start..start+T-1, row b in cache row b (generate).
    `start` a [B] tensor or a StepLayout: row b at positions start[b]..start[b]+T-1 (ragged); the
    keys and values are written with index ops and every layer is one launch per kernel for the
    whole batch, whatever the positions."""
    if not isinstance(start, int):
        layout = start if isinstance(start, StepLayout) else StepLayout(start, cache.k[0].shape[1])
        if decode_fused.eligible(config, tokens) and layout.token_index is None:
            return decode_fused.forward_decode(config, weights, tokens, layout.start.long(), layout.key_length,
                                               layout.slots, cache, hooks)
        return _forward_ragged(config, weights, tokens, layout, cache, hooks)
    if decode_fused.eligible(config, tokens):  # one token per row on a GPU: the fused glue
        positions = torch.full((tokens.shape[0],), start, dtype=torch.int64, device=tokens.device)
        return decode_fused.forward_decode(config, weights, tokens, positions, start + 1, None, cache, hooks,
                                           q_start=start)
    c = config
    batch, steps = tokens.shape
    x = weights["embed"][tokens]  # [B, T, D]
    cos, sin = rope_tables(c, torch.arange(start, start + steps, device=tokens.device))
    for layer in range(c.n_layers):
        p = f"layers.{layer}."
        h = rms_norm(x, weights[p + "attn_norm"], c.norm_eps, c.norm_rounds_once)
        if c.latent_attention is not None:  # the cache holds latents; the arm reads them
            q, entry = mla.inputs(c, weights, p, h, cos, sin)  # [B, T, Hq, qk_nope + r], [B, T, 1, R + r]
            cache.k[layer][:, start:start + steps] = entry
            attended = hooks.latent_attention(layer, q, cache.k[layer], weights[p + "wkv_b"], start,
                                              start + steps)  # [B, T, Hq, v]
            x = x + attended.reshape(batch, steps, -1) @ weights[p + "wo"].t()
        else:
            q, k, v = _attention_inputs(c, weights, p, h, batch, steps)  # [B, T, Hq|Hkv, hd]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            cache.k[layer][:, start:start + steps] = k
            cache.v[layer][:, start:start + steps] = v
            attended = hooks.attention(layer, q, cache.k[layer], cache.v[layer], weights.get(p + "sinks"),
                                       start, start + steps)  # [B, T, Hq, hd]
            x = x + _attention_output(c, weights, p, attended)

        h = rms_norm(x, weights[p + "moe_norm"], c.norm_eps, c.norm_rounds_once)
        h = h.reshape(batch * steps, c.hidden)  # [N, D]
        expert_out = _experts(c, weights, layer, h, hooks)  # [N, D]
        x = x + expert_out.view(batch, steps, c.hidden)
    last = rms_norm(x[:, -1], weights["norm"], c.norm_eps, c.norm_rounds_once)  # [B, D]
    return last.float() @ output_head(c, weights).float().t()  # [B, V]


def _forward_ragged(config: ModelConfig, weights: dict[str, torch.Tensor], tokens: torch.Tensor,
                    layout: StepLayout, cache: KVCache, hooks: LayerHooks) -> torch.Tensor:
    c = config
    batch, steps = tokens.shape
    device = tokens.device
    positions = layout.start.long()[:, None] + torch.arange(steps, device=device)[None, :]  # [B, T]
    cos, sin = rope_tables(c, positions.reshape(-1))  # [B*T, hd/2]
    cos, sin = cos.view(batch, steps, -1), sin.view(batch, steps, -1)
    rows = torch.arange(batch, device=device) if layout.slots is None else layout.slots
    cache_rows = rows[:, None].expand(batch, steps).reshape(-1)  # [B*T] where each token's K/V go
    cache_positions = positions.reshape(-1)  # [B*T]
    if layout.token_index is not None:
        cache_rows, cache_positions = cache_rows[layout.token_index], cache_positions[layout.token_index]  # [N]
    x = weights["embed"][tokens]  # [B, T, D]
    for layer in range(c.n_layers):
        p = f"layers.{layer}."
        h = rms_norm(x, weights[p + "attn_norm"], c.norm_eps, c.norm_rounds_once)
        if c.latent_attention is not None:  # the cache holds latents; the arm reads them
            q, entry = mla.inputs(c, weights, p, h, cos, sin)  # [B, T, Hq, qk_nope + r], [B, T, 1, R + r]
            entry = entry.reshape(batch * steps, 1, -1)
            if layout.token_index is not None:
                entry = entry[layout.token_index]  # [N, 1, R + r]
            cache.k[layer].index_put_((cache_rows, cache_positions), entry)
            latent_rows = cache.latent_rows(layer, batch, layout.key_length, layout.slots)  # [B, Tk, 1, R + r]
            attended = hooks.latent_attention(layer, q, latent_rows, weights[p + "wkv_b"], layout.start,
                                              layout.key_length)  # [B, T, Hq, v]
            x = x + attended.reshape(batch, steps, -1) @ weights[p + "wo"].t()
        else:
            q, k, v = _attention_inputs(c, weights, p, h, batch, steps)  # [B, T, Hq|Hkv, hd]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            k_new = k.reshape(batch * steps, c.n_kv_heads, c.head_dim)  # [B*T, Hkv, hd]
            v_new = v.reshape(batch * steps, c.n_kv_heads, c.head_dim)
            if layout.token_index is not None:
                k_new, v_new = k_new[layout.token_index], v_new[layout.token_index]  # [N, Hkv, hd]
            cache.k[layer].index_put_((cache_rows, cache_positions), k_new)
            cache.v[layer].index_put_((cache_rows, cache_positions), v_new)
            k_rows, v_rows = cache.rows(layer, batch, layout.key_length, layout.slots)  # [B, Tk, Hkv, hd]
            attended = hooks.attention(layer, q, k_rows, v_rows, weights.get(p + "sinks"), layout.start,
                                       layout.key_length)  # [B, T, Hq, hd]
            x = x + _attention_output(c, weights, p, attended)

        h = rms_norm(x, weights[p + "moe_norm"], c.norm_eps, c.norm_rounds_once)
        h = h.reshape(batch * steps, c.hidden)  # [B*T, D]
        if layout.token_index is not None:
            h = h[layout.token_index]  # [N, D]: padding never reaches the router or the experts
        expert_out = _experts(c, weights, layer, h, hooks)  # [N, D]
        if layout.token_index is None:
            x = x + expert_out.view(batch, steps, c.hidden)
        else:
            x = x.reshape(batch * steps, c.hidden).index_add(0, layout.token_index, expert_out)
            x = x.view(batch, steps, c.hidden)
    last = x[:, -1] if layout.last_index is None else x[torch.arange(batch, device=device), layout.last_index]
    last = rms_norm(last, weights["norm"], c.norm_eps, c.norm_rounds_once)  # [B, D]
    return last.float() @ output_head(c, weights).float().t()  # [B, V]


def random_weights_on(config: ModelConfig, seed: int, device: torch.device, dtype: torch.dtype
                      ) -> dict[str, torch.Tensor]:
    """Random weights of `config`: drawn on a GPU by a seeded generator per tensor (seconds for a 48-layer
    model where the CPU draw takes hours), on the CPU by engine.model.random_weights (bit-identical on every
    machine). Either is deterministic for a device type and seed."""
    if device.type != "cuda":
        return random_weights(config, seed, device, dtype)
    import zlib

    weights = {}
    for name, shape in tensor_shapes(config).items():
        std = _init_std(name, shape)
        if std is None:
            weights[name] = torch.ones(shape, dtype=dtype, device=device)
            continue
        generator = torch.Generator(device=device).manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
        weights[name] = torch.randn(shape, generator=generator, dtype=dtype, device=device).mul_(std)
    return weights
