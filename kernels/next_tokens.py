"""The end of a graphed decode step in one launch: each row's next token (greedy argmax of its
logits, the lowest id on ties, as torch.argmax) written where the step's one sync reads it and
where the next replay reads its inputs, with the position moved one on.

    observed[b]  = argmax(logits[b])          the step's output (the host copies it back)
    inputs[0, b] = observed[b]                the token the next replay feeds
    inputs[1, b] = inputs[1, b] + 1           its position

Replaces torch.argmax, a copy and an add (three launches, plus a reduce kernel's ramp) at the tail of
every CUDA-graph decode step (at one row the LM head's GEMV does it instead: kernels.gemv_pick, with
the same jit functions from kernels.parts). Shapes: logits [B, V] float32; observed [>= B] int64; inputs [2, B]
int64. Grid: (B, S), S = cdiv(V, SPLIT_COLUMNS): each program takes the best key (kernels.order_keys) of its
columns in BLOCK chunks; with S > 1 it stores it into partials [B, S] int64 and the last of the row's S programs
(kernels.arrivals, one counter per row) takes the best of them and writes the row's token. A max of keys is
order-free: the token is the one-program walk's, whichever program ends last. Why split: a 151936-token
vocabulary is 75 dependent 8 KB chunks for one program, 45.7 µs a step on the H200 (Qwen3-30B-A3B, run 60).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import arrivals, launches, pdl, scratch
from kernels.parts import argmax_row, best_key, feed_next, token_of

BLOCK = 2048
SPLIT_COLUMNS = 4 * BLOCK  # columns per program: one program up to 8192 tokens (every preset), 19 at 151936


@triton.jit
def _write_token(observed_ptr, inputs_ptr, stride_inputs, row, token, FEED: tl.constexpr):
    tl.store(observed_ptr + row, token)
    if FEED:
        feed_next(inputs_ptr, stride_inputs, row, token)


@triton.jit
def _next_tokens_kernel(logits_ptr, observed_ptr, inputs_ptr, partial_ptr, arrivals_ptr, vocab, stride_l,
                        stride_inputs, BLOCK: tl.constexpr, FEED: tl.constexpr, USE_GDC: tl.constexpr,
                        SPLIT: tl.constexpr = 1, SPLIT_PAD: tl.constexpr = 1, COLUMNS: tl.constexpr = BLOCK):
    if USE_GDC:  # programmatic dependent launch (kernels.pdl)
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_l
    if SPLIT == 1:
        _write_token(observed_ptr, inputs_ptr, stride_inputs, row, argmax_row(row_ptr, vocab, BLOCK), FEED)
    else:
        part = tl.program_id(1)
        best = best_key(row_ptr, part * COLUMNS, tl.minimum(part * COLUMNS + COLUMNS, vocab), BLOCK)
        tl.store(partial_ptr + row * SPLIT + part, best)
        tl.debug_barrier()
        arrived = tl.atomic_add(arrivals_ptr + row, 1, sem="acq_rel")
        if arrived == SPLIT - 1:  # the row's last program: the best of its S keys
            parts = tl.arange(0, SPLIT_PAD)
            keys = tl.load(partial_ptr + row * SPLIT + parts, mask=parts < SPLIT, other=-9223372036854775807 - 1,
                           cache_modifier=".cg")
            token = token_of(tl.max(keys, axis=0))
            _write_token(observed_ptr, inputs_ptr, stride_inputs, row, token, FEED)
            tl.atomic_xchg(arrivals_ptr + row, 0)


def next_tokens(logits: torch.Tensor, observed: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """Write each row's argmax into observed[:B] and inputs[0], add 1 to inputs[1]; returns observed[:B]."""
    rows, vocab = logits.shape
    if logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(f"next_tokens: logits must be float32 [B, V] with unit stride, got {logits.dtype}")
    if inputs.shape != (2, rows) or inputs.dtype != torch.int64 or inputs.stride(1) != 1:
        raise ValueError(f"next_tokens: inputs must be int64 [2, {rows}], got {inputs.dtype} {tuple(inputs.shape)}")
    if observed.dtype != torch.int64 or observed.numel() < rows or not observed.is_contiguous():
        raise ValueError(f"next_tokens: observed must be a contiguous int64 buffer of >= {rows}")
    _launch(logits, observed, inputs, feed=True)
    return observed[:rows]


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax [B] int64 with the same kernel (an eager step launches what a replay does)."""
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(f"argmax_rows: logits must be float32 [B, V] with unit stride, got {logits.dtype}")
    observed = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    _launch(logits, observed, observed, feed=False)
    return observed


def _launch(logits: torch.Tensor, observed: torch.Tensor, inputs: torch.Tensor, feed: bool) -> None:
    rows, vocab = logits.shape
    columns = SPLIT_COLUMNS  # read at call time (tests split small vocabularies)
    split = triton.cdiv(vocab, columns)
    if split == 1:
        partials = counters = observed  # never dereferenced
    else:
        partials = scratch.empty((rows, split), torch.int64, logits.device)
        counters = arrivals.counters(logits.device, rows)
    _next_tokens_kernel[(rows, split)](logits, observed, inputs, partials, counters, vocab, logits.stride(0),
                                       inputs.stride(0) if feed else 0, BLOCK=min(BLOCK, triton.next_power_of_2(vocab)),
                                       FEED=feed, SPLIT=split, SPLIT_PAD=triton.next_power_of_2(split),
                                       COLUMNS=columns, num_warps=4,
                                       **pdl.launch_options(logits.device))
    launches.record("next_tokens", kernel=_next_tokens_kernel)
