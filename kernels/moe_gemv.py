"""Gather-GEMV MoE arm: every (token, expert) pair reads its expert's weights on its own.

Shapes: T tokens, k experts per token, E experts, D hidden, F expert intermediate, N = T*k pairs.

    x             [T, D]        activations
    w13           [E, 2F, D]    rows 0..F-1 gate, F..2F-1 up
    w2            [E, D, F]
    topk_ids      [T, k]        expert of pair p = t*k + j (ids outside [0, E) contribute nothing)
    topk_weights  [T, k]        routing weight of each pair
    hidden        [N, F]        silu(gate_e x_t) * (up_e x_t), x's dtype, pair order
    out           [T, D]
    partials      [N, D]        fp32 scratch, = [T, k, D]: w_p * (w2_e @ hidden_p) per pair
    counters      [T, D/BLOCK_D] int32 arrival counters (kernels.arrivals), 0 before and after

Kernels (two launches, no alignment, no deduplication of expert reads: the decode arm, right
when pairs rarely share an expert):
    _gate_up_kernel  grid (N, F / BLOCK_F)   one pair and BLOCK_F hidden units: gate and up rows
                                             streamed along D, SiLU·mul fused
    _down_kernel     grid (N, D / BLOCK_D)   one pair p = t*k + j and BLOCK_D outputs: its expert's
                                             BLOCK_D rows of w2 streamed along F, fp32, scaled by
                                             the routing weight, stored as the pair's partial;
                                             the last of the k programs of (token, block) to
                                             arrive sums the k partials and writes out
The down grid is the (T, D / BLOCK_D, k) program set with token and j merged into axis 0, pair
order as in gate-up: the k programs of one (token, block) are dispatched side by side, and all
pairs of one output block stream at once, so pairs that share an expert share its lines in L2.

Down's reduction over the k pairs ("last program reduces", kernels/arrivals.py): each program
stores its partial (0 for an id outside [0, E): it still arrives), `tl.debug_barrier()`, one
`atomic_add(counter, 1, sem="acq_rel")` per program; the program that sees k - 1 reads the k
partials past L1 (".cg") and adds them in the fixed order j = 0..k-1, writes out[t, block] in x's
dtype, and sets the counter back to 0. No second launch and no float atomics: which program comes
last changes from run to run, the order of the sum does not, so the output is bit-reproducible.
On the GPU this leans on bar.sync plus one thread's acq_rel atomic at gpu scope ordering the
whole program's stores and loads (the pattern of cooperative groups' grid sync).

Block sizes are not autotuned (an autotuner would time inside CUDA-graph capture and pick
differently per run); they are set for the bandwidth-bound decode case on Hopper: each program
streams 16-byte vectors of 8 rows x 512 (gate-up, w13's gate and up) or 8 x 1024 (down) weights
per step, 16 KB at bf16, and reduces them at once into a few fp32 lanes. An sm_90 compile without
a GPU gives 80 and 40 registers at 4 warps, so 6 and 12 programs fit an SM (up to 96 and 192 KB
of loads in flight per SM; ~30-50 KB per SM covers DRAM latency at 4.3 TB/s).
    n = 1 at D=4096, F=2048, k=6:  gate-up 6 x 256 = 1536 programs (1.9 waves of 792 slots)
                                   down    6 x 512 = 3072 programs (1.9 waves of 1584), 2 steps each
    n = 16:                        gate-up 24576, down 49152 programs
Before, down ran one program per (token, block): 512 programs at n = 1 (3.9 per SM on 132 SMs),
each a chain of k x 2 = 12 dependent steps, and reached 2.5 TB/s. Down at 8 x 1024 keeps two
steps per program so the expert-id load and the arrival are paid once per 32 KB; 4 x 2048 (one
step, 48 registers, 6144 programs) is the alternative if the H200 shows the arrival exposed.
Scratch: partials are N x D x 4 B (96 KB at n = 1, 1.5 MB at n = 16, 805 MB at n = 8192 where
the sweep still times this arm), counters T x D/8 int32 (kept in the shared arrival buffer).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels import arrivals, launches, pdl, scratch, streaming
from kernels.moe_checks import check_moe_inputs, check_triton_device

GATE_UP_BLOCK_F = 8  # hidden units per program: 2 x 8 rows of w13
GATE_UP_BLOCK_D = 512  # hidden elements per step: 1 KB of each bf16 row, 16 B per thread x 64
DOWN_BLOCK_D = 8  # outputs per program: 8 rows of w2
DOWN_BLOCK_F = 1024  # intermediate elements per step: 8 x 1024 bf16 = 16 KB in flight per program
GATE_UP_STAGES = 1  # software-pipelined steps of the weight walk (tl.range num_stages; 1: none)
DOWN_STAGES = 1
DOWN_WALK = 1  # 1: down as _down_walk_kernel (one program per token and output block walks its k pairs); run 47
NUM_WARPS = 4


def _table() -> tuple[int, int, int, int, int, int, int]:
    """(gate-up BLOCK_F, BLOCK_D, stages, down BLOCK_D, BLOCK_F, stages, walk): the module's table, or
    MOEI_MOE_GEMV_TABLE="8,512,3,8,1024,1,0" for an A/B on the GPU (experiment switch)."""
    setting = os.environ.get("MOEI_MOE_GEMV_TABLE")
    if setting:
        values = tuple(int(value) for value in setting.split(","))
        if len(values) != 7:
            raise ValueError(f"MOEI_MOE_GEMV_TABLE needs 7 integers, got {setting!r}")
        return values
    return (GATE_UP_BLOCK_F, GATE_UP_BLOCK_D, GATE_UP_STAGES, DOWN_BLOCK_D, DOWN_BLOCK_F, DOWN_STAGES,
            DOWN_WALK)


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
    STAGES: tl.constexpr,  # software pipelining of the walk along D (1: none)
    USE_GDC: tl.constexpr,  # programmatic dependent launch (kernels.pdl)
    WEIGHT_EVICTION: tl.constexpr,  # the expert weights' L2 policy (kernels.streaming)
):
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
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
        for d0 in tl.range(0, hidden_size, BLOCK_D, num_stages=STAGES):
            d_mask = offs_d < hidden_size - d0
            w_mask = f_mask[:, None] & d_mask[None, :]
            x_chunk = tl.load(x_ptrs, mask=d_mask, other=0.0).to(tl.float32)
            gate = tl.load(gate_ptrs, mask=w_mask, other=0.0, eviction_policy=WEIGHT_EVICTION).to(tl.float32)
            up = tl.load(up_ptrs, mask=w_mask, other=0.0, eviction_policy=WEIGHT_EVICTION).to(tl.float32)
            gate_sum += tl.sum(gate * x_chunk[None, :], axis=1)
            up_sum += tl.sum(up * x_chunk[None, :], axis=1)
            gate_ptrs += BLOCK_D
            up_ptrs += BLOCK_D
            x_ptrs += BLOCK_D
        if USE_GDC:
            tl.extra.cuda.gdc_launch_dependents()
        hidden = gate_sum / (1.0 + tl.exp(-gate_sum)) * up_sum  # silu(gate) * up
        tl.store(hidden_ptr + pair.to(tl.int64) * stride_hp + offs_f, hidden.to(hidden_ptr.dtype.element_ty), mask=f_mask)


@triton.jit
def _down_kernel(
    hidden_ptr,  # [N, F]
    w2_ptr,  # [E, D, F]
    topk_ids_ptr,  # [N]
    topk_weights_ptr,  # [N]
    partials_ptr,  # [N, D] fp32 scratch: pair p's routing-weighted down row
    counters_ptr,  # [T, D / BLOCK_D] int32 arrival counters, 0 on entry and on exit
    out_ptr,  # [T, D] out
    num_experts,
    hidden_size,  # D
    intermediate_size,  # F
    stride_hp,
    stride_we,
    stride_wr,
    stride_pp,
    stride_ot,
    TOP_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_F: tl.constexpr,
    STAGES: tl.constexpr,  # software pipelining of the walk along F (1: none)
    USE_GDC: tl.constexpr,  # programmatic dependent launch (kernels.pdl)
    PRELOAD: tl.constexpr,  # with USE_GDC: the first w2 tile loaded before the wait (kernels.pdl.preload)
    WEIGHT_EVICTION: tl.constexpr,  # the expert weights' L2 policy (kernels.streaming)
):
    pair = tl.program_id(0)
    d_block = tl.program_id(1)
    token = pair // TOP_K
    offs_d = d_block * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < hidden_size
    offs_f = tl.arange(0, BLOCK_F)
    if PRELOAD:  # the ids are the router's, two grids back and complete (kernels.pdl): read past L1 before the wait
        expert = tl.load(topk_ids_ptr + pair, cache_modifier=".cg").to(tl.int32)
        known = (expert >= 0) & (expert < num_experts)
        w_first = tl.load(w2_ptr + tl.where(known, expert, 0).to(tl.int64) * stride_we + offs_d[:, None] * stride_wr
                          + offs_f[None, :], mask=(d_mask & known)[:, None] & (offs_f < intermediate_size)[None, :],
                          other=0.0, eviction_policy=WEIGHT_EVICTION)
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
    if not PRELOAD:
        expert = tl.load(topk_ids_ptr + pair).to(tl.int32)
    partial = tl.zeros([BLOCK_D], dtype=tl.float32)
    if (expert >= 0) & (expert < num_experts):  # an id outside [0, E) leaves its partial at 0
        routing_weight = tl.load(topk_weights_ptr + pair).to(tl.float32)  # issued before the loop
        w_ptrs = w2_ptr + expert.to(tl.int64) * stride_we + offs_d[:, None] * stride_wr + offs_f[None, :]
        h_ptrs = hidden_ptr + pair.to(tl.int64) * stride_hp + offs_f
        f_start = 0
        if PRELOAD:  # the loop's first step, on the preloaded tile
            h = tl.load(h_ptrs, mask=offs_f < intermediate_size, other=0.0).to(tl.float32)
            partial += tl.sum(w_first.to(tl.float32) * h[None, :], axis=1)
            w_ptrs += BLOCK_F
            h_ptrs += BLOCK_F
            f_start = BLOCK_F
        # reduced every step into [BLOCK_D] fp32: few registers, many programs per SM
        for f0 in tl.range(f_start, intermediate_size, BLOCK_F, num_stages=STAGES):
            f_mask = offs_f < intermediate_size - f0
            h = tl.load(h_ptrs, mask=f_mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptrs, mask=d_mask[:, None] & f_mask[None, :], other=0.0,
                        eviction_policy=WEIGHT_EVICTION).to(tl.float32)
            partial += tl.sum(w * h[None, :], axis=1)
            w_ptrs += BLOCK_F
            h_ptrs += BLOCK_F
        partial = partial * routing_weight
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    # last program reduces (kernels/arrivals.py): every pair stores its partial, then counts in
    tl.store(partials_ptr + pair.to(tl.int64) * stride_pp + offs_d, partial, mask=d_mask)
    tl.debug_barrier()  # every thread's store is issued before the release below
    counter = counters_ptr + token * tl.num_programs(1) + d_block
    arrived = tl.atomic_add(counter, 1, sem="acq_rel")
    if arrived == TOP_K - 1:
        first_ptrs = partials_ptr + (token * TOP_K).to(tl.int64) * stride_pp + offs_d
        total = tl.zeros([BLOCK_D], dtype=tl.float32)
        for j in tl.static_range(TOP_K):  # fixed order: the same bits whichever program came last
            total += tl.load(first_ptrs + j * stride_pp, mask=d_mask, other=0.0, cache_modifier=".cg")
        tl.store(out_ptr + token.to(tl.int64) * stride_ot + offs_d, total.to(out_ptr.dtype.element_ty), mask=d_mask)
        tl.atomic_xchg(counter, 0)  # ready for the next launch on this stream, eager or replayed


@triton.jit
def _down_walk_kernel(
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
    STAGES: tl.constexpr,  # software pipelining of the walk over the k pairs' F chunks
    USE_GDC: tl.constexpr,  # programmatic dependent launch (kernels.pdl)
    PRELOAD: tl.constexpr,  # with USE_GDC: pair 0's first w2 tile loaded before the wait (kernels.pdl.preload)
    WEIGHT_EVICTION: tl.constexpr,  # the expert weights' L2 policy (kernels.streaming)
):
    """One program per (token, BLOCK_D outputs) walks its k pairs' w2 rows one after the other, as one
    pipelined stream of k x F / BLOCK_F tiles, and sums them in fp32 in the fixed order j = 0..k-1: no
    partials, no arrivals. Each tile is scaled by its pair's routing weight as it is reduced."""
    token = tl.program_id(0)
    d_block = tl.program_id(1)
    offs_d = d_block * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < hidden_size
    offs_f = tl.arange(0, BLOCK_F)
    first_pair = token * TOP_K
    steps_per_pair = tl.cdiv(intermediate_size, BLOCK_F)
    if PRELOAD:  # the ids are the router's, two grids back and complete (kernels.pdl): read past L1 before the wait
        expert = tl.load(topk_ids_ptr + first_pair, cache_modifier=".cg").to(tl.int32)
        known = (expert >= 0) & (expert < num_experts)
        w_first = tl.load(w2_ptr + tl.where(known, expert, 0).to(tl.int64) * stride_we + offs_d[:, None] * stride_wr
                          + offs_f[None, :], mask=d_mask[:, None] & (offs_f < intermediate_size)[None, :],
                          other=0.0, eviction_policy=WEIGHT_EVICTION)
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
    total = tl.zeros([BLOCK_D], dtype=tl.float32)
    start = 0
    if PRELOAD:  # the walk's first tile, preloaded
        h = tl.where(known, tl.load(hidden_ptr + first_pair.to(tl.int64) * stride_hp + offs_f,
                                    mask=offs_f < intermediate_size, other=0.0).to(tl.float32), 0.0)
        scale = tl.where(known, tl.load(topk_weights_ptr + first_pair).to(tl.float32), 0.0)
        total += scale * tl.sum(w_first.to(tl.float32) * h[None, :], axis=1)
        start = 1
    for step in tl.range(start, TOP_K * steps_per_pair, num_stages=STAGES):
        j = step // steps_per_pair
        f0 = (step - j * steps_per_pair) * BLOCK_F
        pair = first_pair + j
        expert = tl.load(topk_ids_ptr + pair).to(tl.int32)
        known = (expert >= 0) & (expert < num_experts)  # an id outside [0, E) adds nothing
        f_mask = offs_f < intermediate_size - f0
        # an unknown pair's hidden row was never written (gate-up skips it): zeroed, not multiplied by 0
        h = tl.where(known, tl.load(hidden_ptr + pair.to(tl.int64) * stride_hp + f0 + offs_f, mask=f_mask,
                                    other=0.0).to(tl.float32), 0.0)
        w = tl.load(w2_ptr + tl.where(known, expert, 0).to(tl.int64) * stride_we + offs_d[:, None] * stride_wr
                    + (f0 + offs_f)[None, :], mask=d_mask[:, None] & f_mask[None, :], other=0.0,
                    eviction_policy=WEIGHT_EVICTION).to(tl.float32)
        scale = tl.where(known, tl.load(topk_weights_ptr + pair).to(tl.float32), 0.0)
        total += scale * tl.sum(w * h[None, :], axis=1)
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(out_ptr + token.to(tl.int64) * stride_ot + offs_d, total.to(out_ptr.dtype.element_ty), mask=d_mask)


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
    gate_up_block_f, gate_up_block_d, gate_up_stages, down_block_d, down_block_f, down_stages, walk = _table()
    # never wider than the row itself: small shapes (tests, the demo preset) waste no lanes
    gate_up_block_d = min(gate_up_block_d, triton.next_power_of_2(hidden_size))
    down_block_f = min(down_block_f, triton.next_power_of_2(intermediate))
    _gate_up_kernel[(num_pairs, triton.cdiv(intermediate, gate_up_block_f))](
        x, w13, flat_ids, hidden,
        experts, hidden_size, intermediate,
        x.stride(0), w13.stride(0), w13.stride(1), hidden.stride(0),
        TOP_K=top_k, BLOCK_F=gate_up_block_f, BLOCK_D=gate_up_block_d, STAGES=gate_up_stages, num_warps=NUM_WARPS,
        **pdl.launch_options(x.device), WEIGHT_EVICTION=streaming.weight_eviction(x.device),
    )
    launches.record("moe_gemv.gate_up")
    down_blocks = triton.cdiv(hidden_size, down_block_d)
    if walk:  # one program per (token, output block), walking its k pairs
        _down_walk_kernel[(tokens, down_blocks)](
            hidden, w2, flat_ids, flat_weights, out,
            experts, hidden_size, intermediate,
            hidden.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
            TOP_K=top_k, BLOCK_D=down_block_d, BLOCK_F=down_block_f, STAGES=down_stages, num_warps=NUM_WARPS,
            **pdl.launch_options(x.device), PRELOAD=pdl.preload(x.device, "down"),
            WEIGHT_EVICTION=streaming.weight_eviction(x.device),
        )
        launches.record("moe_gemv.down")
        return out
    # one program per (pair, output block); the k pairs of a token add up in the kernel
    partials = scratch.empty((num_pairs, hidden_size), torch.float32, x.device)  # [N, D] = [T, k, D]
    counters = arrivals.counters(x.device, tokens * down_blocks)  # [T, D / BLOCK_D]
    _down_kernel[(num_pairs, down_blocks)](
        hidden, w2, flat_ids, flat_weights, partials, counters, out,
        experts, hidden_size, intermediate,
        hidden.stride(0), w2.stride(0), w2.stride(1), partials.stride(0), out.stride(0),
        TOP_K=top_k, BLOCK_D=down_block_d, BLOCK_F=down_block_f, STAGES=down_stages, num_warps=NUM_WARPS,
        **pdl.launch_options(x.device), PRELOAD=pdl.preload(x.device, "down"),
        WEIGHT_EVICTION=streaming.weight_eviction(x.device),
    )
    launches.record("moe_gemv.down")
    return out
