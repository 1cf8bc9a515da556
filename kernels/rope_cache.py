"""RoPE on the step's queries and keys, and the keys and values written into the KV cache, in one
launch for a decode step (one new token per sequence).

What engine.model does with separate torch kernels (the rotate-half RoPE in float32, then
index_put_ into the cache):

    q_rot[b, h]                   = rope(q[b, h],  position[b])          h < Hq
    k_cache[slot[b], position[b]] = rope(k[b, h'], position[b])          h' < Hkv
    v_cache[slot[b], position[b]] = v[b, h']

rope(x, p): first/second halves of x in float32, angle_i = p * inv_freq[i] (float32, inv_freq
passed in so it is the model's own table), first*cos - second*sin ++ second*cos + first*sin,
rounded to x's dtype; with YaRN's attention factor (`scale`), cos and sin are each multiplied by it first,
as engine.model's YaRN tables carry it. With q_norm and k_norm (Qwen3-MoE's per-head q/k RMSNorm) each q and k head is
first normed as engine.model.rms_norm does: (x32 * rsqrt(mean(x32^2) + eps)) rounded to x's dtype, times
the [hd] weight, rounded again.

Shapes: B sequences, Hq / Hkv heads, hd head dim.
    qkv      [B, (Hq + 2 Hkv) * hd]   the fused projection output: q heads, k heads, v heads
    inv_freq [hd / 2] float32
    position [B] int (each row's position), slot [B] int (its cache row; None: row b)
    k_cache, v_cache [S_rows, S, Hkv, hd];  q_rot [B, Hq, hd] out; position32 [B] int32 out
Grid: (B, Hq + 2 Hkv): one program per (sequence, head), the head's kind by its index.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import launches, pdl, scratch


@triton.jit
def _rotate(first, second, position, inv_freq_ptr, offs, scale, SCALED: tl.constexpr):
    """rope(x, position) of one head from its halves [HALF] (x's dtype): float32 math, rounded back; SCALED:
    cos and sin times `scale` (YaRN's attention factor)."""
    angle = position.to(tl.float32) * tl.load(inv_freq_ptr + offs)
    cos, sin = tl.cos(angle), tl.sin(angle)
    if SCALED:
        cos, sin = cos * scale, sin * scale
    first32, second32 = first.to(tl.float32), second.to(tl.float32)
    return (first32 * cos - second32 * sin).to(first.dtype), (second32 * cos + first32 * sin).to(first.dtype)


@triton.jit
def _head_norm(first, second, weight_ptr, offs, eps, HALF: tl.constexpr):
    """One head's RMSNorm from its halves, rounded as engine.model.rms_norm rounds (x's dtype twice)."""
    first32, second32 = first.to(tl.float32), second.to(tl.float32)
    mean = (tl.sum(first32 * first32, axis=0) + tl.sum(second32 * second32, axis=0)) / (2 * HALF)
    scale = 1.0 / tl.sqrt(mean + eps)
    normed_first = (first32 * scale).to(first.dtype).to(tl.float32)
    normed_second = (second32 * scale).to(first.dtype).to(tl.float32)
    weight_first = tl.load(weight_ptr + offs).to(tl.float32)
    weight_second = tl.load(weight_ptr + HALF + offs).to(tl.float32)
    return (normed_first * weight_first).to(first.dtype), (normed_second * weight_second).to(first.dtype)


@triton.jit
def _rope_cache_kernel(
    qkv_ptr, inv_freq_ptr, position_ptr, slot_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, position32_ptr,
    query_heads, kv_heads,
    stride_qkv_b,
    stride_qo_b, stride_qo_h,
    stride_kc_s, stride_kc_t, stride_kc_h,
    stride_vc_s, stride_vc_t, stride_vc_h,
    HALF: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
    USE_GDC: tl.constexpr,  # programmatic dependent launch (kernels.pdl)
    q_norm_ptr=None,  # [hd] per-head RMSNorm weight of the queries (QK_NORM)
    k_norm_ptr=None,  # [hd] of the keys
    eps=1e-6,
    QK_NORM: tl.constexpr = False,
    scale=1.0,  # YaRN's attention factor on cos and sin (SCALED)
    SCALED: tl.constexpr = False,
):
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    head = tl.program_id(1)
    offs = tl.arange(0, HALF)
    source = qkv_ptr + b.to(tl.int64) * stride_qkv_b + head * (2 * HALF)
    first = tl.load(source + offs)
    second = tl.load(source + HALF + offs)
    position = tl.load(position_ptr + b)
    if HAS_SLOTS:
        slot = tl.load(slot_ptr + b).to(tl.int64)
    else:
        slot = b.to(tl.int64)
    if head == 0:  # the positions as int32, what the attention kernels take: no separate cast launch
        tl.store(position32_ptr + b, position.to(tl.int32))
    if head >= query_heads + kv_heads:  # a value head: copied as it is
        destination = v_cache_ptr + slot * stride_vc_s + position.to(tl.int64) * stride_vc_t \
            + (head - query_heads - kv_heads) * stride_vc_h
        tl.store(destination + offs, first)
        tl.store(destination + HALF + offs, second)
    else:
        if QK_NORM:
            if head < query_heads:
                first, second = _head_norm(first, second, q_norm_ptr, offs, eps, HALF)
            else:
                first, second = _head_norm(first, second, k_norm_ptr, offs, eps, HALF)
        rotated_first, rotated_second = _rotate(first, second, position, inv_freq_ptr, offs, scale, SCALED)
        if head < query_heads:
            destination = q_out_ptr + b.to(tl.int64) * stride_qo_b + head * stride_qo_h
        else:
            destination = k_cache_ptr + slot * stride_kc_s + position.to(tl.int64) * stride_kc_t \
                + (head - query_heads) * stride_kc_h
        tl.store(destination + offs, rotated_first)
        tl.store(destination + HALF + offs, rotated_second)


def rope_cache(qkv: torch.Tensor, inv_freq: torch.Tensor, position: torch.Tensor, slot: torch.Tensor | None,
               k_cache: torch.Tensor, v_cache: torch.Tensor, query_heads: int,
               qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
               scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k of one token per sequence, write k and v into the cache (row slot[b], or row b
    when slot is None); returns q [B, Hq, hd] and the positions as int32 [B]. `qk_norm` (q weight [hd],
    k weight [hd], eps): each q and k head RMSNormed first. `scale`: YaRN's attention factor, multiplying
    cos and sin (1: plain RoPE, the same build as before it)."""
    batch = qkv.shape[0]
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if qkv.dim() != 2 or qkv.shape[1] != (query_heads + 2 * kv_heads) * head_dim or qkv.stride(1) != 1:
        raise ValueError(f"rope_cache: qkv {tuple(qkv.shape)} is not [B, (Hq + 2 Hkv) * hd] = "
                         f"[B, {(query_heads + 2 * kv_heads) * head_dim}] with unit stride")
    if head_dim % 2 or (head_dim // 2) & (head_dim // 2 - 1):
        raise ValueError(f"rope_cache: head_dim / 2 must be a power of two, got head_dim {head_dim}")
    if inv_freq.shape != (head_dim // 2,) or inv_freq.dtype != torch.float32:
        raise ValueError(f"rope_cache: inv_freq must be float32 [{head_dim // 2}]")
    if position.shape != (batch,) or (slot is not None and slot.shape != (batch,)):
        raise ValueError(f"rope_cache: position and slot must be [{batch}]")
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or v_cache.shape != k_cache.shape:
        raise ValueError("rope_cache: the caches must be [rows, S, Hkv, hd] with unit stride along hd")
    norm_options = {}
    if qk_norm is not None:
        q_weight, k_weight, eps = qk_norm
        if q_weight.shape != (head_dim,) or k_weight.shape != (head_dim,):
            raise ValueError(f"rope_cache: the q/k norm weights must be [{head_dim}], got {tuple(q_weight.shape)} "
                             f"and {tuple(k_weight.shape)}")
        norm_options = dict(q_norm_ptr=q_weight, k_norm_ptr=k_weight, eps=float(eps), QK_NORM=True)
    q_out = scratch.empty((batch, query_heads, head_dim), qkv.dtype, qkv.device)
    position32 = scratch.empty((batch,), torch.int32, qkv.device)
    if batch == 0:
        return q_out, position32
    _rope_cache_kernel[(batch, query_heads + 2 * kv_heads)](
        qkv, inv_freq, position, position if slot is None else slot, q_out, k_cache, v_cache, position32,
        query_heads, kv_heads, qkv.stride(0),
        q_out.stride(0), q_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HALF=head_dim // 2, HAS_SLOTS=slot is not None, num_warps=1 if head_dim <= 256 else 2,
        **pdl.launch_options(qkv.device), **norm_options,
        **({} if scale == 1.0 else dict(scale=float(scale), SCALED=True)),
    )
    launches.record("rope_cache", kernel=_rope_cache_kernel)
    return q_out, position32
