"""Fixtures for the public-op tests: a clean environment and a per-test generator (defined in
``support.maxsim_testlib``, shared with tests/kernels)."""
from support.maxsim_testlib import _clean_lik_env, gen  # noqa: F401  (pytest fixtures)
