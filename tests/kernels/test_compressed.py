"""The compressed ops on a CUDA device at realistic sizes (marker ``gpu``): PLAID residuals
(``maxsim_residual``, its packed layout, ``plaid_approx_score``) and the fused projection
head (``maxsim_from_hidden``), served by the Triton kernels, against the float64 reference
(values and gradients).

Where the kernels build document tokens on chip (residuals, hidden states) they round
them to the query's dtype before the product, as a float index would be stored
(``lik_plugins.ops.plaid.maxsim_residual``); the oracle rounds its tokens the same way, so
bf16 winners agree with it except near exact ties.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lik_plugins as lik
from lik_plugins.ops import plaid
from lik_plugins.kernels import reference
from support.cuda_testlib import (
    BUILT_BF16_GRAD_L2, CUDA, DEVICE, SIZES, TOL, cuda_generator, fresh_routing_counts, rel_l2, served, weighted_grads,
)  # noqa: F401  (fresh_routing_counts: a fixture)
from support.maxsim_testlib import rel_err

pytestmark = [*CUDA, pytest.mark.usefixtures("fresh_routing_counts")]


# ------------------------------------------------------------------ PLAID residuals
def _index(seed, nd, ld, dim, nbits):
    """A compressed index of unit tokens with random lengths (document 1 empty, the last
    full); the padding holds out-of-range codes and random bytes, which must not matter."""
    g = cuda_generator(seed)
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
    g = cuda_generator(14)
    Q = torch.randn(SIZES["RES_Q"], SIZES["LQ"], d, generator=g, device=DEVICE).to(dtype).requires_grad_()
    out = lik.maxsim_residual(Q, codes, residuals, lengths, centroids, weights, nbits, normalize=normalize)
    served("maxsim_residual")
    want, Q64 = _residual_oracle(Q, codes, residuals, lengths, centroids, weights, nbits, normalize)
    assert out.shape == want.shape and out.dtype == torch.float32
    assert rel_err(out, want) < TOL[dtype][0]
    assert not out[:, 1].any()                                             # the empty document
    w = torch.randn(out.shape, generator=g, device=DEVICE, dtype=torch.float64)
    (gq,), (wq,) = weighted_grads(out, (Q,), w), weighted_grads(want, (Q64,), w)
    if dtype == torch.bfloat16:
        assert rel_l2(gq, wq) < BUILT_BF16_GRAD_L2
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
    served("maxsim_residual_varlen", calls=2)


def test_residual_lengths_past_the_padding_or_negative():
    # each document's loop stops at its length: 0, negative (empty) and past Ld (all of it)
    # read as the reference's token mask does
    codes, residuals, _, centroids, weights = _index(17, 8, 70, 128, 2)
    codes = codes.clamp_max(SIZES["CENTROIDS"] - 1)
    lengths = torch.tensor([70, 0, -5, 500, 33, 1, 69, 70], device=DEVICE)
    Q = torch.randn(3, SIZES["LQ"], 128, generator=cuda_generator(18), device=DEVICE).to(torch.bfloat16)
    out = lik.maxsim_residual(Q, codes, residuals, lengths, centroids, weights, 2)
    served("maxsim_residual")
    want = reference.maxsim_residual(Q.double(), codes, residuals, lengths, centroids.double(), weights.double(), 2)
    assert rel_err(out, want) < TOL[torch.bfloat16][0]
    assert not out[:, 1].any() and not out[:, 2].any()


def test_plaid_approx_score():
    codes, _, lengths, centroids, _ = _index(15, SIZES["APPROX_D"], SIZES["LD"][1], 128, 2)
    codes = codes.clamp_max(SIZES["CENTROIDS"] - 1)   # in range for the reference, which indexes the padding too
    g = cuda_generator(16)
    Q = F.normalize(torch.randn(SIZES["LQ"], 128, generator=g, device=DEVICE), dim=-1)
    S = centroids @ Q.T                                                    # [C, Lq]
    out = lik.plaid_approx_score(S, codes, lengths)
    served("plaid_approx_score")
    want = reference.plaid_approx_score(S.double(), codes, lengths)
    assert out.dtype == torch.float32 and rel_err(out, want) < 1e-6
    assert out[1] == 0


# ------------------------------------------------------------------ fused projection head
@pytest.mark.parametrize("dtype,bias,normalize,d,hidden", [
    (torch.float32, True, True, 128, 768), (torch.bfloat16, True, True, 128, 768),
    (torch.bfloat16, False, False, 96, 200)], ids=["fp32", "bf16", "bf16-raw-d96-h200"])
def test_maxsim_from_hidden(dtype, bias, normalize, d, hidden):
    g = cuda_generator(18)
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
    served("maxsim_from_hidden")
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
    got, ref = weighted_grads(out, inputs, w), weighted_grads(want, leaves, w)
    for name, a, r in zip("QHWb", got, ref):
        assert a.dtype == dtype, name
        err = rel_l2(a, r) if dtype == torch.bfloat16 else rel_err(a, r)
        assert err < (BUILT_BF16_GRAD_L2 if dtype == torch.bfloat16 else TOL[dtype][1]), (name, err)
    gh = got[1]
    assert torch.equal(gh[1], torch.zeros_like(gh[1]))        # exact zeros: the fully masked document
    assert not gh[~dm].any()
