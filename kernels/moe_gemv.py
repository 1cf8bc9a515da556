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
    _gate_up_kernel  grid (N, F / (F_STEPS BLOCK_F))  one pair and F_STEPS blocks of BLOCK_F hidden
                                             units, in turn: gate and up rows streamed along D,
                                             SiLU·mul fused
    _down_kernel     grid (T, D / BLOCK_D)   one token and BLOCK_D outputs: the w2 rows of its k
                                             experts streamed one pair after the other along F,
                                             each tile scaled by its pair's routing weight and
                                             summed in fp32 in the fixed order j = 0..k-1
Down needs no partials and no arrivals: a program holds every pair of its outputs, so the sum is
made in one place, in one order, and the output is bit-reproducible. An id outside [0, E) reads
expert 0's rows (valid memory) and weighs 0, with its hidden row (never written by gate-up) taken
as 0, so such a pair adds an exact 0.

Block sizes are not autotuned (an autotuner would time inside CUDA-graph capture and pick
differently per run); they are set for the bandwidth-bound decode case on Hopper: each program
streams 16-byte vectors of 8 rows x 512 (gate-up, w13's gate and up) or 8 x 1024 (down) weights
per step, 16 KB at bf16, and reduces them at once into a few fp32 lanes. An sm_90 compile without
a GPU gives 96 and 56 registers at 4 warps (5 and 9 programs per SM).
    n = 1 at D=4096, F=2048, k=6:  gate-up 6 x 128 = 768 programs (1.2 waves of 660 slots), 2 x 8 steps
                                   down    512 programs (one wave), 6 x 2 steps of 16 KB each
    n = 16:                        gate-up 12288, down 8192 programs
Why these blocks and schedules, and what else was measured: docs/moe-kernels.md, bench/RESULTS.md.
With PDL, down loads its first pair's first tile before its wait (the ids are the router's, two
grids back), so the whole grid has a tile in flight as gate-up drains.
Scratch: hidden [N, F] in x's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import launches, pdl, scratch, streaming
from kernels.moe_checks import check_moe_inputs, check_triton_device

GATE_UP_BLOCK_F = 8  # hidden units per program: 2 x 8 rows of w13
GATE_UP_BLOCK_D = 512  # hidden elements per step: 1 KB of each bf16 row, 16 B per thread x 64
DOWN_BLOCK_D = 8  # outputs per program: 8 rows of w2 (D / 8 = 512 programs per token)
DOWN_BLOCK_F = 1024  # intermediate elements per step: 8 x 1024 bf16 = 16 KB in flight per program
GATE_UP_F_STEPS = 2  # blocks of GATE_UP_BLOCK_F hidden units per program, in turn (measured: 2 beat 1 and 4)
NUM_WARPS = 4
# A narrower model (D = 2048, F = 768, one token) launches few gate-up programs at two blocks each (384 at
# Qwen3-30B-A3B's shape; v4-shape 768): below this count gate-up runs one block per program. Run 63: gate-up
# added 702 µs to a Qwen3 step against 852 (run 60). Down halving its outputs per program there (256 programs
# to 512) added 773 µs against 606, so down keeps DOWN_BLOCK_D at every shape.
MIN_GATE_UP_PROGRAMS = 640


def gate_up_f_steps(tokens: int, intermediate: int, top_k: int) -> int:
    """Gate-up's F_STEPS for a call of `tokens` tokens: the table's unless that launches fewer programs than
    MIN_GATE_UP_PROGRAMS, then 1 (shapes only: CUDA-graph safe)."""
    if tokens * top_k * triton.cdiv(intermediate, GATE_UP_BLOCK_F * GATE_UP_F_STEPS) < MIN_GATE_UP_PROGRAMS:
        return 1
    return GATE_UP_F_STEPS


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
    F_STEPS: tl.constexpr,  # blocks of BLOCK_F hidden units per program, one after the other
    USE_GDC: tl.constexpr,  # programmatic dependent launch (kernels.pdl)
    WEIGHT_EVICTION: tl.constexpr,  # the expert weights' L2 policy (kernels.streaming)
    b13_ptr=None,  # [E, 2F] gate then up biases (CLAMPED only, may be absent)
    stride_be=0,
    alpha=1.0,  # CLAMPED: glu = gate * sigmoid(alpha * gate)
    limit=1.0,  # CLAMPED: gate <= limit, -limit <= up <= limit
    CLAMPED: tl.constexpr = False,  # gpt-oss experts: biases and the clamped SwiGLU (kernels.reference)
    HAS_B13: tl.constexpr = False,
):
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
    pair = tl.program_id(0)
    f_block = tl.program_id(1)
    token = pair // TOP_K
    expert = tl.load(topk_ids_ptr + pair).to(tl.int32)
    if (expert >= 0) & (expert < num_experts):
        for f_step in range(F_STEPS):  # F_STEPS consecutive blocks of BLOCK_F hidden units, in turn
            offs_f = (f_block * F_STEPS + f_step) * BLOCK_F + tl.arange(0, BLOCK_F)
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
                gate = tl.load(gate_ptrs, mask=w_mask, other=0.0, eviction_policy=WEIGHT_EVICTION).to(tl.float32)
                up = tl.load(up_ptrs, mask=w_mask, other=0.0, eviction_policy=WEIGHT_EVICTION).to(tl.float32)
                gate_sum += tl.sum(gate * x_chunk[None, :], axis=1)
                up_sum += tl.sum(up * x_chunk[None, :], axis=1)
                gate_ptrs += BLOCK_D
                up_ptrs += BLOCK_D
                x_ptrs += BLOCK_D
            if USE_GDC and f_step == F_STEPS - 1:
                tl.extra.cuda.gdc_launch_dependents()
            if CLAMPED:
                if HAS_B13:
                    bias_base = b13_ptr + expert.to(tl.int64) * stride_be
                    gate_sum += tl.load(bias_base + offs_f, mask=f_mask, other=0.0).to(tl.float32)
                    up_sum += tl.load(bias_base + intermediate_size + offs_f, mask=f_mask, other=0.0).to(tl.float32)
                gate_sum = tl.minimum(gate_sum, limit)
                up_sum = tl.minimum(tl.maximum(up_sum, -limit), limit)
                hidden = (up_sum + 1.0) * (gate_sum / (1.0 + tl.exp(-alpha * gate_sum)))
            else:
                hidden = gate_sum / (1.0 + tl.exp(-gate_sum)) * up_sum  # silu(gate) * up
            tl.store(hidden_ptr + pair.to(tl.int64) * stride_hp + offs_f, hidden.to(hidden_ptr.dtype.element_ty),
                     mask=f_mask)


@triton.jit
def _pair_hidden(hidden_ptr, pair, f0, offs_f, f_mask, known, stride_hp):
    """A pair's hidden[f0 : f0 + BLOCK_F] in fp32; an unknown pair's (an id outside [0, E)) row, which gate-up
    never wrote, is taken as 0 rather than multiplied by its weight of 0."""
    return tl.where(known, tl.load(hidden_ptr + pair.to(tl.int64) * stride_hp + f0 + offs_f, mask=f_mask,
                                   other=0.0).to(tl.float32), 0.0)


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
    USE_GDC: tl.constexpr,  # programmatic dependent launch (kernels.pdl)
    PRELOAD: tl.constexpr,  # with USE_GDC: pair 0's first w2 tile loaded before the wait (kernels.pdl.preload)
    WEIGHT_EVICTION: tl.constexpr,  # the expert weights' L2 policy (kernels.streaming)
    b2_ptr=None,  # [E, D] down biases, inside each pair's routing weight (gpt-oss)
    stride_b2e=0,
    HAS_B2: tl.constexpr = False,
):
    """One program per (token, BLOCK_D outputs) walks its k pairs' w2 rows one after the other, k x F / BLOCK_F
    tiles, and sums them in fp32 in the fixed order j = 0..k-1. Each tile is scaled by its pair's routing weight
    as it is reduced; with HAS_B2 each pair's bias too, once, after its last tile."""
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
        h = _pair_hidden(hidden_ptr, first_pair, 0, offs_f, offs_f < intermediate_size, known, stride_hp)
        scale = tl.where(known, tl.load(topk_weights_ptr + first_pair).to(tl.float32), 0.0)
        total += scale * tl.sum(w_first.to(tl.float32) * h[None, :], axis=1)
        if HAS_B2:
            if steps_per_pair == 1:  # that tile was the first pair's last: its bias, weighted
                total += scale * tl.load(b2_ptr + tl.where(known, expert, 0).to(tl.int64) * stride_b2e + offs_d,
                                         mask=d_mask, other=0.0).to(tl.float32)
        start = 1
    for step in range(start, TOP_K * steps_per_pair):
        j = step // steps_per_pair
        f0 = (step - j * steps_per_pair) * BLOCK_F
        pair = first_pair + j
        expert = tl.load(topk_ids_ptr + pair).to(tl.int32)
        known = (expert >= 0) & (expert < num_experts)  # an id outside [0, E) adds nothing
        f_mask = offs_f < intermediate_size - f0
        h = _pair_hidden(hidden_ptr, pair, f0, offs_f, f_mask, known, stride_hp)
        w = tl.load(w2_ptr + tl.where(known, expert, 0).to(tl.int64) * stride_we + offs_d[:, None] * stride_wr
                    + (f0 + offs_f)[None, :], mask=d_mask[:, None] & f_mask[None, :], other=0.0,
                    eviction_policy=WEIGHT_EVICTION).to(tl.float32)
        scale = tl.where(known, tl.load(topk_weights_ptr + pair).to(tl.float32), 0.0)
        total += scale * tl.sum(w * h[None, :], axis=1)
        if HAS_B2:
            if step - j * steps_per_pair == steps_per_pair - 1:  # the pair's last tile: its bias, weighted
                total += scale * tl.load(b2_ptr + tl.where(known, expert, 0).to(tl.int64) * stride_b2e + offs_d,
                                         mask=d_mask, other=0.0).to(tl.float32)
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
    return _moe_gemv(x, w13, w2, topk_ids, topk_weights)


def moe_gemv_clamped(
    x: torch.Tensor,  # [T, D]
    w13: torch.Tensor,  # [E, 2F, D]
    w2: torch.Tensor,  # [E, D, F]
    topk_ids: torch.Tensor,  # [T, k]
    topk_weights: torch.Tensor,  # [T, k]
    b13: torch.Tensor | None,  # [E, 2F]
    b2: torch.Tensor | None,  # [E, D]
    alpha: float,
    limit: float,
) -> torch.Tensor:  # [T, D]
    """The gather-GEMV arm for gpt-oss experts (biases, the clamped SwiGLU); same contract as
    `kernels.reference.moe_reference_gpt_oss`. The same two kernels, their epilogues switched by constexprs."""
    experts = w13.shape[0]
    for name, bias, shape in (("b13", b13, (experts, w13.shape[1])), ("b2", b2, (experts, w2.shape[1]))):
        if bias is not None and (tuple(bias.shape) != shape or bias.stride(-1) != 1):
            raise ValueError(f"{name} must be a contiguous-row {list(shape)} tensor, got {list(bias.shape)}")
    return _moe_gemv(x, w13, w2, topk_ids, topk_weights, clamped=(b13, b2, float(alpha), float(limit)))


def _moe_gemv(x, w13, w2, topk_ids, topk_weights, clamped=None) -> torch.Tensor:
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
    gate_up_extra, down_extra = {}, {}
    if clamped is not None:
        b13, b2, alpha, limit = clamped
        gate_up_extra = dict(b13_ptr=b13, stride_be=0 if b13 is None else b13.stride(0), alpha=alpha, limit=limit,
                             CLAMPED=True, HAS_B13=b13 is not None)
        if b2 is not None:
            down_extra = dict(b2_ptr=b2, stride_b2e=b2.stride(0), HAS_B2=True)
    f_steps = gate_up_f_steps(tokens, intermediate, top_k)
    _gate_up_kernel[(num_pairs, triton.cdiv(intermediate, GATE_UP_BLOCK_F * f_steps))](
        x, w13, flat_ids, hidden,
        experts, hidden_size, intermediate,
        x.stride(0), w13.stride(0), w13.stride(1), hidden.stride(0),
        TOP_K=top_k, BLOCK_F=GATE_UP_BLOCK_F, BLOCK_D=gate_up_block_d, F_STEPS=f_steps, num_warps=NUM_WARPS,
        **pdl.launch_options(x.device), WEIGHT_EVICTION=streaming.weight_eviction(x.device), **gate_up_extra,
    )
    launches.record("moe_gemv.gate_up", kernel=_gate_up_kernel)
    # one program per (token, output block), walking the token's k pairs
    _down_kernel[(tokens, triton.cdiv(hidden_size, DOWN_BLOCK_D))](
        hidden, w2, flat_ids, flat_weights, out,
        experts, hidden_size, intermediate,
        hidden.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        TOP_K=top_k, BLOCK_D=DOWN_BLOCK_D, BLOCK_F=down_block_f, num_warps=NUM_WARPS,
        **pdl.launch_options(x.device), PRELOAD=pdl.preload(x.device, "down"),
        WEIGHT_EVICTION=streaming.weight_eviction(x.device), **down_extra,
    )
    launches.record("moe_gemv.down", kernel=_down_kernel)
    return out
