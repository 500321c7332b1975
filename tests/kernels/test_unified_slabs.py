"""The unified backward with its fp32 grad_D buffer bounded: documents are scattered
slab by slab and grad_Q gets its own gather pass.  Must equal the one-pass result."""
import pytest
import torch

import lik_plugins as lik
from lik_plugins.kernels import reference
from lik_plugins.kernels.triton import backward_launch


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slabbed_unified_matches_reference(monkeypatch, normalize, dtype):
    monkeypatch.setenv("LIK_BACKEND", "triton")
    g = torch.Generator().manual_seed(7)
    Q = torch.randn(3, 5, 16, generator=g).to(dtype).requires_grad_()
    D = torch.randn(5, 7, 16, generator=g).to(dtype).requires_grad_()
    qm = torch.rand(3, 5, generator=g) > 0.3
    dm = torch.rand(5, 7, generator=g) > 0.3
    dm[2] = False
    grad = torch.randn(3, 5, generator=g)
    # a buffer of two documents: three slabs (2 + 2 + 1)
    monkeypatch.setattr(backward_launch, "UNIFIED_BUFFER_BYTES", 7 * 16 * 4 * 2)
    out = lik.maxsim(Q, D, qm, dm, normalize=normalize, backward="unified", mask_mode="zero")
    gq, gd = torch.autograd.grad(out, (Q, D), grad)
    q64, d64 = Q.detach().double().requires_grad_(), D.detach().double().requires_grad_()
    ref = reference.maxsim(q64, d64, qm, dm, normalize=normalize, mask_mode="zero")
    rq, rd = torch.autograd.grad(ref, (q64, d64), grad.double())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for got, want in ((out, ref), (gq, rq), (gd, rd)):
        assert (got.double() - want).abs().max() <= tol * want.abs().max()
    assert torch.equal(gd[2], torch.zeros_like(gd[2]))  # fully masked document: exact zeros
