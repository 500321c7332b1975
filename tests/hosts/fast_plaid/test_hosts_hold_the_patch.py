"""fast-plaid's patch held by the hosts that search through it: colpali-engine's
``get_topk_plaid`` served once ``patch_colpali_engine()`` ran (no ``patch_pylate()`` needed),
and the original back only when no host holds the patch any more.

Runs where colpali-engine is installed, over the stand-in fast_plaid of
``tests/support/fast_plaid_files.py`` (1.4.6's interface and files; the real releases are
``test_real_fast_plaid.py``'s).
"""
from __future__ import annotations

import sys

import pytest
import torch

import lik_plugins
from lik_plugins.fast_plaid import is_patched, patch_fast_plaid, unpatch_fast_plaid

from support import fast_plaid_files

SCORE_TOL = 2e-2


def _forget_fast_plaid() -> None:
    for name in [n for n in sys.modules if n == "fast_plaid" or n.startswith("fast_plaid.")]:
        del sys.modules[name]


@pytest.fixture
def stand_in(monkeypatch, tmp_path):
    """The stand-in ``fast_plaid.search``, an index of 30 documents on the CPU, 4 queries."""
    monkeypatch.syspath_prepend(fast_plaid_files.STUB_PATH)
    _forget_fast_plaid()
    from fast_plaid import search

    g = torch.Generator().manual_seed(4)
    docs = [torch.nn.functional.normalize(torch.randn(int(n), 16, generator=g), dim=-1)
            for n in torch.randint(2, 12, (30,), generator=g)]
    index = search.FastPlaid(index=str(tmp_path), device="cpu", low_memory=False)
    index.create(documents_embeddings=docs, nbits=2)
    queries = [torch.nn.functional.normalize(torch.randn(int(n), 16, generator=g), dim=-1) for n in (5, 8, 3, 6)]
    for name in ("LIK_DISABLE", "LIK_BACKEND", "COLPALI_SCORES_BACKEND", "PYLATE_SCORES_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    yield search, index, queries
    lik_plugins.unpatch_colpali_engine()
    unpatch_fast_plaid()
    _forget_fast_plaid()


def test_get_topk_plaid_served_after_patch_colpali_engine(stand_in, monkeypatch):
    processing = pytest.importorskip("colpali_engine.utils.processing_utils")
    search, index, queries = stand_in
    get_topk_plaid = processing.BaseVisualRetrieverProcessor.get_topk_plaid
    theirs = get_topk_plaid(queries, index, k=3, device="cpu")[0]          # the stand-in: float64
    lik_plugins.patch_colpali_engine()
    assert is_patched()
    monkeypatch.setenv("LIK_BACKEND", "triton")
    lik_plugins.reset_routing_counts()
    ours = get_topk_plaid(queries, index, k=3, device="cpu")[0]
    assert lik_plugins.routing_counts()["fast_plaid.search"] == {"triton": 1}
    for got, want in zip(ours, theirs):
        assert len(got) == len(want)
        assert all(abs(s - w) <= SCORE_TOL for (_, s), (_, w) in zip(got, want))
    assert sum([p for p, _ in got] == [p for p, _ in want] for got, want in zip(ours, theirs)) >= 3
    lik_plugins.unpatch_colpali_engine()
    assert not is_patched()


def test_original_back_when_no_host_holds_it(stand_in):
    pytest.importorskip("colpali_engine")
    search, _, _ = stand_in
    original = search.FastPlaid.search
    lik_plugins.patch_colpali_engine()
    patch = patch_fast_plaid()
    assert patch.holders == {"colpali", "fast_plaid"}
    served = search.FastPlaid.search
    assert served is not original and served.__wrapped__ is original
    lik_plugins.unpatch_colpali_engine()
    assert search.FastPlaid.search is served                 # still held by patch_fast_plaid()
    patch_fast_plaid()
    lik_plugins.patch_colpali_engine()
    unpatch_fast_plaid()                                     # every hold let go
    assert search.FastPlaid.search is original and not is_patched()
    lik_plugins.unpatch_colpali_engine()
    assert search.FastPlaid.search is original
