# Build/test entry points for lik_plugins.
#   make venv  - bootstrap .venv (CPU torch 2.13.0+cpu, triton 3.7.1, PyLate 1.6.0, colpali-engine 0.3.18)
#   make test  - run the test suite under the Triton CPU interpreter
#   make demo  - run recipes/train_contrastive.py on CPU
#   make gpu   - how to run the GPU benchmarks (on the GPU machine, not here)
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

.PHONY: venv test demo gpu clean

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

# pytest exit code 5 (no tests collected) counts as a failure.
# -rs lists every skipped test with its reason (a missing optional host says which extra to install).
# Four parts, each failing the target on its own:
#   1. the suite in .venv (kernels under Triton's CPU interpreter, PyLate 1.6, colpali-engine 0.3.18);
#   2. the Metal kernels' shader source under the C++ emulator, every kernel (exit non-zero on a mismatch);
#   3. sentence-transformers 6.x in its own environment (it cannot sit beside PyLate's pinned ST 5.3);
#   4. the hosts' own test suites, unpatched / patched / kill switch, compared test for test.
test: venv
	@set +e; start=$$(date +%s); TRITON_INTERPRET=1 $(PY) -m pytest -q -rs tests; rc=$$?; \
	echo "make test: suite $$(( $$(date +%s) - start )) s"; \
	if [ $$rc -eq 5 ]; then echo "make test: ERROR: pytest collected no tests (exit code 5)" >&2; exit 1; fi; \
	if [ $$rc -ne 0 ]; then exit $$rc; fi; \
	$(PY) -m lik_plugins.kernels.metal.emulate || exit 1; \
	bash ci/st6_env.sh || exit 1; \
	$(PY) ci/host_suites.py || exit 1; \
	echo "make test: all parts passed in $$(( $$(date +%s) - start )) s"

demo: venv
	@if [ ! -f $(DEMO) ]; then echo "make demo: ERROR: $(DEMO) does not exist" >&2; exit 1; fi
	$(PY) $(DEMO)

gpu:
	@echo "GPU benchmarks are not run from this Makefile."
	@echo "On a CUDA machine with torch, triton and (for the side-by-side) the peers'"
	@echo "wheels in .whl/, from the repo root run:"
	@echo "    bash benchmarks/run_gpu.sh"

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
