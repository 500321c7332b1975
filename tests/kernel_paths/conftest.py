"""Fixtures for the core kernel tests: a clean environment and a per-test generator."""
from __future__ import annotations

import pytest

from maxsim_testlib import generator, seed_of

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
