"""The environment variables are read at every call (``lik_plugins._config``), through a
cache of parsed values per raw value: a flipped variable is seen by the next call, a bad
value raises on every read, and torch.compile never guards on the cache (a compiled op
compiles once, however the cache fills after the trace)."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing

import lik_plugins as lik
from lik_plugins import _config
from lik_plugins.kernels.dispatch import served_by


def test_a_flipped_variable_is_seen_by_the_next_call(monkeypatch):
    t = torch.zeros(2, 3)
    assert served_by(t) == "torch-chunked"
    monkeypatch.setenv("LIK_DISABLE", "1")
    assert served_by(t) == "reference"
    monkeypatch.setenv("LIK_DISABLE", "0")
    assert served_by(t) == "torch-chunked"
    monkeypatch.delenv("LIK_DISABLE")
    monkeypatch.setenv("LIK_BACKEND", " Reference ")
    assert served_by(t) == "reference"
    monkeypatch.setenv("LIK_BACKEND", "torch-chunked")
    assert served_by(t) == "torch-chunked"


def test_a_bad_value_raises_on_every_read(monkeypatch):
    monkeypatch.setenv("LIK_BACKEND", "cuda")
    for _ in range(2):
        with pytest.raises(ValueError, match="LIK_BACKEND='cuda' is not one of auto, triton"):
            _config.forced_backend()
    monkeypatch.setenv("LIK_AUTOTUNE", "sometimes")
    for _ in range(2):
        with pytest.raises(ValueError, match="LIK_AUTOTUNE='sometimes' is not one of auto, 1, 0"):
            _config.autotune_mode()
    monkeypatch.setenv("LIK_BACKEND", "auto")
    assert _config.forced_backend() == "auto"


def test_values_read_as_the_environment_gives_them(monkeypatch):
    monkeypatch.setenv("LIK_CHUNK_ELEMENTS", "4096")
    assert _config.chunk_elements() == 4096
    monkeypatch.setenv("PYLATE_SCORES_BACKEND", "Lik")
    assert _config.scores_backend("PYLATE_SCORES_BACKEND") == "lik"
    monkeypatch.delenv("PYLATE_SCORES_BACKEND")
    assert _config.scores_backend("PYLATE_SCORES_BACKEND") == "auto"
    monkeypatch.setenv("LIK_DIRECT_LAUNCH", "off")
    assert not _config.direct_launch_enabled()
    monkeypatch.delenv("LIK_DIRECT_LAUNCH")
    assert _config.direct_launch_enabled()


def test_a_compiled_op_compiles_once_while_the_cache_fills(monkeypatch):
    # a process whose first op call is compiled: the trace reads the variables, and eager
    # reads fill the cache afterwards; a guard on the cache would recompile at each change
    monkeypatch.setattr(_config, "_PARSED", {})
    monkeypatch.setattr(_config, "_ENCODED_KEYS", {})
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(lambda Q, D: lik.maxsim(Q, D), backend=counter, fullgraph=True)
    g = torch.Generator().manual_seed(3)
    Q, D = torch.randn(2, 5, 16, generator=g), torch.randn(3, 7, 16, generator=g)
    try:
        scores = compiled(Q, D)
        torch.testing.assert_close(scores, lik.maxsim(Q, D))
        for variable in ("LIK_CHUNK_ELEMENTS", "LIK_AUTOTUNE", "LIK_METAL"):
            torch.testing.assert_close(compiled(Q, D), scores)
            monkeypatch.setenv(variable, "1")
            _config.chunk_elements(), _config.autotune_mode(), _config.metal_enabled()
        assert counter.frame_count == 1
    finally:
        torch._dynamo.reset()
