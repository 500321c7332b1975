"""Fixtures for the core kernel tests (defined in support.maxsim_testlib, shared with tests/ops)."""
from support.maxsim_testlib import _clean_lik_env, gen  # noqa: F401  (pytest fixtures)
