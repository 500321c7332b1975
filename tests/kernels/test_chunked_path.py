"""The bounded-memory torch path (what serves CPU tensors by default) against the
float64 reference: every layout, mask mode and normalisation, fp32/fp64/bf16/fp16,
a forced tiny chunk budget, non-contiguous inputs, and memory-boundedness observed
on the similarity chunks it actually computes.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lik_plugins as lik
from lik_plugins.kernels import chunked, reference
from support.maxsim_testlib import (
    LAYOUTS, MASK_MODES, check_against_reference, check_exact_ties, check_nan_query_poisons_only_its_scores,
    check_nonfinite_masked_tokens_are_ignored, check_property_case, expected_argmax, generator, make_inputs, op,
    property_cases, rel_err, noncontiguous_inputs,
)

SHAPES = {
    "cross": (4, 5, 9, 33, 40),
    "kd": (3, 4, 7, 21, 40),
    "pairs": (5, 1, 8, 25, 40),
}


def _inputs(gen, layout, dtype=torch.float32, shape=None, **kw):
    nq, nj, lq, ld, d = shape or SHAPES[layout]
    return make_inputs(gen, layout, nq, nj, lq, ld, d, dtype, **kw)


def test_cpu_default_route_is_torch_chunked(gen):
    lik.reset_routing_counts()
    Q, D, qm, dm = _inputs(gen, "kd")
    lik.maxsim(Q, D, qm, dm)
    lik.maxsim_pairs(Q, D[:, 0], qm, dm[:, 0])
    assert lik.routing_counts() == {"maxsim": {"torch-chunked": 1}, "maxsim_pairs": {"torch-chunked": 1}}


@pytest.mark.parametrize("budget", [None, "64"], ids=["default-budget", "budget-64"])
@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalize"])
@pytest.mark.parametrize("mask_mode", MASK_MODES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp32_matches_reference(gen, monkeypatch, layout, mask_mode, normalize, budget):
    if budget is not None:
        monkeypatch.setenv("LIK_CHUNK_ELEMENTS", budget)
    Q, D, qm, dm = _inputs(gen, layout)
    check_against_reference(layout, Q, D, qm, dm, gen=gen, normalize=normalize, mask_mode=mask_mode)


@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalize"])
@pytest.mark.parametrize("mask_mode", MASK_MODES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_float64_is_exact(gen, monkeypatch, layout, mask_mode, normalize):
    monkeypatch.setenv("LIK_CHUNK_ELEMENTS", "500")
    Q, D, qm, dm = _inputs(gen, layout, torch.float64)
    check_against_reference(layout, Q, D, qm, dm, gen=gen, normalize=normalize, mask_mode=mask_mode)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_half_precision_matches_reference(gen, layout, dtype):
    Q, D, qm, dm = _inputs(gen, layout, dtype)
    check_against_reference(layout, Q, D, qm, dm, gen=gen, mask_mode="zero", normalize=layout == "kd")


@pytest.mark.parametrize("backward", ["auto", "lowmem", "unified"])
def test_every_backward_strategy_is_accepted(gen, backward):
    Q, D, qm, dm = _inputs(gen, "cross")
    check_against_reference("cross", Q, D, qm, dm, gen=gen, backward=backward)


@pytest.mark.parametrize(
    "layout,shape",
    [
        ("cross", (2, 3, 130, 8, 16)),   # long query
        ("cross", (2, 3, 5, 9, 300)),    # wide embedding
        ("kd", (2, 2, 5, 9, 768)),
        ("cross", (3, 2, 4, 6, 48)),
        ("kd", (2, 3, 4, 6, 96)),
        ("pairs", (3, 1, 4, 6, 120)),
        ("cross", (3, 3, 1, 1, 16)),     # Lq = Ld = 1
        ("kd", (3, 2, 1, 7, 16)),
        ("pairs", (3, 1, 6, 1, 16)),
    ],
    ids=["lq130", "d300", "d768", "d48", "d96", "d120", "lq1-ld1", "kd-lq1", "pairs-ld1"],
)
@pytest.mark.parametrize("budget", [None, "64"], ids=["default-budget", "budget-64"])
def test_odd_sizes(gen, monkeypatch, layout, shape, budget):
    if budget is not None:
        monkeypatch.setenv("LIK_CHUNK_ELEMENTS", budget)
    Q, D, qm, dm = make_inputs(gen, layout, *shape)
    check_against_reference(layout, Q, D, qm, dm, gen=gen, mask_mode="zero", normalize=True)
    check_against_reference(layout, Q, D, None, None, gen=gen)


@pytest.mark.parametrize("layout", ["cross", "kd"])
def test_noncontiguous_inputs_and_masks(gen, monkeypatch, layout):
    monkeypatch.setenv("LIK_CHUNK_ELEMENTS", "100")
    nq, nj, lq, ld, d = 3, 4, 5, 11, 24
    Q, D, qm, dm = noncontiguous_inputs(gen, layout, nq, nj, lq, ld, d)
    for normalize in (False, True):
        check_against_reference(layout, Q, D, qm, dm, gen=gen, normalize=normalize, mask_mode="zero")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_similarity_chunks_stay_within_the_budget(gen, monkeypatch, layout):
    """Observe every similarity block the path computes (einsum outputs) and every
    scatter block of the backward: none exceeds ``LIK_CHUNK_ELEMENTS`` (the full
    ``[Nq, Nd, Lq, Ld]`` tensor is far larger), and the result is still exact."""
    nq, nj, lq, ld, d = 6, 7, 5, 9, 8
    n_docs = nj if layout != "pairs" else 1
    # the smallest block the path scores at once: one (query, document) pair in the cross
    # product, one query's candidates otherwise
    granule = lq * ld if layout == "cross" else n_docs * lq * ld
    budget = 2 * granule if layout != "cross" else 4 * granule
    monkeypatch.setenv("LIK_CHUNK_ELEMENTS", str(budget))
    Q, D, qm, dm = make_inputs(gen, layout, nq, nj, lq, ld, d, torch.float64)
    full = nq * n_docs * lq * ld
    grad_out_shape = (nq,) if layout == "pairs" else (nq, nj)
    grad_out = torch.randn(grad_out_shape, generator=gen, dtype=torch.float64)
    ref = reference.maxsim_pairs if layout == "pairs" else reference.maxsim
    Q64, D64 = Q.clone().requires_grad_(), D.clone().requires_grad_()
    expected = ref(Q64, D64, qm, dm, mask_mode="zero")
    expected_grads = torch.autograd.grad(expected, (Q64, D64), grad_out)

    einsum_sizes, scatter_sizes = [], []
    real_einsum, real_index_add = torch.einsum, torch.Tensor.index_add_

    def einsum(eq, *ops):
        out = real_einsum(eq, *ops)
        einsum_sizes.append(out.numel())
        return out

    def index_add_(self, dim, index, source, *args, **kwargs):
        scatter_sizes.append(source.numel())
        return real_index_add(self, dim, index, source, *args, **kwargs)

    monkeypatch.setattr(torch, "einsum", einsum)
    monkeypatch.setattr(torch.Tensor, "index_add_", index_add_)
    Qr, Dr = Q.clone().requires_grad_(), D.clone().requires_grad_()
    out = op(layout)(Qr, Dr, qm, dm, mask_mode="zero")
    fwd_sizes = list(einsum_sizes)
    grads = torch.autograd.grad(out, (Qr, Dr), grad_out)
    monkeypatch.undo()

    assert full > budget
    assert len(fwd_sizes) > 1, "the forward should have been chunked"
    assert max(fwd_sizes) <= budget
    # backward scatters g * q rows: at most `budget` similarities' worth of rows x d
    assert scatter_sizes and max(scatter_sizes) <= max(budget, n_docs * lq * d)
    assert rel_err(out, expected) < 1e-12
    for g, e in zip(grads, expected_grads):
        assert rel_err(g, e) < 1e-12


def test_saves_only_the_argmax(gen):
    """What autograd keeps for the backward: Q, D and an integer argmax
    ``[Nq, Nd, Lq]`` — no similarity tensor."""
    Q, D, qm, dm = _inputs(gen, "cross")
    Q.requires_grad_()
    out = lik.maxsim(Q, D, qm, dm)
    saved = out.grad_fn.saved_tensors
    floats = [t for t in saved if t.is_floating_point()]
    ints = [t for t in saved if not t.is_floating_point()]
    assert all(t.shape in (Q.shape, D.shape) for t in floats)
    assert len(ints) == 1 and ints[0].shape == (Q.shape[0], D.shape[0], Q.shape[1])


@pytest.mark.parametrize("mask_mode", MASK_MODES)
@pytest.mark.parametrize("layout", ["cross", "kd"])
def test_saved_argmax_and_sentinel(gen, monkeypatch, layout, mask_mode):
    monkeypatch.setenv("LIK_CHUNK_ELEMENTS", "200")
    Q, D, qm, dm = _inputs(gen, layout)
    scores, arg = chunked.forward(Q, D, qm, dm, cross=layout == "cross", normalize=False,
                                  zero_mode=mask_mode == "zero", save_argmax=True)
    assert torch.equal(arg, expected_argmax(Q, D, qm, dm, layout, mask_mode))
    _, none = chunked.forward(Q, D, qm, dm, cross=layout == "cross", normalize=False,
                              zero_mode=mask_mode == "zero", save_argmax=False)
    assert none is None


@pytest.mark.parametrize("layout", ["cross", "kd"])
def test_backward_is_bitwise_deterministic(gen, monkeypatch, layout):
    monkeypatch.setenv("LIK_CHUNK_ELEMENTS", "128")
    Q, D, qm, dm = _inputs(gen, layout)
    Q.requires_grad_()
    D.requires_grad_()
    grad_out = None
    runs = []
    for _ in range(2):
        out = lik.maxsim(Q, D, qm, dm, normalize=True, backward="lowmem")
        grad_out = torch.randn(out.shape, generator=gen) if grad_out is None else grad_out
        runs.append((out.detach(), *torch.autograd.grad(out, (Q, D), grad_out)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_chunk_budget_does_not_change_results(gen, monkeypatch):
    Q, D, qm, dm = make_inputs(gen, "cross", 5, 6, 7, 13, 16, torch.float64)
    outs = []
    for budget in ("1", "64", "1000", str(1 << 24)):
        monkeypatch.setenv("LIK_CHUNK_ELEMENTS", budget)
        outs.append(lik.maxsim(Q, D, qm, dm, mask_mode="zero"))
    for o in outs[1:]:
        assert rel_err(o, outs[0]) < 1e-13


def test_nan_in_query_propagates_without_crash(gen):
    check_nan_query_poisons_only_its_scores(gen)


def test_nonfinite_masked_tokens_are_ignored(gen):
    check_nonfinite_masked_tokens_are_ignored(gen)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=property_cases(max_n=4, max_lq=12, max_ld=30, dims=[3, 16, 40, 96]),
       budget=st.sampled_from([None, 1, 50, 400]))
def test_property_matches_reference(case, budget):
    import os

    old = os.environ.pop("LIK_CHUNK_ELEMENTS", None)
    if budget is not None:
        os.environ["LIK_CHUNK_ELEMENTS"] = str(budget)
    try:
        check_property_case(case)
    finally:
        os.environ.pop("LIK_CHUNK_ELEMENTS", None)
        if old is not None:
            os.environ["LIK_CHUNK_ELEMENTS"] = old


@pytest.mark.parametrize("budget", [None, "70"], ids=["default-budget", "budget-70"])
@pytest.mark.parametrize("layout", ["cross", "kd"])
def test_exact_ties_go_to_the_lowest_index(gen, monkeypatch, layout, budget):
    if budget is not None:
        monkeypatch.setenv("LIK_CHUNK_ELEMENTS", budget)
    check_exact_ties(gen, layout, chunked.forward)


def test_built_documents_without_any_winner_get_zero_gradients(gen):
    """Every projected document token masked: no token wins anywhere, so the winner
    backward has no rows to rebuild, and every gradient is an exact zero."""
    Q = torch.randn(2, 3, 8, generator=gen, requires_grad=True)
    H = torch.randn(4, 5, 16, generator=gen, requires_grad=True)
    W = torch.randn(8, 16, generator=gen, requires_grad=True)
    b = torch.randn(8, generator=gen, requires_grad=True)
    scores = lik.maxsim_from_hidden(Q, H, W, b, torch.zeros(4, 5, dtype=torch.bool))
    assert torch.equal(scores, torch.zeros(2, 4))
    for g, x in zip(torch.autograd.grad(scores, (Q, H, W, b), torch.randn(2, 4, generator=gen)), (Q, H, W, b)):
        assert torch.equal(g, torch.zeros_like(x))
