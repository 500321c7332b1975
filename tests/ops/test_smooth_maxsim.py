"""``smooth_maxsim`` (the op behind colpali's ``use_smooth_max``): chunked torch path and the
fused Triton kernel (under ``TRITON_INTERPRET=1`` on CPU) against the float64 reference,
forward and gradients, all three layouts, zero-padded rows, odd sizes.  The colpali heads
that call it are tested in tests/hosts/colpali; its CUDA kernel under torch.compile in
test_compile.py."""
from __future__ import annotations

import pytest
import torch

from lik_plugins import smooth_maxsim
from lik_plugins.kernels.reference import smooth_maxsim as smooth_maxsim_reference
from support.maxsim_testlib import _triton_interpretable

SHAPES = [
    # layout, Q shape, D shape
    ("cross", (3, 7, 20), (4, 70, 20)),        # two document tiles, d not a power of two
    ("cross", (2, 1, 16), (3, 1, 16)),         # Lq = Ld = 1
    ("cross", (9, 5, 8), (2, 11, 8)),          # more queries than one query block
    ("candidates", (3, 6, 20), (3, 2, 67, 20)),
    ("pairs", (4, 6, 12), (4, 9, 12)),
]


def _inputs(qs, ds, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    Q = torch.randn(*qs, generator=g, dtype=torch.float64)
    D = torch.randn(*ds, generator=g, dtype=torch.float64)
    Q[:, -1:] = 0  # colpali's zero padding: contributes tau * log(Ld)
    D[..., -2:, :] = 0 if D.shape[-2] > 2 else D[..., -2:, :]
    return Q.to(dtype), D.to(dtype)


def _check(layout, qs, ds, dtype, tau, atol):
    Q, D = _inputs(qs, ds, dtype, seed=sum(qs) + sum(ds))
    Q64, D64 = (t.detach().double().requires_grad_() for t in (Q, D))
    ref = smooth_maxsim_reference(Q64, D64, tau=tau, layout=layout)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    rq, rd = torch.autograd.grad(ref, (Q64, D64), g)
    Qx, Dx = Q.clone().requires_grad_(), D.clone().requires_grad_()
    out = smooth_maxsim(Qx, Dx, tau=tau, layout=layout)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    oq, od = torch.autograd.grad(out, (Qx, Dx), g.float())
    assert oq.dtype == dtype and od.dtype == dtype
    scale = max(1.0, ref.abs().max().item())
    torch.testing.assert_close(out.double(), ref, atol=atol * scale, rtol=0)
    torch.testing.assert_close(oq.double(), rq, atol=atol * max(1.0, rq.abs().max().item()), rtol=0)
    torch.testing.assert_close(od.double(), rd, atol=atol * max(1.0, rd.abs().max().item()), rtol=0)


@pytest.mark.parametrize("layout,qs,ds", SHAPES)
@pytest.mark.parametrize("tau", [0.1, 0.02])
def test_chunked_matches_reference(monkeypatch, layout, qs, ds, tau):
    monkeypatch.setenv("LIK_BACKEND", "torch-chunked")
    monkeypatch.setenv("LIK_CHUNK_ELEMENTS", "97")  # many tiny chunks
    _check(layout, qs, ds, torch.float32, tau, atol=2e-5)


@pytest.mark.parametrize("layout,qs,ds", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.skipif(not _triton_interpretable(), reason="needs triton and TRITON_INTERPRET=1")
def test_triton_matches_reference(monkeypatch, layout, qs, ds, dtype):
    monkeypatch.setenv("LIK_BACKEND", "triton")
    _check(layout, qs, ds, dtype, 0.1, atol=2e-5 if dtype == torch.float32 else 2e-2)


def test_fp64_is_an_oracle_and_gradients_only_where_required():
    Q, D = _inputs((3, 5, 8), (4, 6, 8), torch.float64, 0)
    D.requires_grad_()
    out = smooth_maxsim(Q, D, tau=0.1)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, smooth_maxsim_reference(Q, D, tau=0.1), atol=1e-12, rtol=0)
    out.sum().backward()
    assert Q.grad is None and D.grad is not None


def test_small_tau_tends_to_hard_max():
    Q, D = _inputs((2, 4, 8), (3, 9, 8), torch.float64, 3)
    hard = torch.einsum("ash,bth->abst", Q, D).amax(-1).sum(-1)
    soft = smooth_maxsim(Q, D, tau=1e-4)
    torch.testing.assert_close(soft, hard, atol=4 * 1e-4 * torch.log(torch.tensor(9.0)).item(), rtol=0)


def test_argument_errors():
    Q = torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match="tau"):
        smooth_maxsim(Q, torch.randn(2, 4, 8), tau=0.0)
    with pytest.raises(ValueError, match="dims differ"):
        smooth_maxsim(Q, torch.randn(2, 4, 7), tau=0.1)
    with pytest.raises(ValueError, match="one entry per query"):
        smooth_maxsim(Q, torch.randn(3, 4, 8), tau=0.1, layout="pairs")


def test_wide_embeddings_go_to_the_chunked_path(monkeypatch):
    """d > 256 does not fit the fused kernel's on-chip tile: under ``auto`` the chunked
    path serves it (and gives the reference result); only an explicit
    ``LIK_BACKEND=triton`` asks for the kernel."""
    from lik_plugins.kernels import dispatch

    monkeypatch.delenv("LIK_BACKEND", raising=False)
    # a CUDA-like tensor the Triton kernels serve: only the embedding width decides
    monkeypatch.setattr(dispatch, "_triton_refuses", lambda t, op, asked: "")
    cuda_like = type("CudaLike", (), {"is_cuda": True, "shape": None, "device": torch.device("cuda")})
    for width, path in ((128, "triton"), (300, "torch-chunked")):
        t = cuda_like()
        t.shape = (2, 3, width)
        assert dispatch.served_by(t, "smooth") == path
        assert dispatch.served_by(t, "maxsim") == "triton"
    monkeypatch.setenv("LIK_BACKEND", "triton")
    assert dispatch.served_by(t, "smooth") == "triton"
    monkeypatch.undo()
    g = torch.Generator().manual_seed(3)
    Q, D = torch.randn(2, 3, 300, generator=g), torch.randn(4, 5, 300, generator=g)
    got = smooth_maxsim(Q, D, tau=0.1)
    want = smooth_maxsim_reference(Q.double(), D.double(), tau=0.1)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)
