"""``pylate.rank.rerank`` patched: one packed launch, PyLate's structure, order and scores."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("pylate")

import torch  # noqa: E402

from lik_plugins import reset_routing_counts, routing_counts  # noqa: E402
from lik_plugins.pylate import patch_pylate, unpatch_pylate  # noqa: E402


@pytest.fixture
def patched(monkeypatch):
    monkeypatch.delenv("PYLATE_SCORES_BACKEND", raising=False)
    monkeypatch.delenv("LIK_DISABLE", raising=False)
    layout = patch_pylate()
    reset_routing_counts()
    yield layout
    unpatch_pylate()


def _corpus(seed, nq=4, c=(9, 1, 14, 6), dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    unit = torch.nn.functional.normalize
    queries = [unit(torch.randn(int(torch.randint(3, 9, (1,), generator=g)), 16, generator=g), dim=-1).to(dtype)
               for _ in range(nq)]
    # shifted so that many similarities are negative: PyLate's zero padding then wins rows
    docs = [[(unit(torch.randn(int(torch.randint(1, 21, (1,), generator=g)), 16, generator=g), dim=-1) - 0.2)
             .to(dtype) for _ in range(n)] for n in c]
    docs[0][2] = docs[0][1].clone()        # exact ties: equal scores, order as PyLate's
    if len(docs) > 2:
        for j in (7, 9, 11, 13):           # many copies: torch.sort's (unstable) tie order matters
            docs[2][j] = docs[2][2].clone()
    ids = [[f"q{i}-d{j}" for j in range(n)] for i, n in enumerate(c)]
    return ids, queries, docs


def _same(ours, theirs, exact=True):
    assert isinstance(ours, list) and len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert [r["id"] for r in a] == [r["id"] for r in b]
        assert all(set(r) == {"id", "score"} and isinstance(r["score"], float) for r in a)
        got, want = [r["score"] for r in a], [r["score"] for r in b]
        if exact:
            assert got == want
        else:
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rerank_matches_pylate_in_one_launch(patched, dtype):
    from pylate import rank

    ids, queries, docs = _corpus(0, dtype=dtype)
    theirs = patched.originals["rerank"](ids, queries, docs)
    reset_routing_counts()       # PyLate's own loop above called the patched colbert_scores
    ours = rank.rerank(ids, queries, docs)
    # fp16: both round to the embeddings' dtype; fp32 sums may differ in the last bit
    _same(ours, theirs, exact=False)
    assert [r["id"] for r in ours[2]] == [r["id"] for r in theirs[2]]   # the five-way tie too
    counts = routing_counts()
    assert counts["pylate.rerank"] == {"torch-chunked": 1}
    assert counts["score_pairs_packed"] == {"torch-chunked": 1}        # one launch for every query
    assert "pylate.colbert_scores" not in counts                       # PyLate's per-query loop did not run


def test_rerank_numpy_inputs_stacked_queries_and_device_argument(patched):
    from pylate import rank

    ids, queries, docs = _corpus(1, nq=2, c=(5, 3))
    stacked = torch.nn.utils.rnn.pad_sequence(queries, batch_first=True)     # [Nq, Lq, H] tensor
    np_docs = [[d.numpy() for d in group] for group in docs]
    original = patched.originals["rerank"]
    one = queries[0].numpy()                                                # a single [Lq, H] query
    want = [original(ids, stacked, np_docs, device="cpu"), original(ids[:1], one, np_docs[:1])]
    reset_routing_counts()
    _same(rank.rerank(ids, stacked, np_docs, device="cpu"), want[0], exact=False)
    _same(rank.rerank(ids[:1], one, np_docs[:1]), want[1], exact=False)
    assert routing_counts()["pylate.rerank"] == {"torch-chunked": 2}


def test_retrievers_and_reexports_are_captured(patched):
    import pylate.rank as rank_pkg
    import pylate.rank.rank as rank_mod

    original = patched.originals["rerank"]
    served = rank_mod.rerank
    # the served function carries PyLate's identity (doctests, help, pickling) and wraps it
    assert served is not original and served.__wrapped__ is original and served.__name__ == "rerank"
    assert rank_pkg.rerank is served
    retrieve = pytest.importorskip("pylate.retrieve.colbert")
    if "rerank" in vars(retrieve):
        assert retrieve.rerank is served
    unpatch_pylate()
    assert rank_pkg.rerank is patched.originals["rerank"] and rank_mod.rerank is patched.originals["rerank"]


def test_backend_rules_and_fallbacks(patched, monkeypatch):
    from pylate import rank

    ids, queries, docs = _corpus(2, nq=2, c=(4, 3))
    want = patched.originals["rerank"](ids, queries, docs)
    reset_routing_counts()
    monkeypatch.setenv("PYLATE_SCORES_BACKEND", "torch")
    _same(rank.rerank(ids, queries, docs), want)
    monkeypatch.setenv("LIK_DISABLE", "1")
    monkeypatch.delenv("PYLATE_SCORES_BACKEND")
    _same(rank.rerank(ids, queries, docs), want)
    assert routing_counts()["pylate.rerank"] == {"original": 2}
    monkeypatch.delenv("LIK_DISABLE")
    # more candidates than ids: PyLate's own code (and its own error) under auto ...
    with pytest.raises(IndexError):
        rank.rerank([ids[0][:1], ids[1]], queries, docs)
    # ... and a clear refusal under an explicit lik for mixed dtypes
    mixed = [docs[0], [d.double() for d in docs[1]]]
    monkeypatch.setenv("PYLATE_SCORES_BACKEND", "lik")
    with pytest.raises(RuntimeError, match="backend='lik'"):
        rank.rerank(ids, queries, mixed)


def test_rerank_through_the_triton_kernels(patched, monkeypatch):
    from lik_plugins._config import triton_interpret

    if not triton_interpret():
        pytest.skip("the Triton kernels on CPU need TRITON_INTERPRET=1")
    from pylate import rank

    monkeypatch.setenv("LIK_BACKEND", "triton")
    ids, queries, docs = _corpus(3, nq=2, c=(5, 4))
    want = patched.originals["rerank"](ids, queries, docs)
    reset_routing_counts()
    _same(rank.rerank(ids, queries, docs), want, exact=False)
    assert routing_counts()["pylate.rerank"] == {"triton": 1}
