"""Warm the L2 with a weight a later kernel will read, while the device is busy with latency-bound work.

At one decode token a step alternates bandwidth-bound reads of weights (the q/k/v and o projections,
the experts) with latency-bound kernels that leave the HBM idle: decode attention over a short cache,
the router and its top-k. A prefetch issued on a second stream beside such a kernel moves the next
weight from HBM into the L2 while that kernel runs; the GEMV that follows then reads it from the L2.
The weight's bytes still come from HBM once per step; they just arrive during time the step already
spends. It pays only while the weight fits the L2 (50 MB on an H100/H200) beside what else the kernel
in between touches. Normal eviction priority, not evict_last: the lines are to be read once, soon, and
then leave with the rest of the step's stream (the MoE's ~300 MB at v4). A weight pinned in the L2
across steps would be read from the L2 instead of the HBM, and the bound the benchmark divides by
(the active weights' bytes over the copy bandwidth) would no longer describe the step.

Kernel: one `prefetch.global.L2` per 128-byte line, issued by every thread for its lines;
nothing comes back to the SM, so the programs finish as soon as the requests are issued and leave the
SMs to the kernel they run beside. Grid: (cdiv(lines, LINES_PER_PROGRAM),).

A hint with no output: results never depend on it. The Triton interpreter (CPU) cannot run inline PTX
and a CPU has no L2 to fill, so `prefetch_l2` launches nothing there and returns False; on CUDA it
launches one kernel and returns True (tests/test_decode_fused.py runs it on the GPU, and
bench/l2_prefetch.py measures what it buys).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import launches

LINE_BYTES = 128
LINES_PER_PROGRAM = 4096  # 512 KB per program: 32 lines per thread at 4 warps


@triton.jit
def _prefetch_l2_kernel(base_ptr, n_lines, LINE: tl.constexpr, BLOCK: tl.constexpr):
    lines = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = lines < n_lines
    addresses = base_ptr + tl.where(inside, lines, 0) * LINE  # a line outside: line 0 again (harmless)
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; mov.u32 $0, 0;",
        "=r,l",
        [addresses],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


def prefetch_l2(tensor: torch.Tensor) -> bool:
    """Ask the L2 for every line of `tensor`'s storage span (one launch on CUDA; nothing elsewhere).
    Returns whether a kernel was launched."""
    if not tensor.is_cuda or tensor.numel() == 0:
        return False
    if not tensor.is_contiguous():
        raise ValueError("prefetch_l2 takes a contiguous tensor (a weight)")
    n_lines = triton.cdiv(tensor.numel() * tensor.element_size(), LINE_BYTES)
    byte_view = tensor.view(-1).view(torch.uint8) if tensor.dtype != torch.uint8 else tensor.view(-1)
    _prefetch_l2_kernel[(triton.cdiv(n_lines, LINES_PER_PROGRAM),)](
        byte_view, n_lines, LINE=LINE_BYTES, BLOCK=LINES_PER_PROGRAM, num_warps=4,
    )
    launches.record("prefetch_l2")
    return True
