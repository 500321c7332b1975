"""Names shared with late-interaction-kernels 0.4.5 mean what they mean there (issue 37):
``maxsim_from_hidden(normalize=True)`` normalises the projected documents only, the residual
ops normalise both the queries and the decompressed documents.  Checked on the chunked path
and the Triton kernels (interpreter) with queries that are not unit length, where the two
meanings differ in scores and in the gradient into ``Q``."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lik_plugins as lik
from lik_plugins.kernels import reference
from support.maxsim_testlib import backend_params, rel_err

BACKENDS = backend_params()


def _hidden_inputs(gen):
    Q = torch.randn(3, 5, 16, generator=gen) * 3                 # far from unit length
    H = torch.randn(4, 9, 24, generator=gen)
    W = torch.randn(16, 24, generator=gen) / 5
    b = torch.randn(16, generator=gen) / 5
    dm = torch.rand(4, 9, generator=gen) > 0.2
    return Q, H, W, b, dm


@pytest.mark.parametrize("backend", BACKENDS)
def test_maxsim_from_hidden_normalises_the_documents_only(gen, monkeypatch, backend):
    monkeypatch.setenv("LIK_BACKEND", backend)
    Q, H, W, b, dm = _hidden_inputs(gen)
    Q.requires_grad_()
    out = lik.maxsim_from_hidden(Q, H, W, b, dm, normalize=True)
    w = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    (gq,) = torch.autograd.grad((out.double() * w).sum(), Q)
    # the peer's documented equivalent: F.linear -> F.normalize on D -> maxsim(Q, D, d_mask)
    Q64 = Q.detach().double().requires_grad_()
    docs = F.normalize(F.linear(H.double(), W.double(), b.double()), dim=-1)
    want = reference.maxsim(Q64, docs, None, dm)
    (want_gq,) = torch.autograd.grad((want * w).sum(), Q64)
    assert rel_err(out, want) < 1e-5 and rel_err(gq, want_gq) < 1e-5
    # scores are linear in Q (no normalisation of it): 2 Q scores twice
    with torch.no_grad():
        assert rel_err(lik.maxsim_from_hidden(2 * Q, H, W, b, dm), 2 * out.detach()) < 1e-5
    # the other meaning (queries normalised too) is far from these scores
    both = reference.maxsim(F.normalize(Q64.detach(), dim=-1), docs, None, dm)
    assert rel_err(both, want) > 0.1
    # one query as [Lq, d], as the peer takes it: [Nd] scores, that query's row
    with torch.no_grad():
        one = lik.maxsim_from_hidden(Q[1], H, W, b, dm)
    assert one.shape == (4,) and rel_err(one, want[1]) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "varlen"])
def test_residual_ops_normalise_queries_and_documents(gen, monkeypatch, backend, packed):
    monkeypatch.setenv("LIK_BACKEND", backend)
    d, nbits, nd, ld = 16, 2, 5, 11
    centroids = torch.randn(8, d, generator=gen)
    weights = torch.randn(1 << nbits, generator=gen) * 0.2
    lengths = torch.tensor([11, 4, 0, 1, 7])
    codes = torch.randint(0, 8, (nd, ld), generator=gen, dtype=torch.int32)
    residuals = reference.pack_buckets(torch.randint(0, 1 << nbits, (nd * ld, d), generator=gen), nbits)
    residuals = residuals.view(nd, ld, -1)
    Q = (torch.randn(2, 6, d, generator=gen) * 3).requires_grad_()

    def score(q):
        if not packed:
            return lik.maxsim_residual(q, codes, residuals, lengths, centroids, weights, nbits)
        keep = reference.lengths_mask(lengths, ld)
        cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(torch.int32)
        return lik.maxsim_residual_varlen(q, codes[keep], residuals[keep], cu, centroids, weights, nbits)

    out = score(Q)
    want = reference.maxsim_residual(Q.detach().double(), codes, residuals, lengths, centroids.double(),
                                     weights.double(), nbits)
    assert rel_err(out, want) < 1e-5
    with torch.no_grad():                                 # invariant to the queries' scale
        assert rel_err(score(Q * 5), out.detach()) < 1e-5
    # the gradient goes through the queries' normalisation: orthogonal to each query token
    (gq,) = torch.autograd.grad(out.sum(), Q)
    radial = (gq.double() * Q.detach().double()).sum(-1) / Q.detach().double().norm(dim=-1)
    assert radial.abs().max() < 1e-5 * gq.abs().max() and gq.abs().max() > 0
