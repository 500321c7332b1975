"""PLAID search over a fast-plaid index: ``lik_plugins.plaid_search`` and PyLate's
``indexes.PLAID`` patched.

fast-plaid cannot run in this environment (``tests/support/fast_plaid_files.py`` says why), so the index
files are written in fast-plaid's layout by ``fast_plaid_files.write_index`` and the oracle
is fast-plaid's algorithm in float64 (``search_float64``); PyLate's PLAID runs unmodified
over a stand-in ``fast_plaid`` package with that interface.  Our search runs on the Triton
kernels under the interpreter (``LIK_BACKEND=triton``), and compiled on a CUDA device (marker
``gpu``).  Only the PyLate tests need PyLate.

Agreement with the float64 oracle: scores within ``SCORE_TOL`` position by position (fast-plaid
rounds every token similarity to fp16), a different id at a position a swap of two scores
closer than that.  Against ``search_fast_plaid_dtypes`` (fast-plaid's roundings and tie rules):
the same lists and the same scores, bit for bit, on every query without a near tie.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

from lik_plugins import reset_routing_counts, routing_counts, routing_reasons
from lik_plugins import plaid_search as ps

from support import fast_plaid_files
from support.fast_plaid_files import replay_exact_scores, search_fast_plaid_dtypes, search_float64, write_index

SCORE_TOL = 2e-2


def _unit(x):
    return torch.nn.functional.normalize(x, dim=-1)


def _agree(ids, scores, oracle):
    """Position by position: the same score within SCORE_TOL and the same id unless the two
    are a near tie -- the oracle holds our document within SCORE_TOL at another position, or
    our document is outside its list but scores within SCORE_TOL of a score in it (a duplicate
    document under another id, or a near tie at the candidate cut that half-precision
    roundings decide the other way); returns the number of queries whose ids are identical."""
    same = 0
    for got_ids, got_scores, want in zip(ids, scores, oracle):
        want_ids, want_scores = [p for p, _ in want], [s for _, s in want]
        assert len(got_ids) == len(want_ids)
        for pid, s, w_pid, w in zip(got_ids, got_scores, want_ids, want_scores):
            assert abs(s - w) <= SCORE_TOL
            if pid != w_pid and pid in dict(want):
                assert abs(dict(want)[pid] - w) <= SCORE_TOL
            elif pid != w_pid:
                # outside the oracle's list: a near tie with one of its documents (a duplicate
                # document under another id, or the candidate cut's near tie), never a score
                # the oracle has nothing near
                assert min(abs(s - ws) for ws in want_scores) <= SCORE_TOL, "a document outside the oracle's list"
        same += got_ids == want_ids
    return same


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory):
    g = torch.Generator().manual_seed(0)
    # clustered documents: 8 topics, tokens near their topic's directions
    topics = _unit(torch.randn(8, 4, 32, generator=g))
    docs = []
    for j in range(48):
        n = int(torch.randint(1, 24, (1,), generator=g))
        pick = topics[j % 8][torch.randint(0, 4, (n,), generator=g)]
        docs.append(_unit(pick + 0.4 * torch.randn(n, 32, generator=g)))
    docs[5] = docs[5][:1]                                # a one-token document
    path = str(tmp_path_factory.mktemp("fast_plaid_index"))
    write_index(path, docs, nbits=2, n_centroids=24)
    queries = _unit(topics[torch.arange(5) % 8][:, torch.randint(0, 4, (6,), generator=g)]
                    + 0.3 * torch.randn(5, 6, 32, generator=g))
    # query tokens of several norms (fast-plaid takes them as given).  No zero (padding) token:
    # its centroid scores all tie, and which cells a top-k then probes is the top-k
    # implementation's choice (fast-plaid's differs between its devices too)
    queries = queries * torch.empty(5, 6, 1).uniform_(0.5, 1.5, generator=g)
    return path, queries


@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.setenv("LIK_BACKEND", "triton")
    monkeypatch.delenv("LIK_DISABLE", raising=False)


def test_search_matches_fast_plaids_algorithm(index_dir, triton_backend):
    path, queries = index_dir
    index = ps.load_fast_plaid_index(path, "cpu")
    assert ps.load_fast_plaid_index(path, "cpu") is index          # loaded once
    assert index.n_docs == 48 and index.codes.dtype == torch.int32
    scores, ids = ps.plaid_search(index, queries, 4, n_ivf_probe=2, n_full_scores=40)
    oracle = search_float64(path, queries, 4, 2, 40)
    assert _agree(ids.tolist(), scores.tolist(), oracle) >= 4


@pytest.mark.parametrize("dim, n_queries", [(128, 48), (96, 12)])
def test_search_equals_fast_plaids_roundings(tmp_path, triton_backend, dim, n_queries):
    """Top-k lists equal fast-plaid's computed with its CUDA roundings and tie rules
    (``search_fast_plaid_dtypes``), list for list and score for score, on every query without
    a near tie that an fp32 accumulation order may decide.  Tie rules: equal approximate
    scores at the candidate cut go to the lower id; equal exact scores (the duplicated
    documents) keep fast-plaid's order, by approximate score then id after a cut, by id
    without one.  d = 128 sums the norm as 4-vectors, d = 96 element by element (PyTorch's two
    row reductions).  Every cell is probed (the probe's cut is the tests above): the candidate
    cut and the exact scores are what this compares."""
    g = torch.Generator().manual_seed(3)
    topics = _unit(torch.randn(6, 3, dim, generator=g))
    docs = [_unit(topics[j % 6][torch.randint(0, 3, (n,), generator=g)] + 0.5 * torch.randn(n, dim, generator=g))
            for j, n in enumerate(torch.randint(2, 14, (18,), generator=g).tolist())]
    docs += [docs[j].clone() for j in range(0, 18, 3)]                   # exact ties
    write_index(str(tmp_path), docs, nbits=2, n_centroids=16)
    queries = _unit(topics[torch.arange(n_queries) % 6][:, torch.randint(0, 3, (8,), generator=g)]
                    + 0.4 * torch.randn(n_queries, 8, dim, generator=g))
    index = ps.load_fast_plaid_index(str(tmp_path), "cpu")
    # the best 5 approximate scores of the 24 documents kept
    scores, ids = ps.plaid_search(index, queries, 4, n_ivf_probe=16, n_full_scores=20)
    oracle, unsure = search_fast_plaid_dtypes(str(tmp_path), queries, 4, 16, 20)
    plain = search_float64(str(tmp_path), queries, 4, 16, 20)
    sure = [q for q in range(n_queries) if not unsure[q]]
    assert len(sure) >= 0.6 * n_queries
    for q in sure:
        assert [(p, s) for p, s in zip(ids[q].tolist(), scores[q].tolist())] == oracle[q], q
    # the tie rule was exercised, and the roundings matter (float64 scores order some lists otherwise)
    assert any(len({s for _, s in oracle[q]}) < len(oracle[q]) for q in sure)
    assert any([p for p, _ in plain[q]] != [p for p, _ in oracle[q]] for q in sure)


def test_search_subset_and_few_candidates(index_dir, triton_backend):
    path, queries = index_dir
    index = ps.load_fast_plaid_index(path, "cpu")
    subset = [list(range(q, 48, 3)) for q in range(3)] + [[], [7]]
    # n_full_scores 4: one document scored exactly, so each query returns at most one result
    for n_full, k in ((40, 3), (4, 3)):
        scores, ids = ps.plaid_search(index, queries, k, n_ivf_probe=3, n_full_scores=n_full, subset=subset)
        oracle = search_float64(path, queries, k, 3, n_full, subset)
        kept = [[(p, s) for p, s in zip(i, sc) if s != float("-inf")] for i, sc in zip(ids.tolist(), scores.tolist())]
        for got, allowed in zip(kept, subset):
            assert all(p in allowed for p, _ in got)
        assert _agree([[p for p, _ in r] for r in kept], [[s for _, s in r] for r in kept], oracle) >= 4
    assert kept[3] == []                                            # an empty subset finds nothing


def test_index_reloaded_when_rewritten(tmp_path, triton_backend):
    g = torch.Generator().manual_seed(1)
    docs = [_unit(torch.randn(5, 16, generator=g)) for _ in range(6)]
    write_index(str(tmp_path), docs, nbits=4, n_centroids=4)
    first = ps.load_fast_plaid_index(str(tmp_path), "cpu")
    write_index(str(tmp_path), docs[:4], nbits=4, n_centroids=4)
    os.utime(tmp_path / "metadata.json", ns=(1, os.stat(tmp_path / "metadata.json").st_mtime_ns + 10**9))
    second = ps.load_fast_plaid_index(str(tmp_path), "cpu")
    assert second is not first and second.n_docs == 4


# --------------------------------------------------------------------------- PyLate


@pytest.fixture
def pylate_plaid(tmp_path, monkeypatch):
    """PyLate's PLAID over the stand-in fast_plaid, documents encoded by the tiny offline ColBERT."""
    pytest.importorskip("pylate")
    monkeypatch.syspath_prepend(fast_plaid_files.STUB_PATH)
    for name in [n for n in sys.modules if n == "fast_plaid" or n.startswith("fast_plaid.")
                 or n == "pylate.indexes.fast_plaid"]:
        monkeypatch.delitem(sys.modules, name)
    from pylate import indexes, models, retrieve

    from support.pylate_tiny import WORDS, save_tiny_encoder

    model = models.ColBERT(model_name_or_path=save_tiny_encoder(str(tmp_path / "model")), device="cpu",
                           embedding_size=16, query_length=8, document_length=16)
    g = torch.Generator().manual_seed(2)
    docs = [" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (int(n),), generator=g))
            for n in torch.randint(3, 14, (24,), generator=g)]
    index = indexes.PLAID(index_folder=str(tmp_path / "indexes"), index_name="tiny", override=True, nbits=2,
                          device="cpu", show_progress=False, n_full_scores=64, n_ivf_probe=4)
    index.add_documents(documents_ids=[f"d{i}" for i in range(len(docs))],
                        documents_embeddings=model.encode(docs, is_query=False, show_progress_bar=False))
    queries = model.encode(["the cat and the dog", "a river in the city", "fast kernel score"], is_query=True,
                           show_progress_bar=False)
    yield retrieve.ColBERT(index=index), index, queries
    from lik_plugins.pylate import unpatch_pylate

    unpatch_pylate()
    # the stand-in must not outlive this test (a later patch_pylate() would find it)
    for name in [n for n in sys.modules if n == "fast_plaid" or n.startswith("fast_plaid.")
                 or n == "pylate.indexes.fast_plaid"]:
        del sys.modules[name]
    if hasattr(sys.modules["pylate.indexes"], "fast_plaid"):
        delattr(sys.modules["pylate.indexes"], "fast_plaid")


def test_pylate_plaid_patched(pylate_plaid, monkeypatch):
    from lik_plugins.pylate import patch_pylate, unpatch_pylate

    retriever, index, queries = pylate_plaid
    monkeypatch.delenv("LIK_BACKEND", raising=False)
    monkeypatch.delenv("LIK_DISABLE", raising=False)
    theirs = retriever.retrieve(queries_embeddings=queries, k=5)
    fast_plaid = index._index.fast_plaid
    original = type(fast_plaid).search
    patch_pylate()
    assert type(fast_plaid).search is not original

    # a CPU index: fast-plaid serves, same results, the reason counted
    reset_routing_counts()
    assert retriever.retrieve(queries_embeddings=queries, k=5) == theirs
    assert routing_counts()["fast_plaid.search"] == {"original": 1}
    assert routing_reasons()["fast_plaid.search"]["a CPU index (fast-plaid's CPU search)"] == 1

    # PyLate's id mappings: unpickled once while unchanged, inside retrieval only
    import pylate.indexes.fast_plaid as pylate_fast_plaid

    loads = []
    real_load = pylate_fast_plaid.pickle.load
    monkeypatch.setattr(pylate_fast_plaid.pickle, "load", lambda fh: loads.append(1) or real_load(fh))
    assert retriever.retrieve(queries_embeddings=queries, k=5) == theirs
    assert len(loads) == 0                                     # the call above cached both
    wrapper = index._index
    assert wrapper._load_plaid_ids_to_documents_ids() is not wrapper._load_plaid_ids_to_documents_ids()
    assert len(loads) == 2                                     # outside a search: PyLate's loader
    monkeypatch.setattr(pylate_fast_plaid.pickle, "load", real_load)

    # ours (the kernels under the interpreter): same search, fast-plaid not called
    monkeypatch.setenv("LIK_BACKEND", "triton")
    calls = fast_plaid.searches
    reset_routing_counts()
    ours = retriever.retrieve(queries_embeddings=queries, k=5)
    assert routing_counts()["fast_plaid.search"] == {"triton": 1}
    assert fast_plaid.searches == calls and all(v is None for v in fast_plaid.indices.values())
    assert [[r["id"] for r in q] for q in ours] and all(isinstance(r["score"], float) for q in ours for r in q)
    oracle = [[(int(r["id"][1:]), r["score"]) for r in q] for q in theirs]
    got = [[int(r["id"][1:]) for r in q] for q in ours]
    assert _agree(got, [[r["score"] for r in q] for q in ours], oracle) >= 2
    # subset, as PyLate passes it (document ids mapped to fast-plaid's)
    sub = retriever.retrieve(queries_embeddings=queries, k=5, subset=["d1", "d2", "d3", "d9"])
    assert all(r["id"] in {"d1", "d2", "d3", "d9"} for q in sub for r in q)

    # the kill switch: fast-plaid's own search again
    monkeypatch.setenv("LIK_DISABLE", "1")
    reset_routing_counts()
    assert retriever.retrieve(queries_embeddings=queries, k=5) == theirs
    assert routing_counts()["fast_plaid.search"] == {"original": 1}

    unpatch_pylate()
    assert type(fast_plaid).search is original


# --------------------------------------------------------------------------- CUDA
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_search_on_cuda_equals_fast_plaids_roundings(tmp_path):
    """The compiled kernels at a realistic size (600 documents of 20-120 tokens and 60
    duplicates, 256 centroids, 300 queries of 32 tokens): scores within ``SCORE_TOL`` of the
    float64 oracle; lists and scores equal to ``search_fast_plaid_dtypes`` on every query
    without a near tie; and each returned score equal to fast-plaid's own torch ops replayed on
    this GPU (its norm's reduction order, cuBLAS's fp16 similarities) -- all but a few, which
    an fp32 accumulation order moves by one fp16 step of one similarity."""
    g = torch.Generator().manual_seed(0)
    topics = _unit(torch.randn(32, 8, 128, generator=g))
    docs = []
    for j in range(600):
        n = int(torch.randint(20, 120, (1,), generator=g))
        docs.append(_unit(topics[j % 32][torch.randint(0, 8, (n,), generator=g)] + 0.3 * torch.randn(n, 128, generator=g)))
    docs += [docs[j].clone() for j in range(0, 600, 10)]                 # exact ties
    write_index(str(tmp_path), docs, nbits=2, n_centroids=256)
    queries = _unit(topics[torch.arange(300) % 32][:, torch.randint(0, 8, (32,), generator=g)]
                    + 0.3 * torch.randn(300, 32, 128, generator=g))
    index = ps.load_fast_plaid_index(str(tmp_path), "cuda")
    scores, ids = ps.plaid_search(index, queries.cuda(), 10, n_ivf_probe=8, n_full_scores=400)
    scores, ids = scores.cpu(), ids.cpu()
    plain = search_float64(str(tmp_path), queries, 10, 8, 400)
    assert all(len(want) == 10 for want in plain)
    _agree(ids.tolist(), scores.tolist(), plain)
    oracle, unsure = search_fast_plaid_dtypes(str(tmp_path), queries, 10, 8, 400)
    sure = [q for q in range(300) if not unsure[q]]
    assert len(sure) >= 50       # the duplicated documents put most queries near a tie the oracle flags
    for q in sure:
        # the ids exactly; a score may sit one fp16 step of one similarity away (the tensor
        # cores' fp32 accumulation order against the oracle's exact products)
        assert ids[q].tolist() == [p for p, _ in oracle[q]], q
        assert max(abs(s - w) for s, (_, w) in zip(scores[q].tolist(), oracle[q])) <= 2.0 ** -10, q
    replayed = torch.tensor([replay_exact_scores(str(tmp_path), queries[q], ids[q].tolist(), "cuda")
                             for q in range(0, 300, 3)])
    ours = scores[::3]
    assert (replayed - ours).abs().max() <= 2.0 ** -10
    assert (replayed == ours).float().mean() >= 0.99
