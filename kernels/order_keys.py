"""Largest-value-at-the-lowest-index in one reduction: a float32 value and an index packed into one int64 key.

The value's bits, made to order as signed integers (negative floats have their magnitude bits flipped), go in
the high half and the index, reversed, in the low half, so the largest key is the largest value and, among
equal values, the lowest index. -0.0 is taken as 0.0 (equal as floats, so the lower index wins). A NaN has no
place in the order: callers map it to an infinity first. Shared by kernels.router's top-k and
kernels.next_tokens's argmax (each pick one `tl.max`, where a max and then a min over the tied lanes took two).
"""

from __future__ import annotations

import triton
import triton.language as tl

@triton.jit
def _ordered_bits(bits):
    """int32 float bits -> int32 that orders as the floats do (and back: the map is its own inverse)."""
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def key_of(values, reversed_index):
    """The int64 keys of float32 `values` at `reversed_index` (a larger one for a lower index, >= 0, < 2^32)."""
    bits = (values + 0.0).to(tl.int32, bitcast=True)
    return (_ordered_bits(bits).to(tl.int64) << 32) | reversed_index.to(tl.int64)


@triton.jit
def value_of(key):
    """The float32 value a key holds (-0.0 comes back as 0.0)."""
    return _ordered_bits((key >> 32).to(tl.int32)).to(tl.float32, bitcast=True)


@triton.jit
def reversed_index_of(key):
    """The reversed index a key holds (what `key_of` was given)."""
    return key & 0xFFFFFFFF


@triton.jit
def none_chosen(BLOCK: tl.constexpr):
    """[BLOCK] keys below every key (the lowest int64): a running best before any value."""
    return tl.full([BLOCK], -9223372036854775807 - 1, dtype=tl.int64)


@triton.jit
def drop(keys, dropped):
    """`keys` with the lanes `dropped` set below every key (never chosen)."""
    return tl.where(dropped, -9223372036854775807 - 1, keys)
