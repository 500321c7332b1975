"""Fixtures for the public-op tests: a clean environment and a per-test generator.

The numeric helpers live in ``tests/kernel_paths/maxsim_testlib.py``; that folder is put on
``sys.path`` here so ``pytest tests/ops`` alone works too.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

_KERNEL_TESTS = str(Path(__file__).resolve().parent.parent / "kernel_paths")
if _KERNEL_TESTS not in sys.path:
    sys.path.insert(0, _KERNEL_TESTS)

from maxsim_testlib import generator, seed_of  # noqa: E402

LIK_VARS = ("LIK_DISABLE", "LIK_BACKEND", "LIK_CHUNK_ELEMENTS")


@pytest.fixture(autouse=True)
def _clean_lik_env(monkeypatch):
    """Every test starts with the library's switches unset (default routing)."""
    for var in LIK_VARS:
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def gen(request) -> "torch.Generator":  # noqa: F821
    """Fresh random inputs per test (seeded from the test id, so reproducible)."""
    return generator(seed_of(request.node.nodeid))
