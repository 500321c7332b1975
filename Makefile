# Build/test entry points for lik_plugins.
#   make venv  - bootstrap .venv (CPU torch 2.13.0+cpu, triton 3.7.1, PyLate 1.6.0, colpali-engine 0.3.18)
#   make test  - run the test suite under the Triton CPU interpreter
#   make demo  - run recipes/train_contrastive.py on CPU
#   make gpu   - how to run the GPU benchmarks (on the GPU machine, not here)
# Recipe and rationale: ../shared/notes/install.md (sections 4 and 6).

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
test: venv
	@set +e; TRITON_INTERPRET=1 $(PY) -m pytest -q tests; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: ERROR: pytest collected no tests (exit code 5)" >&2; exit 1; fi; \
	exit $$rc

demo: venv
	@if [ ! -f $(DEMO) ]; then echo "make demo: ERROR: $(DEMO) does not exist" >&2; exit 1; fi
	$(PY) $(DEMO)

gpu:
	@echo "GPU benchmarks are not run from this Makefile."
	@echo "On the GPU machine (no network; peer wheels in .whl/), from the repo root run:"
	@echo "    bash benchmarks/run_gpu.sh"

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
