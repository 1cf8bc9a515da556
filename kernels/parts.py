"""The @triton.jit functions more than one kernel calls, public in one place.

A fused kernel that does what another kernel does (the router's GEMV routing as kernels.router does,
the LM head's GEMV picking as kernels.next_tokens does, the pick norming the next step's rows as
kernels.rms_norm does) calls the same function here, so both compute the same bits. Each function is
inlined into its caller at compile time: a call costs nothing, and the caller's constexprs specialise it.

    topk_softmax_row   one token's top-k of its logits and their softmax   kernels.router, kernels.gemv_route
    group_topk_row     one token's group-limited top-k (DeepSeek-V2/V3)      kernels.router, kernels.gemv_route
    count_ids          distinct experts among ids (the woken count)          kernels.router, kernels.gemv_route
    argmax_row         a float32 row's argmax, ties to the lowest id       kernels.next_tokens, kernels.gemv_pick
    best_key, token_of  the argmax of some columns as a key, and its index  kernels.next_tokens (a split row)
    feed_next          the next graph replay's token and position           kernels.next_tokens, kernels.gemv_pick
    norm_row           one row's RMSNorm times its weight                   kernels.rms_norm, kernels.gemv_pick
    bias_epilogue      a product's output plus its bias, rounded as torch   kernels.gemv, kernels.parts.fold_gemv
    fold_gemv          a GEMV of M <= 8 rows with the RMSNorm in front      kernels.gemv_norm, gemv_route, gemv_pick
                       folded (the shared body of the three fused GEMVs)
    fold_activation, fold_step   fold_gemv's pieces: one row's x at some columns, one K step of the product

Not a kernel family: no launcher lives here. The key packing the top-k and the argmax reduce with is
kernels.order_keys.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.order_keys import drop, key_of, none_chosen, reversed_index_of, value_of


# --------------------------------------------------------------------------------------------
# Routing and picking
# --------------------------------------------------------------------------------------------

@triton.jit
def count_ids(ids_ptr, count, experts, E_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """How many of 0..experts-1 appear among ids[0:count] (int32 scalar)."""
    offs_e = tl.arange(0, E_PAD)
    seen = tl.zeros([E_PAD], dtype=tl.int32)
    for start in range(0, count, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + offs, mask=offs < count, other=-1, cache_modifier=".cg")
        hits = (ids[:, None] == offs_e[None, :]).to(tl.int32)  # [BLOCK, E_PAD]
        seen = tl.maximum(seen, tl.max(hits, axis=0))
    return tl.sum(tl.where(offs_e < experts, seen, 0), axis=0)


@triton.jit
def topk_softmax_row(logits_row_ptr, experts, ids_row_ptr, weights_row_ptr,
                     E_PAD: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                     OVER_ALL: tl.constexpr, scale, REPLICAS: tl.constexpr, CACHE: tl.constexpr):
    """One token: the k largest of its float32 logits (logits_row_ptr[0:experts]) in descending order, ties to
    the lowest id, stored as ids (int32) and the softmax over them (weights' dtype); with OVER_ALL the softmax
    over every expert, taken at the k chosen (softmax-then-top-k, not renormalised). The weights are multiplied
    by `scale` (routed_scaling_factor) in float32 before the rounding. CACHE: the load's cache modifier ("" or
    ".cg" for logits other programs of the launch wrote).

    The row is loaded REPLICAS times, [REPLICAS, E_PAD]: at REPLICAS = the program's warps and E_PAD <= 128 each
    warp holds a whole copy, so every pick is one warp's reduction (redux.sync on sm_90) with no barrier between
    the warps, where a row spread over the warps paid two barriers a pick. Copy 0 is stored."""
    # A NaN logit is never chosen (torch would rank it first; the model never produces one). One reduction per
    # pick (kernels.order_keys): the largest key is the largest value at the lowest id, -0.0 taken as 0.0.
    lanes = tl.arange(0, E_PAD)[None, :] + tl.zeros([REPLICAS, 1], dtype=tl.int32)  # [REPLICAS, E_PAD]
    values = tl.load(logits_row_ptr + lanes, mask=lanes < experts, other=float("-inf"), cache_modifier=CACHE)
    values = tl.where(values == values, values, float("-inf"))
    keys = drop(key_of(values, E_PAD - 1 - lanes), lanes >= experts)  # padding lanes never chosen
    slots = tl.arange(0, K_PAD)[None, :] + tl.zeros([REPLICAS, 1], dtype=tl.int32)  # [REPLICAS, K_PAD]
    chosen_ids = tl.zeros([REPLICAS, K_PAD], dtype=tl.int32)
    chosen_logits = tl.full([REPLICAS, K_PAD], float("-inf"), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(keys, axis=1)  # [REPLICAS], the same in every copy
        best_id = (E_PAD - 1 - reversed_index_of(best)).to(tl.int32)
        chosen_ids = tl.where(slots == j, best_id[:, None], chosen_ids)
        chosen_logits = tl.where(slots == j, value_of(best)[:, None], chosen_logits)
        keys = drop(keys, lanes == best_id[:, None])  # taken
    valid = slots < TOP_K
    top = tl.max(tl.where(valid, chosen_logits, float("-inf")), axis=1)
    top = tl.where(top == float("-inf"), 0.0, top)[:, None]
    exponent = tl.where(valid, tl.exp(chosen_logits - top), 0.0)
    if OVER_ALL:  # the top logit is every expert's largest: the whole softmax's reference point
        weights = exponent / tl.sum(tl.where(lanes < experts, tl.exp(values - top), 0.0), axis=1)[:, None]
    else:
        weights = exponent / tl.sum(exponent, axis=1)[:, None]
    weights = weights * scale
    stored = valid & (tl.arange(0, REPLICAS)[:, None] == 0)
    tl.store(ids_row_ptr + slots, chosen_ids, mask=stored)
    tl.store(weights_row_ptr + slots, weights.to(weights_row_ptr.dtype.element_ty), mask=stored)


@triton.jit
def group_topk_row(values, bias, offs, experts, ids_row_ptr, weights_row_ptr,
                   E_PAD: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr, N_GROUP: tl.constexpr,
                   G_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr, SIGMOID: tl.constexpr, NORMALISE: tl.constexpr,
                   scale):
    """One token's group-limited routing from its float32 logits `values` [E_PAD] (lanes offs >= experts never
    chosen), engine.routing.group_limited_topk's function: SIGMOID False (DeepSeek-V2 group_limited_greedy) the
    softmax over every expert, a group scored by its largest; SIGMOID True (V3 noaux_tc) sigmoid scores, `bias`
    [E_PAD] (the correction bias, float32) added for the choice only, a group scored by its two largest. The
    TOPK_GROUP best of the N_GROUP groups (E / N_GROUP experts each, in order) are kept; the k best choices among
    their experts, in descending order (ties to the lowest id), weighed by their unbiased scores (NORMALISE:
    divided by their sum + 1e-20, V3's norm_topk_prob), times `scale` (routed_scaling_factor)."""
    valid = offs < experts
    values = tl.where(valid & (values == values), values, float("-inf"))  # NaN never chosen
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-values))
        choice = tl.where(valid, scores + bias, float("-inf"))
    else:
        exponent = tl.where(valid, tl.exp(values - tl.max(values, axis=0)), 0.0)
        scores = exponent / tl.sum(exponent, axis=0)
        choice = tl.where(valid, scores, float("-inf"))
    group_of = offs // (experts // N_GROUP)
    group_slots = tl.arange(0, G_PAD)
    group_scores = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    for g in tl.static_range(N_GROUP):
        member = valid & (group_of == g)
        best = tl.max(tl.where(member, choice, float("-inf")), axis=0)
        if SIGMOID:  # the sum of the two largest: the best taken once (its lowest lane), then the next
            first = tl.min(tl.where(member & (choice == best), offs, E_PAD), axis=0)
            best = best + tl.max(tl.where(member & (offs != first), choice, float("-inf")), axis=0)
        group_scores = tl.where(group_slots == g, best, group_scores)
    kept = offs < 0  # no expert kept yet
    for j in tl.static_range(TOPK_GROUP):
        best = tl.max(group_scores, axis=0)
        chosen_group = tl.min(tl.where(group_scores == best, group_slots, G_PAD), axis=0)
        kept = kept | (group_of == chosen_group)
        group_scores = tl.where(group_slots == chosen_group, float("-inf"), group_scores)
    keys = drop(key_of(choice, E_PAD - 1 - offs), (offs >= experts) | ~kept)
    slots = tl.arange(0, K_PAD)
    chosen_ids = tl.zeros([K_PAD], dtype=tl.int32)
    weights = tl.zeros([K_PAD], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best_id = (E_PAD - 1 - reversed_index_of(tl.max(keys, axis=0))).to(tl.int32)
        chosen_ids = tl.where(slots == j, best_id, chosen_ids)
        weights = tl.where(slots == j, tl.sum(tl.where(offs == best_id, scores, 0.0), axis=0), weights)
        keys = drop(keys, offs == best_id)
    valid_slots = slots < TOP_K
    if NORMALISE:
        weights = weights / (tl.sum(tl.where(valid_slots, weights, 0.0), axis=0) + 1e-20)
    weights = weights * scale
    tl.store(ids_row_ptr + slots, chosen_ids, mask=valid_slots)
    tl.store(weights_row_ptr + slots, weights.to(weights_row_ptr.dtype.element_ty), mask=valid_slots)


@triton.jit
def best_key(row_ptr, begin, end, BLOCK: tl.constexpr):
    """The largest key (kernels.order_keys: the value, then the lowest index) of a float32 row's columns
    [begin, end), NaN ranking first (torch.argmax): walked in BLOCK chunks keeping each lane's running best, one
    block reduction at the end. Loads go past L1 (".cg"), so a program may read a row other programs of its own
    launch wrote (kernels.gemv_pick, kernels.arrivals)."""
    offs = tl.arange(0, BLOCK)
    best = none_chosen(BLOCK)
    for start in range(begin, end, BLOCK):
        index = start + offs
        values = tl.load(row_ptr + index, mask=index < end, other=float("-inf"), cache_modifier=".cg")
        values = tl.where(values != values, float("inf"), values)  # NaN ranks first, as in torch.argmax
        best = tl.maximum(best, drop(key_of(values, 0x7FFFFFFF - index), index >= end))
    return tl.max(best, axis=0)


@triton.jit
def token_of(key):
    """The column index a `best_key` key holds, as int64."""
    return (0x7FFFFFFF - reversed_index_of(key)).to(tl.int64)


@triton.jit
def argmax_row(row_ptr, vocab, BLOCK: tl.constexpr):
    """The index of a float32 row's largest value, the lowest on ties, NaN ranking first (torch.argmax), as
    int64 (`best_key` over the whole row)."""
    return token_of(best_key(row_ptr, 0, vocab, BLOCK))


@triton.jit
def feed_next(inputs_ptr, stride_inputs, row, token):
    """The next replay's inputs for a row: its token, and its position one on."""
    tl.store(inputs_ptr + row, token)
    position = tl.load(inputs_ptr + stride_inputs + row)
    tl.store(inputs_ptr + stride_inputs + row, position + 1)


@triton.jit
def norm_row(x, weight_ptr, offs, mask, hidden, eps, ROUND_ONCE: tl.constexpr):
    """h = RMSNorm(x) * weight of one whole row x [BLOCK_D] (x's dtype), rounded where torch rounds: the normed
    value, then its product with the weight; ROUND_ONCE (gpt-oss) only the float32 product. The same bits
    wherever it is called with the same warps (a reduction's order follows its layout)."""
    x32 = x.to(tl.float32)
    mean_square = tl.sum(x32 * x32, axis=0) / hidden
    if ROUND_ONCE:
        weight = tl.load(weight_ptr + offs, mask=mask, other=0.0)
        h = (x32 * tl.math.rsqrt(mean_square + eps) * weight.to(tl.float32)).to(x.dtype)
    else:  # the build from before ROUND_ONCE, op for op
        normed = (x32 * tl.math.rsqrt(mean_square + eps)).to(x.dtype)
        weight = tl.load(weight_ptr + offs, mask=mask, other=0.0)
        h = (normed.to(tl.float32) * weight.to(tl.float32)).to(x.dtype)
    return h


# --------------------------------------------------------------------------------------------
# The GEMV with its RMSNorm folded in (kernels.gemv_norm's contract)
# --------------------------------------------------------------------------------------------

@triton.jit
def fold_activation(x_ptr, residual_ptr, table_ptr, index_ptr, m, rows, cols, lanes, stride_xm, stride_rm, stride_t,
                    GATHER: tl.constexpr, RESIDUAL: tl.constexpr):
    """Row m's x at columns `cols` (masked by `lanes`), in the dtype: the gathered embedding row, x + residual
    rounded as torch's add, or x itself."""
    if GATHER:
        source = tl.load(index_ptr + m, mask=m < rows, other=0).to(tl.int64)
        x = tl.load(table_ptr + source * stride_t + cols, mask=lanes, other=0.0)
    else:
        x = tl.load(x_ptr + m * stride_xm + cols, mask=lanes, other=0.0)
        if RESIDUAL:
            residual = tl.load(residual_ptr + m * stride_rm + cols, mask=lanes, other=0.0)
            x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def fold_step(accumulator, squares, scale, w32, k0, offs_k, offs_m, x_ptr, residual_ptr, table_ptr, index_ptr,
              norm_ptr, rows, k_in, stride_xm, stride_rm, stride_t, M_PAD: tl.constexpr, NORM: tl.constexpr,
              EXACT: tl.constexpr, GATHER: tl.constexpr, RESIDUAL: tl.constexpr, ROUND_ONCE: tl.constexpr):
    """The accumulator (and, for the norm without EXACT, the sums of squares) plus one loaded [BLOCK_N,
    BLOCK_K] weight tile, as fp32, times every row's activation at k0 (normed by `scale` with EXACT, rounded as
    norm_row rounds)."""
    cols = k0 + offs_k
    k_mask = cols < k_in
    if NORM:
        g = tl.load(norm_ptr + cols, mask=k_mask, other=0.0).to(tl.float32)
    for m in tl.static_range(M_PAD):
        lanes = k_mask & (tl.full(offs_k.shape, m, dtype=tl.int32) < rows)
        x = fold_activation(x_ptr, residual_ptr, table_ptr, index_ptr, m, rows, cols, lanes, stride_xm, stride_rm,
                            stride_t, GATHER, RESIDUAL)
        a = x.to(tl.float32)
        if NORM:
            if EXACT:  # h as kernels.rms_norm rounds it
                r = tl.sum(tl.where(offs_m == m, scale, 0.0), axis=0)
                if ROUND_ONCE:
                    a = (a * r * g).to(x.dtype).to(tl.float32)
                else:
                    a = ((a * r).to(x.dtype).to(tl.float32) * g).to(x.dtype).to(tl.float32)
            else:
                squares += tl.where(offs_m == m, tl.sum(a * a, axis=0), 0.0)
                a = a * g
        partial = tl.sum(w32 * a[None, :], axis=1)  # [BLOCK_N]
        accumulator += tl.where(offs_m[:, None] == m, partial[None, :], 0.0)
    return accumulator, squares


@triton.jit
def fold_gemv(
    x_ptr, residual_ptr, table_ptr, index_ptr, norm_ptr,  # the norm's input and weight
    x_out_ptr, h_ptr,  # [M, K] slices written (WRITE_X / WRITE_H)
    w_ptr, out_ptr, bias_ptr,  # [N, K], [M, N], [N] (HAS_BIAS)
    rows, n_out, k_in, eps, slice_cols,
    stride_xm, stride_rm, stride_t, stride_xo, stride_h, stride_wn, stride_om,
    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SLICE: tl.constexpr,
    NORM: tl.constexpr, EXACT: tl.constexpr, GATHER: tl.constexpr, RESIDUAL: tl.constexpr,
    WRITE_X: tl.constexpr, WRITE_H: tl.constexpr,
    ROUND_ONCE: tl.constexpr,  # the norm's h rounded once (gpt-oss), as norm_row
    HAS_BIAS: tl.constexpr,  # out = the rounded product + bias, rounded again (bias_epilogue)
    USE_GDC: tl.constexpr,  # programmatic dependent launch (kernels.pdl)
    PRELOAD: tl.constexpr,  # the first weight tile loaded before the wait (kernels.pdl.preload)
):
    """This program's BLOCK_N outputs of out = (RMSNorm(x) or x) @ w^T (+ bias) for every row, stored to out; with
    the norm, its slice of the new residual stream (WRITE_X) and of h (WRITE_H). Signals the next grid (PDL) once
    its weights are read. The caller's epilogue (routing, picking) runs after it."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_out
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, M_PAD)
    m_mask = offs_m < rows
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    if PRELOAD:  # the weight does not depend on the grid before: its first tile (at one row of the router
        # and the LM head, all of the program's weight) while that grid ends
        w_first = tl.load(w_ptrs, mask=n_mask[:, None] & (offs_k < k_in)[None, :], other=0.0)
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
    accumulator = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
    squares = tl.zeros([M_PAD], dtype=tl.float32)  # sum of x^2 per row (NORM)
    scale = tl.full([M_PAD], 1.0, dtype=tl.float32)  # the rows' norm scale (NORM; EXACT: before the product)
    if NORM and EXACT:  # a first pass for the scale, so h can be rounded before the product
        for k0 in range(0, k_in, BLOCK_K):
            cols = k0 + offs_k
            for m in tl.static_range(M_PAD):
                lanes = (cols < k_in) & (tl.full([BLOCK_K], m, dtype=tl.int32) < rows)
                a = fold_activation(x_ptr, residual_ptr, table_ptr, index_ptr, m, rows, cols, lanes, stride_xm,
                                    stride_rm, stride_t, GATHER, RESIDUAL).to(tl.float32)
                squares += tl.where(offs_m == m, tl.sum(a * a, axis=0), 0.0)
        scale = tl.math.rsqrt(squares / k_in + eps)  # [M_PAD], the same in every program
    k_start = 0
    if PRELOAD:  # the loop's first step, on the preloaded tile
        accumulator, squares = fold_step(
            accumulator, squares, scale, w_first.to(tl.float32), 0, offs_k, offs_m, x_ptr, residual_ptr, table_ptr,
            index_ptr, norm_ptr, rows, k_in, stride_xm, stride_rm, stride_t, M_PAD, NORM, EXACT, GATHER, RESIDUAL,
            ROUND_ONCE)
        w_ptrs += BLOCK_K
        k_start = BLOCK_K
    for k0 in range(k_start, k_in, BLOCK_K):
        k_mask = k0 + offs_k < k_in  # as fold_step's lanes: one mask for both (ptxas keeps the old schedule)
        w32 = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        accumulator, squares = fold_step(
            accumulator, squares, scale, w32, k0, offs_k, offs_m, x_ptr, residual_ptr, table_ptr, index_ptr,
            norm_ptr, rows, k_in, stride_xm, stride_rm, stride_t, M_PAD, NORM, EXACT, GATHER, RESIDUAL, ROUND_ONCE)
        w_ptrs += BLOCK_K
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    if NORM:
        if not EXACT:
            scale = tl.math.rsqrt(squares / k_in + eps)  # [M_PAD], the same in every program
            accumulator = accumulator * scale[:, None]
        if WRITE_X or WRITE_H:  # this program's slice of the new residual stream and of h
            cols = pid * slice_cols + tl.arange(0, SLICE)
            in_slice = (tl.arange(0, SLICE) < slice_cols) & (cols < k_in)
            g_slice = tl.load(norm_ptr + cols, mask=in_slice, other=0.0)
            for m in tl.static_range(M_PAD):
                lanes = in_slice & (tl.full([SLICE], m, dtype=tl.int32) < rows)
                x = fold_activation(x_ptr, residual_ptr, table_ptr, index_ptr, m, rows, cols, lanes, stride_xm,
                                    stride_rm, stride_t, GATHER, RESIDUAL)
                if WRITE_X:
                    tl.store(x_out_ptr + m * stride_xo + cols, x, mask=lanes)
                if WRITE_H:  # as kernels.rms_norm: x32 * r rounded, times the weight, rounded (ROUND_ONCE: once)
                    r = tl.sum(tl.where(offs_m == m, scale, 0.0), axis=0)
                    if ROUND_ONCE:
                        h = (x.to(tl.float32) * r * g_slice.to(tl.float32)).to(h_ptr.dtype.element_ty)
                    else:
                        normed = (x.to(tl.float32) * r).to(h_ptr.dtype.element_ty)
                        h = (normed.to(tl.float32) * g_slice.to(tl.float32)).to(h_ptr.dtype.element_ty)
                    tl.store(h_ptr + m * stride_h + cols, h, mask=lanes)
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    tl.store(out_ptrs, bias_epilogue(accumulator, bias_ptr, offs_n, n_mask, out_ptr.dtype.element_ty, HAS_BIAS),
             mask=out_mask)


@triton.jit
def bias_epilogue(accumulator, bias_ptr, offs_n, n_mask, out_dtype: tl.constexpr, HAS_BIAS: tl.constexpr):
    """A product's fp32 accumulator [M_PAD, BLOCK_N] in out_dtype; with HAS_BIAS plus bias[offs_n] as torch adds a
    bias to a rounded product (F.linear's product, then `+ b`): in fp32 on the rounded values, rounded again (for
    float32 logits the plain fp32 sum)."""
    values = accumulator.to(out_dtype)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        values = (values.to(tl.float32) + bias[None, :]).to(out_dtype)
    return values
