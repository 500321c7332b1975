"""Ranking parity of the patched ``pylate.rank.rerank`` with PyLate's own loop (its ``torch``
backend, unpatched) on 16-bit embeddings: the same scores bit for bit, hence the same
rankings, ties included (both sort identical values with the same ``torch.sort`` call).

PyLate's einsum rounds every similarity to the embeddings' dtype, takes the max (padding
included), sums in fp32 and rounds the sum to the dtype; the listed kernel rounds each row's
max before its fp32 sum (``round_maxima``) and the adapter rounds the sum.  The one
difference left: a similarity whose exact value lies within fp32 accumulation error of a
rounding midpoint of the 16-bit grid can round the other way (the two matrix products add
in different orders), moving that row's max, and at most that candidate's score, by one
16-bit step -- rare, and counted here.  Runs the Triton kernel under the interpreter
(``TRITON_INTERPRET=1``), at sizes past one query block (> 16 queries) and a list of more
than 128 candidates."""
from __future__ import annotations

import pytest

pytest.importorskip("pylate")

import torch  # noqa: E402

from lik_plugins import reset_routing_counts, routing_counts  # noqa: E402
from lik_plugins.pylate import patch_pylate, unpatch_pylate  # noqa: E402


def _corpus(seed, counts, dim, dtype, q_len=(4, 33), d_len=(1, 40), shift=0.1):
    g = torch.Generator().manual_seed(seed)
    unit = torch.nn.functional.normalize

    def tokens(lo, hi, offset):
        n = int(torch.randint(lo, hi, (1,), generator=g))
        return (unit(torch.randn(n, dim, generator=g), dim=-1) - offset).to(dtype)

    queries = [tokens(*q_len, 0.0) for _ in counts]
    # shifted: a share of the rows' similarities all negative, so PyLate's zero padding wins them
    docs = [[tokens(*d_len, shift) for _ in range(n)] for n in counts]
    for group in docs[:3]:               # exact copies: tied scores, whose order torch.sort decides
        for j in range(5, len(group), 17):
            group[j] = group[3].clone()
    ids = [[f"q{i}-d{j}" for j in range(n)] for i, n in enumerate(counts)]
    return ids, queries, docs


def _host_and_ours(monkeypatch, ids, queries, docs):
    from pylate import rank

    unpatch_pylate()
    monkeypatch.setenv("PYLATE_SCORES_BACKEND", "torch")
    host = rank.rerank(ids, queries, docs)
    monkeypatch.delenv("PYLATE_SCORES_BACKEND")
    monkeypatch.setenv("LIK_BACKEND", "triton")
    patch_pylate()
    try:
        reset_routing_counts()
        ours = rank.rerank(ids, queries, docs)
        counts = routing_counts()
    finally:
        unpatch_pylate()
    return host, ours, counts


@pytest.fixture
def interpreted(monkeypatch):
    from lik_plugins._config import triton_interpret

    if not triton_interpret():
        pytest.skip("the Triton kernels on CPU need TRITON_INTERPRET=1")
    for var in ("PYLATE_SCORES_BACKEND", "LIK_DISABLE", "LIK_PATCH"):
        monkeypatch.delenv(var, raising=False)
    yield
    unpatch_pylate()


def _compare(host, ours, dtype):
    """(candidates whose score differs, candidates): every list whose scores all equal PyLate's
    is PyLate's ranking, ties in its order; a differing score is one 16-bit step off."""
    step = torch.finfo(dtype).eps
    differ = total = ties = 0
    for mine, theirs in zip(ours, host):
        by_id = {r["id"]: r["score"] for r in theirs}
        assert sorted(by_id) == sorted(r["id"] for r in mine)
        off = [(r["score"], by_id[r["id"]]) for r in mine if r["score"] != by_id[r["id"]]]
        for got, want in off:
            assert abs(got - want) <= step * abs(want)
        if not off:
            assert [(r["id"], r["score"]) for r in mine] == [(r["id"], r["score"]) for r in theirs]
            scores = list(by_id.values())
            ties += len(scores) - len(set(scores))
        differ += len(off)
        total += len(mine)
    assert ties > 0          # the case has ties (copies, and 16-bit sums), ordered as PyLate's
    return differ, total


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("counts, dim", [((20, 11, 16), 16), ((140,) + (6,) * 16, 32)])
def test_rerank_scores_and_rankings_equal_pylates_own(interpreted, monkeypatch, dtype, counts, dim):
    ids, queries, docs = _corpus(len(counts) * 1000 + counts[0], counts, dim, dtype)
    host, ours, routed = _host_and_ours(monkeypatch, ids, queries, docs)
    assert routed["pylate.rerank"] == {"triton": 1}
    differ, total = _compare(host, ours, dtype)
    assert differ <= total // 200


def test_rerank_with_long_queries_in_several_row_chunks(interpreted, monkeypatch):
    # queries past one 128-row block: each chunk's fp32 partial sum of rounded maxima is exact
    ids, queries, docs = _corpus(7, (14, 14), 16, torch.bfloat16, q_len=(130, 200), d_len=(1, 70))
    host, ours, _ = _host_and_ours(monkeypatch, ids, queries, docs)
    differ, total = _compare(host, ours, torch.bfloat16)
    assert differ <= total // 50
