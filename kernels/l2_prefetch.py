"""Ask for a weight's bytes in L2 ahead of the kernel that reads them (sm_90 `cp.async.bulk.prefetch.L2`).

A decode step at batch 1 alternates bandwidth-bound GEMVs with latency-bound kernels (RoPE and the
cache write, attention over a few hundred keys, the router's and the LM head's epilogues) during
which DRAM idles. A prefetch issued at the start of such a window, on a side stream, lets the next
GEMV find its weight in L2 instead of DRAM. The prefetch changes no value anywhere: it only moves
lines into L2 (a GPU test checks a prefetched step gives the same bits).

    prefetch(weight)   one launch of `programs` programs; each one's first thread issues bulk
                       prefetches of CHUNK bytes over its share of the weight's bytes and exits.
                       Nothing waits for the lines: the kernel ends as soon as its requests are issued.

Only on CUDA devices of compute capability >= 9 (the instruction is sm_90's); elsewhere (the CPU, the
interpreter, older GPUs) `available` is False and `prefetch` launches nothing and returns False.
The weight must be contiguous, 16-byte aligned and a multiple of 16 bytes long (what the
instruction takes); anything else is refused with ValueError, not silently skipped.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels import launches

CHUNK = 65536  # bytes per bulk prefetch instruction
PROGRAMS = 32  # programs issuing them

_AVAILABLE: dict[torch.device, bool] = {}


@triton.jit
def _bulk_prefetch(address, nbytes):
    """One bulk prefetch of [address, address + nbytes) into L2 by the program's first thread;
    `address` 16-byte aligned and `nbytes` a multiple of 16."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [address.to(tl.pointer_type(tl.int8)), nbytes.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_kernel(base_ptr, nbytes, per_program, CHUNK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * per_program
    end = tl.minimum(start + per_program, nbytes)
    for offset in range(start, end, CHUNK):
        _bulk_prefetch(base_ptr + offset, tl.minimum(end - offset, CHUNK))


def available(device: torch.device) -> bool:
    """Whether `prefetch` issues anything on `device` (a CUDA device of compute capability >= 9, not
    under the Triton interpreter)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if device not in _AVAILABLE:
        _AVAILABLE[device] = torch.cuda.get_device_capability(device)[0] >= 9
    return _AVAILABLE[device]


def check(weight: torch.Tensor) -> None:
    if not weight.is_contiguous() or weight.data_ptr() % 16 or (weight.numel() * weight.element_size()) % 16:
        raise ValueError(f"l2_prefetch: the weight must be contiguous, 16-byte aligned and a multiple of 16 bytes "
                         f"long; got shape {tuple(weight.shape)}, strides {weight.stride()}, "
                         f"address % 16 = {weight.data_ptr() % 16}")


def prefetch(weight: torch.Tensor, programs: int = PROGRAMS, chunk: int = CHUNK) -> bool:
    """Issue L2 prefetches for all of `weight`'s bytes on the current stream; False (nothing launched)
    where the device cannot (`available`)."""
    if not available(weight.device):
        return False
    check(weight)
    if programs < 1 or chunk < 16 or chunk % 16:
        raise ValueError(f"l2_prefetch: programs >= 1 and chunk a positive multiple of 16; got {programs}, {chunk}")
    nbytes = weight.numel() * weight.element_size()
    if nbytes == 0:
        return False
    per_program = -(-nbytes // programs)
    per_program = -(-per_program // chunk) * chunk  # whole chunks per program; the last one is cut at the end
    programs = -(-nbytes // per_program)
    _prefetch_kernel[(programs,)](weight.reshape(-1).view(torch.uint8), nbytes, per_program, CHUNK=chunk,
                                  num_warps=1)
    launches.record("l2_prefetch")
    return True
