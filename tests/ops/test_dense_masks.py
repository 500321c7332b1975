"""Mask semantics of the public ops (DESIGN.md §1), on every CPU-runnable path:
``exclude`` vs ``zero`` on constructed inputs with known answers, tie-breaking between a
valid 0 and a masked 0, masks of any dtype, and masked tokens' values never mattering."""
from __future__ import annotations

import pytest
import torch

import lik_plugins as lik
from lik_plugins.kernels import reference
from support.maxsim_testlib import backend_params, make_inputs, op, rel_err

BACKENDS = backend_params()


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv("LIK_BACKEND", request.param)
    return request.param


def _e(i, d=8, scale=1.0):
    v = torch.zeros(d)
    v[i] = scale
    return v


def _negative_case():
    """Query tokens e0 and e1; a document whose valid tokens all have negative similarity
    with e0 (-1, -2, -3) while token 2 (+5) wins when it is not masked.  Token e1 scores
    0.5 (token 3) in every case."""
    Q = torch.stack([_e(0), _e(1)]).unsqueeze(0)                     # [1, 2, 8]
    doc = torch.stack([_e(0, scale=-1.0), _e(0, scale=-2.0), _e(0, scale=5.0), _e(0, scale=-3.0) + _e(1, scale=0.5)])
    doc = doc + torch.stack([_e(7, scale=0.3)] * 4)                  # not all-zero elsewhere
    return Q, doc


def test_zero_mode_semantics_on_known_inputs(backend):
    Q, doc = _negative_case()
    D = doc.unsqueeze(0).repeat(2, 1, 1)                               # two identical documents
    dm = torch.tensor([[True, True, False, True],                      # doc 0: token 2 masked
                       [True, True, True, True]])                      # doc 1: nothing masked
    D[1, 2] = _e(0, scale=-3.0) + _e(7, scale=0.3)                     # doc 1 has no positive token for q
    for layout_D, layout_dm, fn in ((D, dm, lik.maxsim), (D.unsqueeze(0), dm.unsqueeze(0), lik.maxsim)):
        zero = fn(Q, layout_D, None, layout_dm, mask_mode="zero").reshape(-1)
        excl = fn(Q, layout_D, None, layout_dm, mask_mode="exclude").reshape(-1)
        # doc 0: q=e0's valid sims are -1, -2 and a masked token exists -> zero: 0, exclude: -1
        # doc 1: no masked token -> both modes: max(-1, -2, -3) = -1.   Token e1 adds 0.5.
        torch.testing.assert_close(zero, torch.tensor([0.5, -0.5]), rtol=0, atol=1e-6)
        torch.testing.assert_close(excl, torch.tensor([-0.5, -0.5]), rtol=0, atol=1e-6)
    pairs_zero = lik.maxsim_pairs(Q.repeat(2, 1, 1), D, None, dm, mask_mode="zero")
    torch.testing.assert_close(pairs_zero, torch.tensor([0.5, -0.5]), rtol=0, atol=1e-6)
    ref = reference.maxsim(Q.double(), D.double(), None, dm, mask_mode="zero")
    torch.testing.assert_close(ref.reshape(-1).float(), torch.tensor([0.5, -0.5]), rtol=0, atol=1e-6)


def test_zero_mode_masked_winner_gets_no_gradient(backend):
    Q, doc = _negative_case()
    D = doc.unsqueeze(0).clone()
    dm = torch.tensor([[True, True, False, True]])
    Q.requires_grad_()
    D.requires_grad_()
    out = lik.maxsim(Q, D, None, dm, mask_mode="zero")
    gq, gd = torch.autograd.grad(out, (Q, D), torch.ones_like(out))
    # token e0's row is won by the masked 0: no gradient; token e1's row won by token 3
    assert torch.equal(gq[0, 0], torch.zeros(8))
    torch.testing.assert_close(gq[0, 1], doc[3], rtol=0, atol=1e-6)
    assert torch.equal(gd[0, :3], torch.zeros(3, 8))
    torch.testing.assert_close(gd[0, 3], _e(1), rtol=0, atol=1e-6)
    # exclude mode: the row is won by token 0 (-1)
    out = lik.maxsim(Q, D, None, dm, mask_mode="exclude")
    gq, gd = torch.autograd.grad(out, (Q, D), torch.ones_like(out))
    torch.testing.assert_close(gq[0, 0], doc[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(gd[0, 0], _e(0), rtol=0, atol=1e-6)


def test_valid_zero_wins_a_tie_with_a_masked_zero(backend):
    """zero mode: a valid token with similarity exactly 0 beats a masked 0, so it takes
    the gradient (reference: "a valid token wins a tie with a masked 0")."""
    Q = _e(0).view(1, 1, 8)
    D = torch.stack([_e(3, scale=2.0), _e(0, scale=-1.0), _e(0, scale=4.0)]).unsqueeze(0)  # sims 0, -1, 4
    dm = torch.tensor([[True, True, False]])
    Q.requires_grad_()
    out = lik.maxsim(Q, D, None, dm, mask_mode="zero")
    assert out.item() == 0.0
    (gq,) = torch.autograd.grad(out, (Q,), torch.ones_like(out))
    torch.testing.assert_close(gq[0, 0], _e(3, scale=2.0), rtol=0, atol=0)


@pytest.mark.parametrize("mask_mode", ["exclude", "zero"])
@pytest.mark.parametrize("layout", ["cross", "kd", "pairs"])
def test_mask_dtypes_give_identical_results(gen, backend, layout, mask_mode):
    Q, D, qm, dm = make_inputs(gen, layout, 2, 2, 4, 7, 16)
    Q.requires_grad_()
    D.requires_grad_()
    grad_out = None
    results = {}
    dtypes = [torch.bool, torch.uint8, torch.int64, torch.float32, torch.bfloat16]
    if backend != "triton":  # (interpreter time)
        dtypes += [torch.int8, torch.int32, torch.float16, torch.float64]
    for dtype in dtypes:
        out = op(layout)(Q, D, qm.to(dtype), dm.to(dtype), mask_mode=mask_mode)
        grad_out = torch.randn(out.shape, generator=gen) if grad_out is None else grad_out
        results[dtype] = (out.detach(), *torch.autograd.grad(out, (Q, D), grad_out))
    base = results[torch.bool]
    for dtype, res in results.items():
        for a, b in zip(res, base):
            assert torch.equal(a, b), dtype
    # non-zero means valid, whatever the value
    out = op(layout)(Q, D, qm.to(torch.int64) * 3, dm.to(torch.float32) * -2.5, mask_mode=mask_mode)
    assert torch.equal(out, base[0])


@pytest.mark.parametrize("layout", ["cross", "kd", "pairs"])
def test_all_true_masks_equal_no_masks(gen, backend, layout):
    Q, D, _, _ = make_inputs(gen, layout, 2, 3, 5, 9, 16)
    qm = torch.ones(Q.shape[:2], dtype=torch.bool)
    dm = torch.ones(D.shape[:-1], dtype=torch.bool)
    for mode in ("exclude", "zero"):
        assert torch.equal(op(layout)(Q, D, qm, dm, mask_mode=mode), op(layout)(Q, D, mask_mode=mode))
    # and with no mask, zero mode == exclude mode (no masked token can compete)
    assert torch.equal(op(layout)(Q, D, mask_mode="zero"), op(layout)(Q, D, mask_mode="exclude"))


@pytest.mark.parametrize("mask_mode", ["exclude", "zero"])
@pytest.mark.parametrize("layout", ["cross", "kd"])
def test_masked_token_values_do_not_matter(gen, backend, layout, mask_mode):
    Q, D, qm, dm = make_inputs(gen, layout, 3, 2, 5, 9, 16)
    Q2, D2 = Q.clone(), D.clone()
    Q2[~qm] = 100 * torch.randn(int((~qm).sum()), 16, generator=gen)
    D2[~dm] = 100 * torch.randn(int((~dm).sum()), 16, generator=gen)
    a = lik.maxsim(Q, D, qm, dm, mask_mode=mask_mode)
    b = lik.maxsim(Q2, D2, qm, dm, mask_mode=mask_mode)
    assert torch.equal(a, b)
    ref = reference.maxsim(Q.double(), D.double(), qm, dm, mask_mode=mask_mode)
    assert rel_err(a, ref) < 2e-5


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("path", ["default", "kill-switch"])
def test_nonfinite_masked_query_token_contributes_zero(gen, monkeypatch, path):
    """A masked query token contributes 0 (DESIGN.md §1), even when it holds NaN/inf:
    the kernels and the plain formulation (kill switch) must agree."""
    if path == "kill-switch":
        monkeypatch.setenv("LIK_DISABLE", "1")
    Q, D, qm, dm = make_inputs(gen, "cross", 2, 3, 5, 9, 16, special_rows=False)
    qm[0, 2] = False
    qm[1, 3] = False
    expected = reference.maxsim(Q.double(), D.double(), qm, dm)
    Q[0, 2, 1] = float("nan")
    Q[1, 3] = float("inf")
    out = lik.maxsim(Q, D, qm, dm)
    assert torch.isfinite(out).all()
    assert rel_err(out, expected) < 2e-5


def test_reference_ignores_nonfinite_masked_query_tokens(gen):
    """The specification itself: a masked query token holding NaN contributes 0."""
    Q, D, qm, dm = make_inputs(gen, "cross", 2, 3, 5, 9, 16, special_rows=False)
    qm[0, 2] = False
    clean = reference.maxsim(Q.double(), D.double(), qm, dm)
    Q[0, 2] = float("nan")
    for mode in ("exclude", "zero"):
        dirty = reference.maxsim(Q.double(), D.double(), qm, dm, mask_mode=mode)
        assert torch.isfinite(dirty).all(), mode
    assert torch.equal(reference.maxsim(Q.double(), D.double(), qm, dm), clean)
