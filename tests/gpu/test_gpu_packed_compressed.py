"""GPU suite, packed and compressed ops: ``maxsim_varlen``, ``score_pairs_packed``,
``maxsim_padded``, PLAID residuals, int8 tokens and the fused projection head, on a CUDA
device at realistic sizes against the float64 reference (values and gradients), served by
the Triton kernels.  Skipped without CUDA; run by ``benchmarks/run_gpu.sh tests``.

Where the kernels build document tokens on chip (residuals, hidden states) they round
them to the query's dtype before the product, as a float index would be stored
(``lik_plugins.plaid.maxsim_residual``); the oracle rounds its tokens the same way, so
bf16 winners agree with it except near exact ties.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lik_plugins as lik
from lik_plugins import plaid
from lik_plugins.kernels import reference
from support.maxsim_testlib import rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEVICE = "cuda"
# Sizes in one place: a rerank (1 query x 1000 candidates), an in-batch training batch
# (B = 64), PLAID / int8 / hidden-state batches.  Document lengths are uniform in LD.
SIZES = dict(LD=(50, 300), LQ=32, RERANK_DOCS=1000, TRAIN_B=64, CROSS_Q=24, CROSS_D=40, PAIR_Q=16, PAIR_D=60,
             PAIRS=300, PAD_B=8, PAD_C=16, RES_Q=8, RES_D=200, RES_LD=180, CENTROIDS=1024, APPROX_D=1000,
             INT8_Q=16, INT8_D=64, INT8_K=8, HID_Q=8, HID_D=24, HID_LD=180)

# Relative max-norm error against fp64: (scores, gradients), as in test_gpu_kernels.py
# (gradients are written in the input dtype: one bf16 rounding).
TOL = {torch.float32: (2e-5, 1e-4), torch.bfloat16: (1e-2, 4e-2)}
# Gradients through tokens built on chip in bf16 compare in the relative L2 norm: where the
# kernel's fp32 normalisation and the oracle's round one token element to neighbouring bf16
# values, a near tie can flip, moving one winner's whole gradient row -- an O(1) error in
# the max-norm, about 3e-2 of the L2 norm at these sizes.  Rounding alone is ~2e-3.
BUILT_BF16_GRAD_L2 = 4e-2
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


@pytest.fixture(autouse=True)
def _fresh_counts():
    lik.reset_routing_counts()


def _served(entry: str, path: str = "triton", calls: int = 1) -> None:
    """The call was served by ``path`` (the Triton kernels on CUDA), not a fallback."""
    assert lik.routing_counts().get(entry) == {path: calls}, lik.routing_counts()


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


def _lengths(g, n, lo, hi) -> list[int]:
    return torch.randint(lo, hi + 1, (n,), generator=g, device=DEVICE).tolist()


def _ragged(g, lengths, d, dtype):
    return [torch.randn(n, d, generator=g, device=DEVICE).to(dtype) for n in lengths]


def _holes(g, n, p=0.25):
    return torch.rand(n, generator=g, device=DEVICE) > p


def _rel_l2(x, ref) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-12)).item()


def _weighted_grads(out, inputs, w):
    return torch.autograd.grad((out.double() * w).sum(), inputs)


# ------------------------------------------------------------------ packed layouts
def _check_packed(seed, q_lengths, d_lengths, dtype, d, *, pairs=None, mode="exclude", normalize=False,
                  grads=True, holes=True):
    """The packed op (cross product, or the pair list ``pairs``) against the fp64
    reference, values and gradients; masked tokens get exact zero gradients.  With
    ``holes``: random holes and document 2 fully masked."""
    g = _gen(seed)
    Qp, cu_q, mq = lik.pack(_ragged(g, q_lengths, d, dtype))
    Dp, cu_d, md = lik.pack(_ragged(g, d_lengths, d, dtype))
    qm = dm = None
    if holes:
        qm, dm = _holes(g, Qp.shape[0]), _holes(g, Dp.shape[0])
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
    _served(entry)
    assert out.shape == shape and out.dtype == torch.float32
    fwd_tol, bwd_tol = TOL[dtype]
    assert rel_err(out, want) < fwd_tol
    if grads:
        w = torch.randn(out.shape, generator=g, device=DEVICE, dtype=torch.float64)
        got_q, got_d = _weighted_grads(out, (Qp, Dp), w)
        want_q, want_d = _weighted_grads(want, (Q64, D64), w)
        assert got_q.dtype == got_d.dtype == dtype
        assert rel_err(got_q, want_q) < bwd_tol and rel_err(got_d, want_d) < bwd_tol
        if holes:
            assert not got_q[~qm].any() and not got_d[~dm].any()
    return out.detach(), (Qp.detach(), Dp.detach(), cu_q, cu_d, qm, dm)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [128, 96])
@pytest.mark.parametrize("mode,normalize", [("exclude", False), ("zero", True)])
def test_varlen_cross_product(dtype, d, mode, normalize):
    g = _gen(1)
    lo, hi = SIZES["LD"]
    q_lengths = _lengths(g, SIZES["CROSS_Q"], 1, SIZES["LQ"])
    q_lengths[3] = 0                                      # an empty query
    d_lengths = _lengths(g, SIZES["CROSS_D"], lo, hi)
    d_lengths[1], d_lengths[5] = 0, 1                     # an empty document inside the batch, Ld = 1
    out, _ = _check_packed(2, q_lengths, d_lengths, dtype, d, mode=mode, normalize=normalize)
    assert not out[:, 1].any() and not out[:, 2].any() and not out[3].any()   # empty, fully masked, empty query


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode,normalize", [("exclude", True), ("zero", False)])
def test_pair_list_unsorted_with_duplicates(dtype, mode, normalize):
    g = _gen(3)
    lo, hi = SIZES["LD"]
    nq, nd = SIZES["PAIR_Q"], SIZES["PAIR_D"]
    q_lengths = _lengths(g, nq, 1, SIZES["LQ"])
    q_lengths[0] = 0
    d_lengths = _lengths(g, nd, lo, hi)
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
    g = _gen(5)
    Qp, cu_q, _ = lik.pack(_ragged(g, [32], 128, torch.bfloat16))
    Dp, cu_d, _ = lik.pack(_ragged(g, [120, 0, 257], 128, torch.bfloat16))
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
    g = _gen(6)
    d_lengths = _lengths(g, SIZES["RERANK_DOCS"], *SIZES["LD"])
    empty = len(d_lengths) // 2
    d_lengths[empty] = 0
    with torch.no_grad():
        out, _ = _check_packed(7, [SIZES["LQ"]], d_lengths, dtype, 128, grads=False, holes=False)
    assert out[0, empty] == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_in_batch_training_shape(dtype):
    g = _gen(8)
    b = SIZES["TRAIN_B"]
    _check_packed(9, _lengths(g, b, 1, SIZES["LQ"]), _lengths(g, b, *SIZES["LD"]), dtype, 128, mode="zero")


@pytest.mark.parametrize("dtype,normalize,d", [(torch.float32, False, 128), (torch.bfloat16, True, 128),
                                               (torch.bfloat16, False, 96)], ids=["fp32", "bf16-normalize", "bf16-d96"])
def test_padded_with_lengths(dtype, normalize, d):
    g = _gen(10)
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
    _served("maxsim_padded")
    Q64, D64 = Q.detach().double().requires_grad_(), D.detach().double().requires_grad_()
    want = reference.maxsim_padded(Q64, D64, q_len, d_len, normalize=normalize)
    assert out.shape == (b, c) and rel_err(out, want) < TOL[dtype][0]
    assert not out[1].any() and out[0, 1] == 0
    w = torch.randn(out.shape, generator=g, device=DEVICE, dtype=torch.float64)
    (gq, gd), (wq, wd) = _weighted_grads(out, (Q, D), w), _weighted_grads(want, (Q64, D64), w)
    assert rel_err(gq, wq) < TOL[dtype][1] and rel_err(gd, wd) < TOL[dtype][1]
    assert not gd[torch.arange(ld, device=DEVICE) >= d_len[..., None]].any()


def test_int64_offsets_follow_the_rule():
    """int64 offsets and pair indices are checked, then converted to int32: the same
    scores, bit for bit, with or without the max_seqlen bounds; a packed tensor of more
    than 2**31 - 1 tokens is refused before anything runs."""
    g = _gen(11)
    Qp, cu_q, mq = lik.pack(_ragged(g, [32, 7, 0, 19], 128, torch.bfloat16))
    Dp, cu_d, md = lik.pack(_ragged(g, [300, 0, 51, 180], 128, torch.bfloat16))
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
    g = _gen(12)
    Qp, cu_q, _ = lik.pack(_ragged(g, [5, 9], 128, torch.bfloat16))
    Dp, cu_d, _ = lik.pack(_ragged(g, [60, 0, 70], 128, torch.bfloat16))
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


# ------------------------------------------------------------------ PLAID residuals
def _index(seed, nd, ld, dim, nbits):
    """A compressed index of unit tokens with random lengths (document 1 empty, the last
    full); the padding holds out-of-range codes and random bytes, which must not matter."""
    g = _gen(seed)
    emb = F.normalize(torch.randn(nd * ld, dim, generator=g, device=DEVICE), dim=-1)
    centroids = F.normalize(torch.randn(SIZES["CENTROIDS"], dim, generator=g, device=DEVICE), dim=-1)
    index = plaid.compress(emb, centroids, nbits)
    codes, residuals = index.codes.view(nd, ld).clone(), index.residuals.view(nd, ld, -1).clone()
    lengths = torch.randint(1, ld + 1, (nd,), generator=g, device=DEVICE)
    lengths[1], lengths[-1] = 0, ld
    pad = torch.arange(ld, device=DEVICE)[None, :] >= lengths[:, None]
    codes[pad] = 1 << 20
    residuals[pad] = torch.randint(0, 256, residuals[pad].shape, generator=g, device=DEVICE, dtype=torch.uint8)
    return codes, residuals, lengths, centroids, index.bucket_weights


def _residual_oracle(Q, codes, residuals, lengths, centroids, weights, nbits, normalize):
    """fp64 scores and Q leaf of the specification: decompress (fp32, normalised), round to
    Q's dtype, MaxSim over the valid tokens."""
    valid = reference.lengths_mask(lengths, codes.shape[1])
    dec = plaid.decompress(torch.where(valid, codes, torch.zeros_like(codes)), residuals, centroids.float(),
                           weights, nbits)
    if normalize:
        dec = F.normalize(dec, dim=-1, eps=reference.NORM_EPS)
    Q64 = Q.detach().double().requires_grad_()
    q = F.normalize(Q64, dim=-1, eps=reference.NORM_EPS) if normalize else Q64
    return reference.maxsim(q, dec.to(Q.dtype).double(), None, valid), Q64


@pytest.mark.parametrize("nbits,dtype,normalize,d", [
    (2, torch.bfloat16, True, 128), (4, torch.float32, True, 128), (8, torch.bfloat16, False, 128),
    (1, torch.float32, True, 96), (2, torch.bfloat16, True, 96), (4, torch.bfloat16, True, 128),
    (4, torch.bfloat16, True, 96)],
    ids=["nbits2-bf16", "nbits4-fp32", "nbits8-bf16-raw", "nbits1-fp32-d96", "nbits2-bf16-d96", "nbits4-bf16",
         "nbits4-bf16-d96"])
def test_maxsim_residual(nbits, dtype, normalize, d):
    codes, residuals, lengths, centroids, weights = _index(13, SIZES["RES_D"], SIZES["RES_LD"], d, nbits)
    g = _gen(14)
    Q = torch.randn(SIZES["RES_Q"], SIZES["LQ"], d, generator=g, device=DEVICE).to(dtype).requires_grad_()
    out = lik.maxsim_residual(Q, codes, residuals, lengths, centroids, weights, nbits, normalize=normalize)
    _served("maxsim_residual")
    want, Q64 = _residual_oracle(Q, codes, residuals, lengths, centroids, weights, nbits, normalize)
    assert out.shape == want.shape and out.dtype == torch.float32
    assert rel_err(out, want) < TOL[dtype][0]
    assert not out[:, 1].any()                                             # the empty document
    w = torch.randn(out.shape, generator=g, device=DEVICE, dtype=torch.float64)
    (gq,), (wq,) = _weighted_grads(out, (Q,), w), _weighted_grads(want, (Q64,), w)
    if dtype == torch.bfloat16:
        assert _rel_l2(gq, wq) < BUILT_BF16_GRAD_L2
    else:
        assert rel_err(gq, wq) < TOL[dtype][1]
    # the packed layout of the same index, read in place by the packed (VARLEN) programs: the
    # same similarities (the blocking may differ, so the per-query sums may round apart)
    valid = reference.lengths_mask(lengths, codes.shape[1])
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=DEVICE)
    cu[1:] = lengths.cumsum(0)
    lik.reset_routing_counts()
    with torch.no_grad():
        padded = lik.maxsim_residual(Q, codes, residuals, lengths, centroids, weights, nbits, normalize=normalize)
        for bound in (None, SIZES["RES_LD"]):
            packed = lik.maxsim_residual_varlen(Q, codes[valid], residuals[valid], cu, centroids, weights, nbits,
                                                max_seqlen_d=bound, normalize=normalize)
            assert rel_err(packed, padded) < 1e-6
    assert lik.routing_counts().get("maxsim_residual") == {"triton": 1}, lik.routing_counts()
    _served("maxsim_residual_varlen", calls=2)


def test_residual_lengths_past_the_padding_or_negative():
    # each document's loop stops at its length: 0, negative (empty) and past Ld (all of it)
    # read as the reference's token mask does
    codes, residuals, _, centroids, weights = _index(17, 8, 70, 128, 2)
    codes = codes.clamp_max(SIZES["CENTROIDS"] - 1)
    lengths = torch.tensor([70, 0, -5, 500, 33, 1, 69, 70], device=DEVICE)
    Q = torch.randn(3, SIZES["LQ"], 128, generator=_gen(18), device=DEVICE).to(torch.bfloat16)
    out = lik.maxsim_residual(Q, codes, residuals, lengths, centroids, weights, 2)
    _served("maxsim_residual")
    want = reference.maxsim_residual(Q.double(), codes, residuals, lengths, centroids.double(), weights.double(), 2)
    assert rel_err(out, want) < TOL[torch.bfloat16][0]
    assert not out[:, 1].any() and not out[:, 2].any()


def test_plaid_approx_score():
    codes, _, lengths, centroids, _ = _index(15, SIZES["APPROX_D"], SIZES["LD"][1], 128, 2)
    codes = codes.clamp_max(SIZES["CENTROIDS"] - 1)   # in range for the reference, which indexes the padding too
    g = _gen(16)
    Q = F.normalize(torch.randn(SIZES["LQ"], 128, generator=g, device=DEVICE), dim=-1)
    S = centroids @ Q.T                                                    # [C, Lq]
    out = lik.plaid_approx_score(S, codes, lengths)
    _served("plaid_approx_score")
    want = reference.plaid_approx_score(S.double(), codes, lengths)
    assert out.dtype == torch.float32 and rel_err(out, want) < 1e-6
    assert out[1] == 0


# ------------------------------------------------------------------ int8 tokens
@pytest.mark.parametrize("kd,mode,dtype,d,prequantised", [
    (False, "exclude", torch.bfloat16, 128, False), (False, "zero", torch.float32, 96, False),
    (True, "zero", torch.bfloat16, 128, True), (True, "exclude", torch.float32, 128, False)],
    ids=["cross-exclude-bf16", "cross-zero-fp32-d96", "kd-zero-bf16-int8query", "kd-exclude-fp32"])
def test_maxsim_int8(kd, mode, dtype, d, prequantised):
    g = _gen(17)
    nq, lq, ld = SIZES["INT8_Q"], SIZES["LQ"], SIZES["LD"][1]
    doc_lead = (nq, SIZES["INT8_K"]) if kd else (SIZES["INT8_D"],)
    Q = torch.randn(nq, lq, d, generator=g, device=DEVICE).to(dtype)
    D = torch.randn(*doc_lead, ld, d, generator=g, device=DEVICE).to(dtype)
    qm = torch.rand(nq, lq, generator=g, device=DEVICE) > 0.2
    dm = torch.rand(*doc_lead, ld, generator=g, device=DEVICE) > 0.3
    qm[-1] = False                                   # a fully masked query
    dm.view(-1, ld)[1] = False                       # a fully masked (empty) document
    index = lik.quantize_int8(D)
    q_in = lik.quantize_int8(Q) if prequantised else Q
    out = lik.maxsim_int8(q_in, index, qm, dm, mask_mode=mode)
    _served("maxsim_int8")
    q_spec = reference.quantize_int8(Q)
    want = reference.maxsim_int8(q_spec, tuple(index), qm, dm, mask_mode=mode, dtype=torch.float64)
    assert out.shape == want.shape and out.dtype == torch.float32
    # exact int32 products, each scaled by two fp32 scales: fp32 rounding only
    assert rel_err(out, want) < 1e-5
    assert not out[-1].any()
    assert not (out[0, 1] if kd else out[:, 1]).any()


# ------------------------------------------------------------------ fused projection head
@pytest.mark.parametrize("dtype,bias,normalize,d,hidden", [
    (torch.float32, True, True, 128, 768), (torch.bfloat16, True, True, 128, 768),
    (torch.bfloat16, False, False, 96, 200)], ids=["fp32", "bf16", "bf16-raw-d96-h200"])
def test_maxsim_from_hidden(dtype, bias, normalize, d, hidden):
    g = _gen(18)
    nq, nd, lq, ld = SIZES["HID_Q"], SIZES["HID_D"], SIZES["LQ"], SIZES["HID_LD"]
    # small integers and multiples of 1/64: the projection is exact in fp32, so the kernel
    # and the oracle round the same projected tokens to bf16
    def ints(*shape, bound, scale=1.0):
        return (torch.randint(-bound, bound + 1, shape, generator=g, device=DEVICE) * scale).to(dtype)

    Q = torch.randn(nq, lq, d, generator=g, device=DEVICE).to(dtype).requires_grad_()
    H = ints(nd, ld, hidden, bound=2).requires_grad_()
    W = ints(d, hidden, bound=8, scale=1 / 64).requires_grad_()
    b = ints(d, bound=8, scale=1 / 64).requires_grad_() if bias else None
    dm = torch.rand(nd, ld, generator=g, device=DEVICE) > 0.3
    dm[1] = False                                    # a fully masked document
    out = lik.maxsim_from_hidden(Q, H, W, b, dm, normalize=normalize)
    _served("maxsim_from_hidden")
    inputs = [t for t in (Q, H, W, b) if t is not None]
    leaves = [t.detach().double().requires_grad_() for t in inputs]
    Q64, H64, W64 = leaves[:3]
    docs = F.linear(H64, W64, leaves[3] if bias else None)
    if normalize:                                    # the documents only (late-interaction-kernels' meaning)
        docs = F.normalize(docs, dim=-1, eps=reference.NORM_EPS)
    # the kernel rounds the projected tokens to Q's dtype for the product (values only:
    # its backward projects the winners again in fp32)
    docs = docs + (docs.to(dtype).double() - docs).detach()
    want = reference.maxsim(Q64, docs, None, dm)
    assert out.dtype == torch.float32 and rel_err(out, want) < TOL[dtype][0]
    assert not out[:, 1].any()
    w = torch.randn(out.shape, generator=g, device=DEVICE, dtype=torch.float64)
    got, ref = _weighted_grads(out, inputs, w), _weighted_grads(want, leaves, w)
    for name, a, r in zip("QHWb", got, ref):
        assert a.dtype == dtype, name
        err = _rel_l2(a, r) if dtype == torch.bfloat16 else rel_err(a, r)
        assert err < (BUILT_BF16_GRAD_L2 if dtype == torch.bfloat16 else TOL[dtype][1]), (name, err)
    gh = got[1]
    assert torch.equal(gh[1], torch.zeros_like(gh[1]))        # exact zeros: the fully masked document
    assert not gh[~dm].any()
