"""A latent attention (MLA) layer's decode glue in one launch: RoPE on the queries' RoPE dims, and the
token's cache entry (the normed latent, then the rotated shared RoPE key) written into the latent cache.

What engine.mla.inputs does with torch kernels after the projections, for one new token per sequence:

    q_out[b, h]                = q_nope[b, h] ++ rope(q_rope[b, h], position[b])       h < Hq
    cache[slot[b], position[b]] = RMSNorm(c[b]) * kv_norm  ++  rope(k_r[b], position[b])

rope(x, p): DeepSeek's interleaved pairs (x0, x1), (x2, x3), ... taken as halves (the evens, the odds;
`interleaved` False: the first and second halves), angle_i = p * inv_freq[i] (float32, the model's own
table: YaRN's where the config scales RoPE), cos and sin times `rope_scale` (YaRN's attention factor, 1
otherwise), first*cos - second*sin ++ second*cos + first*sin, rounded to x's dtype: the evens-then-odds
layout engine.mla writes, so every dot product is unchanged. The norm rounds as engine.mla's: the
normalised value to the dtype, then its product with the weight.

Shapes: B sequences, Hq heads, n = qk_nope, r = RoPE dims, R = kv_lora_rank.
    q         [B, Hq * (n + r)]   the query projection's output (unit stride along it; rows any stride)
    kv        [B, R + r]          the kv_a projection's output: latent, then the RoPE key
    kv_norm   [R]                 inv_freq [r / 2] float32;  position [B] int, slot [B] int (None: row b)
    cache     [rows, S, 1, R + r];  q_out [B, Hq, n + r] out;  position32 [B] int32 out
Grid: (B, Hq + 1): one program per (sequence, query head), and one per sequence for its cache entry.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import launches, pdl, scratch


@triton.jit
def _halves(row_ptr, offs, mask, HALF: tl.constexpr, INTERLEAVED: tl.constexpr, HALF_PAD: tl.constexpr):
    """The two halves RoPE rotates against each other, of the r values at row_ptr."""
    if INTERLEAVED:
        first = tl.load(row_ptr + 2 * offs, mask=mask, other=0.0)
        second = tl.load(row_ptr + 2 * offs + 1, mask=mask, other=0.0)
    else:
        first = tl.load(row_ptr + offs, mask=mask, other=0.0)
        second = tl.load(row_ptr + HALF + offs, mask=mask, other=0.0)
    return first, second


@triton.jit
def _rotate(first, second, position, inv_freq_ptr, offs, mask, rope_scale):
    """rope(x, position) from its halves: float32 math, cos and sin scaled, rounded back to x's dtype."""
    angle = position.to(tl.float32) * tl.load(inv_freq_ptr + offs, mask=mask, other=0.0)
    cos, sin = tl.cos(angle) * rope_scale, tl.sin(angle) * rope_scale
    first32, second32 = first.to(tl.float32), second.to(tl.float32)
    return (first32 * cos - second32 * sin).to(first.dtype), (second32 * cos + first32 * sin).to(first.dtype)


@triton.jit
def _mla_rope_cache_kernel(
    q_ptr, kv_ptr, kv_norm_ptr, inv_freq_ptr, position_ptr, slot_ptr, q_out_ptr, cache_ptr, position32_ptr,
    heads, nope, latent_rank, eps, rope_scale,
    stride_qb, stride_kvb, stride_qo_b, stride_qo_h, stride_c_s, stride_c_t,
    NOPE_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr, LATENT_PAD: tl.constexpr,
    INTERLEAVED: tl.constexpr, HAS_SLOTS: tl.constexpr,
    USE_GDC: tl.constexpr,  # programmatic dependent launch (kernels.pdl)
):
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    head = tl.program_id(1)
    position = tl.load(position_ptr + b)
    offs_half = tl.arange(0, HALF_PAD)
    half_mask = offs_half < HALF
    if head < heads:  # a query head: the no-RoPE dims copied, the RoPE dims rotated
        source = q_ptr + b.to(tl.int64) * stride_qb + head * (nope + 2 * HALF)
        destination = q_out_ptr + b.to(tl.int64) * stride_qo_b + head * stride_qo_h
        offs_nope = tl.arange(0, NOPE_PAD)
        nope_mask = offs_nope < nope
        tl.store(destination + offs_nope, tl.load(source + offs_nope, mask=nope_mask), mask=nope_mask)
        first, second = _halves(source + nope, offs_half, half_mask, HALF, INTERLEAVED, HALF_PAD)
        first, second = _rotate(first, second, position, inv_freq_ptr, offs_half, half_mask, rope_scale)
        tl.store(destination + nope + offs_half, first, mask=half_mask)
        tl.store(destination + nope + HALF + offs_half, second, mask=half_mask)
    else:  # the sequence's cache entry
        if HAS_SLOTS:
            slot = tl.load(slot_ptr + b).to(tl.int64)
        else:
            slot = b.to(tl.int64)
        tl.store(position32_ptr + b, position.to(tl.int32))  # what the attention kernels take: no cast launch
        source = kv_ptr + b.to(tl.int64) * stride_kvb
        destination = cache_ptr + slot * stride_c_s + position.to(tl.int64) * stride_c_t
        offs_latent = tl.arange(0, LATENT_PAD)
        latent_mask = offs_latent < latent_rank
        latent = tl.load(source + offs_latent, mask=latent_mask, other=0.0)
        latent32 = latent.to(tl.float32)
        scale = 1.0 / tl.sqrt(tl.sum(latent32 * latent32, axis=0) / latent_rank + eps)
        weight = tl.load(kv_norm_ptr + offs_latent, mask=latent_mask, other=0.0).to(tl.float32)
        normed = ((latent32 * scale).to(latent.dtype).to(tl.float32) * weight).to(latent.dtype)
        tl.store(destination + offs_latent, normed, mask=latent_mask)
        first, second = _halves(source + latent_rank, offs_half, half_mask, HALF, INTERLEAVED, HALF_PAD)
        first, second = _rotate(first, second, position, inv_freq_ptr, offs_half, half_mask, rope_scale)
        tl.store(destination + latent_rank + offs_half, first, mask=half_mask)
        tl.store(destination + latent_rank + HALF + offs_half, second, mask=half_mask)


def mla_rope_cache(q: torch.Tensor, kv: torch.Tensor, kv_norm: torch.Tensor, eps: float, inv_freq: torch.Tensor,
                   rope_scale: float, position: torch.Tensor, slot: torch.Tensor | None, cache: torch.Tensor,
                   heads: int, nope: int, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the queries' RoPE dims and write each sequence's cache entry (row slot[b], or row b when slot is
    None) at its position; returns q [B, Hq, n + r] and the positions as int32 [B]."""
    batch = q.shape[0]
    width = cache.shape[-1] if cache.dim() == 4 else -1
    rope_dim = 2 * inv_freq.shape[0] if inv_freq.dim() == 1 else -1
    latent_rank = width - rope_dim
    if cache.dim() != 4 or cache.shape[2] != 1 or cache.stride(3) != 1 or latent_rank < 1 or rope_dim < 2:
        raise ValueError(f"mla_rope_cache: cache {tuple(cache.shape)} is not [rows, S, 1, R + r] with unit stride "
                         f"and r = 2 x inv_freq's {inv_freq.shape}")
    if inv_freq.dtype != torch.float32:
        raise ValueError("mla_rope_cache: inv_freq must be float32 [r / 2]")
    if q.dim() != 2 or q.shape[1] != heads * (nope + rope_dim) or q.stride(1) != 1:
        raise ValueError(f"mla_rope_cache: q {tuple(q.shape)} is not [B, Hq * (n + r)] = [B, {heads * (nope + rope_dim)}]"
                         f" with unit stride")
    if kv.shape != (batch, width) or kv.stride(1) != 1 or kv_norm.shape != (latent_rank,):
        raise ValueError(f"mla_rope_cache: kv {tuple(kv.shape)} must be [{batch}, {width}] with unit stride and "
                         f"kv_norm [{latent_rank}], got {tuple(kv_norm.shape)}")
    if kv.dtype != q.dtype or cache.dtype != q.dtype:
        raise ValueError(f"mla_rope_cache: q, kv and the cache must share a dtype, got {q.dtype}, {kv.dtype}, "
                         f"{cache.dtype}")
    if position.shape != (batch,) or (slot is not None and slot.shape != (batch,)):
        raise ValueError(f"mla_rope_cache: position and slot must be [{batch}]")
    q_out = scratch.empty((batch, heads, nope + rope_dim), q.dtype, q.device)
    position32 = scratch.empty((batch,), torch.int32, q.device)
    if batch == 0:
        return q_out, position32
    _mla_rope_cache_kernel[(batch, heads + 1)](
        q, kv, kv_norm, inv_freq, position, position if slot is None else slot, q_out, cache, position32,
        heads, nope, latent_rank, float(eps), float(rope_scale),
        q.stride(0), kv.stride(0), q_out.stride(0), q_out.stride(1), cache.stride(0), cache.stride(1),
        NOPE_PAD=triton.next_power_of_2(nope), HALF=rope_dim // 2, HALF_PAD=triton.next_power_of_2(rope_dim // 2),
        LATENT_PAD=triton.next_power_of_2(latent_rank), INTERLEAVED=interleaved, HAS_SLOTS=slot is not None,
        num_warps=1 if latent_rank <= 256 else 2, **pdl.launch_options(q.device),
    )
    launches.record("mla_rope_cache", kernel=_mla_rope_cache_kernel)
    return q_out, position32
