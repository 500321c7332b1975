"""Bad input gets a clear, specific error (what was expected, what was given); edge
input (empty batches, empty sequences, non-finite values) gets a correct answer."""
from __future__ import annotations

import re

import pytest
import torch

import lik_plugins as lik
from lik_plugins.kernels import reference
from support.maxsim_testlib import backend_params, make_inputs, rel_err

BACKENDS = backend_params()


def _q(nq=2, lq=5, d=8, **kw):
    return torch.randn(nq, lq, d, **kw)


# ------------------------------------------------------------------ ranks and shapes
@pytest.mark.parametrize(
    "fn,Q,D,match",
    [
        (lik.maxsim, torch.randn(5, 8), torch.randn(3, 4, 8), r"Q must be 3-D, got shape \(5, 8\)"),
        (lik.maxsim, torch.randn(1, 2, 5, 8), torch.randn(3, 4, 8), r"Q must be 3-D, got shape \(1, 2, 5, 8\)"),
        (lik.maxsim, _q(), torch.randn(4, 8), r"D must be 3-D or 4-D, got shape \(4, 8\)"),
        (lik.maxsim, _q(), torch.randn(2, 1, 3, 4, 8), r"D must be 3-D or 4-D, got shape \(2, 1, 3, 4, 8\)"),
        (lik.maxsim_pairs, _q(), torch.randn(2, 1, 4, 8), r"D must be 3-D, got shape \(2, 1, 4, 8\)"),
        (lik.maxsim_pairs, torch.randn(5, 8), torch.randn(2, 4, 8), r"Q must be 3-D, got shape \(5, 8\)"),
    ],
    ids=["Q-2d", "Q-4d", "D-2d", "D-5d", "pairs-D-4d", "pairs-Q-2d"],
)
def test_wrong_rank(fn, Q, D, match):
    with pytest.raises(ValueError, match=match):
        fn(Q, D)


def test_wrong_rank_in_retrieve():
    with pytest.raises(ValueError, match=r"D must be 3-D, got shape \(2, 3, 4, 8\)"):
        lik.retrieve(_q(), torch.randn(2, 3, 4, 8), 1)
    with pytest.raises(ValueError, match=r"Q must be 3-D, got shape \(5, 8\)"):
        lik.retrieve(torch.randn(5, 8), torch.randn(3, 4, 8), 1)


def test_not_a_tensor():
    with pytest.raises(TypeError, match=r"Q must be a torch.Tensor, got list"):
        lik.maxsim([[[1.0]]], torch.randn(1, 1, 1))
    with pytest.raises(TypeError, match=r"D must be a torch.Tensor, got ndarray"):
        import numpy as np

        lik.maxsim(torch.randn(1, 1, 1), np.zeros((1, 1, 1), dtype=np.float32))


@pytest.mark.parametrize(
    "fn,D",
    [(lik.maxsim, torch.randn(3, 4, 7)), (lik.maxsim, torch.randn(2, 3, 4, 7)), (lik.maxsim_pairs, torch.randn(2, 4, 7))],
    ids=["cross", "kd", "pairs"],
)
def test_mismatched_embedding_dims(fn, D):
    with pytest.raises(ValueError, match=r"embedding dims differ: Q has d=8, D has d=7"):
        fn(_q(), D)


def test_mismatched_batch_dims():
    with pytest.raises(ValueError, match=r"per-query candidates D \[Nq, K, Ld, d\] must have Nq=2 like Q, "
                                         r"got D shape \(3, 4, 5, 8\)"):
        lik.maxsim(_q(), torch.randn(3, 4, 5, 8))
    with pytest.raises(ValueError, match=r"maxsim_pairs needs one document per query: Q has B=2, D has B=3"):
        lik.maxsim_pairs(_q(), torch.randn(3, 5, 8))


@pytest.mark.parametrize(
    "fn,D,q_mask,d_mask,match",
    [
        (lik.maxsim, torch.randn(3, 4, 8), torch.ones(2, 6, dtype=torch.bool), None,
         r"q_mask must have shape \(2, 5\), got \(2, 6\)"),
        (lik.maxsim, torch.randn(3, 4, 8), torch.ones(5, 2, dtype=torch.bool), None,
         r"q_mask must have shape \(2, 5\), got \(5, 2\)"),
        (lik.maxsim, torch.randn(3, 4, 8), None, torch.ones(3, 5, dtype=torch.bool),
         r"d_mask must have shape \(3, 4\), got \(3, 5\)"),
        (lik.maxsim, torch.randn(3, 4, 8), None, torch.ones(3, 4, 1, dtype=torch.bool),
         r"d_mask must have shape \(3, 4\), got \(3, 4, 1\)"),
        (lik.maxsim, torch.randn(2, 3, 4, 8), None, torch.ones(3, 4, dtype=torch.bool),
         r"d_mask must have shape \(2, 3, 4\), got \(3, 4\)"),
        (lik.maxsim_pairs, torch.randn(2, 4, 8), None, torch.ones(2, 1, 4, dtype=torch.bool),
         r"d_mask must have shape \(2, 4\), got \(2, 1, 4\)"),
        (lik.maxsim_pairs, torch.randn(2, 4, 8), torch.ones(2, dtype=torch.bool), None,
         r"q_mask must have shape \(2, 5\), got \(2,\)"),
    ],
    ids=["q-len", "q-transposed", "d-len", "d-extra-dim", "kd-d-rank", "pairs-d-rank", "pairs-q-rank"],
)
def test_mask_of_the_wrong_shape(fn, D, q_mask, d_mask, match):
    with pytest.raises(ValueError, match=match):
        fn(_q(), D, q_mask, d_mask)


def test_mask_of_the_wrong_type():
    with pytest.raises(TypeError, match=r"q_mask must be a torch.Tensor or None, got list"):
        lik.maxsim(_q(), torch.randn(3, 4, 8), [[1] * 5] * 2)
    with pytest.raises(TypeError, match=r"d_mask must be bool or a real 0/1 tensor, got torch.complex64"):
        lik.maxsim(_q(), torch.randn(3, 4, 8), None, torch.ones(3, 4, dtype=torch.complex64))


# ------------------------------------------------------------------ devices and dtypes
def test_mixed_devices():
    meta_D = torch.empty(3, 4, 8, device="meta")
    with pytest.raises(ValueError, match=r"Q is on cpu but D is on meta; move both to one device"):
        lik.maxsim(_q(), meta_D)
    with pytest.raises(ValueError, match=r"Q is on cpu but D is on meta"):
        lik.maxsim_pairs(_q(), torch.empty(2, 4, 8, device="meta"))
    with pytest.raises(ValueError, match=r"Q is on cpu but D is on meta"):
        lik.retrieve(_q(), meta_D, 2)
    with pytest.raises(ValueError, match=r"q_mask is on meta but the embeddings are on cpu"):
        lik.maxsim(_q(), torch.randn(3, 4, 8), torch.ones(2, 5, dtype=torch.bool, device="meta"))
    with pytest.raises(ValueError, match=r"d_mask is on meta but the embeddings are on cpu"):
        lik.maxsim(_q(), torch.randn(3, 4, 8), None, torch.ones(3, 4, dtype=torch.bool, device="meta"))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool, torch.complex64])
def test_unsupported_dtypes(dtype):
    bad = torch.ones(2, 5, 8, dtype=dtype)
    good = torch.randn(3, 4, 8)
    name = str(dtype)
    with pytest.raises(TypeError, match=rf"Q must be float16, bfloat16, float32 or float64, got {name}"):
        lik.maxsim(bad, good)
    with pytest.raises(TypeError, match=rf"D must be float16, bfloat16, float32 or float64, got {name}"):
        lik.maxsim(_q(), torch.ones(3, 4, 8, dtype=dtype))
    with pytest.raises(TypeError, match=rf"D must be float16, bfloat16, float32 or float64, got {name}"):
        lik.maxsim_pairs(_q(), torch.ones(2, 4, 8, dtype=dtype))


def test_mixed_float_dtypes():
    with pytest.raises(TypeError, match=r"Q and D must have the same dtype, got torch.float32 and torch.bfloat16"):
        lik.maxsim(_q(), torch.randn(3, 4, 8, dtype=torch.bfloat16))


# ------------------------------------------------------------------ options
@pytest.mark.parametrize("bad", ["fast", "Unified", "", None, "atomic"])
def test_invalid_backward_names_the_accepted_values(bad):
    match = r"backward must be one of 'auto', 'unified', 'lowmem'; got " + re.escape(repr(bad))
    for call in (lambda: lik.maxsim(_q(), torch.randn(3, 4, 8), backward=bad),
                 lambda: lik.maxsim_pairs(_q(), torch.randn(2, 4, 8), backward=bad),
                 lambda: lik.MaxSimScorer(backward=bad)(_q(), torch.randn(3, 4, 8))):
        with pytest.raises(ValueError, match=match):
            call()


@pytest.mark.parametrize("bad", ["mask", "Zero", "multiply", None])
def test_invalid_mask_mode(bad):
    match = r"mask_mode must be one of 'exclude', 'zero'; got " + re.escape(repr(bad))
    with pytest.raises(ValueError, match=match):
        lik.maxsim(_q(), torch.randn(3, 4, 8), mask_mode=bad)
    with pytest.raises(ValueError, match=match):
        lik.maxsim_pairs(_q(), torch.randn(2, 4, 8), mask_mode=bad)
    with pytest.raises(ValueError, match=match):
        lik.retrieve(_q(), torch.randn(3, 4, 8), 1, mask_mode=bad)


def test_options_are_checked_before_any_work(monkeypatch):
    """An invalid option fails even when the kill switch would route to the reference."""
    monkeypatch.setenv("LIK_DISABLE", "1")
    with pytest.raises(ValueError, match=r"backward must be one of"):
        lik.maxsim(_q(), torch.randn(3, 4, 8), backward="fast")


@pytest.mark.parametrize("value", ["cuda", "metal", "chunked", "1"])
def test_invalid_lik_backend_value(monkeypatch, value):
    monkeypatch.setenv("LIK_BACKEND", value)
    with pytest.raises(ValueError, match=rf"LIK_BACKEND='{value}' is not one of auto, triton, torch-chunked, reference"):
        lik.maxsim(_q(), torch.randn(3, 4, 8))


# ------------------------------------------------------------------ empty outputs
EMPTY_CASES = {
    # name: (layout, nq, nj, lq, ld, d)
    "Nq=0": ("cross", 0, 3, 5, 4, 8),
    "Nd=0": ("cross", 2, 0, 5, 4, 8),
    "K=0": ("kd", 2, 0, 5, 4, 8),
    "kd-Nq=0": ("kd", 0, 3, 5, 4, 8),
    "B=0": ("pairs", 0, 1, 5, 4, 8),
    "Ld=0": ("cross", 2, 3, 5, 0, 8),
    "kd-Ld=0": ("kd", 2, 3, 5, 0, 8),
    "pairs-Ld=0": ("pairs", 2, 1, 5, 0, 8),
    "Lq=0": ("cross", 2, 3, 0, 4, 8),
    "kd-Lq=0": ("kd", 2, 3, 0, 4, 8),
    "pairs-Lq=0": ("pairs", 2, 1, 0, 4, 8),
}


@pytest.mark.parametrize("masks", [False, True], ids=["no-mask", "masks"])
@pytest.mark.parametrize("case", list(EMPTY_CASES))
@pytest.mark.parametrize("backend", BACKENDS + ["reference"])
def test_empty_inputs(gen, monkeypatch, backend, case, masks):
    """Correct shapes, zero scores for empty sequences (a query with no tokens scores 0;
    a document with no tokens gives every query token nothing to win: 0), and a backward
    with finite zero gradients of the right shapes."""
    monkeypatch.setenv("LIK_BACKEND", backend)
    layout, nq, nj, lq, ld, d = EMPTY_CASES[case]
    Q, D, qm, dm = make_inputs(gen, layout, nq, nj, lq, ld, d, masks=masks)
    if ld:  # make stale memory obvious if an output is left uninitialised
        D = D * 1e3
    Q.requires_grad_()
    D.requires_grad_()
    fn = lik.maxsim_pairs if layout == "pairs" else lik.maxsim
    expected_shape = (nq,) if layout == "pairs" else (nq, nj)
    for mode in ("exclude", "zero"):
        out = fn(Q, D, qm, dm, mask_mode=mode)
        assert out.shape == expected_shape and out.dtype == torch.float32
        assert torch.equal(out, torch.zeros(expected_shape)), out
        gq, gd = torch.autograd.grad(out.sum() * 2, (Q, D), allow_unused=True)
        for g, x in ((gq, Q), (gd, D)):
            if g is not None:
                assert g.shape == x.shape and torch.equal(g, torch.zeros_like(x))
    with torch.no_grad():
        assert torch.equal(fn(Q, D, qm, dm), torch.zeros(expected_shape))


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_retrieve(gen, monkeypatch, backend):
    monkeypatch.setenv("LIK_BACKEND", backend)
    scores, index = lik.retrieve(_q(), torch.randn(0, 4, 8), 3)
    assert scores.shape == (2, 0) and index.shape == (2, 0) and index.dtype == torch.int64
    scores, index = lik.retrieve(_q(nq=0), torch.randn(3, 4, 8), 2)
    assert scores.shape == (0, 2) and index.shape == (0, 2)


# ------------------------------------------------------------------ non-finite input
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("layout", ["cross", "kd", "pairs"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_in_a_query_poisons_only_that_query(gen, monkeypatch, backend, layout):
    monkeypatch.setenv("LIK_BACKEND", backend)
    Q, D, qm, dm = make_inputs(gen, layout, 3, 2, 4, 7, 16, special_rows=False)
    qm[1, 2] = True
    Q[1, 2, 5] = float("nan")
    fn = lik.maxsim_pairs if layout == "pairs" else lik.maxsim
    rfn = reference.maxsim_pairs if layout == "pairs" else reference.maxsim
    for mode in ("exclude", "zero"):
        out = fn(Q, D, qm, dm, mask_mode=mode)
        assert torch.isnan(out[1]).all()
        ref = rfn(Q.double(), D.double(), qm, dm, mask_mode=mode)
        keep = torch.tensor([0, 2])
        assert rel_err(out[keep], ref[keep]) < 2e-5
    Q.requires_grad_()
    fn(Q, D, qm, dm).sum().backward()  # must not crash
    assert torch.isfinite(Q.grad[0]).all() and torch.isfinite(Q.grad[2]).all()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("backend", BACKENDS)
def test_infinite_inputs_do_not_crash(gen, monkeypatch, backend):
    monkeypatch.setenv("LIK_BACKEND", backend)
    Q, D, qm, dm = make_inputs(gen, "cross", 2, 3, 4, 7, 16, special_rows=False)
    Q[0, 1, 2] = float("inf")
    D[1, 3, 4] = float("-inf")
    Q.requires_grad_()
    D.requires_grad_()
    for normalize in (False, True):
        out = lik.maxsim(Q, D, qm, dm, normalize=normalize)
        assert out.shape == (2, 3)
        out.sum().backward()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("backward", ["lowmem", "unified"])
@pytest.mark.parametrize("mask_mode", ["exclude", "zero"])
@pytest.mark.parametrize("layout", ["cross", "kd"])
@pytest.mark.parametrize("backend", BACKENDS + ["reference"])
def test_nonfinite_masked_tokens_reach_neither_scores_nor_gradients(gen, monkeypatch, backend, layout, mask_mode,
                                                                    backward):
    """Masked tokens may hold anything (uninitialised padding, NaN, inf): scores and
    gradients equal those of the same input with finite masked tokens.  (The plain
    reference formulation differentiates through a dense einsum, so 0 * inf reaches its
    gradients by construction: only its scores are checked.)"""
    monkeypatch.setenv("LIK_BACKEND", backend)
    Q, D, qm, dm = make_inputs(gen, layout, 3, 2, 5, 7, 16)
    qm[0, 0] = False
    dm.view(-1, 7)[:, 0] = False  # token 0 of every document: where a no-winner row's index is clamped
    Qr, Dr = Q.clone().requires_grad_(), D.clone().requires_grad_()
    clean = lik.maxsim(Qr, Dr, qm, dm, mask_mode=mask_mode, backward=backward)
    grad_out = torch.randn(clean.shape, generator=gen)
    clean_grads = torch.autograd.grad(clean, (Qr, Dr), grad_out)
    Q2, D2 = Q.clone(), D.clone()
    Q2[~qm] = float("nan")
    D2[~dm] = float("inf")
    Qr, Dr = Q2.requires_grad_(), D2.requires_grad_()
    dirty = lik.maxsim(Qr, Dr, qm, dm, mask_mode=mask_mode, backward=backward)
    dirty_grads = torch.autograd.grad(dirty, (Qr, Dr), grad_out)
    assert torch.equal(dirty, clean)
    if backend == "reference":
        return
    for name, g, c in zip(("grad_Q", "grad_D"), dirty_grads, clean_grads):
        assert torch.isfinite(g).all(), f"{name} is not finite"
        assert torch.equal(g, c), name
