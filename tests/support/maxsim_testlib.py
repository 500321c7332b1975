"""Shared helpers for the core-op tests (``tests/kernels``, ``tests/ops``).

Every numeric check runs the public op on fresh random inputs (masks with holes, a fully
masked query, a fully masked document, a document whose similarities with one valid
query token are all negative) and compares scores *and* gradients against the float64
reference :mod:`lik_plugins.kernels.reference`, autograd by torch.
"""
from __future__ import annotations

import zlib

import pytest
import torch

import lik_plugins as lik
from lik_plugins.kernels import reference

LAYOUTS = ("cross", "kd", "pairs")
MASK_MODES = ("exclude", "zero")

# Relative max-norm error against the float64 reference: (scores, gradients).
# bf16 gradients are written in bf16 (one rounding, 2**-8 relative), fp32 is near exact.
TOL = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (2e-5, 2e-5),
    torch.float16: (1e-3, 4e-3),
    torch.bfloat16: (1e-4, 1.5e-2),
}


class LaunchSpy:
    """Stands in for a Triton kernel object and counts its launches."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]

    def __getattr__(self, name):  # warmup() and the rest: the kernel's own
        return getattr(self.kernel, name)


def force_forward_block_n(monkeypatch, block_n: int) -> None:
    """Make every forward launch use document tiles of ``block_n`` tokens (the autotuner's
    or the fixed small-launch choice otherwise), keeping the rest of its meta-parameters."""
    from lik_plugins.kernels.triton import launch

    real = launch.forward_kernel_and_meta

    def with_block_n(**kw):
        kernel, meta, after = real(**kw)
        return kernel, {**meta, "BLOCK_N": block_n}, after

    monkeypatch.setattr(launch, "forward_kernel_and_meta", with_block_n)


def seed_of(nodeid: str) -> int:
    """A per-test seed: fresh inputs for every test, reproducible across runs."""
    return zlib.crc32(nodeid.encode())


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def doc_shape(layout: str, nq: int, nj: int, ld: int, d: int) -> tuple[int, ...]:
    if layout == "cross":
        return (nj, ld, d)
    if layout == "kd":
        return (nq, nj, ld, d)
    if layout == "pairs":
        return (nq, ld, d)
    raise ValueError(layout)


def out_shape(layout: str, nq: int, nj: int) -> tuple[int, ...]:
    return (nq,) if layout == "pairs" else (nq, nj)


def make_inputs(gen, layout, nq, nj, lq, ld, d, dtype=torch.float32, *, masks=True, special_rows=True):
    """Random ``Q``, ``D`` (and masks with holes) for a layout.

    With ``special_rows`` (and enough rows): the last query is fully masked, the last
    document row is fully masked, and document row 0 is built so that query 0's token 0
    has only negative similarities with it (and it has a masked token), which separates
    ``mask_mode="zero"`` from ``"exclude"``.
    """
    Q = torch.randn(nq, lq, d, generator=gen)
    D = torch.randn(*doc_shape(layout, nq, nj, ld, d), generator=gen)
    rows = D.view(-1, ld, d) if ld and d else None
    n_rows = D.numel() // max(ld * d, 1) if ld and d else 0
    if special_rows and rows is not None and nq and lq and n_rows:
        # doc row 0 is seen by query 0 in every layout (cross: all queries; kd: (0, 0); pairs: 0)
        q0 = Q[0, 0]
        u = torch.rand(ld, generator=gen) + 0.5
        rows[0] = -u[:, None] * q0[None, :] + 0.05 * torch.randn(ld, d, generator=gen)
    qm = dm = None
    if masks:
        qm = torch.rand(nq, lq, generator=gen) > 0.25
        dm = torch.rand(*D.shape[:-1], generator=gen) > 0.3
        if special_rows and nq and lq:
            qm[0, 0] = True
            if nq >= 2:
                qm[-1] = False
        dm_rows = dm.view(-1, ld) if ld else None
        if special_rows and dm_rows is not None and n_rows:
            dm_rows[0, 0] = True
            if ld >= 2:
                dm_rows[0, ld // 2] = False
            if n_rows >= 2:
                dm_rows[-1] = False
    return Q.to(dtype), D.to(dtype), qm, dm


def noncontiguous_inputs(gen, layout, nq, nj, lq, ld, d):
    """Q, D, q_mask, d_mask as transposed / permuted views (none of them contiguous)."""
    Q = torch.randn(lq, nq, d, generator=gen).transpose(0, 1)
    if layout == "cross":
        D = torch.randn(nj, d, ld, generator=gen).transpose(1, 2)
        dm = (torch.rand(ld, nj, generator=gen) > 0.3).t()
    else:
        D = torch.randn(nq, ld, nj, d, generator=gen).permute(0, 2, 1, 3)
        dm = (torch.rand(nq, ld, nj, generator=gen) > 0.3).permute(0, 2, 1)
    qm = (torch.rand(lq, nq, generator=gen) > 0.2).t()
    assert not (Q.is_contiguous() or D.is_contiguous() or qm.is_contiguous() or dm.is_contiguous())
    return Q, D, qm, dm


def op(layout):
    return lik.maxsim_pairs if layout == "pairs" else lik.maxsim


def ref_op(layout):
    return reference.maxsim_pairs if layout == "pairs" else reference.maxsim


def rel_err(x: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    """Max abs error over the largest |ref| -- or over the largest ``scale`` where given: an
    upper bound of the terms ``ref`` sums, for sums that may nearly cancel."""
    if ref.numel() == 0:
        return 0.0
    err = (x.double() - ref.double()).abs().max()
    size = ref.double().abs().max() if scale is None else torch.maximum(ref.double().abs().max(),
                                                                        scale.double().abs().max())
    return (err / size.clamp_min(1e-6)).item()


def reference_run(layout, Q, D, qm, dm, grad_out, *, normalize, mask_mode, need_q=True, need_d=True):
    """float64 reference scores and gradients (autograd by torch)."""
    Q64 = Q.detach().double().requires_grad_(need_q)
    D64 = D.detach().double().requires_grad_(need_d)
    out = ref_op(layout)(Q64, D64, qm, dm, normalize=normalize, mask_mode=mask_mode)
    wrt = [t for t in (Q64, D64) if t.requires_grad]
    grads = torch.autograd.grad(out, wrt, grad_out.double()) if wrt and out.numel() else [torch.zeros_like(t) for t in wrt]
    grads = list(grads)
    gq = grads.pop(0) if need_q else None
    gd = grads.pop(0) if need_d else None
    return out.detach(), gq, gd


def check_against_reference(layout, Q, D, qm, dm, *, gen, normalize=False, mask_mode="exclude",
                            backward="auto", tol=None, need_q=True, need_d=True):
    """Run the public op (forward + backward) and compare with the float64 reference.

    Also checks: output shape and dtype, gradient dtypes, exact zero gradients for masked
    query tokens (so fully masked queries) and masked document tokens (so fully masked
    documents).  Returns ``(scores, grad_Q, grad_D)``.
    """
    dtype = Q.dtype
    tol_s, tol_g = tol if tol is not None else TOL[dtype]
    Qr = Q.detach().clone().requires_grad_(need_q)
    Dr = D.detach().clone().requires_grad_(need_d)
    out = op(layout)(Qr, Dr, qm, dm, normalize=normalize, mask_mode=mask_mode, backward=backward)
    nq, nj = Q.shape[0], (D.shape[0] if layout == "cross" else D.shape[1])
    assert out.shape == out_shape(layout, nq, nj)
    assert out.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    grad_out = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(out.dtype)
    ref, rq, rd = reference_run(layout, Q, D, qm, dm, grad_out, normalize=normalize, mask_mode=mask_mode,
                                need_q=need_q, need_d=need_d)
    assert torch.isfinite(out).all()
    # against the scores' conditioning: a score sums per-token maxima of either sign, and the
    # same scores of |Q|, |D| bound every term; a sum that nearly cancels (a property run drew
    # 0.0037 from terms near 10, fp32 off by 6e-4 of it) has a large error relative to itself
    # in any precision
    scale = reference_run(layout, Q.abs(), D.abs(), qm, dm, grad_out, normalize=normalize, mask_mode=mask_mode,
                          need_q=False, need_d=False)[0]
    err = rel_err(out, ref, scale)
    assert err <= tol_s, f"scores: relative error {err:.3g} > {tol_s:g}"

    gq = gd = None
    wrt = [t for t in (Qr, Dr) if t.requires_grad]
    if wrt:
        grads = list(torch.autograd.grad(out, wrt, grad_out))
        gq = grads.pop(0) if need_q else None
        gd = grads.pop(0) if need_d else None
    if need_q:
        assert gq.dtype == dtype and gq.shape == Q.shape
        assert torch.isfinite(gq).all()
        err = rel_err(gq, rq)
        assert err <= tol_g, f"grad_Q: relative error {err:.3g} > {tol_g:g}"
        if qm is not None:
            assert torch.equal(gq[~qm], torch.zeros_like(gq[~qm])), "masked query tokens must get exact zero gradient"
    if need_d:
        assert gd.dtype == dtype and gd.shape == D.shape
        assert torch.isfinite(gd).all()
        err = rel_err(gd, rd)
        assert err <= tol_g, f"grad_D: relative error {err:.3g} > {tol_g:g}"
        if dm is not None:
            masked = gd[~dm]
            assert torch.equal(masked, torch.zeros_like(masked)), "masked doc tokens must get exact zero gradient"
    return out, gq, gd


def expected_argmax(Q, D, qm, dm, layout, mask_mode):
    """The winner index of every (query, document, query token) in float64, -1 where no
    valid document token wins (masked query token, fully masked document, or — in zero
    mode — a masked 0 beating every valid similarity).  ``layout`` is cross or kd."""
    eq = "ash,bth->abst" if layout == "cross" else "ash,abth->abst"
    sim = torch.einsum(eq, Q.double(), D.double())
    if dm is None:
        dv = torch.ones(sim.shape, dtype=torch.bool)
    else:
        dv = (dm.unsqueeze(0) if layout == "cross" else dm).unsqueeze(-2).expand_as(sim)
    best, win = sim.masked_fill(~dv, float("-inf")).max(-1)
    ok = best > float("-inf")
    if mask_mode == "zero":
        ok &= ~((~dv).any(-1) & (best < 0))
    if qm is not None:
        ok &= qm.unsqueeze(1)
    return torch.where(ok, win, torch.full_like(win, -1))


def property_cases(*, max_n: int, max_lq: int, max_ld: int, dims: list[int]):
    """A hypothesis strategy of random property-test cases for :func:`check_property_case`:
    layout, counts up to ``max_n``, lengths, width from ``dims``, mask mode, normalisation,
    masks or none, and the seed of the inputs."""
    from hypothesis import strategies as st

    return st.fixed_dictionaries(dict(
        layout=st.sampled_from(LAYOUTS), nq=st.integers(1, max_n), nj=st.integers(1, max_n),
        lq=st.integers(1, max_lq), ld=st.integers(1, max_ld), d=st.sampled_from(dims),
        mask_mode=st.sampled_from(MASK_MODES), normalize=st.booleans(), masks=st.booleans(),
        seed=st.integers(0, 2**31 - 1),
    ))


def check_property_case(case: dict, **kw) -> None:
    """One :func:`property_cases` case through :func:`check_against_reference` (``kw``: its
    ``backward``, for one)."""
    gen = generator(case["seed"])
    layout = case["layout"]
    Q, D, qm, dm = make_inputs(gen, layout, case["nq"], case["nj"], case["lq"], case["ld"], case["d"],
                               masks=case["masks"])
    check_against_reference(layout, Q, D, qm, dm, gen=gen, normalize=case["normalize"],
                            mask_mode=case["mask_mode"], **kw)


def check_nan_query_poisons_only_its_scores(gen) -> None:
    """A NaN in a valid query token: that query's scores are NaN, the others equal the
    reference, and the backward runs with finite gradients for the other queries."""
    Q, D, qm, dm = make_inputs(gen, "cross", 3, 4, 5, 9, 16, special_rows=False)
    qm[0, 1] = True
    Q[0, 1, 3] = float("nan")
    Q.requires_grad_()
    out = lik.maxsim(Q, D, qm, dm)
    assert torch.isnan(out[0]).all()
    ref = reference.maxsim(Q.detach().double(), D.double(), qm, dm)
    assert rel_err(out[1:], ref[1:]) < 2e-5
    out.sum().backward()  # no crash
    assert torch.isfinite(Q.grad[1:]).all()


def check_nonfinite_masked_tokens_are_ignored(gen) -> None:
    """NaN / inf in masked tokens (query or document) never reach a score."""
    Q, D, qm, dm = make_inputs(gen, "cross", 2, 3, 5, 9, 16, special_rows=False)
    qm[0, 2] = False
    dm[1, 4] = False
    ref = reference.maxsim(Q.double(), D.double(), qm, dm)
    Q[0, 2] = float("nan")
    D[1, 4] = float("inf")
    for mode in MASK_MODES:
        assert torch.isfinite(lik.maxsim(Q, D, qm, dm, mask_mode=mode)).all()
    assert rel_err(lik.maxsim(Q, D, qm, dm), ref) < 2e-5


def check_exact_ties(gen, layout: str, forward, **kw) -> None:
    """Token 3 of document 0 is copied to 67 (same column of the next 64-token tile) and to
    10 (same tile): the argmax of ``forward(Q, D, None, None, cross=..., normalize=False,
    zero_mode=False, save_argmax=True)`` and the gradient (``kw`` for
    :func:`check_against_reference`) must pick token 3, as the reference does."""
    ld, d = 70, 16
    Q, D = tied_inputs(gen, layout, 2, 2, 4, ld, d, copies=(3, 67, 10))
    _, arg = forward(Q, D, None, None, cross=layout == "cross", normalize=False, zero_mode=False, save_argmax=True)
    first = arg[:, 0] if layout == "cross" else arg[0, 0]
    assert (first == 3).all(), first
    assert torch.equal(arg.long(), expected_argmax(Q, D, None, None, layout, "exclude"))
    _, _, gd = check_against_reference(layout, Q, D, None, None, gen=gen, **kw)
    doc0 = gd.reshape(-1, ld, d)[0]
    assert doc0[3].abs().sum() > 0
    assert torch.equal(doc0[10], torch.zeros(d)) and torch.equal(doc0[67], torch.zeros(d))


def _triton_interpretable() -> bool:
    from lik_plugins._config import triton_interpret
    from lik_plugins.kernels import dispatch

    return dispatch.triton_available() and triton_interpret()


def backend_params():
    """``LIK_BACKEND`` values that run kernels on CPU tensors: the chunked torch path
    always, the Triton kernels under the interpreter when it is on."""
    import pytest

    return [
        pytest.param("torch-chunked", id="chunked"),
        pytest.param("triton", id="triton", marks=pytest.mark.skipif(
            not _triton_interpretable(), reason="needs triton and TRITON_INTERPRET=1")),
    ]


def tied_inputs(gen, layout, nq, nj, lq, ld, d, copies):
    """Document row 0 holds exact copies of its token ``copies[0]`` at ``copies[1:]``,
    and every query token prefers it: exact ties that must resolve to the lowest index
    (the reference's rule), in the forward's argmax and so in the gradient.  Small
    integer values make every dot product exact, whatever the summation order."""
    def ints(*shape, lo=-2, hi=3):
        return torch.randint(lo, hi, shape, generator=gen).float()

    D = ints(*doc_shape(layout, nq, nj, ld, d))
    rows = D.view(-1, ld, d)
    target = ints(d, lo=-3, hi=4)
    target[0] = 4.0
    rows[0] = ints(ld, d, lo=-1, hi=2)
    for t in copies:
        rows[0, t] = target
    Q = 2 * target + ints(nq, lq, d, lo=-1, hi=2)
    return Q, D


# ---------------------------------------------------------------- shared fixtures
# (imported by tests/kernels/conftest.py and tests/ops/conftest.py)
LIK_VARS = ("LIK_DISABLE", "LIK_BACKEND", "LIK_CHUNK_ELEMENTS")


@pytest.fixture(autouse=True)
def _clean_lik_env(monkeypatch):
    """Every test starts with the library's switches unset (default routing)."""
    for var in LIK_VARS:
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def gen(request) -> "torch.Generator":
    """Fresh random inputs per test (seeded from the test id, so reproducible)."""
    return generator(seed_of(request.node.nodeid))


def unit_token_lists(n, lo, hi, dim, seed, dtype, shift=0.0) -> list:
    """``n`` candidates of ``lo``..``hi`` unit-norm tokens (each shifted by ``-shift``, so some
    similarities are negative), in ``dtype``: the ragged lists the hosts' list scorers take."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    unit = torch.nn.functional.normalize
    return [(unit(torch.randn(n_tokens, dim, generator=g), dim=-1) - shift).to(dtype) for n_tokens in lengths]
