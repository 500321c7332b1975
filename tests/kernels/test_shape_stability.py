"""Lengths that change every call compile nothing new once their bucket has been seen.

Every Triton launch is counted by its specialisation (``direct.variants()``: kernel,
constexprs and the argument features Triton specialises on, honouring each kernel's
``do_not_specialize``).  A first sweep of lengths visits every bucket (query rows rounded
to a power of two, the document tail widths 0/16/32/64); a second sweep with other
lengths in the same buckets must launch no new variant, and the totals stay inside the
bound documented in ``blocking.py``.
"""
from __future__ import annotations

import pytest
import torch

import lik_plugins as lik
from lik_plugins.kernels import reference

pytestmark = pytest.mark.skipif(
    not __import__("lik_plugins._config", fromlist=["x"]).triton_interpret(), reason="needs TRITON_INTERPRET=1"
)


def _step(gen, lq, ld, *, nq=2, nj=3, d=16):
    Q = torch.randn(nq, lq, d, generator=gen, requires_grad=True)
    D = torch.randn(nj, ld, d, generator=gen, requires_grad=True)
    dm = torch.rand(nj, ld, generator=gen) > 0.2
    dm[:, 0] = True
    out = lik.maxsim(Q, D, None, dm)
    out.sum().backward()
    # exact against the reference: a variant that ran must also be right
    Q64, D64 = Q.detach().double().requires_grad_(), D.detach().double().requires_grad_()
    ref = reference.maxsim(Q64, D64, None, dm)
    ref.sum().backward()
    assert (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert (Q.grad.double() - Q64.grad).abs().max() <= 1e-5 * Q64.grad.abs().max()
    assert (D.grad.double() - D64.grad).abs().max() <= 1e-5 * D64.grad.abs().max().clamp_min(1)


# (Lq, Ld): Lq covers the row buckets 8 / 16 / 32 / 64 (two queries per program), Ld the
# tail widths (Ld % 64 in 1-16, 17-32, 33-63; Ld % 128 == 64; none).
FIRST = [(3, 17), (12, 40), (20, 70), (40, 128), (33, 100), (5, 140), (60, 50), (16, 64), (45, 64)]
SECOND = [(4, 18), (9, 47), (25, 77), (50, 192), (35, 99), (7, 141), (61, 54), (14, 130), (31, 75)]


def test_new_lengths_inside_seen_buckets_compile_nothing(monkeypatch):
    from lik_plugins.kernels.triton import blocking, direct, launch

    monkeypatch.setenv("LIK_BACKEND", "triton")
    monkeypatch.setattr(blocking, "TAIL_MIN_LD", 0)   # every tail width is a bucket here (short documents)
    gen = torch.Generator().manual_seed(7)
    direct.reset_variants()
    for lq, ld in FIRST:
        _step(gen, lq, ld)
    seen = direct.variants()
    assert seen.get("maxsim_fwd_kernel", 0) >= 4, seen          # the sweep did reach several buckets
    for lq, ld in SECOND:
        _step(gen, lq, ld)
    assert direct.variants() == seen
    for name, count in seen.items():
        assert count <= blocking.MAX_VARIANTS_PER_KERNEL, (name, count)


def test_a_specialised_argument_does_make_a_new_variant(monkeypatch):
    """The counter is not blind: an embedding width that changes the specialised strides
    (d = 16 -> 20: no longer divisible by 16) is a new binary."""
    from lik_plugins.kernels.triton import direct

    monkeypatch.setenv("LIK_BACKEND", "triton")
    gen = torch.Generator().manual_seed(8)
    direct.reset_variants()
    _step(gen, 5, 30)
    before = direct.variants()["maxsim_fwd_kernel"]
    _step(gen, 5, 30, d=20)
    assert direct.variants()["maxsim_fwd_kernel"] == before + 1
