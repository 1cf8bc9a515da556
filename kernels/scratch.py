"""Buffers the launchers allocate for their kernels to write, with an optional poison fill.

Every launcher in kernels/ allocates its outputs and intermediates through `empty`, so a test can
run inside `poison_new_buffers()` and every buffer starts as NaN (floats) or a huge integer
(ints). A row a kernel forgot to write then shows up as NaN in the output or as an impossible
index, instead of passing by luck on freshly zeroed memory. Outside tests the fill is off: it is
one extra launch per buffer and must not appear in timings or CUDA graphs.

Knows nothing of MoE or of which kernel uses a buffer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_POISON = False

# An int32 value no index computation can produce: reading it back as a row or a pair id is out
# of range for every shape this package supports.
INT_POISON = -(2**31) + 7


@contextlib.contextmanager
def poison_new_buffers() -> Iterator[None]:
    """Fill every buffer `empty` hands out inside this block with NaN / INT_POISON."""
    global _POISON
    previous, _POISON = _POISON, True
    try:
        yield
    finally:
        _POISON = previous


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    buffer = torch.empty(shape, dtype=dtype, device=device)
    if _POISON:
        buffer.fill_(float("nan") if dtype.is_floating_point else INT_POISON)
    return buffer
