"""``retrieve`` (top-k over a corpus, chunked) and the ``MaxSimScorer`` module."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import lik_plugins as lik
from lik_plugins.kernels import chunked, reference
from support.maxsim_testlib import backend_params, make_inputs, rel_err

BACKENDS = backend_params()


# ------------------------------------------------------------------ retrieve
@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalize"])
@pytest.mark.parametrize("mask_mode", ["exclude", "zero"])
def test_retrieve_equals_reference_topk(gen, mask_mode, normalize):
    Q, D, qm, dm = make_inputs(gen, "cross", 3, 11, 6, 9, 16, torch.float64, special_rows=False)
    scores, index = lik.retrieve(Q, D, 4, qm, dm, mask_mode=mask_mode, normalize=normalize)
    ref_scores, ref_index = reference.retrieve(Q, D, 4, qm, dm, mask_mode=mask_mode, normalize=normalize)
    assert scores.dtype == torch.float64 and index.dtype == torch.int64
    assert torch.equal(index, ref_index)
    assert rel_err(scores, ref_scores) < 1e-12
    # best first, and the scores are those of the returned documents
    assert (scores[:, :-1] >= scores[:, 1:]).all()
    full = reference.maxsim(Q, D, qm, dm, mask_mode=mask_mode, normalize=normalize)
    assert rel_err(scores, full.gather(1, index)) < 1e-12


def test_retrieve_fp32(gen):
    Q, D, qm, dm = make_inputs(gen, "cross", 2, 9, 5, 8, 32, special_rows=False)
    scores, index = lik.retrieve(Q, D, 3, qm, dm)
    ref = reference.maxsim(Q.double(), D.double(), qm, dm)
    assert scores.dtype == torch.float32
    assert rel_err(scores, ref.gather(1, index)) < 2e-5
    assert torch.equal(index, ref.topk(3, dim=1).indices)


@pytest.mark.parametrize("top_k", [7, 8, 100])
def test_top_k_is_clamped_to_the_corpus(gen, top_k):
    Q, D, qm, dm = make_inputs(gen, "cross", 2, 7, 4, 6, 16, torch.float64)
    scores, index = lik.retrieve(Q, D, top_k, qm, dm)
    assert scores.shape == index.shape == (2, 7)
    assert torch.equal(index.sort(dim=1).values, torch.arange(7).expand(2, 7))


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 12, 50])
def test_chunked_corpus_gives_identical_results(gen, chunk):
    # no fully masked query or document: exact ties in the scores would make the order
    # of equal scores (not the results) depend on the chunking
    Q, D, qm, dm = make_inputs(gen, "cross", 3, 12, 5, 7, 16, torch.float64, special_rows=False)
    whole = lik.retrieve(Q, D, 4, qm, dm, mask_mode="zero")
    part = lik.retrieve(Q, D, 4, qm, dm, mask_mode="zero", chunk=chunk)
    assert torch.equal(part[1], whole[1])
    # same documents; a score may differ in its last bit (matmul blocking per chunk)
    assert rel_err(part[0], whole[0]) < 1e-14


def test_retrieve_smallest(gen):
    Q, D, qm, dm = make_inputs(gen, "cross", 2, 9, 4, 6, 16, torch.float64, special_rows=False)
    scores, index = lik.retrieve(Q, D, 3, qm, dm, largest=False, chunk=2)
    ref = reference.maxsim(Q, D, qm, dm).topk(3, dim=1, largest=False)
    assert torch.equal(index, ref.indices)
    assert rel_err(scores, ref.values) < 1e-12


def test_retrieve_top_k_zero(gen):
    Q, D, _, _ = make_inputs(gen, "cross", 2, 5, 4, 6, 16)
    scores, index = lik.retrieve(Q, D, 0)
    assert scores.shape == index.shape == (2, 0)


@pytest.mark.parametrize("top_k", [-1, 1.5, "3", None, True])
def test_invalid_top_k(top_k):
    with pytest.raises(ValueError, match=r"top_k must be a non-negative int, got " + repr(top_k).replace(".", r"\.")):
        lik.retrieve(torch.randn(2, 4, 8), torch.randn(5, 6, 8), top_k)


@pytest.mark.parametrize("chunk", [0, -3, 2.0, "4"])
def test_invalid_chunk(chunk):
    with pytest.raises(ValueError, match=r"chunk must be a positive int or None, got " + repr(chunk).replace(".", r"\.")):
        lik.retrieve(torch.randn(2, 4, 8), torch.randn(5, 6, 8), 2, chunk=chunk)


def _spy_on_save_argmax(monkeypatch, module) -> list:
    """The ``save_argmax`` of every ``module.forward`` call from now on (whether a forward
    kept the winners for a backward)."""
    seen = []
    real = module.forward

    def spy(*args, **kwargs):
        seen.append(kwargs["save_argmax"])
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "forward", spy)
    return seen


def test_retrieve_computes_no_gradient(gen, monkeypatch):
    seen = _spy_on_save_argmax(monkeypatch, chunked)
    Q, D, _, _ = make_inputs(gen, "cross", 2, 6, 4, 6, 16)
    Q.requires_grad_()
    D.requires_grad_()
    scores, _ = lik.retrieve(Q, D, 2, chunk=4)
    assert not scores.requires_grad
    assert seen == [False, False]


@pytest.mark.parametrize("backend", [p for p in BACKENDS if p.id == "triton"])
def test_retrieve_on_the_triton_kernels(gen, monkeypatch, backend):
    monkeypatch.setenv("LIK_BACKEND", backend)
    lik.reset_routing_counts()
    Q, D, qm, dm = make_inputs(gen, "cross", 2, 5, 4, 6, 16, special_rows=False)
    scores, index = lik.retrieve(Q, D, 3, qm, dm, chunk=3)
    ref = reference.maxsim(Q.double(), D.double(), qm, dm)
    assert torch.equal(index, ref.topk(3, dim=1).indices)
    assert rel_err(scores, ref.gather(1, index)) < 2e-5
    assert lik.routing_counts() == {"retrieve": {"triton": 1}}


# ------------------------------------------------------------------ MaxSimScorer
def test_scorer_is_a_parameter_free_module():
    scorer = lik.MaxSimScorer(normalize=True, backward="unified", mask_mode="zero")
    assert isinstance(scorer, nn.Module)
    assert list(scorer.parameters()) == []
    assert "normalize=True" in repr(scorer) and "'unified'" in repr(scorer) and "'zero'" in repr(scorer)


@pytest.mark.parametrize("layout", ["cross", "kd"])
def test_scorer_matches_the_op_and_the_reference(gen, layout):
    Q, D, qm, dm = make_inputs(gen, layout, 3, 2, 5, 8, 16)
    scorer = lik.MaxSimScorer(normalize=True, mask_mode="zero")
    out = scorer(Q, D, qm, dm)
    assert torch.equal(out, lik.maxsim(Q, D, qm, dm, normalize=True, mask_mode="zero"))
    # gradients through the module, compared with the reference
    Qr, Dr = Q.clone().requires_grad_(), D.clone().requires_grad_()
    out = scorer(Qr, Dr, qm, dm)
    g = torch.randn(out.shape, generator=gen)
    gq, gd = torch.autograd.grad(out, (Qr, Dr), g)
    Q64, D64 = Q.double().requires_grad_(), D.double().requires_grad_()
    ref = reference.maxsim(Q64, D64, qm, dm, normalize=True, mask_mode="zero")
    rq, rd = torch.autograd.grad(ref, (Q64, D64), g.double())
    assert rel_err(out, ref) < 2e-5 and rel_err(gq, rq) < 2e-5 and rel_err(gd, rd) < 2e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_scorer_respects_no_grad(gen, monkeypatch, backend):
    monkeypatch.setenv("LIK_BACKEND", backend)
    if backend == "triton":
        from lik_plugins.kernels.triton import launch as module
    else:
        module = chunked
    seen = _spy_on_save_argmax(monkeypatch, module)
    scorer = lik.MaxSimScorer()
    Q, D, qm, dm = make_inputs(gen, "cross", 2, 2, 4, 6, 16)
    Q.requires_grad_()
    with torch.no_grad():
        out = scorer(Q, D, qm, dm)
    assert out.grad_fn is None and not out.requires_grad
    out = scorer(Q, D, qm, dm)
    assert out.requires_grad
    out.sum().backward()
    assert Q.grad is not None and D.grad is None
    assert seen == [False, True]


def test_scorer_in_a_model_trains(gen):
    """One optimiser step through a projection + scorer changes the loss (gradients flow)."""
    torch.manual_seed(0)
    proj = nn.Linear(16, 8)
    scorer = lik.MaxSimScorer(normalize=True)
    Q, D, qm, dm = make_inputs(gen, "cross", 4, 4, 5, 7, 16, special_rows=False)
    opt = torch.optim.SGD(proj.parameters(), lr=0.5)
    losses = []
    for _ in range(3):
        scores = scorer(proj(Q), proj(D), qm, dm)
        loss = nn.functional.cross_entropy(scores, torch.arange(4))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert proj.weight.grad is not None and torch.isfinite(proj.weight.grad).all()
    assert losses[-1] < losses[0]


def test_scorer_checks_layouts_like_the_op(gen):
    scorer = lik.MaxSimScorer(mask_mode="zero")
    Q, D, qm, dm = make_inputs(gen, "kd", 2, 3, 4, 6, 16)
    assert scorer(Q, D, qm, dm).shape == (2, 3)
    assert scorer(Q, D[:, 0], qm, dm[:, 0]).shape == (2, 2)  # 3-D D: the cross product
    with pytest.raises(ValueError, match=r"embedding dims differ: Q has d=16, D has d=8"):
        scorer(Q, D[..., :8])
    with pytest.raises(ValueError, match=r"d_mask must have shape \(2, 3, 6\), got \(2, 6\)"):
        scorer(Q, D, qm, dm[:, 0])
