"""Parity of the patched ``util.maxsim`` / ``maxsim_pairwise`` on lists with sentence-transformers
6's own (unpatched) on 16-bit embeddings: the same fp32 scores bit for bit, hence the same
rankings, ties included.

ST's einsum rounds every similarity to the embeddings' dtype, takes the max over the valid
document tokens, casts the maxima to fp32 and sums them (no final rounding: fp32 scores);
the listed kernel rounds each row's max before its fp32 sum (``round_maxima``).  Left: a
similarity within fp32 accumulation error of a 16-bit rounding midpoint may round the other
way (the matrix products add in different orders), moving one score by one 16-bit step of
that row's max -- rare, and counted here.  The Triton kernel runs under the interpreter
(``TRITON_INTERPRET=1``), with more than 16 queries and more than 128 documents."""
from __future__ import annotations

import os

import pytest

st = pytest.importorskip("sentence_transformers")
if int(st.__version__.split(".")[0]) < 6:
    pytest.skip("needs sentence-transformers 6", allow_module_level=True)

import torch  # noqa: E402

from lik_plugins import reset_routing_counts, routing_counts  # noqa: E402
from lik_plugins.sentence_transformers import patch_sentence_transformers, unpatch_sentence_transformers  # noqa: E402
from support.maxsim_testlib import unit_token_lists  # noqa: E402


@pytest.mark.parametrize("dtype, nq, nd, dim", [
    (torch.float16, 3, 9, 32), (torch.bfloat16, 3, 9, 32), (torch.bfloat16, 17, 130, 16)])
def test_maxsim_on_lists_equals_sts_own(monkeypatch, dtype, nq, nd, dim):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernels on CPU need TRITON_INTERPRET=1")
    from sentence_transformers import util

    qs = unit_token_lists(nq, 5, 30 if nq < 16 else 12, dim, nq, dtype)
    ds = unit_token_lists(nd, 1, 40 if nd < 128 else 20, dim, nd, dtype, shift=0.1)
    for j in range(7, nd, 11):          # exact copies: tied scores
        ds[j] = ds[2].clone()
    unpatch_sentence_transformers()
    host, host_pairs = util.maxsim(qs, ds), util.maxsim_pairwise(qs, ds[:nq])
    monkeypatch.setenv("LIK_BACKEND", "triton")
    patch_sentence_transformers()
    try:
        reset_routing_counts()
        ours, ours_pairs = util.maxsim(qs, ds), util.maxsim_pairwise(qs, ds[:nq])   # the patched names
        counts = routing_counts()
    finally:
        unpatch_sentence_transformers()
    assert counts["sentence_transformers.maxsim_lists"] == {"triton": 1}
    assert counts["sentence_transformers.maxsim_pairwise_lists"] == {"triton": 1}
    assert ours.dtype == host.dtype == torch.float32 and ours.shape == host.shape == (nq, nd)
    assert torch.equal(ours_pairs, host_pairs)
    off = ours != host
    assert int(off.sum()) <= max(1, host.numel() // 200)
    # a differing score is one 16-bit step of one row's max away (that max is at most 1 here)
    assert bool(((ours - host).abs() <= torch.finfo(dtype).eps)[off].all())
    same_rows = ~off.any(dim=1)
    assert int(same_rows.sum()) >= nq - 1
    order = lambda s: torch.sort(s, dim=1, descending=True, stable=True).indices   # noqa: E731
    assert torch.equal(order(ours[same_rows]), order(host[same_rows]))
    assert any(len(set(row.tolist())) < nd for row in host)       # ties, ordered alike
