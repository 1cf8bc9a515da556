# Two entry points, both safe on a fresh machine: `make run` and `make test`.
# An installed torch (a CUDA build on a GPU machine) is reused; only where there is none is the
# CPU build put in place (on the CI machines it lies on local disk and installs in seconds).
PYTHON ?= python3
PIP = $(PYTHON) -m pip install --quiet --disable-pip-version-check

.PHONY: install install-test run test gpu

install:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) torch==2.13.0
	@$(PIP) -e .

install-test:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) torch==2.13.0
	@$(PIP) -e '.[test]'

run: install
	$(PYTHON) -m inspector

# Two workers (pytest-xdist), each test file whole on one of them: the CI machine has two cores and most
# tests are single-threaded (the Triton interpreter, the TUI's Pilot).
test: install-test
	$(PYTHON) -m pytest -n 2 --dist loadfile

# On a GPU machine: the device-only tests and benchmarks (see bench/README.md).
gpu:
	bash bench/gpu_all.sh
