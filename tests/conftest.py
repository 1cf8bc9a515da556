"""Test setup: CPU by default; `-m gpu` selects the device-only tests.

Without a GPU, Triton kernels run under its interpreter (TRITON_INTERPRET=1), which must be set
before triton compiles anything, so it is set here, before any test module imports kernels/.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def foreign_kernels_distribution() -> str | None:
    """The version of an installed distribution named `kernels` (Hugging Face's, which transformers >= 5.25
    requires), or None. Its import name is this project's kernels/: transformers finds ours, takes it for
    its own and fails to build any model, so the family tests would all error on an ImportError."""
    from importlib import metadata

    try:
        return metadata.version("kernels")
    except metadata.PackageNotFoundError:
        return None


def pytest_sessionstart(session):
    version = foreign_kernels_distribution()
    if version is not None:
        pytest.exit(f"Hugging Face's `kernels` {version} is installed (transformers >= 5.25 requires it) and shares "
                    "the import name of this project's kernels/: run `pip uninstall -y kernels` and "
                    "`pip install 'transformers<5.25'`, or `make test` in a fresh virtual environment",
                    returncode=2)


def _dot_in_one_rounding() -> None:
    """The interpreter's tl.dot is numpy's matmul, whose BLAS sums each element in an order that depends
    on the operands' shapes (its N and M blocking), so two schedules that multiply the same rows and
    columns with different block widths round differently on some CPUs and not others. On the GPU an
    element's MMA does not depend on the block width; here each fp16 or fp32 element is summed in float64
    (every product is exact there, and an order's effect stays far below one fp32 rounding) and rounded
    once to the accumulator's dtype, so an element depends on its row, its column and the accumulator it
    is added to, as on the GPU. Other dtypes keep the interpreter's own dot."""
    try:
        import numpy as np
        from triton.runtime import interpreter
    except ImportError:  # no triton: the kernel tests skip themselves
        return
    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.data.dtype not in (np.float16, np.float32) or b.data.dtype not in (np.float16, np.float32):
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        product = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64))
        return interpreter.TensorHandle(product.astype(d.data.dtype) + d.data, d.dtype.scalar)

    builder.create_dot = create_dot


if not HAS_CUDA and os.environ.get("TRITON_INTERPRET") == "1":
    _dot_in_one_rounding()


@pytest.fixture
def fused_decode_steps(monkeypatch) -> list:
    """Every decode step through engine.decode_fused on the CPU too (as on a GPU: its kernels under the interpreter,
    the arms the CPU's): eligibility forced, and each call of forward_decode counted in the returned list."""
    from engine import decode_fused

    eligible, forward_decode, steps = decode_fused.eligible, decode_fused.forward_decode, []
    monkeypatch.setattr(decode_fused, "eligible", lambda config, tokens, force=False: eligible(config, tokens, True))
    monkeypatch.setattr(decode_fused, "forward_decode", lambda *args, **kwargs: steps.append(1)
                        or forward_decode(*args, **kwargs))
    return steps


@pytest.fixture
def pinned_environment(monkeypatch, tmp_path):
    """`moe_gate=measured` reads a calibration file and every flag reads MOEI_*: a test module that runs the
    engine's entry points pins both (`pytestmark = pytest.mark.usefixtures("pinned_environment")`), so its runs
    do not depend on the machine's calibration or the shell's variables."""
    from engine import flags

    monkeypatch.setenv("MOEI_CALIBRATION", str(tmp_path / "no-calibration.json"))
    for name in flags.SPECS:
        monkeypatch.delenv(flags.environment_name(name), raising=False)


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


try:  # generated hostile inputs (tests/test_hostile_*.py): bounded, so the suite stays fast
    from hypothesis import HealthCheck, settings

    settings.register_profile("default", max_examples=60, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    # CI runs on a shared 2-core machine inside a time budget: fewer examples, derandomized so a
    # failure there reproduces here.
    settings.register_profile("ci", max_examples=30, deadline=None, derandomize=True,
                              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    settings.register_profile("thorough", max_examples=1000, deadline=None,  # HYPOTHESIS_PROFILE=thorough, by hand
                              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "default"))
except ImportError:  # hypothesis is in the test extra; the generated tests skip themselves without it
    pass
