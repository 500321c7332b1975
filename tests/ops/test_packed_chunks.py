"""Every packed op's CPU paths at sizes that span several chunks: property tests that draw up
to a few hundred sequences of up to ~1000 tokens (the chunked path under small and default
``LIK_CHUNK_ELEMENTS`` budgets; the Triton kernels in the interpreter, fewer and smaller),
forward and backward against the float64 reference; and the shape that crashed the chunked
varlen backward (issue 37) as a regular test.

Packed ops covered: ``maxsim_varlen``, ``score_pairs_packed``, ``maxsim_padded``
(``lik_plugins.ops.packed``), ``maxsim_residual_varlen`` with and without a gradient and
``plaid_approx_score`` (``lik_plugins.ops.plaid``).  (``lik_plugins.ops.quantized`` is the fp8/int8
token container: it has no packed op.)

The cost is bounded: few examples, small embedding dims, and reference loops of at most a
few hundred pairs.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lik_plugins as lik
from lik_plugins.kernels import reference
from support.maxsim_testlib import _triton_interpretable, generator, rel_err

FP32_TOL = 2e-5
CHUNKED = "torch-chunked"
# budgets (similarities per chunk): one row at a time, a few rows, and the default
BUDGETS = (1, 97, 5000, None)
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
needs_interpreter = pytest.mark.skipif(not _triton_interpretable(), reason="needs triton and TRITON_INTERPRET=1")


@contextlib.contextmanager
def _env(**values):
    """Set LIK_* variables (None: unset) for one hypothesis example (function-scoped fixtures
    would not reset between examples)."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in values.items():
            if value is None:
                patch.delenv(name, raising=False)
            else:
                patch.setenv(name, str(value))
        yield


def _lengths(gen, n: int, longest: int) -> list[int]:
    """``n`` lengths in ``[0, longest]``, mostly short, one of them ``longest`` and (for
    ``n > 2``) one empty."""
    short = max(1, longest // 8)
    out = torch.randint(0, short + 1, (n,), generator=gen)
    long_ones = torch.rand(n, generator=gen) < 0.1
    out = torch.where(long_ones, torch.randint(0, longest + 1, (n,), generator=gen), out)
    out[int(torch.randint(0, n, (1,), generator=gen))] = longest
    if n > 2:
        empty = int(torch.randint(0, n, (1,), generator=gen))
        out[empty] = 0 if out[empty] != longest else out[empty]
    return out.tolist()


def _packed(gen, lengths, d):
    x = torch.randn(sum(lengths), d, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lengths, dtype=torch.long).cumsum(0).tolist()], dtype=torch.int32)
    return x, cu


def _mask(gen, n, masks):
    return (torch.rand(n, generator=gen) > 0.3) if masks else None


def _weighted_grads(out, inputs, w):
    return torch.autograd.grad((out.double() * w).sum(), inputs, allow_unused=True)


def _check(got, want, bound):
    """Scores within fp32 rounding of the terms they sum (``bound``: the same op on |Q|, |D|)."""
    assert got.shape == want.shape and got.dtype == torch.float32
    assert rel_err(got, want, bound) < FP32_TOL


def _packed_queries_and_documents(case):
    """``(generator, query lengths, document lengths, (Q, cu_q), (D, cu_d))`` of a case."""
    gen = generator(case["seed"])
    lq, ld = _lengths(gen, case["nq"], case["max_q"]), _lengths(gen, case["nd"], case["max_d"])
    return gen, lq, ld, _packed(gen, lq, case["d"]), _packed(gen, ld, case["d"])


def _check_packed_op(case, backend, budget, gen, Q, D, q_mask, d_mask, score, spec):
    """``score(Q, D, **options)`` on ``backend`` (chunk budget ``budget``) against the float64
    ``spec`` with the same options: the scores, and the gradients of a random weighting of
    them (zero where no score depends on a token)."""
    kw = dict(q_mask=q_mask, d_mask=d_mask, normalize=case["normalize"], mask_mode=case["mask_mode"])
    Q.requires_grad_()
    D.requires_grad_()
    with _env(LIK_BACKEND=backend, LIK_CHUNK_ELEMENTS=budget):
        out = score(Q, D, **kw)
        w = torch.randn(out.shape, generator=gen, dtype=torch.float64)
        got = _weighted_grads(out, (Q, D), w)
    Q64, D64 = (t.detach().double().requires_grad_() for t in (Q, D))
    want = spec(Q64, D64, **kw)
    _check(out, want, spec(Q64.detach().abs(), D64.detach().abs(), **{**kw, "mask_mode": "exclude"}))
    want_g = _weighted_grads(want, (Q64, D64), w) if want.numel() else (torch.zeros_like(Q64), torch.zeros_like(D64))
    for a, r in zip(got, want_g):
        a = torch.zeros_like(r) if a is None else a
        assert rel_err(a, r) < FP32_TOL


# ------------------------------------------------------------------ maxsim_varlen
SHAPES = {  # (queries, documents, longest query, longest document)
    "many-docs": (st.integers(1, 2), st.integers(100, 300), 48, 1000),
    "many-queries": (st.integers(100, 300), st.integers(1, 2), 48, 1000),
    "square": (st.integers(2, 16), st.integers(2, 16), 48, 600),
    "long-queries": (st.integers(1, 3), st.integers(2, 12), 1000, 200),
}


@st.composite
def varlen_case(draw, shapes=tuple(SHAPES)):
    kind = draw(st.sampled_from(shapes))
    nq_s, nd_s, max_q, max_d = SHAPES[kind]
    return dict(nq=draw(nq_s), nd=draw(nd_s), max_q=draw(st.integers(1, max_q)), max_d=draw(st.integers(1, max_d)),
                d=draw(st.sampled_from([3, 8, 16])), mask_mode=draw(st.sampled_from(["exclude", "zero"])),
                normalize=draw(st.booleans()), masks=draw(st.booleans()), seed=draw(st.integers(0, 2**31 - 1)))


def _varlen_check(case, backend, budget):
    gen, lq, ld, (Q, cu_q), (D, cu_d) = _packed_queries_and_documents(case)
    q_mask, d_mask = _mask(gen, Q.shape[0], case["masks"]), _mask(gen, D.shape[0], case["masks"])
    _check_packed_op(case, backend, budget, gen, Q, D, q_mask, d_mask,
                     lambda q, d, **kw: lik.maxsim_varlen(q, d, cu_q, cu_d, max(lq), max(ld), **kw),
                     lambda q, d, **kw: reference.maxsim_varlen(q, d, cu_q, cu_d, **kw))


@settings(max_examples=8, **SETTINGS)
@given(case=varlen_case(), budget=st.sampled_from(BUDGETS))
def test_varlen_property_chunked(case, budget):
    _varlen_check(case, CHUNKED, budget)


@needs_interpreter
@settings(max_examples=3, **SETTINGS)
@given(case=varlen_case(shapes=("square", "long-queries")))
def test_varlen_property_triton(case):
    _varlen_check(case, "triton", None)


def test_varlen_issue37_shape_chunked():
    """Issue 37's crash: 128 queries of 16-48 tokens x 128 documents of 100-500, d 128, forward
    and backward on the chunked path at the default budget (the backward's last query chunk
    is partial).  The weights of the scores are zero except for queries at chunk edges and
    in the last chunk, so the float64 reference needs only those rows: their scores, their
    gradients, and the documents' gradients (which only they feed); every other query's
    gradient must be exactly zero."""
    gen = generator(37)
    lq = torch.randint(16, 49, (128,), generator=gen).tolist()
    ld = torch.randint(100, 501, (128,), generator=gen).tolist()
    Q, cu_q = _packed(gen, lq, 128)
    D, cu_d = _packed(gen, ld, 128)
    Q.requires_grad_()
    D.requires_grad_()
    out = lik.maxsim_varlen(Q, D, cu_q, cu_d)
    assert lik.routing_counts()["maxsim_varlen"].get(CHUNKED, 0) >= 1
    rows = torch.tensor([0, 20, 21, 64, 105, 125, 126, 127])
    w = torch.zeros(out.shape, dtype=torch.float64)
    w[rows] = torch.randn(len(rows), out.shape[1], generator=gen, dtype=torch.float64)
    gq, gd = _weighted_grads(out, (Q, D), w)

    Q64, D64 = (t.detach().double().requires_grad_() for t in (Q, D))
    starts = cu_q[:-1].long()
    picked = torch.cat([torch.arange(int(starts[i]), int(starts[i]) + lq[i]) for i in rows])
    cu_sub = torch.tensor([0, *torch.tensor([lq[i] for i in rows]).cumsum(0).tolist()], dtype=torch.int32)
    want = reference.maxsim_varlen(Q64[picked], D64, cu_sub, cu_d)
    # (no cancellation: every term is a max over 100+ tokens, far above 0)
    assert rel_err(out[rows], want) < FP32_TOL
    rq, rd = torch.autograd.grad((want * w[rows]).sum(), (Q64, D64))
    assert rel_err(gq, rq) < FP32_TOL and rel_err(gd, rd) < FP32_TOL
    others = torch.ones(Q.shape[0], dtype=torch.bool)
    others[picked] = False
    assert torch.equal(gq[others], torch.zeros_like(gq[others]))


# ------------------------------------------------------------------ score_pairs_packed
@st.composite
def pairs_case(draw, max_seqs=300, max_len=1000, max_pairs=300):
    return dict(nq=draw(st.integers(1, max_seqs)), nd=draw(st.integers(1, max_seqs)),
                n_pairs=draw(st.integers(0, max_pairs)), order=draw(st.sampled_from(["random", "by-query"])),
                max_q=draw(st.integers(1, 48)), max_d=draw(st.integers(1, max_len)),
                d=draw(st.sampled_from([3, 8, 16])), mask_mode=draw(st.sampled_from(["exclude", "zero"])),
                normalize=draw(st.booleans()), masks=draw(st.booleans()), seed=draw(st.integers(0, 2**31 - 1)))


def _pairs_check(case, backend, budget):
    gen, lq, ld, (Q, cu_q), (D, cu_d) = _packed_queries_and_documents(case)
    n = case["n_pairs"]
    pq = torch.randint(0, case["nq"], (n,), generator=gen)
    pd = torch.randint(0, case["nd"], (n,), generator=gen)
    if n > 1:
        pd[-1], pq[-1] = pd[0], pq[0]                          # a repeated pair: its gradients add up
    if case["order"] == "by-query":                            # runs of one query (a rerank's layout)
        pq = pq.sort().values
    q_mask, d_mask = _mask(gen, Q.shape[0], case["masks"]), _mask(gen, D.shape[0], case["masks"])
    _check_packed_op(case, backend, budget, gen, Q, D, q_mask, d_mask,
                     lambda q, d, **kw: lik.score_pairs_packed(q, d, cu_q, cu_d, pq, pd, max_seqlen_q=max(lq),
                                                               max_seqlen_d=max(ld), **kw),
                     lambda q, d, **kw: reference.score_pairs_packed(q, d, cu_q, cu_d, pq, pd, **kw))


@settings(max_examples=8, **SETTINGS)
@given(case=pairs_case(), budget=st.sampled_from(BUDGETS))
def test_pairs_property_chunked(case, budget):
    _pairs_check(case, CHUNKED, budget)


@needs_interpreter
@settings(max_examples=3, **SETTINGS)
@given(case=pairs_case(max_seqs=40, max_len=200, max_pairs=100))
def test_pairs_property_triton(case):
    _pairs_check(case, "triton", None)


# ------------------------------------------------------------------ maxsim_padded
@st.composite
def padded_case(draw):
    return dict(b=draw(st.integers(1, 24)), c=draw(st.integers(1, 6)), lq=draw(st.integers(1, 32)),
                ld=draw(st.integers(1, 1000)), d=draw(st.sampled_from([3, 8, 16])), normalize=draw(st.booleans()),
                seed=draw(st.integers(0, 2**31 - 1)))


def _padded_check(case, backend, budget):
    gen = generator(case["seed"])
    b, c, lq, ld, d = (case[k] for k in ("b", "c", "lq", "ld", "d"))
    Q = torch.randn(b, lq, d, generator=gen, requires_grad=True)
    D = torch.randn(b, c, ld, d, generator=gen, requires_grad=True)
    q_len = torch.randint(0, lq + 1, (b,), generator=gen)
    d_len = torch.randint(0, ld + 1, (b, c), generator=gen)
    d_len.view(-1)[0] = ld
    with _env(LIK_BACKEND=backend, LIK_CHUNK_ELEMENTS=budget):
        out = lik.maxsim_padded(Q, D, q_len, d_len, normalize=case["normalize"])
        w = torch.randn(out.shape, generator=gen, dtype=torch.float64)
        got = _weighted_grads(out, (Q, D), w)
    Q64, D64 = (t.detach().double().requires_grad_() for t in (Q, D))
    want = reference.maxsim_padded(Q64, D64, q_len, d_len, normalize=case["normalize"])
    bound = reference.maxsim_padded(Q64.detach().abs(), D64.detach().abs(), q_len, d_len,
                                    normalize=case["normalize"])
    _check(out, want, bound)
    for a, r in zip(got, _weighted_grads(want, (Q64, D64), w)):
        assert rel_err(a, r) < FP32_TOL


@settings(max_examples=6, **SETTINGS)
@given(case=padded_case(), budget=st.sampled_from(BUDGETS))
def test_padded_property_chunked(case, budget):
    _padded_check(case, CHUNKED, budget)


# ------------------------------------------------------------------ PLAID residual ops
@st.composite
def residual_case(draw, max_docs=300, max_len=1000):
    nbits = draw(st.sampled_from([1, 2, 4, 8]))
    return dict(nq=draw(st.integers(1, 3)), lq=draw(st.integers(1, 32)), nd=draw(st.integers(1, max_docs)),
                max_d=draw(st.integers(1, max_len)), d=draw(st.sampled_from([8, 16, 24])), nbits=nbits,
                n_centroids=draw(st.integers(1, 40)), normalize=draw(st.booleans()), grad=draw(st.booleans()),
                seed=draw(st.integers(0, 2**31 - 1)))


def _residual_index(gen, case):
    """A packed index: random codes and buckets, written with the reference's bit packing."""
    d, nbits = case["d"], case["nbits"]
    lengths = _lengths(gen, case["nd"], case["max_d"])
    n = sum(lengths)
    centroids = torch.randn(case["n_centroids"], d, generator=gen)
    weights = torch.randn(1 << nbits, generator=gen) * 0.2
    codes = torch.randint(0, case["n_centroids"], (n,), generator=gen, dtype=torch.int32)
    buckets = torch.randint(0, 1 << nbits, (n, d), generator=gen)
    residuals = reference.pack_buckets(buckets, nbits) if n else torch.empty((0, d * nbits // 8), dtype=torch.uint8)
    cu = torch.tensor([0, *torch.tensor(lengths, dtype=torch.long).cumsum(0).tolist()], dtype=torch.int32)
    return codes, residuals, cu, centroids, weights, lengths


def _residual_check(case, backend, budget):
    gen = generator(case["seed"])
    codes, residuals, cu, centroids, weights, lengths = _residual_index(gen, case)
    Q = torch.randn(case["nq"], case["lq"], case["d"], generator=gen) * 3      # not unit length
    Q.requires_grad_(case["grad"])
    args = (codes, residuals, cu, centroids, weights, case["nbits"])
    with _env(LIK_BACKEND=backend, LIK_CHUNK_ELEMENTS=budget):
        out = lik.maxsim_residual_varlen(Q, *args, max_seqlen_d=max(lengths), normalize=case["normalize"])
        w = torch.randn(out.shape, generator=gen, dtype=torch.float64)
        got = _weighted_grads(out, (Q,), w)[0] if case["grad"] else None
    Q64 = Q.detach().double().requires_grad_()
    p_codes, p_res, p_len = reference.pad_packed_index(codes, residuals, cu, max(lengths))
    index = (p_codes, p_res, p_len, centroids.double(), weights.double(), case["nbits"])
    want = reference.maxsim_residual(Q64, *index, normalize=case["normalize"])
    # each term is at most |q| . |d| of the tokens as scored
    valid = reference.lengths_mask(p_len, p_codes.shape[1])
    docs = reference.decompress_residual(torch.where(valid, p_codes, torch.zeros_like(p_codes)), p_res, *index[3:])
    q = Q64.detach()
    if case["normalize"]:
        q, docs = F.normalize(q, dim=-1), F.normalize(docs, dim=-1)
    bound = reference.maxsim(q.abs(), docs.abs(), None, valid)
    _check(out, want, bound)
    if case["grad"]:
        assert rel_err(got, _weighted_grads(want, (Q64,), w)[0]) < FP32_TOL


@settings(max_examples=8, **SETTINGS)
@given(case=residual_case(), budget=st.sampled_from(BUDGETS))
def test_residual_varlen_property_chunked(case, budget):
    _residual_check(case, CHUNKED, budget)


@needs_interpreter
@settings(max_examples=3, **SETTINGS)
@given(case=residual_case(max_docs=60, max_len=400))
def test_residual_varlen_property_triton(case):
    _residual_check(case, "triton", None)


@settings(max_examples=6, **SETTINGS)
@given(b=st.integers(1, 300), ld=st.integers(1, 1000), lq=st.integers(1, 32), n_centroids=st.integers(1, 64),
       seed=st.integers(0, 2**31 - 1), backend=st.sampled_from([CHUNKED, "triton"]))
def test_plaid_approx_score_property(b, ld, lq, n_centroids, seed, backend):
    if backend == "triton" and not _triton_interpretable():
        return
    gen = generator(seed)
    S = torch.randn(n_centroids, lq, generator=gen)
    codes = torch.randint(0, n_centroids, (b, ld), generator=gen, dtype=torch.int32)
    lengths = torch.tensor(_lengths(gen, b, ld))
    with _env(LIK_BACKEND=backend):
        out = lik.plaid_approx_score(S, codes, lengths)
    want = reference.plaid_approx_score(S.double(), codes, lengths)
    bound = reference.plaid_approx_score(S.double().abs(), codes, lengths)
    _check(out, want, bound)
