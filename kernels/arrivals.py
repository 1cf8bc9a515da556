"""Arrival counters: the zeroed int32 buffer a "last program reduces" kernel counts into.

The pattern (one launch instead of a partials kernel plus a reduce kernel):
    each program stores its partial result, then `tl.debug_barrier()` and
    `old = tl.atomic_add(counter, 1, sem="acq_rel")`; the program that sees old == arrivals - 1
    is the last of its group: it reads every partial (with cache_modifier=".cg", past L1) in a
    fixed order, so the result is the same whatever order the programs finished in, writes the
    output, and stores 0 back into the counter.
Every counter is therefore 0 again when the kernel ends, so one buffer serves every launch on a
stream, eager or replayed from a CUDA graph, with no memset in between. Kernels on one stream run
one after another, so launchers share the buffer; two streams must not run such kernels at once.

The buffer is allocated (zeroed) outside any CUDA-graph capture: the engine's capture step runs the
same shapes eagerly first, and a launcher that would need a larger buffer while capturing is an
error, not a silent allocation in the graph's private pool. A buffer outgrown later is kept alive,
never freed: graphs captured earlier (the engine captures each batch size when it first sees it)
still count into it on every replay, and freed memory would be handed to other tensors.
"""

from __future__ import annotations

import torch

_BUFFERS: dict[torch.device, torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []  # replaced by a larger buffer, still used by captured graphs
_MINIMUM = 4096


def counters(device: torch.device, count: int) -> torch.Tensor:
    """`count` zeroed int32 counters on `device` (a view of the shared buffer)."""
    device = torch.device(device)
    buffer = _BUFFERS.get(device)
    if buffer is None or buffer.numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"arrival counters: {count} needed while capturing a CUDA graph, "
                f"{0 if buffer is None else buffer.numel()} allocated; run the same launch once before capturing"
            )
        size = max(_MINIMUM, 1 << (count - 1).bit_length())
        if buffer is not None:
            _OUTGROWN.append(buffer)
        buffer = torch.zeros(size, dtype=torch.int32, device=device)
        _BUFFERS[device] = buffer
    return buffer[:count]
