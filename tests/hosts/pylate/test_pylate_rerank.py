"""``pylate.rank.rerank`` patched: candidates scored in place in one launch (Triton kernels, here
interpreted), PyLate's own loop on a plain CPU; PyLate's structure, order and scores."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("pylate")

import torch  # noqa: E402

from lik_plugins import reset_routing_counts, routing_counts  # noqa: E402
from lik_plugins.pylate import unpatch_pylate  # noqa: E402


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


@pytest.fixture
def kernels(patched, monkeypatch):
    from lik_plugins._config import triton_interpret

    if not triton_interpret():
        pytest.skip("the Triton kernels on CPU need TRITON_INTERPRET=1")
    monkeypatch.setenv("LIK_BACKEND", "triton")
    return patched


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rerank_matches_pylate_in_one_launch(kernels, dtype, monkeypatch):
    from pylate import rank

    ids, queries, docs = _corpus(0, dtype=dtype)
    monkeypatch.setenv("PYLATE_SCORES_BACKEND", "torch")     # PyLate's own loop and colbert_scores
    theirs = kernels.originals["rerank"](ids, queries, docs)
    monkeypatch.delenv("PYLATE_SCORES_BACKEND")
    reset_routing_counts()
    ours = rank.rerank(ids, queries, docs)
    # 16-bit: both round each row's max and the sum to the embeddings' dtype; fp32 sums may
    # differ in the last bit
    _same(ours, theirs, exact=False)
    assert [r["id"] for r in ours[2]] == [r["id"] for r in theirs[2]]   # the five-way tie too
    assert routing_counts() == {"pylate.rerank": {"triton": 1}}       # no per-query colbert_scores


def test_rerank_reads_views_of_one_buffer_and_mixed_lengths(kernels):
    from pylate import rank

    g = torch.Generator().manual_seed(5)
    lengths = [[1, 40, 3, 77, 2, 2], [130, 5], [9]]
    # candidates as split views of one buffer (addresses inside one storage), long queries
    # (several row chunks) and candidates shorter and longer than one 64-token tile
    buffers = [torch.randn(sum(n), 24, generator=g) - 0.1 for n in lengths]
    docs = [list(torch.split(b, n)) for b, n in zip(buffers, lengths)]
    queries = [torch.randn(n, 24, generator=g) for n in (300, 1, 33)]
    ids = [list(range(len(n))) for n in lengths]
    _same(rank.rerank(ids, queries, docs), kernels.originals["rerank"](ids, queries, docs), exact=False)
    assert routing_counts()["pylate.rerank"] == {"triton": 1}


def test_rerank_of_numpy_candidates_and_non_contiguous_ones(kernels):
    from pylate import rank

    ids, queries, docs = _corpus(6, nq=2, c=(5, 3))
    np_docs = [[d.numpy() for d in group] for group in docs]
    want = kernels.originals["rerank"](ids, queries, np_docs)
    reset_routing_counts()
    _same(rank.rerank(ids, queries, np_docs), want, exact=False)
    strided = [[torch.stack([d, d], dim=-1)[..., 0] for d in group] for group in docs]   # same values, stride 2
    _same(rank.rerank(ids, queries, strided), want, exact=False)
    # read in place, then PyLate's own loop for the strided ones (its colbert_scores patched)
    assert routing_counts()["pylate.rerank"] == {"triton": 1, "original": 1}


def test_rerank_on_a_plain_cpu_runs_pylates_loop(patched, monkeypatch):
    from pylate import rank

    monkeypatch.setenv("LIK_BACKEND", "torch-chunked")
    ids, queries, docs = _corpus(0)
    want = patched.originals["rerank"](ids, queries, docs)
    reset_routing_counts()
    _same(rank.rerank(ids, queries, docs), want)
    counts = routing_counts()
    assert counts["pylate.rerank"] == {"original": 1}
    assert counts["pylate.colbert_scores"] == {"original": len(queries)}   # PyLate's loop, all of it


def test_rerank_numpy_inputs_stacked_queries_and_device_argument(kernels):
    from pylate import rank

    ids, queries, docs = _corpus(1, nq=2, c=(5, 3))
    stacked = torch.nn.utils.rnn.pad_sequence(queries, batch_first=True)     # [Nq, Lq, H] tensor
    np_docs = [[d.numpy() for d in group] for group in docs]
    original = kernels.originals["rerank"]
    one = queries[0].numpy()                                                # a single [Lq, H] query
    want = [original(ids, stacked, np_docs, device="cpu"), original(ids[:1], one, np_docs[:1])]
    reset_routing_counts()
    _same(rank.rerank(ids, stacked, np_docs, device="cpu"), want[0], exact=False)
    _same(rank.rerank(ids[:1], one, np_docs[:1]), want[1], exact=False)
    assert routing_counts()["pylate.rerank"] == {"triton": 2}


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
    # ... and under an explicit lik on a plain CPU PyLate's loop runs its torch path, with that
    # path's own error for mixed dtypes (not PyLate's LIK backend, which refuses CPU tensors)
    mixed = [docs[0], [d.double() for d in docs[1]]]
    monkeypatch.setenv("PYLATE_SCORES_BACKEND", "lik")
    with pytest.raises(RuntimeError) as raised:
        rank.rerank(ids, queries, mixed)
    assert "CUDA or MPS" not in str(raised.value)
    _same(rank.rerank(ids, queries, docs), want)


def test_explicit_lik_refuses_what_the_kernels_cannot_read(kernels, monkeypatch):
    from pylate import rank

    ids, queries, docs = _corpus(2, nq=2, c=(4, 3))
    mixed = [docs[0], [d.double() for d in docs[1]]]
    monkeypatch.setenv("PYLATE_SCORES_BACKEND", "lik")
    with pytest.raises(RuntimeError, match="backend='lik'"):
        rank.rerank(ids, queries, mixed)


def test_rerank_of_candidates_off_16_bytes_runs_pylates_loop(kernels):
    from pylate import rank

    ids, queries, docs = _corpus(7, nq=2, c=(4, 3))
    # one element into a buffer: every address 4 bytes off a multiple of 16 (the kernel's vectors)
    shifted = []
    for group in docs:
        flat = torch.cat([torch.zeros(1), torch.cat(group).flatten()])[1:]
        shifted.append(list(torch.split(flat.view(-1, 16), [d.shape[0] for d in group])))
    want = kernels.originals["rerank"](ids, queries, docs)
    reset_routing_counts()
    _same(rank.rerank(ids, queries, shifted), want, exact=False)
    assert routing_counts()["pylate.rerank"] == {"original": 1}
