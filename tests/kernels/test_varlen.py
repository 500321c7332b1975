"""The packed (varlen) ops on a CUDA device at realistic sizes (marker ``gpu``):
``maxsim_varlen``, ``score_pairs_packed`` and ``maxsim_padded``, served by the Triton kernels,
against the float64 reference (values and gradients), and packed launches replayed with new
counts and lengths.

The packed forward, backward and input-check launches replay their compiled binary under a
key that leaves out the unspecialised integers (query and document counts, pair counts,
length bounds: ``kernels/triton/launch.py``, ``checks.py``); a call whose counts differ from
the call that built the plan must still compute its own scores and gradients.
"""
from __future__ import annotations

import pytest
import torch

import lik_plugins as lik
from lik_plugins.kernels import reference
from support.cuda_testlib import (
    CUDA, DEVICE, DTYPES, SIZES, TOL, cuda_generator, fresh_routing_counts, hole_mask, ragged, random_lengths, served,
    weighted_grads,
)  # noqa: F401  (fresh_routing_counts: a fixture)
from support.maxsim_testlib import rel_err

pytestmark = [*CUDA, pytest.mark.usefixtures("fresh_routing_counts")]


def _check_packed(seed, q_lengths, d_lengths, dtype, d, *, pairs=None, mode="exclude", normalize=False,
                  grads=True, holes=True):
    """The packed op (cross product, or the pair list ``pairs``) against the fp64
    reference, values and gradients; masked tokens get exact zero gradients.  With
    ``holes``: random holes and document 2 fully masked."""
    g = cuda_generator(seed)
    Qp, cu_q, mq = lik.pack(ragged(g, q_lengths, d, dtype))
    Dp, cu_d, md = lik.pack(ragged(g, d_lengths, d, dtype))
    qm = dm = None
    if holes:
        qm, dm = hole_mask(g, Qp.shape[0]), hole_mask(g, Dp.shape[0])
        dm[cu_d[2]:cu_d[3]] = False
    kw = dict(q_mask=qm, d_mask=dm, normalize=normalize, mask_mode=mode)
    Qp.requires_grad_(grads)
    Dp.requires_grad_(grads)
    Q64 = Qp.detach().double().requires_grad_(grads)
    D64 = Dp.detach().double().requires_grad_(grads)
    with torch.set_grad_enabled(grads):
        if pairs is None:
            entry, shape = "maxsim_varlen", (len(q_lengths), len(d_lengths))
            out = lik.maxsim_varlen(Qp, Dp, cu_q, cu_d, mq, md, **kw)
            want = reference.maxsim_varlen(Q64, D64, cu_q, cu_d, **kw)
        else:
            entry, shape = "score_pairs_packed", tuple(pairs[0].shape)
            out = lik.score_pairs_packed(Qp, Dp, cu_q, cu_d, *pairs, max_seqlen_q=mq, max_seqlen_d=md, **kw)
            want = reference.score_pairs_packed(Q64, D64, cu_q, cu_d, *pairs, **kw)
    served(entry)
    assert out.shape == shape and out.dtype == torch.float32
    fwd_tol, bwd_tol = TOL[dtype]
    assert rel_err(out, want) < fwd_tol
    if grads:
        w = torch.randn(out.shape, generator=g, device=DEVICE, dtype=torch.float64)
        got_q, got_d = weighted_grads(out, (Qp, Dp), w)
        want_q, want_d = weighted_grads(want, (Q64, D64), w)
        assert got_q.dtype == got_d.dtype == dtype
        assert rel_err(got_q, want_q) < bwd_tol and rel_err(got_d, want_d) < bwd_tol
        if holes:
            assert not got_q[~qm].any() and not got_d[~dm].any()
    return out.detach(), (Qp.detach(), Dp.detach(), cu_q, cu_d, qm, dm)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [128, 96])
@pytest.mark.parametrize("mode,normalize", [("exclude", False), ("zero", True)])
def test_varlen_cross_product(dtype, d, mode, normalize):
    g = cuda_generator(1)
    lo, hi = SIZES["LD"]
    q_lengths = random_lengths(g, SIZES["CROSS_Q"], 1, SIZES["LQ"])
    q_lengths[3] = 0                                      # an empty query
    d_lengths = random_lengths(g, SIZES["CROSS_D"], lo, hi)
    d_lengths[1], d_lengths[5] = 0, 1                     # an empty document inside the batch, Ld = 1
    out, _ = _check_packed(2, q_lengths, d_lengths, dtype, d, mode=mode, normalize=normalize)
    assert not out[:, 1].any() and not out[:, 2].any() and not out[3].any()   # empty, fully masked, empty query


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode,normalize", [("exclude", True), ("zero", False)])
def test_pair_list_unsorted_with_duplicates(dtype, mode, normalize):
    g = cuda_generator(3)
    lo, hi = SIZES["LD"]
    nq, nd = SIZES["PAIR_Q"], SIZES["PAIR_D"]
    q_lengths = random_lengths(g, nq, 1, SIZES["LQ"])
    q_lengths[0] = 0
    d_lengths = random_lengths(g, nd, lo, hi)
    d_lengths[1] = 0
    pair_q = torch.randint(0, nq, (SIZES["PAIRS"],), generator=g, device=DEVICE)
    pair_d = torch.randint(0, nd, (SIZES["PAIRS"],), generator=g, device=DEVICE)
    # unsorted by construction; (5, 7) three times, the empty query and the empty document
    pair_q[:5] = torch.tensor([5, 0, 5, 2, 5])
    pair_d[:5] = torch.tensor([7, 3, 7, 1, 7])
    out, (Qp, Dp, cu_q, cu_d, qm, dm) = _check_packed(4, q_lengths, d_lengths, dtype, 128, pairs=(pair_q, pair_d),
                                                      mode=mode, normalize=normalize)
    assert out[0] == out[2] == out[4]
    assert out[1] == 0 and out[3] == 0
    cross = lik.maxsim_varlen(Qp, Dp, cu_q, cu_d, q_mask=qm, d_mask=dm, normalize=normalize, mask_mode=mode)
    assert rel_err(out, cross[pair_q, pair_d]) < TOL[dtype][0]


def test_one_pair_no_queries_no_pairs():
    g = cuda_generator(5)
    Qp, cu_q, _ = lik.pack(ragged(g, [32], 128, torch.bfloat16))
    Dp, cu_d, _ = lik.pack(ragged(g, [120, 0, 257], 128, torch.bfloat16))
    one = lik.score_pairs_packed(Qp, Dp, cu_q, cu_d, torch.tensor([0], device=DEVICE),
                                 torch.tensor([2], device=DEVICE))
    want = reference.maxsim(Qp[None].double(), Dp[None, 120:].double())[0]
    assert one.shape == (1,) and rel_err(one, want) < TOL[torch.bfloat16][0]
    none = lik.score_pairs_packed(Qp, Dp, cu_q, cu_d, torch.zeros(0, dtype=torch.int32, device=DEVICE),
                                  torch.zeros(0, dtype=torch.int32, device=DEVICE))
    assert none.shape == (0,)
    Dr = Dp.clone().requires_grad_()
    empty_q = torch.zeros(0, 128, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
    out = lik.maxsim_varlen(empty_q, Dr, torch.zeros(1, dtype=torch.int32, device=DEVICE), cu_d)
    assert out.shape == (0, 3)
    out.sum().backward()
    assert Dr.grad is not None and not Dr.grad.any() and not Dr.grad.isnan().any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rerank_one_query_1000_documents(dtype):
    g = cuda_generator(6)
    d_lengths = random_lengths(g, SIZES["RERANK_DOCS"], *SIZES["LD"])
    empty = len(d_lengths) // 2
    d_lengths[empty] = 0
    with torch.no_grad():
        out, _ = _check_packed(7, [SIZES["LQ"]], d_lengths, dtype, 128, grads=False, holes=False)
    assert out[0, empty] == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_in_batch_training_shape(dtype):
    g = cuda_generator(8)
    b = SIZES["TRAIN_B"]
    _check_packed(9, random_lengths(g, b, 1, SIZES["LQ"]), random_lengths(g, b, *SIZES["LD"]), dtype, 128, mode="zero")


@pytest.mark.parametrize("dtype,normalize,d", [(torch.float32, False, 128), (torch.bfloat16, True, 128),
                                               (torch.bfloat16, False, 96)], ids=["fp32", "bf16-normalize", "bf16-d96"])
def test_padded_with_lengths(dtype, normalize, d):
    g = cuda_generator(10)
    b, c, lq, ld = SIZES["PAD_B"], SIZES["PAD_C"], SIZES["LQ"], SIZES["LD"][1]
    q_len = torch.randint(0, lq + 1, (b,), generator=g, device=DEVICE)
    d_len = torch.randint(0, ld + 1, (b, c), generator=g, device=DEVICE)
    q_len[0], q_len[1], d_len[0, 1], d_len[2, 3] = lq, 0, 0, ld
    Q = torch.randn(b, lq, d, generator=g, device=DEVICE)
    D = torch.randn(b, c, ld, d, generator=g, device=DEVICE)
    # padding holds large values: any that took part would dominate the max
    Q[torch.arange(lq, device=DEVICE) >= q_len[:, None]] = 50.0
    D[torch.arange(ld, device=DEVICE) >= d_len[..., None]] = 50.0
    Q, D = Q.to(dtype).requires_grad_(), D.to(dtype).requires_grad_()
    out = lik.maxsim_padded(Q, D, q_len, d_len, normalize=normalize)
    served("maxsim_padded")
    Q64, D64 = Q.detach().double().requires_grad_(), D.detach().double().requires_grad_()
    want = reference.maxsim_padded(Q64, D64, q_len, d_len, normalize=normalize)
    assert out.shape == (b, c) and rel_err(out, want) < TOL[dtype][0]
    assert not out[1].any() and out[0, 1] == 0
    w = torch.randn(out.shape, generator=g, device=DEVICE, dtype=torch.float64)
    (gq, gd), (wq, wd) = weighted_grads(out, (Q, D), w), weighted_grads(want, (Q64, D64), w)
    assert rel_err(gq, wq) < TOL[dtype][1] and rel_err(gd, wd) < TOL[dtype][1]
    assert not gd[torch.arange(ld, device=DEVICE) >= d_len[..., None]].any()


def test_int64_offsets_follow_the_rule():
    """int64 offsets and pair indices are checked, then converted to int32: the same
    scores, bit for bit, with or without the max_seqlen bounds; a packed tensor of more
    than 2**31 - 1 tokens is refused before anything runs."""
    g = cuda_generator(11)
    Qp, cu_q, mq = lik.pack(ragged(g, [32, 7, 0, 19], 128, torch.bfloat16))
    Dp, cu_d, md = lik.pack(ragged(g, [300, 0, 51, 180], 128, torch.bfloat16))
    want = lik.maxsim_varlen(Qp, Dp, cu_q, cu_d)
    assert torch.equal(lik.maxsim_varlen(Qp, Dp, cu_q.long(), cu_d.long()), want)
    assert torch.equal(lik.maxsim_varlen(Qp, Dp, cu_q.long(), cu_d.long(), mq, md), want)
    pq, pd = torch.tensor([3, 0, 2, 0], device=DEVICE), torch.tensor([2, 3, 1, 0], device=DEVICE)
    pairs = lik.score_pairs_packed(Qp, Dp, cu_q.long(), cu_d.long(), pq.long(), pd.long())
    assert torch.equal(pairs, lik.score_pairs_packed(Qp, Dp, cu_q, cu_d, pq.int(), pd.int()))
    huge = torch.zeros(1, 128, dtype=torch.bfloat16, device=DEVICE).expand(2**31, 128)   # a view: no memory
    with pytest.raises(ValueError, match="do not fit int32 offsets"):
        lik.maxsim_varlen(Qp, huge, cu_q, torch.tensor([0, 2**31], dtype=torch.int64, device=DEVICE))


def test_offsets_that_do_not_match_the_packed_tensor_are_errors():
    # Host-checked path only (max_seqlen omitted): with the bounds given the check is a
    # device-side assertion, which would end this process's CUDA context.
    g = cuda_generator(12)
    Qp, cu_q, _ = lik.pack(ragged(g, [5, 9], 128, torch.bfloat16))
    Dp, cu_d, _ = lik.pack(ragged(g, [60, 0, 70], 128, torch.bfloat16))
    bad = {"end at the packed length 130": [0, 60, 60, 129], "start at 0": [1, 60, 60, 130],
           "never decrease": [0, 70, 60, 130]}
    for message, offsets in bad.items():
        with pytest.raises(ValueError, match=message):
            lik.maxsim_varlen(Qp, Dp, cu_q, torch.tensor(offsets, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[2\] = 15 is past the packed length 14"):
        lik.score_pairs_packed(Qp, Dp, torch.tensor([0, 5, 15], device=DEVICE), cu_d,
                               torch.tensor([0], device=DEVICE), torch.tensor([0], device=DEVICE))
    with pytest.raises(ValueError, match=r"pair_q_idx\[1\] = 2: pair indices must lie in \[0, Nq=2\)"):
        lik.score_pairs_packed(Qp, Dp, cu_q, cu_d, torch.tensor([0, 2], device=DEVICE),
                               torch.tensor([0, 1], device=DEVICE))


# ------------------------------------------------------------------ replayed launches
def _packed(g, lengths, d=128):
    seqs = [torch.randn(n, d, generator=g, device=DEVICE).bfloat16() for n in lengths]
    return lik.pack(seqs)


def test_cross_product_training_with_changing_counts():
    g = torch.Generator(device=DEVICE).manual_seed(0)
    for nq, nd, (lo, hi) in ((6, 9, (20, 90)), (11, 5, (1, 200)), (3, 17, (40, 60))):
        Qp, cu_q, mq = _packed(g, random_lengths(g, nq, 1, 32))
        Dp, cu_d, md = _packed(g, random_lengths(g, nd, lo, hi))
        Qp.requires_grad_()
        Dp.requires_grad_()
        Q64 = Qp.detach().double().requires_grad_()
        D64 = Dp.detach().double().requires_grad_()
        out = lik.maxsim_varlen(Qp, Dp, cu_q, cu_d, mq, md)
        want = reference.maxsim_varlen(Q64, D64, cu_q, cu_d)
        assert out.shape == (nq, nd) and rel_err(out, want) < TOL[torch.bfloat16][0]
        w = torch.randn(out.shape, generator=g, device=DEVICE, dtype=torch.float64)
        got = torch.autograd.grad((out.double() * w).sum(), (Qp, Dp))
        ref = torch.autograd.grad((want * w).sum(), (Q64, D64))
        assert all(rel_err(a, b) < TOL[torch.bfloat16][1] for a, b in zip(got, ref))


def test_pair_lists_and_reranks_with_changing_counts():
    g = torch.Generator(device=DEVICE).manual_seed(1)
    for nq, nd, n_pairs in ((4, 30, 50), (7, 12, 333), (2, 90, 7)):
        Qp, cu_q, mq = _packed(g, random_lengths(g, nq, 8, 32))
        Dp, cu_d, md = _packed(g, random_lengths(g, nd, 1, 250))
        pq = torch.randint(0, nq, (n_pairs,), generator=g, device=DEVICE)
        pd = torch.randint(0, nd, (n_pairs,), generator=g, device=DEVICE)
        with torch.no_grad():
            out = lik.score_pairs_packed(Qp, Dp, cu_q, cu_d, pq, pd, max_seqlen_q=mq, max_seqlen_d=md)
            rerank = lik.maxsim_varlen(Qp, Dp, cu_q, cu_d, mq, md)
        Q64, D64 = Qp.double(), Dp.double()
        assert rel_err(out, reference.score_pairs_packed(Q64, D64, cu_q, cu_d, pq, pd)) < TOL[torch.bfloat16][0]
        assert rel_err(rerank, reference.maxsim_varlen(Q64, D64, cu_q, cu_d)) < TOL[torch.bfloat16][0]
