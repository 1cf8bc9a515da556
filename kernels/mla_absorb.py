"""The two per-head products around absorbed latent attention (engine.mla) at decode widths, one launch each,
where the torch form is an einsum per product plus the copies and the concatenation around it.

    absorb:    q_abs[m, h] = (q[m, h, :n] @ W_UK_h) ++ q[m, h, n:]      [M, Hq, R + r]   (engine.mla.absorb_query)
    unabsorb:  o[m, h]     = out_latent[m, h] @ W_UV_h^T                [M, Hq, v]       (engine.mla.unabsorb_output)

with W_UK_h [n, R] and W_UV_h [v, R] the rows of kv_b [Hq * (n + v), R] (per head: n key rows, then v value
rows). Each output is one fp32 sum over n (or R) in a fixed order, rounded once to the input's dtype, as
torch's matmul rounds. Shapes: M = B * T query rows (M <= MAX_ROWS), Hq heads, n = qk_nope, r = RoPE dims,
v = v_head_dim, R = kv_lora_rank; q [M, Hq, n + r] and out_latent [M, Hq, R] with unit stride along the last
dim (rows and heads any stride); outputs contiguous.

Grids: absorb (Hq, cdiv(R, BLOCK_R)): a program holds W_UK_h's [n, BLOCK_R] tile (column block pid 0 also
copies the RoPE dims) and loops over the rows; unabsorb (Hq, cdiv(v, BLOCK_V)): W_UV_h's [BLOCK_V, R] tile.
At DeepSeek-V2-Lite's widths (Hq 16, n = v = 128, R = 512) each is 128 programs of 16 KB of weights. Rows
beyond MAX_ROWS (a prefill) are a GEMM: the caller keeps torch there.

unabsorb may take the latent attention's split partials unmerged (`splits`): each program merges its head's
rows as kernels.attention_mla's combine kernel does (the same fp32 operations in split order, rounded once to
the input's dtype), so the combine's launch goes and the product is the same to the bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import launches, pdl, scratch

MAX_ROWS = 64  # a decode batch (kernels.gemv's bound); more rows reuse each tile enough for a GEMM
TILE_ELEMENTS = 8192  # weight elements a program holds: 16 KB at bf16, 64 fp32 registers a thread at 4 warps


@triton.jit
def _absorb_kernel(
    q_ptr, kv_b_ptr, out_ptr, rows, nope, latent_rank, rope_dim, per_head,
    stride_qm, stride_qh, stride_w, stride_om, stride_oh,
    NOPE_PAD: tl.constexpr, BLOCK_R: tl.constexpr, ROPE_PAD: tl.constexpr,
    USE_GDC: tl.constexpr,  # programmatic dependent launch (kernels.pdl)
):
    head, pid_r = tl.program_id(0), tl.program_id(1)
    offs_n = tl.arange(0, NOPE_PAD)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    n_mask, r_mask = offs_n < nope, offs_r < latent_rank
    w_rows = kv_b_ptr + (head * per_head + offs_n).to(tl.int64)[:, None] * stride_w
    w = tl.load(w_rows + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
    offs_rope = tl.arange(0, ROPE_PAD)
    rope_mask = offs_rope < rope_dim
    for m in range(rows):
        q_row = q_ptr + tl.cast(m, tl.int64) * stride_qm + head * stride_qh
        out_row = out_ptr + tl.cast(m, tl.int64) * stride_om + head * stride_oh
        q_nope = tl.load(q_row + offs_n, mask=n_mask, other=0.0)
        absorbed = tl.sum(w * q_nope.to(tl.float32)[:, None], axis=0)  # [BLOCK_R]
        tl.store(out_row + offs_r, absorbed.to(q_nope.dtype), mask=r_mask)
        if pid_r == 0:  # the RoPE dims as they are
            tl.store(out_row + latent_rank + offs_rope, tl.load(q_row + nope + offs_rope, mask=rope_mask),
                     mask=rope_mask)
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _unabsorb_kernel(
    x_ptr, kv_b_ptr, out_ptr, rows, nope, latent_rank, value_dim, per_head,
    stride_xm, stride_xh, stride_w, stride_om, stride_oh,
    lse_ptr, heads,  # MERGE: x_ptr is the splits' partials [S, rows * heads, R] float32, lse [S, rows * heads]
    BLOCK_V: tl.constexpr, LATENT_PAD: tl.constexpr,
    MERGE: tl.constexpr,  # merge the split kernel's partials as kernels.attention_mla's combine does, then the product
    SPLITS: tl.constexpr,  # S (MERGE): unrolled, so every split's loads issue at once
    USE_GDC: tl.constexpr,
):
    head, pid_v = tl.program_id(0), tl.program_id(1)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_r = tl.arange(0, LATENT_PAD)
    v_mask, r_mask = offs_v < value_dim, offs_r < latent_rank
    w_rows = kv_b_ptr + (head * per_head + nope + offs_v).to(tl.int64)[:, None] * stride_w
    w = tl.load(w_rows + offs_r[None, :], mask=v_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
    for m in range(rows):
        if MERGE:  # the combine kernel's arithmetic, per element and in split order, so the rounded x is its bits
            flat = tl.cast(m, tl.int64) * heads + head
            split_rows = tl.cast(rows, tl.int64) * heads
            total_max = float("-inf")
            for split in tl.static_range(SPLITS):
                total_max = tl.maximum(total_max, tl.load(lse_ptr + split * split_rows + flat))
            safe_max = tl.where(total_max == float("-inf"), 0.0, total_max)
            weight_sum = 0.0
            merged = tl.zeros([LATENT_PAD], dtype=tl.float32)
            for split in tl.static_range(SPLITS):
                weight = tl.math.exp2(tl.load(lse_ptr + split * split_rows + flat) - safe_max)
                merged += tl.load(x_ptr + (split * split_rows + flat) * latent_rank + offs_r, mask=r_mask,
                                  other=0.0) * weight
                weight_sum += weight
            x = (merged / tl.where(weight_sum > 0.0, weight_sum, 1.0)).to(out_ptr.dtype.element_ty)
        else:
            x = tl.load(x_ptr + tl.cast(m, tl.int64) * stride_xm + head * stride_xh + offs_r, mask=r_mask, other=0.0)
        out = tl.sum(w * x.to(tl.float32)[None, :], axis=1)  # [BLOCK_V]
        tl.store(out_ptr + tl.cast(m, tl.int64) * stride_om + head * stride_oh + offs_v, out.to(x.dtype), mask=v_mask)
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()


def _check(name: str, x: torch.Tensor, kv_b: torch.Tensor, heads: int, width: int, per_head: int,
           latent_rank: int) -> None:
    if x.dim() != 3 or x.shape[1] != heads or x.shape[2] != width or x.stride(2) != 1:
        raise ValueError(f"{name}: input {tuple(x.shape)} is not [M, {heads}, {width}] with unit stride along it")
    if not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"{name} takes 1..{MAX_ROWS} rows, got {x.shape[0]}: use a GEMM for more")
    if kv_b.shape != (heads * per_head, latent_rank) or kv_b.stride(1) != 1:
        raise ValueError(f"{name}: kv_b {tuple(kv_b.shape)} is not [{heads * per_head}, {latent_rank}] with unit stride")
    if kv_b.dtype != x.dtype:
        raise ValueError(f"{name}: the input is {x.dtype} but kv_b is {kv_b.dtype}")


def absorb(q: torch.Tensor, kv_b: torch.Tensor, nope: int, value_dim: int) -> torch.Tensor:
    """q [M, Hq, n + r] (RoPE applied) -> [M, Hq, R + r]: q_nope W_UK per head, then the RoPE dims."""
    heads, latent_rank = q.shape[1], kv_b.shape[1]
    rope_dim = q.shape[2] - nope
    _check("mla absorb", q, kv_b, heads, nope + rope_dim, nope + value_dim, latent_rank)
    rows = q.shape[0]
    out = scratch.empty((rows, heads, latent_rank + rope_dim), q.dtype, q.device)
    nope_pad = triton.next_power_of_2(nope)
    block_r = min(triton.next_power_of_2(latent_rank), max(16, TILE_ELEMENTS // nope_pad))
    _absorb_kernel[(heads, triton.cdiv(latent_rank, block_r))](
        q, kv_b, out, rows, nope, latent_rank, rope_dim, nope + value_dim,
        q.stride(0), q.stride(1), kv_b.stride(0), out.stride(0), out.stride(1),
        NOPE_PAD=nope_pad, BLOCK_R=block_r, ROPE_PAD=triton.next_power_of_2(rope_dim), num_warps=4,
        **pdl.launch_options(q.device),
    )
    launches.record("mla_absorb", kernel=_absorb_kernel)
    return out


def unabsorb(out_latent: torch.Tensor, kv_b: torch.Tensor, nope: int, value_dim: int,
             splits=None) -> torch.Tensor:
    """out_latent [M, Hq, R] (attention over the latents) -> [M, Hq, v]: W_UV applied per head. With `splits`
    (a kernels.attention_mla.LatentSplits whose partials are unmerged) the latents are the splits' merge, computed
    here as the combine kernel computes it, to the bit, and out_latent is not read: one launch fewer."""
    heads, latent_rank = out_latent.shape[1], kv_b.shape[1]
    _check("mla unabsorb", out_latent, kv_b, heads, latent_rank, nope + value_dim, latent_rank)
    rows = out_latent.shape[0]
    merge = splits is not None and splits.partials is not None
    if merge and (splits.partials.shape[1] * splits.partials.shape[2] != rows * heads
                  or splits.partials.shape[3] != latent_rank or not splits.partials.is_contiguous()):
        raise ValueError(f"mla unabsorb: partials {tuple(splits.partials.shape)} are not [S, B, T * {heads}, "
                         f"{latent_rank}] for {rows} rows")
    out = scratch.empty((rows, heads, value_dim), out_latent.dtype, out_latent.device)
    latent_pad = triton.next_power_of_2(latent_rank)
    block_v = min(triton.next_power_of_2(value_dim), max(1, TILE_ELEMENTS // latent_pad))
    source = splits.partials if merge else out_latent
    lse = splits.lse if merge else out_latent  # never dereferenced without MERGE
    _unabsorb_kernel[(heads, triton.cdiv(value_dim, block_v))](
        source, kv_b, out, rows, nope, latent_rank, value_dim, nope + value_dim,
        out_latent.stride(0), out_latent.stride(1), kv_b.stride(0), out.stride(0), out.stride(1),
        lse, heads, BLOCK_V=block_v, LATENT_PAD=latent_pad, MERGE=merge,
        SPLITS=splits.partials.shape[0] if merge else 1, num_warps=4, **pdl.launch_options(out_latent.device),
    )
    launches.record("mla_unabsorb", kernel=_unabsorb_kernel)
    return out
