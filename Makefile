# Build/test entry points for lik_plugins.
#   make venv  - bootstrap .venv (CPU torch 2.13.0+cpu, triton 3.7.1, PyLate 1.6.0, colpali-engine 0.3.18)
#   make test  - every CI part (suite, Metal emulator, ST 6, hosts' suites, install check), then one summary
#   make demo  - run recipes/train_contrastive.py on CPU
#   make gpu   - how to run the GPU benchmarks (on the GPU machine, not here)
#   make releases - the host releases CI tests, and any newer one on PyPI (ci/host_releases.py)
#
# Why the environment is built in two steps: PyLate 1.6 depends on fast-plaid, and every
# fast-plaid release pins one exact torch (1.6.0 -> torch 2.11.0, a CUDA build), so a plain
# resolve replaces the CPU torch with a 5 GB CUDA one; colpali-engine depends on
# torchvision, and PyPI's torchvision is built against the CUDA torch of the same version
# (beside a CPU torch it fails with "operator torchvision::nms does not exist", which breaks
# transformers' imports).  So ci/requirements-ci.txt lists the hosts' other dependencies
# with the torch we want, and the hosts go in with --no-deps (ci/requirements-nodeps.txt).
# torch==2.13.0 is the CPU build where pip can see a 2.13.0+cpu wheel (a find-links folder,
# or PyTorch's CPU index: `PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu make test`);
# from PyPI alone it is the CUDA build, which works on CPU too but downloads ~5 GB.

SHELL   := /bin/bash
PYTHON  ?= python3
VENV    := .venv
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip
STAMP   := $(VENV)/.stamp
REQS    := $(wildcard ci/requirements-*.txt)
DEMO    := recipes/train_contrastive.py

.PHONY: venv test demo gpu releases clean

venv: $(STAMP)

# Re-runs only when a requirements file or pyproject.toml changes.
# pylate/colpali-engine go in with --no-deps: their metadata would pull fast-plaid
# (-> CUDA torch 2.11) and torchvision (broken beside torch 2.13.0+cpu).
$(STAMP): $(REQS) pyproject.toml setup.py lik_plugins_autoactivate.pth
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -r ci/requirements-ci.txt
	$(PIP) install --no-deps -r ci/requirements-nodeps.txt
	$(PIP) install --no-deps -e .
	@touch $@

test demo: export HF_HUB_OFFLINE := 1
test demo: export TRANSFORMERS_OFFLINE := 1

# ci/make_test.py runs five parts, each failing the target on its own, and ends with one
# summary: the skipped tests with their reasons, a line per part, the verdict.
#   1. the suite in .venv (kernels under Triton's CPU interpreter, PyLate 1.6, colpali-engine 0.3.18);
#   2. the Metal kernels' shader source under the C++ emulator, every kernel;
#   3. sentence-transformers 6.x in its own environment (it cannot sit beside PyLate's pinned ST 5.3);
#   4. the hosts' own test suites, unpatched / patched / kill switch, compared test for test;
#   5. pip install of this checkout beside torch and the hosts leaves them untouched (pip list before/after),
#      and python -m build's sdist and wheel install into a fresh venv and pass a CPU smoke test.
# pytest exit code 5 (no tests collected) counts as a failure.
test: venv
	@$(PY) ci/make_test.py

demo: venv
	@if [ ! -f $(DEMO) ]; then echo "make demo: ERROR: $(DEMO) does not exist" >&2; exit 1; fi
	$(PY) $(DEMO)

gpu:
	@echo "GPU benchmarks are not run from this Makefile."
	@echo "On a CUDA machine with torch, triton and (for the side-by-side) the peers'"
	@echo "wheels in .whl/, from the repo root run:"
	@echo "    bash benchmarks/run_gpu.sh"

releases:
	@$(PYTHON) ci/host_releases.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
