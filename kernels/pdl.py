"""Programmatic dependent launch (PDL, Hopper and later) for the decode step's kernels.

A decode step at batch 1 is a chain of ~15 short kernels; between two of them the GPU idles while
the next grid is launched and ramps up (about 1-1.5 us each on the H200, bench/results/). With PDL
a kernel may be launched while its predecessor's last programs still run: each program of every
kernel here first executes `gdc_wait` (it returns once the previous grid has completed and its
memory is visible), and, once its main loop is done, `gdc_launch_dependents` (the next grid may
start launching). Every program waits unconditionally before it can exit, so completion stays
transitive along the chain: a kernel that reads what a kernel two launches back wrote is safe.

Kernels take a `USE_GDC: tl.constexpr` switch and launch with `**launch_options(device)`. It is OFF
unless MOEI_PDL=1, and then only on CUDA devices of compute capability >= 9 whose Triton has the GDC
intrinsics. The interpreter and older GPUs never use it. It has not paid on the H200 (v4-shape tg128
@ b1, graphs on, device time per step, PDL on against off):
- run 8, as above: 146.2 against 144.7 us;
- run 21, every kernel triggering its dependents right after its wait, and the GEMVs and MoE down
  loading their first weight chunk before the wait and each next chunk one step ahead: 141.3
  against 146.8 us, but those loops were slower than these without PDL (133.9 us, run 23);
- run 23, these loops, with each program asking for its weight rows in L2 (one bulk prefetch per
  row, `cp.async.bulk.prefetch.L2`) before its wait: 139.0 against 133.9 us.
So it stays an opt-in for the benchmark's A/B (bench/results/2026-11-29-h200-run21..23).
"""

from __future__ import annotations

import os

import torch

_ENABLED: dict[torch.device, bool] = {}


def _triton_supports_pdl() -> bool:
    try:
        from triton.language.extra import cuda as triton_cuda
    except ImportError:
        return False
    return hasattr(triton_cuda, "gdc_wait") and hasattr(triton_cuda, "gdc_launch_dependents")


def supported(device: torch.device) -> bool:
    """Whether kernels on `device` can launch early and trigger and wait (CUDA, compute capability >= 9, a
    Triton with the GDC intrinsics), whatever MOEI_PDL says (kernels.moe_gemv's overlap uses it on its own)."""
    if device.type != "cuda":
        return False
    if device not in _ENABLED:
        _ENABLED[device] = torch.cuda.get_device_capability(device)[0] >= 9 and _triton_supports_pdl()
    return _ENABLED[device]


def enabled(device: torch.device) -> bool:
    return os.environ.get("MOEI_PDL", "0") == "1" and supported(device)


def launch_options(device: torch.device) -> dict:
    """What to add to a launch: {"USE_GDC": bool} and, when on, {"launch_pdl": True}."""
    if enabled(device):
        return {"USE_GDC": True, "launch_pdl": True}
    return {"USE_GDC": False}
