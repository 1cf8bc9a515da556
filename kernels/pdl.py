"""Programmatic dependent launch (PDL, Hopper and later) for the decode step's kernels.

A decode step at batch 1 is a chain of ~11 short kernels; at each boundary the GPU drains one grid,
launches the next and waits for its first loads (about 1 us of launch and 1-2 us of ramp and tail
per kernel on the H200, bench/results/). With PDL a kernel may be launched while its predecessor
still runs. Every program of every kernel here executes `gdc_wait` (it returns once the previous
grid has completed and its memory is visible) before it reads anything a kernel wrote, and
`gdc_launch_dependents` right after it (the next grid may then be scheduled into SM slots as they
free up). Before its wait a program may only load what no kernel of the step writes -- the weights:
the GEMVs (kernels.gemv, kernels.gemv_fused) load their first weight chunk there, so the next grid
streams weights while the previous one drains (`prefetch_l2`: each program asks for its own rows
of the weight with one bulk prefetch into L2, no registers held); MoE down (kernels.moe_gemv) also reads its pair's
expert id, written by the routing two grids back, which is complete once down may start (gate-up
triggers only after its own wait). Every program waits unconditionally before it can exit, so
completion stays transitive along the chain: a kernel that reads what a kernel two launches back
wrote, after its wait, is safe.

Kernels take a `USE_GDC: tl.constexpr` switch and launch with `**launch_options(device)`. It is ON on
CUDA devices of compute capability >= 9 whose Triton has the GDC intrinsics, unless MOEI_PDL=0 (the
benchmark's A/B). The interpreter and older GPUs never use it. Measured on the H200 (v4-shape tg128
@ b1, graphs on): with every program waiting first and no prefetch, 146.2 us per step against 144.7
without (run 8); with the weights loaded a chunk ahead in registers, 141.3 against 146.8 (run 21),
and those loops were slower without PDL; with the L2 prefetch and the loops as they were: run 23.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_ENABLED: dict[torch.device, bool] = {}


def _triton_supports_pdl() -> bool:
    try:
        from triton.language.extra import cuda as triton_cuda
    except ImportError:
        return False
    return hasattr(triton_cuda, "gdc_wait") and hasattr(triton_cuda, "gdc_launch_dependents")


def enabled(device: torch.device) -> bool:
    if device.type != "cuda" or os.environ.get("MOEI_PDL", "1") == "0":
        return False
    if device not in _ENABLED:
        _ENABLED[device] = torch.cuda.get_device_capability(device)[0] >= 9 and _triton_supports_pdl()
    return _ENABLED[device]


def launch_options(device: torch.device) -> dict:
    """What to add to a launch: {"USE_GDC": bool} and, when on, {"launch_pdl": True}."""
    if enabled(device):
        return {"USE_GDC": True, "launch_pdl": True}
    return {"USE_GDC": False}


def can_prefetch(weight: torch.Tensor) -> bool:
    """Whether `prefetch_l2` may be asked for `weight`'s rows (PDL on, and rows that start on 16 bytes and
    span a multiple of 16: what the bulk prefetch instruction takes)."""
    size = weight.element_size()
    return (enabled(weight.device) and weight.data_ptr() % 16 == 0 and weight.stride(-1) == 1
            and all((stride * size) % 16 == 0 for stride in weight.stride()[:-1])
            and (weight.shape[-1] * size) % 16 == 0)


@triton.jit
def prefetch_l2(address, nbytes):
    """One bulk prefetch of [address, address + nbytes) into L2 (sm_90 `cp.async.bulk.prefetch.L2`), issued
    by the program's first thread; `address` 16-byte aligned, `nbytes` a multiple of 16 (`can_prefetch`).
    Nothing waits for it: the program's own loads later find the lines in L2, or in flight."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [address.to(tl.pointer_type(tl.int8)), nbytes.to(tl.int32)], dtype=tl.int32, is_pure=False,
        pack=1)
