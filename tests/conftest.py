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


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
