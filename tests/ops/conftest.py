"""Fixtures for the public-op tests: a clean environment and a per-test generator (defined in
``support.maxsim_testlib``, shared with tests/kernels), and the compiled-versus-eager check
the torch.compile tests share."""
import pytest
import torch

import lik_plugins as lik
from lik_plugins._config import triton_interpret
from support.maxsim_testlib import _clean_lik_env, gen  # noqa: F401  (pytest fixtures)


@pytest.fixture(params=["torch-chunked", "triton"])
def compile_backend(request, monkeypatch) -> str:
    """``LIK_BACKEND`` for a torch.compile test: the chunked path, and the Triton kernels where
    ``TRITON_INTERPRET=1`` interprets them on the CPU."""
    if request.param == "triton" and not triton_interpret():
        pytest.skip("the Triton kernels on CPU need TRITON_INTERPRET=1")
    monkeypatch.setenv("LIK_BACKEND", request.param)
    return request.param


@pytest.fixture
def check_compiled(compile_backend):
    """``check(run, fn, inputs, fullgraph)``: ``run(torch.compile(fn), inputs)`` equals
    ``run(fn, inputs)`` (values and gradients), and the compiled call ran our ops on the path
    the environment asks for."""

    def check(run, fn, inputs, fullgraph: bool) -> None:
        lik.reset_routing_counts()
        compiled = run(torch.compile(fn, fullgraph=fullgraph, dynamic=False), inputs)
        counts = lik.routing_counts()
        eager = run(fn, inputs)
        for got, want in zip(compiled, eager):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert any(compile_backend in paths for paths in counts.values()), counts

    return check
