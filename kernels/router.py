"""Top-k routing from router logits in one launch: the k largest logits of each token, in
descending order (ties: the lowest expert id first), and the softmax over those k.

What engine.model's `route` (kind `topk_softmax`) does with torch.topk, a softmax and two casts:

    top_logits, top_ids = topk(logits, k);  weights = softmax(top_logits).to(dtype)

Shapes: N tokens, E experts, k chosen.  logits [N, E] float32 -> ids [N, k] int32, weights [N, k].
Grid: (N,); a program holds its token's E logits (E <= MAX_EXPERTS). The per-token work is
kernels.parts.topk_softmax_row, which the router's fused GEMV (kernels.gemv_route) calls too.
`group_topk`: DeepSeek's group-limited routers (engine.routing) in the same shape of launch
(kernels.parts.group_topk_row).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import arrivals, launches, pdl, scratch
from kernels.parts import count_ids, group_topk_row, topk_softmax_row

MAX_EXPERTS = 4096


@triton.jit
def _count_woken(ids_ptr, woken_ptr, arrivals_ptr, tokens, experts, TOP_K: tl.constexpr, E_PAD: tl.constexpr,
                 COUNT_BLOCK: tl.constexpr):
    """The last token's program counts the distinct experts of all (kernels.arrivals) into woken_ptr."""
    tl.debug_barrier()
    arrived = tl.atomic_add(arrivals_ptr, 1, sem="acq_rel")
    if arrived == tokens - 1:
        tl.store(woken_ptr, count_ids(ids_ptr, tokens * TOP_K, experts, E_PAD, COUNT_BLOCK).to(tl.int64))
        tl.atomic_xchg(arrivals_ptr, 0)


@triton.jit
def _topk_softmax_kernel(
    logits_ptr, ids_ptr, weights_ptr, woken_ptr, arrivals_ptr, tokens, experts, stride_l, stride_i, stride_w,
    scale,
    E_PAD: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr, WOKEN: tl.constexpr, COUNT_BLOCK: tl.constexpr,
    OVER_ALL: tl.constexpr,
    REPLICAS: tl.constexpr,  # the program's warps: a copy of the row each (kernels.parts.topk_softmax_row)
    USE_GDC: tl.constexpr,  # programmatic dependent launch (kernels.pdl)
):
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    token = tl.program_id(0)
    topk_softmax_row(logits_ptr + token.to(tl.int64) * stride_l, experts, ids_ptr + token.to(tl.int64) * stride_i,
                     weights_ptr + token.to(tl.int64) * stride_w, E_PAD, TOP_K, K_PAD, OVER_ALL, scale, REPLICAS, "")
    if WOKEN:
        _count_woken(ids_ptr, woken_ptr, arrivals_ptr, tokens, experts, TOP_K, E_PAD, COUNT_BLOCK)


def route_replicas(e_pad: int, warps: int) -> int:
    """Copies of a row kernels.parts.topk_softmax_row routes at once in a program of `warps` warps: one a warp up
    to 128 experts (its picks then need no barrier), fewer for wider rows (a copy spans several warps anyway, and
    each copy costs its registers)."""
    return max(1, min(warps, 512 // e_pad))


def count_block(e_pad: int, pairs: int) -> int:
    """Ids kernels.parts.count_ids takes per step: at most 64 and the pairs, with block x E_PAD <= 16384 flags."""
    return max(1, min(64, 16384 // e_pad, triton.next_power_of_2(pairs)))


def _outputs(tokens: int, top_k: int, weight_dtype: torch.dtype, device: torch.device):
    """ids [T, k] int32, weights [T, k] and the woken count's one int64, as scratch buffers."""
    return (scratch.empty((tokens, top_k), torch.int32, device), scratch.empty((tokens, top_k), weight_dtype, device),
            scratch.empty((1,), torch.int64, device))


def topk_softmax(logits: torch.Tensor, top_k: int, weight_dtype: torch.dtype, *, woken: bool = False,
                 over_all: bool = False, scale: float = 1.0):
    """(ids [N, k] int32, weights [N, k] in weight_dtype) from float32 logits [N, E]; with woken=True
    also the number of distinct experts chosen (0-d int64, what `count_distinct` gives), in the same
    launch: the last token's program counts them. `over_all`: the weights are the softmax over all E at
    the k chosen (engine.model.route's softmax_topk without renormalisation); `scale`: they are multiplied
    by it (routed_scaling_factor), in float32 before the rounding to weight_dtype."""
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(f"topk_softmax: logits must be float32 [N, E] with unit stride, got "
                         f"{logits.dtype} {tuple(logits.shape)}")
    tokens, experts = logits.shape
    if not 1 <= top_k <= experts or experts > MAX_EXPERTS:
        raise ValueError(f"topk_softmax: need 1 <= k <= E <= {MAX_EXPERTS}, got k={top_k}, E={experts}")
    ids, weights, count = _outputs(tokens, top_k, weight_dtype, logits.device)
    if tokens == 0:
        if woken:
            count.zero_()
        return (ids, weights, count[0]) if woken else (ids, weights)
    e_pad = triton.next_power_of_2(experts)
    warps = 1 if experts <= 256 else 4
    _topk_softmax_kernel[(tokens,)](
        logits, ids, weights, count, arrivals.counters(logits.device, 1) if woken else count, tokens, experts,
        logits.stride(0), ids.stride(0), weights.stride(0), float(scale),
        E_PAD=e_pad, TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), WOKEN=woken, OVER_ALL=over_all,
        COUNT_BLOCK=count_block(e_pad, tokens * top_k), REPLICAS=route_replicas(e_pad, warps),
        num_warps=warps,
        **pdl.launch_options(logits.device),
    )
    launches.record("topk_softmax", kernel=_topk_softmax_kernel)
    return (ids, weights, count[0]) if woken else (ids, weights)


@triton.jit
def _group_topk_kernel(
    logits_ptr, bias_ptr, ids_ptr, weights_ptr, woken_ptr, arrivals_ptr, tokens, experts, stride_l, stride_i,
    stride_w, scale,
    E_PAD: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr, N_GROUP: tl.constexpr, G_PAD: tl.constexpr,
    TOPK_GROUP: tl.constexpr, SIGMOID: tl.constexpr, NORMALISE: tl.constexpr, HAS_BIAS: tl.constexpr,
    WOKEN: tl.constexpr, COUNT_BLOCK: tl.constexpr,
    USE_GDC: tl.constexpr,  # programmatic dependent launch (kernels.pdl)
):
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    token = tl.program_id(0)
    offs = tl.arange(0, E_PAD)
    values = tl.load(logits_ptr + token.to(tl.int64) * stride_l + offs, mask=offs < experts, other=float("-inf"))
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs, mask=offs < experts, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros([E_PAD], dtype=tl.float32)
    group_topk_row(values, bias, offs, experts, ids_ptr + token.to(tl.int64) * stride_i,
                   weights_ptr + token.to(tl.int64) * stride_w, E_PAD, TOP_K, K_PAD, N_GROUP, G_PAD, TOPK_GROUP,
                   SIGMOID, NORMALISE, scale)
    if WOKEN:
        _count_woken(ids_ptr, woken_ptr, arrivals_ptr, tokens, experts, TOP_K, E_PAD, COUNT_BLOCK)


def group_topk(logits: torch.Tensor, top_k: int, n_group: int, topk_group: int, kind: str,
               weight_dtype: torch.dtype, *, bias: torch.Tensor | None = None, norm_topk_prob: bool = False,
               scale: float = 1.0, woken: bool = False):
    """DeepSeek's group-limited routing from float32 logits [N, E] in one launch (engine.routing.group_limited_topk,
    then routed_scaling_factor `scale`): `kind` softmax_group_topk (V2) or sigmoid_group_topk (V3, with the
    correction `bias` [E] and `norm_topk_prob`). Returns (ids [N, k] int32 in descending order of choice, weights
    [N, k] in weight_dtype) and, with woken=True, the number of distinct experts chosen (0-d int64)."""
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(f"group_topk: logits must be float32 [N, E] with unit stride, got "
                         f"{logits.dtype} {tuple(logits.shape)}")
    if kind not in ("softmax_group_topk", "sigmoid_group_topk"):
        raise ValueError(f"group_topk: {kind!r} is not a group-limited router")
    tokens, experts = logits.shape
    if experts > MAX_EXPERTS or n_group < 1 or experts % n_group or not 1 <= topk_group <= n_group \
            or not 1 <= top_k <= topk_group * (experts // n_group):
        raise ValueError(f"group_topk: need E <= {MAX_EXPERTS} in n_group equal groups, 1 <= topk_group <= n_group "
                         f"and 1 <= k <= topk_group x E / n_group; got E={experts}, n_group={n_group}, "
                         f"topk_group={topk_group}, k={top_k}")
    if bias is not None and (bias.shape != (experts,) or bias.device != logits.device):
        raise ValueError(f"group_topk: bias must be [{experts}] on {logits.device}, got {tuple(bias.shape)}")
    ids, weights, count = _outputs(tokens, top_k, weight_dtype, logits.device)
    if tokens == 0:
        if woken:
            count.zero_()
        return (ids, weights, count[0]) if woken else (ids, weights)
    e_pad = triton.next_power_of_2(experts)
    _group_topk_kernel[(tokens,)](
        logits, logits if bias is None else bias, ids, weights, count,
        arrivals.counters(logits.device, 1) if woken else count, tokens, experts,
        logits.stride(0), ids.stride(0), weights.stride(0), float(scale),
        E_PAD=e_pad, TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), N_GROUP=n_group,
        G_PAD=triton.next_power_of_2(n_group), TOPK_GROUP=topk_group, SIGMOID=kind == "sigmoid_group_topk",
        NORMALISE=norm_topk_prob and kind == "sigmoid_group_topk", HAS_BIAS=bias is not None, WOKEN=woken,
        COUNT_BLOCK=count_block(e_pad, tokens * top_k),
        num_warps=1 if experts <= 256 else 4,
        **pdl.launch_options(logits.device),
    )
    launches.record("group_topk", kernel=_group_topk_kernel)
    return (ids, weights, count[0]) if woken else (ids, weights)


@triton.jit
def _count_distinct_kernel(ids_ptr, out_ptr, count, experts, E_PAD: tl.constexpr, BLOCK: tl.constexpr):
    tl.store(out_ptr, count_ids(ids_ptr, count, experts, E_PAD, BLOCK).to(tl.int64))


def count_distinct(ids: torch.Tensor, experts: int) -> torch.Tensor:
    """How many of the experts 0..E-1 appear in `ids` (any shape, int): a 0-d int64 tensor (as torch's
    sum of counts), in one launch with no host sync (the woken-expert count of a decision record)."""
    if experts > MAX_EXPERTS:
        raise ValueError(f"count_distinct: E={experts} > {MAX_EXPERTS}")
    flat = ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    out = scratch.empty((1,), torch.int64, ids.device)
    e_pad = triton.next_power_of_2(experts)
    _count_distinct_kernel[(1,)](flat, out, flat.numel(), experts, E_PAD=e_pad,
                                 BLOCK=max(1, min(64, 16384 // e_pad)), num_warps=4)
    launches.record("count_distinct", kernel=_count_distinct_kernel)
    return out[0]
