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
Down needs no partials and no arrivals: a program holds every pair of its outputs, so the sum is made in one
place, in one order, and the output is bit-reproducible. Where a call has too few programs to keep the SMs'
loads in flight (fewer than MIN_DOWN_PROGRAMS: D = 2048 at one token), each program loads DOWN_TILES tiles of
its walk at once ([TILES, BLOCK_D, BLOCK_F]) on NARROW_DOWN_WARPS warps (`down_schedule`). An id outside
[0, E) reads expert 0's rows (valid memory) and weighs 0, with its hidden row (never written by gate-up) taken
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
Scratch: hidden [N + T S, F] in x's dtype.

Shared experts (`moe_gemv(..., shared=(gate_up, down))`: gate_up [2Fs, D], rows 0..Fs-1 gate, Fs..2Fs-1 up, as
engine.hf_loader packs DeepSeek's n_shared experts side by side; down [D, Fs]): every token also runs one SwiGLU of
Fs units at weight exactly 1 (no routing weight, no routed_scaling_factor), in the same two launches, reading the
model's own tensors (no copy, no concatenation with the routed stack):
    gate-up  S = cdiv(Fs, F) extra "pairs" per token past the N routed ones (grid N + T S): program N + t S + c
             computes shared units c F .. c F + F - 1 (the last chunk masked to Fs - (S-1) F) from ws13's rows, up
             Fs rows below gate, into hidden row N + t S + c; the routed pairs' F_STEPS and grid are unchanged.
             Chunks of the routed F rather than a width of their own: every program of the grid has the same
             shape, so a shared chunk is one more pair of the grid's one schedule (V2-Lite: 2 of F = 1408 each).
    down     after its k routed pairs' tiles, each program walks the shared Fs units as one more walk over
             hidden's rows N + t S .. (contiguous: Fs units back to back) and ws2's rows, tile by tile, added
             to the same fp32 sum without a weight: out = sum_j w_j (W2_j h_j) + W2s hs, in that order, one
             program per output, so still bit-reproducible (V2-Lite: 6 x 2 routed tiles, then 3 shared).
An id outside [0, E) still adds an exact 0; the shared term is added whatever the ids. SHARED_CHUNKS is a
constexpr, 0 without shared experts: that build is the same SASS as before the fold (bench/moe_shared_fold_sass.py),
so models without shared experts pay nothing. The fold's gate-up takes 96 registers at 4 warps at one F step (the
routed-only one-step build 80): 5 programs per SM where 6 fit. Why the engine folds only a one-row decode step:
docs/decode-step.md.
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
# A call that would launch fewer than MIN_DOWN_PROGRAMS down programs (a narrow model at one token: Qwen3-30B-A3B
# and DeepSeek-V2-Lite, D = 2048, 256 programs of one 12-22 KB tile in flight each) loads DOWN_TILES tiles of its
# walk at once, NARROW_DOWN_BLOCK_D outputs a program on NARROW_DOWN_WARPS warps. One token, H200
# (bench/experiments/down_walk.py): run 66, four tiles of 4 x 1024 on 4 warps: the arm 24.6 against 30.0 us
# (Qwen3), 42.9 against 51.1 (V2-Lite, shared experts folded), the tg128 step 2573 against 2694 and 2149 against
# 2377 us; run 68, four tiles of 8 x 1024 on 8 warps: the step 2554 against 2567-2569 and 2129 against 2142-2143.
# v4-shape (512 programs) keeps one tile.
DOWN_TILES = 4
NARROW_DOWN_BLOCK_D = 8
NARROW_DOWN_WARPS = 8
MIN_DOWN_PROGRAMS = 512


def gate_up_f_steps(tokens: int, intermediate: int, top_k: int) -> int:
    """Gate-up's F_STEPS for a call of `tokens` tokens: the table's unless that launches fewer programs than
    MIN_GATE_UP_PROGRAMS, then 1 (shapes only: CUDA-graph safe)."""
    if tokens * top_k * triton.cdiv(intermediate, GATE_UP_BLOCK_F * GATE_UP_F_STEPS) < MIN_GATE_UP_PROGRAMS:
        return 1
    return GATE_UP_F_STEPS


def down_schedule(tokens: int, hidden_size: int) -> tuple[int, int, int]:
    """Down's (BLOCK_D, TILES, warps) for a call of `tokens` tokens: (NARROW_DOWN_BLOCK_D, DOWN_TILES,
    NARROW_DOWN_WARPS) where (DOWN_BLOCK_D, 1, NUM_WARPS) would launch fewer than MIN_DOWN_PROGRAMS programs
    (shapes only: CUDA-graph safe)."""
    if tokens * triton.cdiv(hidden_size, DOWN_BLOCK_D) < MIN_DOWN_PROGRAMS:
        return NARROW_DOWN_BLOCK_D, DOWN_TILES, NARROW_DOWN_WARPS
    return DOWN_BLOCK_D, 1, NUM_WARPS


@triton.jit
def _gate_up_units(x_ptr, w_ptr, w_index, stride_w, hidden_ptr, pair, stride_hp, up_rows, units, token, f_block,
                   hidden_size, stride_xt, stride_wr, b13_ptr, stride_be, alpha, limit, BLOCK_F: tl.constexpr,
                   BLOCK_D: tl.constexpr, F_STEPS: tl.constexpr, USE_GDC: tl.constexpr,
                   WEIGHT_EVICTION: tl.constexpr, CLAMPED: tl.constexpr, HAS_B13: tl.constexpr):
    """One program's F_STEPS blocks of BLOCK_F hidden units of one pair, written to row `pair` of hidden: gate rows
    from w_ptr + w_index * stride_w, up rows `up_rows` rows further, `units` hidden units valid. A routed pair's
    rows are its expert's (w_index the expert, up_rows = units = F); a shared chunk's its F-unit slice of the shared
    gate_up (w_index its first unit, up_rows = Fs). The addresses are formed where they are used, as before the
    shared experts came: the routed-only build is the same SASS (bench/moe_shared_fold_sass.py)."""
    for f_step in range(F_STEPS):  # F_STEPS consecutive blocks of BLOCK_F hidden units, in turn
        offs_f = (f_block * F_STEPS + f_step) * BLOCK_F + tl.arange(0, BLOCK_F)
        f_mask = offs_f < units
        offs_d = tl.arange(0, BLOCK_D)
        # expert * stride_we reaches E*2F*D = 4.3e9 at v4-shape: int64
        w_base = w_ptr + w_index.to(tl.int64) * stride_w
        gate_ptrs = w_base + offs_f[:, None] * stride_wr + offs_d[None, :]  # [BLOCK_F, BLOCK_D]
        up_ptrs = gate_ptrs + up_rows * stride_wr
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
                bias_base = b13_ptr + w_index.to(tl.int64) * stride_be
                gate_sum += tl.load(bias_base + offs_f, mask=f_mask, other=0.0).to(tl.float32)
                up_sum += tl.load(bias_base + up_rows + offs_f, mask=f_mask, other=0.0).to(tl.float32)
            gate_sum = tl.minimum(gate_sum, limit)
            up_sum = tl.minimum(tl.maximum(up_sum, -limit), limit)
            hidden = (up_sum + 1.0) * (gate_sum / (1.0 + tl.exp(-alpha * gate_sum)))
        else:
            hidden = gate_sum / (1.0 + tl.exp(-gate_sum)) * up_sum  # silu(gate) * up
        tl.store(hidden_ptr + pair.to(tl.int64) * stride_hp + offs_f, hidden.to(hidden_ptr.dtype.element_ty),
                 mask=f_mask)


@triton.jit
def _gate_up_pair(x_ptr, w13_ptr, topk_ids_ptr, hidden_ptr, pair, f_block, num_experts, hidden_size,
                  intermediate_size, stride_xt, stride_we, stride_wr, stride_hp, b13_ptr, stride_be, alpha, limit,
                  TOP_K: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr, F_STEPS: tl.constexpr,
                  USE_GDC: tl.constexpr, WEIGHT_EVICTION: tl.constexpr, CLAMPED: tl.constexpr,
                  HAS_B13: tl.constexpr):
    """Routed pair `pair` (token pair // TOP_K): its expert's gate and up rows; an id outside [0, E) writes
    nothing (down takes its hidden row as 0)."""
    token = pair // TOP_K
    expert = tl.load(topk_ids_ptr + pair).to(tl.int32)
    if (expert >= 0) & (expert < num_experts):
        _gate_up_units(x_ptr, w13_ptr, expert, stride_we, hidden_ptr, pair, stride_hp, intermediate_size,
                       intermediate_size, token, f_block, hidden_size, stride_xt, stride_wr, b13_ptr, stride_be, alpha,
                       limit, BLOCK_F, BLOCK_D, F_STEPS, USE_GDC, WEIGHT_EVICTION, CLAMPED, HAS_B13)


@triton.jit
def _gate_up_kernel(
    x_ptr,  # [T, D]
    w13_ptr,  # [E, 2F, D]
    topk_ids_ptr,  # [N] flattened [T, k]
    hidden_ptr,  # [N + T S, F] out
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
    ws13_ptr=None,  # [2Fs, D] the shared experts' gate then up rows (SHARED_CHUNKS > 0)
    shared_intermediate=0,  # Fs
    stride_wsr=0,
    num_routed_pairs=0,  # N: programs from N on are shared chunks
    CLAMPED: tl.constexpr = False,  # gpt-oss experts: biases and the clamped SwiGLU (kernels.reference)
    HAS_B13: tl.constexpr = False,
    SHARED_CHUNKS: tl.constexpr = 0,  # S = cdiv(Fs, F) chunks of F shared units per token; 0: none
):
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
    pair = tl.program_id(0)
    f_block = tl.program_id(1)
    if SHARED_CHUNKS > 0:  # one loop for both kinds of pair, its scalars selected: one copy of the loop
        shared = pair >= num_routed_pairs  # chunk c of token t's shared units c F .. c F + F - 1: rows of ws13
        chunk = tl.maximum(pair - num_routed_pairs, 0)
        shared_token = chunk // SHARED_CHUNKS
        first_unit = (chunk - shared_token * SHARED_CHUNKS) * intermediate_size
        expert = tl.load(topk_ids_ptr + tl.minimum(pair, num_routed_pairs - 1)).to(tl.int32)
        if shared | ((expert >= 0) & (expert < num_experts)):
            _gate_up_units(x_ptr, tl.where(shared, ws13_ptr, w13_ptr), tl.where(shared, first_unit, expert),
                           tl.where(shared, stride_wsr, stride_we), hidden_ptr, pair, stride_hp,
                           tl.where(shared, shared_intermediate, intermediate_size),
                           tl.where(shared, tl.minimum(intermediate_size, shared_intermediate - first_unit),
                                    intermediate_size),
                           tl.where(shared, shared_token, pair // TOP_K), f_block, hidden_size, stride_xt,
                           tl.where(shared, stride_wsr, stride_wr), b13_ptr, stride_be, alpha, limit, BLOCK_F,
                           BLOCK_D, F_STEPS, USE_GDC, WEIGHT_EVICTION, CLAMPED, HAS_B13)
    else:
        _gate_up_pair(x_ptr, w13_ptr, topk_ids_ptr, hidden_ptr, pair, f_block, num_experts, hidden_size,
                      intermediate_size, stride_xt, stride_we, stride_wr, stride_hp, b13_ptr, stride_be, alpha,
                      limit, TOP_K, BLOCK_F, BLOCK_D, F_STEPS, USE_GDC, WEIGHT_EVICTION, CLAMPED, HAS_B13)


@triton.jit
def _pair_hidden(hidden_ptr, pair, f0, offs_f, f_mask, known, stride_hp):
    """A pair's hidden[f0 : f0 + BLOCK_F] in fp32; an unknown pair's (an id outside [0, E)) row, which gate-up
    never wrote, is taken as 0 rather than multiplied by its weight of 0."""
    return tl.where(known, tl.load(hidden_ptr + pair.to(tl.int64) * stride_hp + f0 + offs_f, mask=f_mask,
                                   other=0.0).to(tl.float32), 0.0)


@triton.jit
def _walk_load(w2_ptr, topk_ids_ptr, first_pair, step, walk, steps_per_pair, num_experts, intermediate_size, offs_d,
               d_mask, offs_f, stride_we, stride_wr, BLOCK_F: tl.constexpr, TILES: tl.constexpr,
               WEIGHT_EVICTION: tl.constexpr, IDS_CACHE: tl.constexpr):
    """Steps step .. step + TILES - 1 of a token's walk (step s: pair j = s // steps_per_pair, its F tile
    s % steps_per_pair), one load: w [TILES, BLOCK_D, BLOCK_F] as stored, with each step's pair [TILES], expert,
    F offset, F mask [TILES, BLOCK_F] and whether it counts (a step past the walk, or an id outside [0, E), reads
    expert 0's rows masked off and adds nothing)."""
    steps = step + tl.arange(0, TILES)
    live = steps < walk
    j = tl.where(live, steps // steps_per_pair, 0)
    f0 = (steps - j * steps_per_pair) * BLOCK_F
    pair = first_pair + j
    expert = tl.load(topk_ids_ptr + pair, cache_modifier=IDS_CACHE).to(tl.int32)
    known = live & (expert >= 0) & (expert < num_experts)
    f_mask = (offs_f[None, :] < intermediate_size - f0[:, None]) & live[:, None]
    rows = tl.where(known, expert, 0).to(tl.int64)[:, None, None] * stride_we + offs_d[None, :, None] * stride_wr
    w = tl.load(w2_ptr + rows + (f0[:, None] + offs_f[None, :])[:, None, :],
                mask=d_mask[None, :, None] & f_mask[:, None, :], other=0.0, eviction_policy=WEIGHT_EVICTION)
    return w, pair, expert, f0, f_mask, known


@triton.jit
def _walk_add(total, tiles, hidden_ptr, stride_hp, topk_weights_ptr, offs_f, offs_d,
              d_mask, steps_per_pair, b2_ptr, stride_b2e, BLOCK_F: tl.constexpr, HAS_B2: tl.constexpr):
    """total + the TILES steps' routing weight x (w @ hidden tile), in fp32; with HAS_B2, for a step that is its
    pair's last tile, its weighted bias too, added after. Steps that do not count weigh 0 over hidden 0."""
    w, pair, expert, f0, f_mask, known = tiles
    h = tl.where(known[:, None], tl.load(hidden_ptr + pair.to(tl.int64)[:, None] * stride_hp + f0[:, None]
                                         + offs_f[None, :], mask=f_mask, other=0.0).to(tl.float32), 0.0)
    scale = tl.where(known, tl.load(topk_weights_ptr + pair, mask=known, other=0.0).to(tl.float32), 0.0)
    total += tl.sum(scale[:, None] * tl.sum(w.to(tl.float32) * h[:, None, :], axis=2), axis=0)
    if HAS_B2:  # a pair's bias, weighted, at its last tile
        last = known & (f0 == (steps_per_pair - 1) * BLOCK_F)
        bias = tl.load(b2_ptr + tl.where(known, expert, 0).to(tl.int64)[:, None] * stride_b2e + offs_d[None, :],
                       mask=last[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
        total += tl.sum(scale[:, None] * bias, axis=0)
    return total


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
    PRELOAD: tl.constexpr,  # with USE_GDC: the walk's first TILES w2 tiles loaded before the wait (kernels.pdl.preload)
    WEIGHT_EVICTION: tl.constexpr,  # the expert weights' L2 policy (kernels.streaming)
    b2_ptr=None,  # [E, D] down biases, inside each pair's routing weight (gpt-oss)
    stride_b2e=0,
    ws2_ptr=None,  # [D, Fs] the shared experts' down (SHARED_CHUNKS > 0)
    shared_intermediate=0,  # Fs
    stride_ws2r=0,
    num_routed_pairs=0,  # N: token t's shared hidden units are hidden rows N + t S .. N + t S + S - 1, flat
    HAS_B2: tl.constexpr = False,
    SHARED_CHUNKS: tl.constexpr = 0,  # S, as gate-up's; 0: no shared experts
    TILES: tl.constexpr = 1,  # w2 tiles of the walk in one load (a power of two)
):
    """One program per (token, BLOCK_D outputs) walks its k pairs' w2 rows one after the other, k x F / BLOCK_F
    tiles, TILES at a time (one load of [TILES, BLOCK_D, BLOCK_F]: bytes in flight where a program walks few
    tiles), and sums them in fp32 in the fixed order of the walk, so the output is bit-reproducible. Each tile is
    scaled by its pair's routing weight as it is reduced; with HAS_B2 each pair's bias too, after its last tile.
    With SHARED_CHUNKS, then the shared experts' ws2 row tiles over Fs, weight 1 (added, not multiplied), into
    the same fp32 sum."""
    token = tl.program_id(0)
    d_block = tl.program_id(1)
    offs_d = d_block * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < hidden_size
    offs_f = tl.arange(0, BLOCK_F)
    first_pair = token * TOP_K
    steps_per_pair = tl.cdiv(intermediate_size, BLOCK_F)
    if TILES == 1:  # one tile at a time (the build every launch above MIN_DOWN_PROGRAMS programs makes)
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
    else:  # TILES tiles in one load [TILES, BLOCK_D, BLOCK_F]
        walk = TOP_K * steps_per_pair
        if PRELOAD:  # the ids are the router's, two grids back and complete (kernels.pdl): read past L1 before the wait
            first = _walk_load(
                w2_ptr, topk_ids_ptr, first_pair, 0, walk, steps_per_pair, num_experts, intermediate_size, offs_d,
                d_mask, offs_f, stride_we, stride_wr, BLOCK_F, TILES, WEIGHT_EVICTION, ".cg")
        if USE_GDC:
            tl.extra.cuda.gdc_wait()
        total = tl.zeros([BLOCK_D], dtype=tl.float32)
        start = 0
        if PRELOAD:  # the walk's first TILES tiles, preloaded
            total = _walk_add(total, first, hidden_ptr, stride_hp, topk_weights_ptr, offs_f, offs_d, d_mask,
                              steps_per_pair, b2_ptr, stride_b2e, BLOCK_F, HAS_B2)
            start = TILES
        for step in range(start, walk, TILES):
            tiles = _walk_load(w2_ptr, topk_ids_ptr, first_pair, step, walk, steps_per_pair, num_experts,
                               intermediate_size, offs_d, d_mask, offs_f, stride_we, stride_wr, BLOCK_F, TILES,
                               WEIGHT_EVICTION, "")
            total = _walk_add(total, tiles, hidden_ptr, stride_hp, topk_weights_ptr, offs_f, offs_d, d_mask,
                              steps_per_pair, b2_ptr, stride_b2e, BLOCK_F, HAS_B2)
    if SHARED_CHUNKS > 0:  # after the k routed pairs: the shared experts' Fs units, weight 1, no routing scale
        # gate-up wrote token t's S chunks as consecutive rows of a contiguous hidden: Fs units back to back
        shared_row = hidden_ptr + (num_routed_pairs + token * SHARED_CHUNKS).to(tl.int64) * stride_hp
        for f0 in range(0, shared_intermediate, BLOCK_F):
            f_mask = offs_f < shared_intermediate - f0
            h = tl.load(shared_row + f0 + offs_f, mask=f_mask, other=0.0).to(tl.float32)
            w = tl.load(ws2_ptr + offs_d[:, None] * stride_ws2r + (f0 + offs_f)[None, :],
                        mask=d_mask[:, None] & f_mask[None, :], other=0.0,
                        eviction_policy=WEIGHT_EVICTION).to(tl.float32)
            total += tl.sum(w * h[None, :], axis=1)
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(out_ptr + token.to(tl.int64) * stride_ot + offs_d, total.to(out_ptr.dtype.element_ty), mask=d_mask)


def moe_gemv(
    x: torch.Tensor,  # [T, D]
    w13: torch.Tensor,  # [E, 2F, D]
    w2: torch.Tensor,  # [E, D, F]
    topk_ids: torch.Tensor,  # [T, k]
    topk_weights: torch.Tensor,  # [T, k]
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,  # ([2Fs, D], [D, Fs]): ungated shared experts
) -> torch.Tensor:  # [T, D]
    """The gather-GEMV arm; same contract as `kernels.reference.moe_reference`. With `shared` (gate_up [2Fs, D],
    rows 0..Fs-1 gate and Fs..2Fs-1 up; down [D, Fs]), plus the shared SwiGLU of every token, weight 1, in the
    same two launches (module docstring): `moe_reference(...) + swiglu(x, gate_up, down)` rounded once."""
    return _moe_gemv(x, w13, w2, topk_ids, topk_weights, shared=shared)


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


def check_shared(x: torch.Tensor, shared: tuple[torch.Tensor, torch.Tensor]) -> int:
    """The shared experts' gate_up [2Fs, D] and down [D, Fs] beside x [T, D]: x's dtype and device, rows contiguous
    along D and Fs. Returns Fs."""
    gate_up, down = shared
    hidden_size = x.shape[1]
    if gate_up.dim() != 2 or gate_up.shape[1] != hidden_size or gate_up.shape[0] % 2 or gate_up.shape[0] == 0:
        raise ValueError(f"shared gate_up must be [2Fs, D={hidden_size}], got shape {tuple(gate_up.shape)}")
    shared_intermediate = gate_up.shape[0] // 2
    if tuple(down.shape) != (hidden_size, shared_intermediate):
        raise ValueError(f"shared down must be [D={hidden_size}, Fs={shared_intermediate}], got {tuple(down.shape)}")
    for name, tensor in (("shared gate_up", gate_up), ("shared down", down)):
        if tensor.dtype != x.dtype or tensor.device != x.device or tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be a {x.dtype} tensor on {x.device}, contiguous along its last dimension "
                             f"(got {tensor.dtype} on {tensor.device}, stride {tensor.stride()})")
    return shared_intermediate


def _moe_gemv(x, w13, w2, topk_ids, topk_weights, clamped=None, shared=None) -> torch.Tensor:
    tokens, hidden_size, experts, intermediate, top_k = check_moe_inputs(x, w13, w2, topk_ids, topk_weights)
    check_triton_device(x, "moe_gemv")
    if shared is not None and clamped is not None:
        raise ValueError("shared experts ride only the plain SwiGLU launches, not the clamped epilogue")
    shared_intermediate = 0 if shared is None else check_shared(x, shared)
    out = scratch.empty((tokens, hidden_size), x.dtype, x.device)
    if tokens == 0:
        return out
    num_pairs = tokens * top_k
    # S chunks of F shared units per token, as extra pairs past the N routed ones (module docstring)
    chunks = triton.cdiv(shared_intermediate, intermediate)
    flat_ids = topk_ids.reshape(-1).contiguous()  # [N]
    flat_weights = topk_weights.reshape(-1).contiguous()  # [N]
    hidden = scratch.empty((num_pairs + tokens * chunks, intermediate), x.dtype, x.device)  # [N + T S, F]
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
    if shared is not None:
        gate_up_extra = dict(ws13_ptr=shared[0], shared_intermediate=shared_intermediate,
                             stride_wsr=shared[0].stride(0), num_routed_pairs=num_pairs, SHARED_CHUNKS=chunks)
        down_extra = dict(ws2_ptr=shared[1], shared_intermediate=shared_intermediate, stride_ws2r=shared[1].stride(0),
                          num_routed_pairs=num_pairs, SHARED_CHUNKS=chunks)
    # the routed pairs' schedule decides (the routed part of the grid is the launch without shared experts)
    f_steps = gate_up_f_steps(tokens, intermediate, top_k)
    _gate_up_kernel[(num_pairs + tokens * chunks, triton.cdiv(intermediate, GATE_UP_BLOCK_F * f_steps))](
        x, w13, flat_ids, hidden,
        experts, hidden_size, intermediate,
        x.stride(0), w13.stride(0), w13.stride(1), hidden.stride(0),
        TOP_K=top_k, BLOCK_F=GATE_UP_BLOCK_F, BLOCK_D=gate_up_block_d, F_STEPS=f_steps, num_warps=NUM_WARPS,
        **pdl.launch_options(x.device), WEIGHT_EVICTION=streaming.weight_eviction(x.device), **gate_up_extra,
    )
    launches.record("moe_gemv.gate_up", kernel=_gate_up_kernel)
    # one program per (token, output block), walking the token's k pairs
    down_block_d, down_tiles, down_warps = down_schedule(tokens, hidden_size)
    _down_kernel[(tokens, triton.cdiv(hidden_size, down_block_d))](
        hidden, w2, flat_ids, flat_weights, out,
        experts, hidden_size, intermediate,
        hidden.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        TOP_K=top_k, BLOCK_D=down_block_d, BLOCK_F=down_block_f, TILES=down_tiles, num_warps=down_warps,
        **pdl.launch_options(x.device), PRELOAD=pdl.preload(x.device, "down"),
        WEIGHT_EVICTION=streaming.weight_eviction(x.device), **down_extra,
    )
    launches.record("moe_gemv.down", kernel=_down_kernel)
    return out
