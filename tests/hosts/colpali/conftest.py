import os

# TRITON_INTERPRET is tests/conftest.py's (CPU-only machines only): set here, it would put
# every kernel imported later under the interpreter on a GPU machine too.
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
