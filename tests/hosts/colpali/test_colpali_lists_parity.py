"""Parity of the patched ``score_multi_vector`` on lists with colpali-engine's own (its torch
backend, unpatched) on 16-bit embeddings: the same scores bit for bit, hence the same
rankings, ties included (identical values sort alike under any deterministic sort).

colpali's einsum rounds every similarity to the embeddings' dtype, takes the max (its zero
padding per ``batch_size`` chunk included), sums over the query tokens in fp32, rounds the
sum to the dtype and returns it as fp32; the listed kernel rounds each row's max before its
fp32 sum (``round_maxima``), the adapter rounds the sum.  Left: a similarity within fp32
accumulation error of a 16-bit rounding midpoint may round the other way (the matrix
products add in different orders), moving that one score by one 16-bit step -- rare, and
counted here.  The Triton kernel runs under the interpreter (``TRITON_INTERPRET=1``), with
more than 16 queries and more than 128 passages over several chunks."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("colpali_engine")

import lik_plugins  # noqa: E402
from colpali_engine.utils.processing_utils import BaseVisualRetrieverProcessor as Base  # noqa: E402
from support.maxsim_testlib import unit_token_lists  # noqa: E402


@pytest.mark.parametrize("dtype, nq, n_p, batch_size, dim", [
    (torch.float16, 3, 9, 4, 32), (torch.bfloat16, 3, 9, 4, 32), (torch.bfloat16, 17, 130, 50, 16)])
def test_score_multi_vector_lists_equal_colpalis_own(monkeypatch, dtype, nq, n_p, batch_size, dim):
    from lik_plugins._config import triton_interpret

    if not triton_interpret():
        pytest.skip("the Triton kernels on CPU need TRITON_INTERPRET=1")
    qs = unit_token_lists(nq, 5, 30 if nq < 16 else 12, dim, nq, dtype)
    # shifted passages: rows whose similarities are all negative, won by colpali's chunk padding
    ps = unit_token_lists(n_p, 1, 40 if n_p < 128 else 20, dim, n_p, dtype, shift=0.1)
    for j in range(7, n_p, 11):         # exact copies: tied scores
        ps[j] = ps[2].clone()
    monkeypatch.setenv("COLPALI_SCORES_BACKEND", "torch")
    host = Base.score_multi_vector(qs, ps, batch_size=batch_size, device="cpu")
    monkeypatch.delenv("COLPALI_SCORES_BACKEND")
    monkeypatch.setenv("LIK_BACKEND", "triton")
    lik_plugins.reset_routing_counts()
    lik_plugins.patch_colpali_engine()
    try:
        ours = Base.score_multi_vector(qs, ps, batch_size=batch_size, device="cpu")
    finally:
        lik_plugins.unpatch_colpali_engine()
    assert lik_plugins.routing_counts()["colpali.score_multi_vector"] == {"triton": 1}
    assert ours.dtype == host.dtype == torch.float32 and ours.shape == host.shape == (nq, n_p)
    off = ours != host
    assert int(off.sum()) <= max(1, host.numel() // 200)
    # a differing score is one step of the 16-bit grid away (the host's scores are on it)
    step = torch.finfo(dtype).eps * host.abs()
    assert bool(((ours - host).abs() <= step)[off].all())
    same_rows = ~off.any(dim=1)
    assert int(same_rows.sum()) >= nq - 1
    order = lambda s: torch.sort(s, dim=1, descending=True, stable=True).indices   # noqa: E731
    assert torch.equal(order(ours[same_rows]), order(host[same_rows]))
    # ties beyond the copies: the 16-bit sums put distinct passages on one value
    assert any(len(set(row.tolist())) < n_p for row in host)
