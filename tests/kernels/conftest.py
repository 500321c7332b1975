"""Fixtures for the core kernel tests (defined in maxsim_testlib, shared with tests/ops)."""
from maxsim_testlib import _clean_lik_env, gen  # noqa: F401  (pytest fixtures)
