"""The unified backward with its fp32 grad_D buffer bounded: documents are scattered
slab by slab and grad_Q gets its own gather pass.  Must equal the one-pass result."""
import pytest
import torch

import lik_plugins as lik
from lik_plugins.kernels import reference
from lik_plugins.kernels.triton import launch
from maxsim_testlib import LaunchSpy


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
    monkeypatch.setattr(launch, "UNIFIED_BUFFER_BYTES", 7 * 16 * 4 * 2)
    out = lik.maxsim(Q, D, qm, dm, normalize=normalize, backward="unified", mask_mode="zero")
    gq, gd = torch.autograd.grad(out, (Q, D), grad)
    q64, d64 = Q.detach().double().requires_grad_(), D.detach().double().requires_grad_()
    ref = reference.maxsim(q64, d64, qm, dm, normalize=normalize, mask_mode="zero")
    rq, rd = torch.autograd.grad(ref, (q64, d64), grad.double())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for got, want in ((out, ref), (gq, rq), (gd, rd)):
        assert (got.double() - want).abs().max() <= tol * want.abs().max()
    assert torch.equal(gd[2], torch.zeros_like(gd[2]))  # fully masked document: exact zeros


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("need_q", [True, False])
def test_ring_unified_matches_reference(monkeypatch, normalize, dtype, need_q):
    """The one-launch ring (two slots of two documents, three slabs).  The interpreter runs
    programs one after another, so it serves the ring only with one program (one query
    of <= 32 tokens); the GPU suite covers many programs meeting at the barrier."""
    monkeypatch.setenv("LIK_BACKEND", "triton")
    spy = LaunchSpy(launch.maxsim_bwd_ring_kernel)
    monkeypatch.setattr(launch, "maxsim_bwd_ring_kernel", spy)
    monkeypatch.setattr(launch, "RING_SLABS", 3)
    monkeypatch.setattr(launch, "RING_ENABLED", True)  # off by default: wrong on the GPU (launch.py)
    g = torch.Generator().manual_seed(11)
    Q = torch.randn(1, 5, 16, generator=g).to(dtype).requires_grad_(need_q)
    D = torch.randn(5, 7, 16, generator=g).to(dtype).requires_grad_()
    qm = torch.rand(1, 5, generator=g) > 0.3
    qm[0, 0] = True
    dm = torch.rand(5, 7, generator=g) > 0.3
    dm[3] = False
    grad = torch.randn(1, 5, generator=g)
    out = lik.maxsim(Q, D, qm, dm, normalize=normalize, backward="unified")
    inputs = (Q, D) if need_q else (D,)
    grads = torch.autograd.grad(out, inputs, grad)
    leaves = [t.detach().double().requires_grad_() for t in (Q, D)]
    ref = reference.maxsim(*leaves, qm, dm, normalize=normalize)
    want = torch.autograd.grad(ref, leaves if need_q else leaves[1:], grad.double())
    # fp32 without normalisation scatters straight into grad_D: no buffer, no ring
    assert spy.launches == (0 if dtype == torch.float32 and not normalize else 1)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for got, ref_grad in zip(grads, want):
        assert (got.double() - ref_grad).abs().max() <= tol * ref_grad.abs().max()
    assert torch.equal(grads[-1][3], torch.zeros_like(grads[-1][3]))  # fully masked document
