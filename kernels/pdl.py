"""Programmatic dependent launch (PDL, Hopper and later) for the decode step's kernels.

With PDL a kernel may launch while its predecessor's last programs still run. Every program of a
kernel here first executes `gdc_wait` (it returns once the previous grid has completed and its
memory is visible) and, once its main loop is done, `gdc_launch_dependents` (the next grid may start
launching). Every program waits before it can exit, so completion stays transitive along the chain:
a kernel that reads what a kernel two launches back wrote is safe. Why: at batch 1 a decode step is a
chain of short kernels and the gaps between them are a large share of the step
(docs/decode-step.md; figures in bench/RESULTS.md).

Kernels take a `USE_GDC: tl.constexpr` switch and launch with `**launch_options(device)`. It is on
for CUDA devices of compute capability >= 9 whose Triton has the GDC intrinsics, when the launch
settings say so (kernels.settings: the flags `pdl` and `pdl_preload`). The interpreter and older GPUs
never use it. Changes timing only, never a result.
"""

from __future__ import annotations

import torch

from kernels import settings
from kernels.settings import PRELOADERS  # noqa: F401 - the names `preload` takes, re-exported

_ENABLED: dict[torch.device, bool] = {}


def _triton_supports_pdl() -> bool:
    try:
        from triton.language.extra import cuda as triton_cuda
    except ImportError:
        return False
    return hasattr(triton_cuda, "gdc_wait") and hasattr(triton_cuda, "gdc_launch_dependents")


def enabled(device: torch.device, launch: settings.LaunchSettings | None = None) -> bool:
    """Whether launches on `device` use PDL under `launch` (None: the current settings)."""
    if device.type != "cuda" or not (launch or settings.current()).pdl:
        return False
    if device not in _ENABLED:
        _ENABLED[device] = torch.cuda.get_device_capability(device)[0] >= 9 and _triton_supports_pdl()
    return _ENABLED[device]


def preload(device: torch.device, kernel: str = "", launch: settings.LaunchSettings | None = None) -> bool:
    """Whether `kernel` (one of PRELOADERS) loads its first weight tile before its PDL wait: its weights do
    not depend on the grid before. With PDL and `kernel` in the settings' `pdl_preload`; with no kernel
    named, whether any kernel does."""
    launch = launch or settings.current()
    if not enabled(device, launch):
        return False
    return kernel in launch.pdl_preload if kernel else bool(launch.pdl_preload)


def launch_options(device: torch.device) -> dict:
    """What to add to a launch: {"USE_GDC": bool} and, when on, {"launch_pdl": True}."""
    if enabled(device):
        return {"USE_GDC": True, "launch_pdl": True}
    return {"USE_GDC": False}
