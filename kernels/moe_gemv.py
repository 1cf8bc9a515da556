"""Gather-GEMV MoE arm: every (token, expert) pair reads its expert's weights on its own.

Shapes: T tokens, k experts per token, E experts, D hidden, F expert intermediate, N = T*k pairs.

    x             [T, D]        activations
    w13           [E, 2F, D]    rows 0..F-1 gate, F..2F-1 up
    w2            [E, D, F]
    topk_ids      [T, k]        expert of pair p = t*k + j (ids outside [0, E) contribute nothing)
    topk_weights  [T, k]        routing weight of each pair
    hidden        [N, F]        silu(gate_e x_t) * (up_e x_t), x's dtype, pair order
    out           [T, D]

Kernels (two launches, no alignment, no deduplication of expert reads: the decode arm, right
when pairs rarely share an expert):
    _gate_up_kernel  grid (N, F / BLOCK_F)   one pair and BLOCK_F hidden units: gate and up rows
                                             streamed along D, SiLU·mul fused
    _down_kernel     grid (T, D / BLOCK_D)   one token and BLOCK_D outputs: the k pairs of the
                                             token in order j = 0..k-1, each scaled by its routing
                                             weight, accumulated and summed in fp32. Summing inside
                                             one program (not with atomics) keeps the output
                                             bit-reproducible.

Block sizes are not autotuned (an autotuner would time inside CUDA-graph capture and pick
differently per run); they are set for the bandwidth-bound decode case on Hopper: each program
streams 16-byte vectors of 8 rows x 512 (gate-up) or 8 x 1024 (down) weights per step and reduces
them at once into a few fp32 lanes. An sm_90 compile without a GPU gave 80 and 56 registers at 4
warps, so 6 and 9 programs fit an SM (96 and 144 KB of loads in flight per SM), and n=1 at D=4096,
F=2048 launches 1536 + 512 programs over 132 SMs: enough loads in flight to cover DRAM latency.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import launches, scratch
from kernels.moe_checks import check_moe_inputs, check_triton_device

GATE_UP_BLOCK_F = 8  # hidden units per program: 2 x 8 rows of w13
GATE_UP_BLOCK_D = 512  # hidden elements per step: 1 KB of each bf16 row, 16 B per thread x 64
DOWN_BLOCK_D = 8  # outputs per program: 8 rows of w2
DOWN_BLOCK_F = 1024  # intermediate elements per step: 8 x 1024 bf16 = 16 KB in flight per program
NUM_WARPS = 4


@triton.jit
def _gate_up_kernel(
    x_ptr,  # [T, D]
    w13_ptr,  # [E, 2F, D]
    topk_ids_ptr,  # [N] flattened [T, k]
    hidden_ptr,  # [N, F] out
    num_experts,
    hidden_size,  # D
    intermediate_size,  # F
    stride_xt,
    stride_we,
    stride_wr,
    stride_hp,
    TOP_K: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pair = tl.program_id(0)
    f_block = tl.program_id(1)
    token = pair // TOP_K
    expert = tl.load(topk_ids_ptr + pair).to(tl.int32)
    if (expert >= 0) & (expert < num_experts):
        offs_f = f_block * BLOCK_F + tl.arange(0, BLOCK_F)
        f_mask = offs_f < intermediate_size
        offs_d = tl.arange(0, BLOCK_D)
        # expert * stride_we reaches E*2F*D = 4.3e9 at v4-shape: int64
        w_base = w13_ptr + expert.to(tl.int64) * stride_we
        gate_ptrs = w_base + offs_f[:, None] * stride_wr + offs_d[None, :]  # [BLOCK_F, BLOCK_D]
        up_ptrs = gate_ptrs + intermediate_size * stride_wr
        x_ptrs = x_ptr + token.to(tl.int64) * stride_xt + offs_d
        # reduced every step into [BLOCK_F] accumulators: few registers, so many programs fit an
        # SM and their loads in flight cover DRAM latency (this kernel is pure bandwidth)
        gate_sum = tl.zeros([BLOCK_F], dtype=tl.float32)
        up_sum = tl.zeros([BLOCK_F], dtype=tl.float32)
        for d0 in range(0, hidden_size, BLOCK_D):
            d_mask = offs_d < hidden_size - d0
            w_mask = f_mask[:, None] & d_mask[None, :]
            x_chunk = tl.load(x_ptrs, mask=d_mask, other=0.0).to(tl.float32)
            gate = tl.load(gate_ptrs, mask=w_mask, other=0.0).to(tl.float32)
            up = tl.load(up_ptrs, mask=w_mask, other=0.0).to(tl.float32)
            gate_sum += tl.sum(gate * x_chunk[None, :], axis=1)
            up_sum += tl.sum(up * x_chunk[None, :], axis=1)
            gate_ptrs += BLOCK_D
            up_ptrs += BLOCK_D
            x_ptrs += BLOCK_D
        hidden = gate_sum / (1.0 + tl.exp(-gate_sum)) * up_sum  # silu(gate) * up
        tl.store(hidden_ptr + pair.to(tl.int64) * stride_hp + offs_f, hidden.to(hidden_ptr.dtype.element_ty), mask=f_mask)


@triton.jit
def _down_kernel(
    hidden_ptr,  # [N, F]
    w2_ptr,  # [E, D, F]
    topk_ids_ptr,  # [N]
    topk_weights_ptr,  # [N]
    out_ptr,  # [T, D] out
    num_experts,
    hidden_size,  # D
    intermediate_size,  # F
    stride_hp,
    stride_we,
    stride_wr,
    stride_ot,
    TOP_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    token = tl.program_id(0)
    d_block = tl.program_id(1)
    offs_d = d_block * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < hidden_size
    offs_f = tl.arange(0, BLOCK_F)
    # each pair's products are scaled by its routing weight and reduced every step into
    # [BLOCK_D] fp32: few registers, so many programs per SM keep enough loads in flight
    out_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(TOP_K):  # fixed order: the sum is the same on every run
        pair = token * TOP_K + j
        expert = tl.load(topk_ids_ptr + pair).to(tl.int32)
        # the validity test as a vector, so it can join the element masks below
        expert_lanes = tl.zeros([BLOCK_F], dtype=tl.int32) + expert
        valid_lanes = (expert_lanes >= 0) & (expert_lanes < num_experts)
        routing_weight = tl.load(topk_weights_ptr + pair).to(tl.float32)
        w_ptrs = w2_ptr + expert.to(tl.int64) * stride_we + offs_d[:, None] * stride_wr + offs_f[None, :]
        h_ptrs = hidden_ptr + pair.to(tl.int64) * stride_hp + offs_f
        for f0 in range(0, intermediate_size, BLOCK_F):
            f_mask = (offs_f < intermediate_size - f0) & valid_lanes
            h = tl.load(h_ptrs, mask=f_mask, other=0.0).to(tl.float32) * routing_weight
            w = tl.load(w_ptrs, mask=d_mask[:, None] & f_mask[None, :], other=0.0).to(tl.float32)
            out_acc += tl.sum(w * h[None, :], axis=1)
            w_ptrs += BLOCK_F
            h_ptrs += BLOCK_F
    tl.store(out_ptr + token.to(tl.int64) * stride_ot + offs_d, out_acc.to(out_ptr.dtype.element_ty), mask=d_mask)


def moe_gemv(
    x: torch.Tensor,  # [T, D]
    w13: torch.Tensor,  # [E, 2F, D]
    w2: torch.Tensor,  # [E, D, F]
    topk_ids: torch.Tensor,  # [T, k]
    topk_weights: torch.Tensor,  # [T, k]
) -> torch.Tensor:  # [T, D]
    """The gather-GEMV arm; same contract as `kernels.reference.moe_reference`."""
    tokens, hidden_size, experts, intermediate, top_k = check_moe_inputs(x, w13, w2, topk_ids, topk_weights)
    check_triton_device(x, "moe_gemv")
    out = scratch.empty((tokens, hidden_size), x.dtype, x.device)
    if tokens == 0:
        return out
    num_pairs = tokens * top_k
    flat_ids = topk_ids.reshape(-1).contiguous()  # [N]
    flat_weights = topk_weights.reshape(-1).contiguous()  # [N]
    hidden = scratch.empty((num_pairs, intermediate), x.dtype, x.device)  # [N, F]
    # never wider than the row itself: small shapes (tests, the demo preset) waste no lanes
    gate_up_block_d = min(GATE_UP_BLOCK_D, triton.next_power_of_2(hidden_size))
    down_block_f = min(DOWN_BLOCK_F, triton.next_power_of_2(intermediate))
    _gate_up_kernel[(num_pairs, triton.cdiv(intermediate, GATE_UP_BLOCK_F))](
        x, w13, flat_ids, hidden,
        experts, hidden_size, intermediate,
        x.stride(0), w13.stride(0), w13.stride(1), hidden.stride(0),
        TOP_K=top_k, BLOCK_F=GATE_UP_BLOCK_F, BLOCK_D=gate_up_block_d, num_warps=NUM_WARPS,
    )
    launches.record("moe_gemv.gate_up")
    _down_kernel[(tokens, triton.cdiv(hidden_size, DOWN_BLOCK_D))](
        hidden, w2, flat_ids, flat_weights, out,
        experts, hidden_size, intermediate,
        hidden.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        TOP_K=top_k, BLOCK_D=DOWN_BLOCK_D, BLOCK_F=down_block_f, num_warps=NUM_WARPS,
    )
    launches.record("moe_gemv.down")
    return out
