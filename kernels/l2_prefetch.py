"""Asking L2 for a tensor's bytes ahead of the kernel that reads them (sm_90 `cp.async.bulk.prefetch.L2`).

At one row a decode layer's latency-bound kernels (rope_cache, attention's split and combine, the router's fold)
leave DRAM idle for microseconds while the weights the next GEMV streams are already known. `prefetch_l2(t)`
issues bulk prefetches over all of t's bytes from a few one-warp programs; each program stays resident until its
lines land (the bulk prefetch's completion), so the caller launches it on a side stream that nothing on the
critical path waits for (engine.l2_prefetch). A hint only: nothing is written, and a reader gets the same values
whether the lines arrived or not. Needs Hopper (compute capability 9) and a Triton that lowers inline PTX; the
interpreter has neither, so `supported` says False there and the engine launches nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import launches

CHUNK_BYTES = 65536  # one bulk prefetch instruction's span (bench/experiments/probe_l2.py: no gain above 64 KB)
PROGRAMS = 16  # one-warp programs a prefetch spreads over (probe_l2.py: 8-32 alike for 17-42 MB)
PAUSE_NS = 0  # each program's pause after each chunk: paces the prefetch below the copy bandwidth (0: no pause)


@triton.jit
def _bulk_prefetch(address, nbytes):
    """[address, address + nbytes) into L2 by the program's first thread; 16-byte aligned, nbytes % 16 == 0."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [address.to(tl.pointer_type(tl.int8)), nbytes.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _pause(nanoseconds: tl.constexpr, after):
    """About `nanoseconds` of this thread's sleep (PTX nanosleep), ordered after `after`."""
    tl.inline_asm_elementwise(f"nanosleep.u32 {nanoseconds}; mov.u32 $0, $1;", "=r,r", [after], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _prefetch_kernel(base_ptr, nbytes, per_program, CHUNK: tl.constexpr, PAUSE_NS: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * per_program
    end = tl.minimum(start + per_program, nbytes)
    for offset in range(start, end, CHUNK):
        _bulk_prefetch(base_ptr + offset, tl.minimum(end - offset, CHUNK))
        if PAUSE_NS > 0:
            _pause(PAUSE_NS, offset.to(tl.int32))


_SUPPORTED: dict[torch.device, bool] = {}


def supported(device: torch.device) -> bool:
    """Whether `prefetch_l2` can run on `device`: a CUDA GPU of compute capability >= 9 (asked once per device:
    every one-row step with the flag on asks)."""
    if device.type != "cuda":
        return False
    if device not in _SUPPORTED:
        _SUPPORTED[device] = torch.cuda.get_device_capability(device)[0] >= 9
    return _SUPPORTED[device]


def refusal(t: torch.Tensor) -> str:
    """Why `t` cannot be prefetched ("" when it can): its bytes must be contiguous, start 16-byte aligned and
    span a multiple of 16 bytes (the bulk prefetch's operands)."""
    nbytes = t.numel() * t.element_size()
    if not t.is_contiguous():
        return "not contiguous"
    if t.data_ptr() % 16:
        return "not 16-byte aligned"
    if nbytes % 16 or nbytes == 0:
        return f"{nbytes} bytes, not a positive multiple of 16"
    return ""


def prefetch_l2(t: torch.Tensor, programs: int | None = None, chunk: int | None = None,
                pause_ns: int | None = None) -> None:
    """Ask L2 for all of t's bytes, on the current stream: `programs` one-warp programs of whole `chunk`-byte
    prefetches, each program pausing `pause_ns` after each chunk (None: the module's PROGRAMS, CHUNK_BYTES,
    PAUSE_NS). ValueError where `refusal(t)` names a reason or the device is not `supported`."""
    programs = PROGRAMS if programs is None else programs
    chunk = CHUNK_BYTES if chunk is None else chunk
    pause_ns = PAUSE_NS if pause_ns is None else pause_ns
    reason = refusal(t) or ("" if supported(t.device) else f"{t.device} has no bulk L2 prefetch (sm_90 and later)")
    if reason:
        raise ValueError(f"prefetch_l2: {reason}")
    if chunk <= 0 or chunk % 16 or programs < 1 or not 0 <= pause_ns < 1 << 20:
        raise ValueError(f"prefetch_l2: chunk must be a positive multiple of 16, programs >= 1 and pause_ns in "
                         f"[0, 2^20), got {chunk}, {programs}, {pause_ns}")
    nbytes = t.numel() * t.element_size()
    per_program = triton.cdiv(triton.cdiv(nbytes, programs), chunk) * chunk  # whole chunks per program
    _prefetch_kernel[(triton.cdiv(nbytes, per_program),)](t.reshape(-1).view(torch.uint8), nbytes, per_program,
                                                          CHUNK=chunk, PAUSE_NS=pause_ns, num_warps=1)
    launches.record("l2_prefetch", kernel=_prefetch_kernel)
