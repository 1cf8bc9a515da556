"""The end of a graphed decode step in one launch: each row's next token (greedy argmax of its
logits, the lowest id on ties, as torch.argmax) written where the step's one sync reads it and
where the next replay reads its inputs, with the position moved one on.

    observed[b]  = argmax(logits[b])          the step's output (the host copies it back)
    inputs[0, b] = observed[b]                the token the next replay feeds
    inputs[1, b] = inputs[1, b] + 1           its position

Replaces torch.argmax, a copy and an add (three launches, plus a reduce kernel's ramp) at the tail of
every CUDA-graph decode step (at one row the LM head's GEMV does it instead: kernels.gemv_pick, with
the same jit functions from kernels.parts). Shapes: logits [B, V] float32; observed [>= B] int64; inputs [2, B]
int64. Grid: (B,); a program walks its row in BLOCK chunks keeping the running best.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import launches, pdl
from kernels.parts import argmax_row, feed_next

BLOCK = 2048


@triton.jit
def _next_tokens_kernel(logits_ptr, observed_ptr, inputs_ptr, vocab, stride_l, stride_inputs, BLOCK: tl.constexpr,
                        FEED: tl.constexpr, USE_GDC: tl.constexpr):
    if USE_GDC:  # programmatic dependent launch (kernels.pdl)
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0)
    token = argmax_row(logits_ptr + row.to(tl.int64) * stride_l, vocab, BLOCK)
    tl.store(observed_ptr + row, token)
    if FEED:
        feed_next(inputs_ptr, stride_inputs, row, token)


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
    _next_tokens_kernel[(rows,)](logits, observed, inputs, vocab, logits.stride(0), inputs.stride(0) if feed else 0,
                                 BLOCK=min(BLOCK, triton.next_power_of_2(vocab)), FEED=feed, num_warps=4,
                                 **pdl.launch_options(logits.device))
    launches.record("next_tokens", kernel=_next_tokens_kernel)
