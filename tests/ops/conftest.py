"""Fixtures for the public-op tests: a clean environment and a per-test generator.

The numeric helpers live in ``tests/kernels/maxsim_testlib.py``; that folder is put on
``sys.path`` here so ``pytest tests/ops`` alone works too.
"""
from __future__ import annotations

import sys
from pathlib import Path


_KERNEL_TESTS = str(Path(__file__).resolve().parent.parent / "kernels")
if _KERNEL_TESTS not in sys.path:
    sys.path.insert(0, _KERNEL_TESTS)

from maxsim_testlib import _clean_lik_env, gen  # noqa: E402,F401  (pytest fixtures)
