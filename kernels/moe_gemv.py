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

from kernels import arrivals, launches, pdl, scratch
from kernels.moe_checks import check_moe_inputs, check_triton_device

GATE_UP_BLOCK_F = 8  # hidden units per program: 2 x 8 rows of w13
GATE_UP_BLOCK_D = 512  # hidden elements per step: 1 KB of each bf16 row, 16 B per thread x 64
DOWN_BLOCK_D = 8  # outputs per program: 8 rows of w2
DOWN_BLOCK_F = 1024  # intermediate elements per step: 8 x 1024 bf16 = 16 KB in flight per program
NUM_WARPS = 4
# Gate-up and down in one launch (`_moe_one_launch_kernel`) unless told otherwise; not measured yet.
ONE_LAUNCH = False
# Registers per thread of the one-launch kernel: gate-up's own count, so 6 programs fit an SM as in the
# gate-up kernel (an sm_90 compile gives 96 to the persistent loop over both paths: 5 per SM; at 80 it
# spills 48 bytes of stack).
ONE_LAUNCH_REGISTERS = 80
ONE_LAUNCH_POLL_NS = 256  # a waiting down program's poll interval


@triton.jit
def _gate_up_rows(x_ptr, w13_ptr, hidden_ptr, pair, f_block, token, expert, hidden_size, intermediate_size,
                  stride_xt, stride_we, stride_wr, stride_hp, BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr,
                  USE_GDC: tl.constexpr):
    """One program's gate-up work: pair `pair`'s BLOCK_F hidden units of block `f_block` (expert valid)."""
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
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    hidden = gate_sum / (1.0 + tl.exp(-gate_sum)) * up_sum  # silu(gate) * up
    tl.store(hidden_ptr + pair.to(tl.int64) * stride_hp + offs_f, hidden.to(hidden_ptr.dtype.element_ty), mask=f_mask)


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
    USE_GDC: tl.constexpr,  # programmatic dependent launch (kernels.pdl)
):
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
    pair = tl.program_id(0)
    f_block = tl.program_id(1)
    token = pair // TOP_K
    expert = tl.load(topk_ids_ptr + pair).to(tl.int32)
    if (expert >= 0) & (expert < num_experts):
        _gate_up_rows(x_ptr, w13_ptr, hidden_ptr, pair, f_block, token, expert, hidden_size, intermediate_size,
                      stride_xt, stride_we, stride_wr, stride_hp, BLOCK_F, BLOCK_D, USE_GDC)


@triton.jit
def _down_steps(partial, w_ptrs, h_ptrs, d_mask, offs_f, f_start, intermediate_size, BLOCK_F: tl.constexpr,
                PAST_L1: tl.constexpr):
    """partial + w2 rows . hidden over F from f_start (pointers at f_start), one BLOCK_F step at a time,
    reduced every step into [BLOCK_D] fp32: few registers, many programs per SM. PAST_L1: the hidden
    row was written in this launch by other programs (read at L2, ".cg")."""
    for f0 in range(f_start, intermediate_size, BLOCK_F):
        f_mask = offs_f < intermediate_size - f0
        if PAST_L1:
            h = tl.load(h_ptrs, mask=f_mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        else:
            h = tl.load(h_ptrs, mask=f_mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptrs, mask=d_mask[:, None] & f_mask[None, :], other=0.0).to(tl.float32)
        partial += tl.sum(w * h[None, :], axis=1)
        w_ptrs += BLOCK_F
        h_ptrs += BLOCK_F
    return partial


@triton.jit
def _down_arrive(partial, partials_ptr, counter, out_ptr, pair, token, offs_d, d_mask, stride_pp, stride_ot,
                 TOP_K: tl.constexpr, BLOCK_D: tl.constexpr):
    """Last program reduces (kernels/arrivals.py): the pair's partial stored, then counted in at `counter`
    (its (token, output block)); the last of the k sums the k partials in the order j = 0..k-1 (and returns
    True)."""
    tl.store(partials_ptr + pair.to(tl.int64) * stride_pp + offs_d, partial, mask=d_mask)
    tl.debug_barrier()  # every thread's store is issued before the release below
    arrived = tl.atomic_add(counter, 1, sem="acq_rel")
    last = arrived == TOP_K - 1
    if last:
        first_ptrs = partials_ptr + (token * TOP_K).to(tl.int64) * stride_pp + offs_d
        total = tl.zeros([BLOCK_D], dtype=tl.float32)
        for j in tl.static_range(TOP_K):  # fixed order: the same bits whichever program came last
            total += tl.load(first_ptrs + j * stride_pp, mask=d_mask, other=0.0, cache_modifier=".cg")
        tl.store(out_ptr + token.to(tl.int64) * stride_ot + offs_d, total.to(out_ptr.dtype.element_ty), mask=d_mask)
        tl.atomic_xchg(counter, 0)  # ready for the next launch on this stream, eager or replayed
    return last


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
    USE_GDC: tl.constexpr,  # programmatic dependent launch (kernels.pdl)
):
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
    pair = tl.program_id(0)
    d_block = tl.program_id(1)
    token = pair // TOP_K
    offs_d = d_block * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < hidden_size
    expert = tl.load(topk_ids_ptr + pair).to(tl.int32)
    partial = tl.zeros([BLOCK_D], dtype=tl.float32)
    if (expert >= 0) & (expert < num_experts):  # an id outside [0, E) leaves its partial at 0
        routing_weight = tl.load(topk_weights_ptr + pair).to(tl.float32)  # issued before the loop
        offs_f = tl.arange(0, BLOCK_F)
        w_ptrs = w2_ptr + expert.to(tl.int64) * stride_we + offs_d[:, None] * stride_wr + offs_f[None, :]
        h_ptrs = hidden_ptr + pair.to(tl.int64) * stride_hp + offs_f
        partial = _down_steps(partial, w_ptrs, h_ptrs, d_mask, offs_f, 0, intermediate_size, BLOCK_F, False)
        partial = partial * routing_weight
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    _down_arrive(partial, partials_ptr, counters_ptr + token * tl.num_programs(1) + d_block, out_ptr, pair, token,
                 offs_d, d_mask, stride_pp, stride_ot, TOP_K, BLOCK_D)


@triton.jit
def _pause(nanoseconds):
    """Sleep the calling threads about this long (sm_70+ `nanosleep`): a waiting program's poll backs off
    instead of flooding the L2 slice that holds the counter it polls."""
    tl.inline_asm_elementwise("nanosleep.u32 $1; mov.u32 $0, 0;", "=r,r", [nanoseconds], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _moe_one_launch_kernel(
    x_ptr, w13_ptr, w2_ptr, topk_ids_ptr, topk_weights_ptr, hidden_ptr, partials_ptr, out_ptr,
    counters_ptr,  # [T * down_blocks] down's arrivals, then [N] ready (per pair), then [T] finished (per token)
    num_experts, num_pairs, hidden_size, intermediate_size, f_blocks, down_blocks,
    stride_xt, stride_w13e, stride_w13r, stride_hp, stride_w2e, stride_w2r, stride_pp, stride_ot,
    TOP_K: tl.constexpr,
    GATE_UP_BLOCK_F: tl.constexpr, GATE_UP_BLOCK_D: tl.constexpr,
    DOWN_BLOCK_D: tl.constexpr, DOWN_BLOCK_F: tl.constexpr,
    SLEEP: tl.constexpr,  # a waiting program's poll interval, ns (0 under the interpreter: one program)
):
    """Gate-up and down in one persistent, cooperative grid (`moe_gemv(..., one_launch=True)`).

    Work items: [0, N * f_blocks) gate-up's (pair-major: all of pair 0's hidden blocks, then pair 1's, ...),
    then N * down_blocks of down's (pair-major too). Program p takes items p, p + P, p + 2P, ... in order (P
    programs, all resident at once: a cooperative launch, which the driver refuses rather than run with
    fewer). So the first pairs' hidden rows are done by the time their down items come up, and down's first
    items run while gate-up's last ones stream: no gap between two launches and no ramp of a second grid.
    A down item waits (one thread polling with an acquire, `nanosleep` between polls) until every gate-up
    item of its pair has stored its hidden units and released the pair's ready count; since every program
    runs its gate-up items before its down items and all programs are resident, the gate-up items a wait
    needs are always running or done. Then it runs as `_down_kernel` (the same jit functions: the same
    bits). The last (token, output block) reduction of a token sets its pairs' ready counts and its own
    count back to 0 for the next launch."""
    ready_ptr = counters_ptr + (num_pairs // TOP_K) * down_blocks
    finished_ptr = ready_ptr + num_pairs
    gate_up_items = num_pairs * f_blocks
    for item in range(tl.program_id(0), gate_up_items + num_pairs * down_blocks, tl.num_programs(0)):
        if item < gate_up_items:
            pair = item // f_blocks
            token = pair // TOP_K
            expert = tl.load(topk_ids_ptr + pair).to(tl.int32)
            if (expert >= 0) & (expert < num_experts):
                _gate_up_rows(x_ptr, w13_ptr, hidden_ptr, pair, item % f_blocks, token, expert, hidden_size,
                              intermediate_size, stride_xt, stride_w13e, stride_w13r, stride_hp, GATE_UP_BLOCK_F,
                              GATE_UP_BLOCK_D, False)
            tl.debug_barrier()  # every thread's store is issued before the release below
            tl.atomic_add(ready_ptr + pair, 1, sem="release")  # counted even for an invalid id: down waits on it
        else:
            work = item - gate_up_items
            pair = work // down_blocks
            d_block = work % down_blocks
            token = pair // TOP_K
            offs_d = d_block * DOWN_BLOCK_D + tl.arange(0, DOWN_BLOCK_D)
            d_mask = offs_d < hidden_size
            expert = tl.load(topk_ids_ptr + pair).to(tl.int32)
            # acquire (one thread; a compare-and-swap that never swaps): the pair's hidden row, stored before
            # each gate-up item's release; the barrier after each poll hands the value and the order on
            while tl.atomic_cas(ready_ptr + pair, -1, -1, sem="acquire") < f_blocks:
                if SLEEP > 0:
                    _pause(SLEEP)
            tl.debug_barrier()
            partial = tl.zeros([DOWN_BLOCK_D], dtype=tl.float32)
            if (expert >= 0) & (expert < num_experts):  # an id outside [0, E) leaves its partial at 0
                routing_weight = tl.load(topk_weights_ptr + pair).to(tl.float32)
                offs_f = tl.arange(0, DOWN_BLOCK_F)
                w_ptrs = w2_ptr + expert.to(tl.int64) * stride_w2e + offs_d[:, None] * stride_w2r + offs_f[None, :]
                h_ptrs = hidden_ptr + pair.to(tl.int64) * stride_hp + offs_f  # written in this launch: read at L2
                partial = _down_steps(partial, w_ptrs, h_ptrs, d_mask, offs_f, 0, intermediate_size, DOWN_BLOCK_F,
                                      True)
                partial = partial * routing_weight
            if _down_arrive(partial, partials_ptr, counters_ptr + token * down_blocks + d_block, out_ptr, pair,
                            token, offs_d, d_mask, stride_pp, stride_ot, TOP_K, DOWN_BLOCK_D):
                # the token's blocks reduced so far; at the last, every down item of its pairs is past its wait
                if tl.atomic_add(finished_ptr + token, 1, sem="relaxed") == down_blocks - 1:
                    for j in tl.static_range(TOP_K):
                        tl.atomic_xchg(ready_ptr + token * TOP_K + j, 0, sem="relaxed")
                    tl.atomic_xchg(finished_ptr + token, 0, sem="relaxed")


def one_launch_available(device: torch.device) -> bool:
    """Whether the one-launch arm can run here: under the interpreter (one program walks every item in
    order), or on a CUDA device with a Triton that launches cooperative grids."""
    if device.type != "cuda":
        return True
    from triton.backends.nvidia.compiler import CUDAOptions

    return "launch_cooperative_grid" in getattr(CUDAOptions, "__dataclass_fields__", {})


_RESIDENT: dict = {}


def one_launch_registers() -> int:
    """The one-launch kernel's register cap per thread: ONE_LAUNCH_REGISTERS, or MOEI_MOE_REGISTERS (A/B)."""
    return int(os.environ.get("MOEI_MOE_REGISTERS", ONE_LAUNCH_REGISTERS))


def resident_programs(device: torch.device, registers: int) -> int:
    """Programs of the one-launch kernel that fit the device at once: per SM, the register file over
    `registers` x NUM_WARPS x 32 threads (2 KB of shared memory each binds nowhere near)."""
    key = (device, registers)
    if key not in _RESIDENT:
        properties = torch.cuda.get_device_properties(device)
        register_file = getattr(properties, "regs_per_multiprocessor", 65536)
        per_sm = min(register_file // (registers * NUM_WARPS * 32),
                     properties.max_threads_per_multi_processor // (NUM_WARPS * 32))
        _RESIDENT[key] = properties.multi_processor_count * per_sm
    return _RESIDENT[key]


def one_launch_default() -> bool:
    """Whether moe_gemv runs gate-up and down in one launch when not told: MOEI_MOE_ONE_LAUNCH=1 (the
    benchmark's A/B) or ONE_LAUNCH."""
    value = os.environ.get("MOEI_MOE_ONE_LAUNCH")
    return ONE_LAUNCH if value is None else value == "1"


def moe_gemv(
    x: torch.Tensor,  # [T, D]
    w13: torch.Tensor,  # [E, 2F, D]
    w2: torch.Tensor,  # [E, D, F]
    topk_ids: torch.Tensor,  # [T, k]
    topk_weights: torch.Tensor,  # [T, k]
    one_launch: bool | None = None,  # gate-up and down in one grid (_moe_one_launch_kernel); None: the default
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
    f_blocks = triton.cdiv(intermediate, GATE_UP_BLOCK_F)
    # one program per (pair, output block); the k pairs of a token add up in the kernel
    down_blocks = triton.cdiv(hidden_size, DOWN_BLOCK_D)
    partials = scratch.empty((num_pairs, hidden_size), torch.float32, x.device)  # [N, D] = [T, k, D]
    if one_launch_default() if one_launch is None else one_launch:
        if not one_launch_available(x.device):
            raise ValueError("moe_gemv: one_launch needs a cooperative launch (a CUDA device and a Triton with "
                             "launch_cooperative_grid), or the interpreter")
        # down's arrivals [T, D / BLOCK_D], the pairs' ready counts, the tokens' finished counts
        counters = arrivals.counters(x.device, tokens * down_blocks + num_pairs + tokens)
        items = num_pairs * (f_blocks + down_blocks)
        interpreted = x.device.type != "cuda"
        registers = one_launch_registers()
        options = {} if interpreted else {"launch_cooperative_grid": True, "maxnreg": registers}
        _moe_one_launch_kernel[(1 if interpreted else min(items, resident_programs(x.device, registers)),)](
            x, w13, w2, flat_ids, flat_weights, hidden, partials, out, counters,
            experts, num_pairs, hidden_size, intermediate, f_blocks, down_blocks,
            x.stride(0), w13.stride(0), w13.stride(1), hidden.stride(0), w2.stride(0), w2.stride(1),
            partials.stride(0), out.stride(0),
            TOP_K=top_k, GATE_UP_BLOCK_F=GATE_UP_BLOCK_F, GATE_UP_BLOCK_D=gate_up_block_d,
            DOWN_BLOCK_D=DOWN_BLOCK_D, DOWN_BLOCK_F=down_block_f,
            SLEEP=0 if interpreted else ONE_LAUNCH_POLL_NS, num_warps=NUM_WARPS, **options,
        )
        launches.record("moe_gemv.one_launch")
        return out
    _gate_up_kernel[(num_pairs, f_blocks)](
        x, w13, flat_ids, hidden,
        experts, hidden_size, intermediate,
        x.stride(0), w13.stride(0), w13.stride(1), hidden.stride(0),
        TOP_K=top_k, BLOCK_F=GATE_UP_BLOCK_F, BLOCK_D=gate_up_block_d, num_warps=NUM_WARPS,
        **pdl.launch_options(x.device),
    )
    launches.record("moe_gemv.gate_up")
    counters = arrivals.counters(x.device, tokens * down_blocks)  # [T, D / BLOCK_D]
    _down_kernel[(num_pairs, down_blocks)](
        hidden, w2, flat_ids, flat_weights, partials, counters, out,
        experts, hidden_size, intermediate,
        hidden.stride(0), w2.stride(0), w2.stride(1), partials.stride(0), out.stride(0),
        TOP_K=top_k, BLOCK_D=DOWN_BLOCK_D, BLOCK_F=down_block_f, num_warps=NUM_WARPS,
        **pdl.launch_options(x.device),
    )
    launches.record("moe_gemv.down")
    return out
