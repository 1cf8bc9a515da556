"""Multi-head latent attention (DeepSeek-V2/V3): the projections into the latent cache, and the two
ways of attending over it.

Shapes: B = sequences, T = new tokens, S = cache positions, D = hidden, Hq = heads, R = kv_lora_rank,
r = qk_rope_head_dim, n = qk_nope_head_dim, v = v_head_dim, Rq = q_lora_rank.

    q       = x Wq^T                      [B, T, Hq, n + r]   (or RMSNorm(x Wq_a^T) Wq_b^T through rank Rq)
    c, k_r  = split(x Wkv_a^T)            [B, T, R], [B, T, r]
    c       = RMSNorm(c)                  the latent: what the cache keeps, with RoPE(k_r), per token
    q_r     = RoPE(q[..., n:]), k_r = RoPE(k_r)   (DeepSeek's pairs are interleaved: x0 x1, x2 x3, ...)
    kv_b    [Hq * (n + v), R]: per head h the rows W_UK_h [n, R] then W_UV_h [v, R]

  reference (`decompressed`): K_h = [c W_UK_h^T ; k_r], V_h = c W_UV_h^T per head, then causal softmax
      attention with the softmax scale: the naive form, Hq * (n + r + v) values per token.
  fused (absorbed): q_lat_h = q_h[:n] W_UK_h [R]; s = (q_lat_h . c + q_r_h . k_r) * scale over the
      cache of R + r per token (kernels.attention_mla: split-KV over the latents); o_lat_h = P c [R];
      o_h = o_lat_h W_UV_h^T [v]. The same function: (q W_UK) . c = q . (W_UK^T c).

The interleaved RoPE is computed as transformers' DeepSeek-V3 computes it: the even and odd elements
rotated as pairs and written de-interleaved (evens, then odds), for q and k alike, so every dot product
is unchanged; the cache holds k_r in that order. Knows nothing of dispatch or flags.
"""

from __future__ import annotations

import torch

from engine.config import ModelConfig
from engine.rope import apply_rope


def tensor_shapes(config: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """Layer prefix `p`'s attention weights: wq or wq_a + q_a_norm + wq_b, wkv_a, kv_a_norm, wkv_b, wo."""
    c, latent = config, config.latent_attention
    query_width = c.n_heads * latent.qk_head_dim
    shapes: dict[str, tuple[int, ...]] = {}
    if latent.q_lora_rank is None:
        shapes[p + "wq"] = (query_width, c.hidden)
    else:
        shapes.update({p + "wq_a": (latent.q_lora_rank, c.hidden), p + "q_a_norm": (latent.q_lora_rank,),
                       p + "wq_b": (query_width, latent.q_lora_rank)})
    shapes.update({
        p + "wkv_a": (latent.kv_lora_rank + latent.qk_rope_head_dim, c.hidden),
        p + "kv_a_norm": (latent.kv_lora_rank,),
        p + "wkv_b": (c.n_heads * (latent.qk_nope_head_dim + latent.v_head_dim), latent.kv_lora_rank),
        p + "wo": (c.hidden, c.n_heads * latent.v_head_dim),
    })
    return shapes


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x [B, T, H, r]; cos, sin [T, r/2] or [B, T, r/2]. Interleaved pairs are rotated and laid out evens-then-odds."""
    if interleaved:
        x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
    return apply_rope(x, cos, sin)


def inputs(config: ModelConfig, weights: dict[str, torch.Tensor], p: str, h: torch.Tensor,
           cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """h [B, T, D] (normed) -> q [B, T, Hq, n + r] (RoPE applied) and the cache entry [B, T, 1, R + r]:
    the normed latent, then the rotated RoPE key."""
    c, latent = config, config.latent_attention
    batch, steps = h.shape[:2]
    if latent.q_lora_rank is None:
        q = h @ weights[p + "wq"].t()
    else:
        q = _rms_norm(h @ weights[p + "wq_a"].t(), weights[p + "q_a_norm"], latent.norm_eps) @ weights[p + "wq_b"].t()
    q = q.view(batch, steps, c.n_heads, latent.qk_head_dim)
    q_nope, q_rope = q.split([latent.qk_nope_head_dim, latent.qk_rope_head_dim], dim=-1)
    compressed = h @ weights[p + "wkv_a"].t()  # [B, T, R + r]
    kv, k_rope = compressed.split([latent.kv_lora_rank, latent.qk_rope_head_dim], dim=-1)
    kv = _rms_norm(kv, weights[p + "kv_a_norm"], latent.norm_eps)  # [B, T, R]
    q_rope = _rope(q_rope, cos, sin, latent.rope_interleave)
    k_rope = _rope(k_rope.view(batch, steps, 1, latent.qk_rope_head_dim), cos, sin, latent.rope_interleave)
    return torch.cat([q_nope, q_rope], dim=-1), torch.cat([kv.view(batch, steps, 1, -1), k_rope], dim=-1)


def split_kv_b(config: ModelConfig, kv_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b [Hq * (n + v), R] -> W_UK [Hq, n, R], W_UV [Hq, v, R] (views)."""
    latent = config.latent_attention
    per_head = kv_b.view(config.n_heads, latent.qk_nope_head_dim + latent.v_head_dim, latent.kv_lora_rank)
    return per_head[:, :latent.qk_nope_head_dim], per_head[:, latent.qk_nope_head_dim:]


def absorb_query(config: ModelConfig, q: torch.Tensor, kv_b: torch.Tensor) -> torch.Tensor:
    """q [B, T, Hq, n + r] -> [B, T, Hq, R + r]: the no-RoPE part projected into the latent space (q W_UK),
    the RoPE part as it is: what the fused arm attends with over the latent cache."""
    latent = config.latent_attention
    w_uk, _ = split_kv_b(config, kv_b)
    q_nope, q_rope = q.split([latent.qk_nope_head_dim, latent.qk_rope_head_dim], dim=-1)
    q_latent = torch.einsum("bthn,hnr->bthr", q_nope, w_uk)  # [B, T, Hq, R]
    return torch.cat([q_latent, q_rope.to(q_latent.dtype)], dim=-1)


def unabsorb_output(config: ModelConfig, out_latent: torch.Tensor, kv_b: torch.Tensor) -> torch.Tensor:
    """out_latent [B, T, Hq, R] (attention over the latents) -> [B, T, Hq, v]: W_UV applied after."""
    _, w_uv = split_kv_b(config, kv_b)
    return torch.einsum("bthr,hvr->bthv", out_latent, w_uv)


def cache_bytes_per_token(config: ModelConfig, element_bytes: int) -> tuple[int, int]:
    """(latent cache, naive decompressed cache) bytes one token adds to one layer."""
    latent = config.latent_attention
    return (latent.cache_elements_per_token() * element_bytes,
            latent.naive_cache_elements_per_token(config.n_heads) * element_bytes)
