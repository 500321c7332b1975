"""Packed launches replayed with new counts and lengths (GPU).

The packed forward, backward and input-check launches replay their compiled binary under a
key that leaves out the unspecialised integers (query and document counts, pair counts,
length bounds: ``kernels/triton/launch.py``, ``checks.py``).  A call whose counts differ from
the call that built the plan must still compute its own scores and gradients: each call here
changes them and is checked against the fp64 reference.
"""
from __future__ import annotations

import pytest
import torch

import lik_plugins as lik
from lik_plugins.kernels import reference
from support.maxsim_testlib import rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEVICE = "cuda"
TOL = (1e-2, 4e-2)   # bf16: scores, gradients (relative max-norm against fp64)


def _packed(g, lengths, d=128):
    seqs = [torch.randn(n, d, generator=g, device=DEVICE).bfloat16() for n in lengths]
    return lik.pack(seqs)


def _lengths(g, n, lo, hi):
    return torch.randint(lo, hi + 1, (n,), generator=g, device=DEVICE).tolist()


def test_cross_product_training_with_changing_counts():
    g = torch.Generator(device=DEVICE).manual_seed(0)
    for nq, nd, (lo, hi) in ((6, 9, (20, 90)), (11, 5, (1, 200)), (3, 17, (40, 60))):
        Qp, cu_q, mq = _packed(g, _lengths(g, nq, 1, 32))
        Dp, cu_d, md = _packed(g, _lengths(g, nd, lo, hi))
        Qp.requires_grad_()
        Dp.requires_grad_()
        Q64 = Qp.detach().double().requires_grad_()
        D64 = Dp.detach().double().requires_grad_()
        out = lik.maxsim_varlen(Qp, Dp, cu_q, cu_d, mq, md)
        want = reference.maxsim_varlen(Q64, D64, cu_q, cu_d)
        assert out.shape == (nq, nd) and rel_err(out, want) < TOL[0]
        w = torch.randn(out.shape, generator=g, device=DEVICE, dtype=torch.float64)
        got = torch.autograd.grad((out.double() * w).sum(), (Qp, Dp))
        ref = torch.autograd.grad((want * w).sum(), (Q64, D64))
        assert all(rel_err(a, b) < TOL[1] for a, b in zip(got, ref))


def test_pair_lists_and_reranks_with_changing_counts():
    g = torch.Generator(device=DEVICE).manual_seed(1)
    for nq, nd, n_pairs in ((4, 30, 50), (7, 12, 333), (2, 90, 7)):
        Qp, cu_q, mq = _packed(g, _lengths(g, nq, 8, 32))
        Dp, cu_d, md = _packed(g, _lengths(g, nd, 1, 250))
        pq = torch.randint(0, nq, (n_pairs,), generator=g, device=DEVICE)
        pd = torch.randint(0, nd, (n_pairs,), generator=g, device=DEVICE)
        with torch.no_grad():
            out = lik.score_pairs_packed(Qp, Dp, cu_q, cu_d, pq, pd, max_seqlen_q=mq, max_seqlen_d=md)
            rerank = lik.maxsim_varlen(Qp, Dp, cu_q, cu_d, mq, md)
        Q64, D64 = Qp.double(), Dp.double()
        assert rel_err(out, reference.score_pairs_packed(Q64, D64, cu_q, cu_d, pq, pd)) < TOL[0]
        assert rel_err(rerank, reference.maxsim_varlen(Q64, D64, cu_q, cu_d)) < TOL[0]
