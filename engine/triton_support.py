"""Whether Triton can be imported here, and the one line a feature that needs it says where it cannot.

Triton is a dependency wherever the platform has wheels (Linux x86_64 and aarch64; CUDA builds
of torch bring their own). Elsewhere the reference arms still run everything but the features
that launch a Triton kernel: the attention check (its fused kernel, under the interpreter on a
CPU) and the sweep. Those call `require_triton` first, so a missing package is a UserError
(exit 2 headless, a message in place in the TUI), never a ModuleNotFoundError from a kernel
module. Knows nothing of which feature is asking beyond the name it is given.
"""

from __future__ import annotations

import importlib.util

from engine.errors import UserError

INSTALL = "pip install triton (wheels for Linux x86_64 and aarch64)"


def triton_installed() -> bool:
    """Cheap: whether the package can be found, without importing it (an import takes a second)."""
    return importlib.util.find_spec("triton") is not None


def missing_message(feature: str, detail: str = "") -> str:
    found = f" ({detail})" if detail else ""
    return (f"{feature} runs a Triton kernel (under its interpreter on a CPU), and triton cannot be imported "
            f"here{found}: {INSTALL}; every other feature runs on the reference arms")


def require_triton(feature: str) -> None:
    """Raise UserError naming `feature` unless `import triton` works."""
    if not triton_installed():
        raise UserError(missing_message(feature))
    try:
        import triton  # noqa: F401 - the import is the check
    except ImportError as error:  # found, yet broken (a wheel for another Python, a missing library)
        raise UserError(missing_message(feature, f"import triton: {error}")) from None
