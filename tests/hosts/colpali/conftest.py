import os

# The Triton kernels run under the CPU interpreter in CI; must be set before any kernel
# module is imported (triton reads it when @triton.jit decorates).
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402

import lik_plugins  # noqa: E402


@pytest.fixture(autouse=True)
def _clean_colpali_patch(monkeypatch):
    """Every test starts unpatched, with the switches unset, and leaves nothing patched."""
    for var in ("LIK_DISABLE", "LIK_BACKEND", "COLPALI_SCORES_BACKEND"):
        monkeypatch.delenv(var, raising=False)
    lik_plugins.unpatch_colpali_engine()
    yield
    lik_plugins.unpatch_colpali_engine()
