"""Programmatic dependent launch (PDL, Hopper and later) for the decode step's kernels.

A decode step at batch 1 is a chain of ~15 short kernels; between two of them the GPU idles while
the next grid is launched and ramps up (about 1-1.5 us each on the H200, bench/results/). With PDL
a kernel may be launched while its predecessor's last programs still run: each program of every
kernel here first executes `gdc_wait` (it returns once the previous grid has completed and its
memory is visible), and, once its main loop is done, `gdc_launch_dependents` (the next grid may
start launching). Every program waits unconditionally before it can exit, so completion stays
transitive along the chain: a kernel that reads what a kernel two launches back wrote is safe.

Kernels take a `USE_GDC: tl.constexpr` switch and launch with `**launch_options(device)`. It is ON on
CUDA devices of compute capability >= 9 whose Triton has the GDC intrinsics, unless MOEI_PDL=0 (the
benchmark's A/B). The interpreter and older GPUs never use it. On the H200 (v4-shape tg128 @ b1, graphs
on, device time per step, PDL on against off):
- run 29, the kernels as they are now: 126.5 and 126.7 us against 133.0 and 132.9 us (two bench processes
  each), so it is on; run 31: +5 % tokens/s at batch 1, nothing beyond the spread at batch 8 and 32;
- run 32: the dense GEMV and MoE down loading their first weight tile before the wait (`preload`, the
  loops otherwise unchanged): 125.4 and 125.2 us against 126.7 and 126.7; runs 36-37 (8 steps per graph
  launch): the router's and the LM head's fused GEMVs too (at one row, a program's whole weight):
  122.0-122.1 against 122.5-122.8 us, and 122.8-122.9 against 123.3-123.4 on another lease;
- before, with other loops, it lost: run 8 146.2 against 144.7 us; run 21 (each kernel loading its
  first weight chunk before its wait and each next chunk one step ahead) 141.3 against 146.8 us, but
  those loops were slower than these; run 23 (each program asking for its weight rows in L2 with a bulk
  prefetch before its wait) 139.0 against 133.9 us: a bulk prefetch keeps its program resident until the
  lines land (bench/probe_l2.py), so the early programs held slots and bandwidth the running grid needed.
- letting the next grid launch earlier lost every time: the short kernels (rms_norm, rope_cache, attention's
  split and combine) signalling before their own wait, 123.9 against 122.6-122.7 us (run 39) and 120.6-120.8
  against 119.5-119.6 (run 40); attention's combine kernel, which never signals (the o projection launches at
  its exit), signalling right after its wait, 116.8-116.9 against 116.2 (run 44). The early grids' programs
  preload their weights while the latency-bound kernels run, and those kernels slow.
(bench/results/2026-11-29-h200-run21..23, run29-pdl-ab, run31-pdl-batches, run32-pdl-preload, run39, run40, run44.)
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


def enabled(device: torch.device) -> bool:
    if device.type != "cuda" or os.environ.get("MOEI_PDL", "1") == "0":
        return False
    if device not in _ENABLED:
        _ENABLED[device] = torch.cuda.get_device_capability(device)[0] >= 9 and _triton_supports_pdl()
    return _ENABLED[device]


PRELOADERS = ("gemv", "down", "fused")  # kernels.gemv, kernels.moe_gemv's down, kernels.gemv_fused


def preload(device: torch.device, kernel: str = "") -> bool:
    """Whether a kernel with PDL loads its first weight tile before its wait (weights do not depend on the
    grid before; kernels.gemv, kernels.moe_gemv's down, kernels.gemv_fused): with PDL, unless
    MOEI_PDL_PRELOAD=0, or MOEI_PDL_PRELOAD lists the kernels that do (e.g. `gemv,down`: the A/B of one of
    them). Run 32: the v4 step 125.4 and 125.2 us against 126.7 and 126.7 without (gemv and down)."""
    setting = os.environ.get("MOEI_PDL_PRELOAD", "1")
    if setting == "0" or not enabled(device):
        return False
    return setting == "1" or not kernel or kernel in setting.split(",")


def launch_options(device: torch.device) -> dict:
    """What to add to a launch: {"USE_GDC": bool} and, when on, {"launch_pdl": True}."""
    if enabled(device):
        return {"USE_GDC": True, "launch_pdl": True}
    return {"USE_GDC": False}
