"""Compressed indexes and the fused projection head: int8 tokens, PLAID residuals,
maxsim_from_hidden -- against the references (float64 where gradients are compared) on the
chunked path and the Triton kernels (interpreter), with empty and fully masked documents."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import lik_plugins as lik
from lik_plugins.ops import plaid
from lik_plugins.kernels import reference
from support.maxsim_testlib import backend_params, rel_err

BACKENDS = backend_params()


# ------------------------------------------------------------------ int8
def test_quantize_int8_contract(gen):
    x = torch.randn(4, 30, 40, generator=gen) * torch.logspace(-3, 3, 30)[None, :, None]
    x[1, 7] = 0
    q = lik.quantize_int8(x)
    assert q.values.dtype == torch.int8 and q.scales.dtype == torch.float32
    amax = q.values.abs().amax(-1)
    assert torch.equal(amax[x.abs().amax(-1) > 0], torch.full_like(amax[x.abs().amax(-1) > 0], 127))
    assert q.scales[1, 7] == 1 and not q.values[1, 7].any()
    # round to nearest: half a step of error at most
    err = (q.dequantize(torch.float64) - x.double()).abs()
    assert (err <= q.scales.double()[..., None] * (0.5 + 1e-6)).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_mode", ["exclude", "zero"])
def test_maxsim_int8_matches_the_reference(gen, monkeypatch, backend, mask_mode):
    monkeypatch.setenv("LIK_BACKEND", backend)
    Q = torch.randn(3, 7, 40, generator=gen)
    D = torch.randn(5, 19, 40, generator=gen)
    qm = torch.rand(3, 7, generator=gen) > 0.2
    qm[2] = False
    dm = torch.rand(5, 19, generator=gen) > 0.3
    dm[4] = False
    index = lik.quantize_int8(D)
    got = lik.maxsim_int8(Q, index, qm, dm, mask_mode=mask_mode)
    want = reference.maxsim_int8(reference.quantize_int8(Q), tuple(index), qm, dm, mask_mode=mask_mode,
                                 dtype=torch.float64)
    assert rel_err(got, want) < 1e-6
    assert torch.equal(got[:, 4], torch.zeros(3)) and torch.equal(got[2], torch.zeros(5))
    # per-query candidates
    Dk = torch.randn(3, 4, 11, 40, generator=gen)
    got = lik.maxsim_int8(Q, Dk)
    want = reference.maxsim_int8(reference.quantize_int8(Q), reference.quantize_int8(Dk), dtype=torch.float64)
    assert rel_err(got, want) < 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
def test_int8_query_quantisation_rounds_half_to_even(monkeypatch, backend):
    # A float query is quantised inside the Triton kernel (one launch); its values must be
    # torch.round's (ties to even), not round-half-away: 0.5 -> 0, 1.5 -> 2, 2.5 -> 2.
    # Scoring against one-hot documents reads each quantised component back.
    monkeypatch.setenv("LIK_BACKEND", backend)
    lead = [127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, 126.5, 125.5]
    Q = torch.tensor([[lead + [0.0] * (16 - len(lead))]])
    index = lik.quantize_int8(torch.eye(16)[:, None, :])          # 16 documents, one token each
    got = lik.maxsim_int8(Q, index)
    assert torch.equal(got[0, :len(lead)], torch.tensor([127.0, 0, 2, 2, 0, -2, -2, 4, 126, 126]))
    assert torch.equal(got, reference.maxsim_int8(reference.quantize_int8(Q), tuple(index)))


def test_int8_quantisation_kernel_equals_the_reference(gen, monkeypatch):
    # the one-launch query quantisation of the Triton path (queries too large to quantise
    # inside the scoring kernel), bit for bit, ties included
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from lik_plugins.kernels.triton import quantize

    x = torch.randn(3, 5, 40, generator=gen) * 3
    x[0, 0, :6] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -2.5])
    x[1, 1] = 0.0                                                # an all-zero token: scale 1
    for t in (x, x.to(torch.bfloat16), x[:, ::2]):               # a strided view too
        values, scales = quantize.quantize_int8(t)
        want_v, want_s = reference.quantize_int8(t)
        assert values.dtype == torch.int8 and values.is_contiguous()
        assert torch.equal(values, want_v) and torch.equal(scales, want_s)


@pytest.mark.parametrize("backend", BACKENDS)
def test_retrieve_over_an_int8_index(gen, monkeypatch, backend):
    monkeypatch.setenv("LIK_BACKEND", backend)
    Q = F.normalize(torch.randn(2, 5, 32, generator=gen), dim=-1)
    index = lik.quantize_int8(torch.randn(9, 12, 32, generator=gen), normalize=True)
    scores, idx = lik.retrieve(Q, index, 4, chunk=4)
    full = reference.maxsim_int8(reference.quantize_int8(Q), tuple(index))
    want_scores, want_idx = full.topk(4, dim=1)
    assert torch.equal(idx, want_idx)
    torch.testing.assert_close(scores, want_scores, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="cannot normalise"):
        lik.retrieve(Q, index, 3, normalize=True)


def test_int8_rejects_bad_input(gen):
    with pytest.raises(RuntimeError, match="inference-only"):
        lik.maxsim_int8(torch.randn(1, 2, 8, requires_grad=True), torch.randn(2, 3, 8))
    with pytest.raises(TypeError, match="torch.int8"):
        lik.maxsim_int8(torch.randn(1, 2, 8), lik.Int8Tokens(torch.zeros(2, 3, 8), torch.ones(2, 3)))
    with pytest.raises(ValueError, match="NaN or inf"):
        lik.quantize_int8(torch.tensor([[[1.0, float("nan")]]]))


# ------------------------------------------------------------------ PLAID format
def _colbert_pack(buckets: torch.Tensor, nbits: int) -> torch.Tensor:
    """The published packing, independently: each bucket's bits least significant first,
    the stream packed by numpy.packbits (most significant bit first)."""
    bits = (buckets.unsqueeze(-1) >> torch.arange(nbits)) & 1
    packed = np.packbits(bits.to(torch.uint8).flatten().numpy())
    return torch.from_numpy(packed).view(buckets.shape[0], -1)


@pytest.mark.parametrize("nbits", [1, 2, 4, 8])
def test_residual_bit_order_is_colbertv2s(gen, nbits):
    dim = 48
    emb = F.normalize(torch.randn(60, dim, generator=gen), dim=-1)
    centroids = F.normalize(torch.randn(7, dim, generator=gen), dim=-1)
    index = plaid.compress(emb, centroids, nbits)
    assert index.codes.dtype == torch.int32 and index.residuals.shape == (60, dim * nbits // 8)
    assert index.bucket_cutoffs.shape == (2**nbits - 1,) and index.bucket_weights.shape == (2**nbits,)
    # codes: nearest centroid by inner product
    assert torch.equal(index.codes.long(), (emb @ centroids.T).argmax(-1))
    residual = emb - centroids[index.codes.long()]
    buckets = torch.bucketize(residual, index.bucket_cutoffs)
    assert torch.equal(index.residuals, _colbert_pack(buckets, nbits))
    dec = plaid.decompress(index.codes, index.residuals, centroids, index.bucket_weights, nbits)
    torch.testing.assert_close(dec, centroids[index.codes.long()] + index.bucket_weights[buckets])
    # more bits, closer tokens
    assert (dec - emb).norm(dim=-1).mean() < {1: 1.0, 2: 0.7, 4: 0.3, 8: 0.05}[nbits]


def _index(gen, nd, ld, dim, nbits, n_centroids=11):
    emb = F.normalize(torch.randn(nd * ld, dim, generator=gen), dim=-1)
    centroids = F.normalize(torch.randn(n_centroids, dim, generator=gen), dim=-1)
    index = plaid.compress(emb, centroids, nbits)
    codes = index.codes.view(nd, ld).clone()
    residuals = index.residuals.view(nd, ld, -1).clone()
    lengths = torch.randint(1, ld + 1, (nd,), generator=gen)
    lengths[1] = 0          # an empty document
    lengths[-1] = ld
    # padding holds garbage: out-of-range codes and random bytes must not matter
    pad = torch.arange(ld)[None, :] >= lengths[:, None]
    codes[pad] = 10_000
    residuals[pad] = torch.randint(0, 256, residuals[pad].shape, generator=gen, dtype=torch.uint8)
    return codes, residuals, lengths, centroids, index.bucket_weights


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("nbits,normalize", [(1, True), (2, True), (4, False), (8, True)])
def test_maxsim_residual_matches_maxsim_of_decompress(gen, monkeypatch, backend, nbits, normalize):
    monkeypatch.setenv("LIK_BACKEND", backend)
    codes, residuals, lengths, centroids, weights = _index(gen, 6, 21, 40, nbits)
    Q = torch.randn(3, 5, 40, generator=gen, requires_grad=True)
    g = torch.randn(3, 6, generator=gen)
    got = lik.maxsim_residual(Q, codes, residuals, lengths, centroids, weights, nbits, normalize=normalize)
    (gq,) = torch.autograd.grad((got * g).sum(), Q)
    Q64 = Q.detach().double().requires_grad_()
    # the specification composed independently: decompress every token, then plain MaxSim
    dec = plaid.decompress(codes.clamp_max(10), residuals, centroids.double(), weights, nbits)  # padding: any code
    want = reference.maxsim(Q64, dec, None, reference.lengths_mask(lengths, 21), normalize=normalize)
    (gq_want,) = torch.autograd.grad((want * g.double()).sum(), Q64)
    assert rel_err(got, want) < 1e-5 and rel_err(gq, gq_want) < 1e-5
    assert torch.equal(got[:, 1], torch.zeros(3))


@pytest.mark.parametrize("backend", BACKENDS)
def test_residual_half_precision_and_single_query(gen, monkeypatch, backend):
    monkeypatch.setenv("LIK_BACKEND", backend)
    codes, residuals, lengths, centroids, weights = _index(gen, 4, 17, 32, 2)
    Q = torch.randn(6, 32, generator=gen).to(torch.bfloat16)
    got = lik.maxsim_residual(Q, codes, residuals, lengths, centroids, weights, 2)
    assert got.shape == (4,) and got.dtype == torch.float32
    want = reference.maxsim_residual(Q.double().unsqueeze(0), codes.clamp_max(10), residuals, lengths,
                                     centroids.double(), weights, 2)[0]
    assert rel_err(got, want) < 2e-2


@pytest.mark.parametrize("backend", BACKENDS)
def test_residual_lengths_past_the_padding_or_negative(gen, monkeypatch, backend):
    # the kernel bounds each document's loop by its length: a length past Ld reads as Ld, a
    # negative one as an empty document -- what the reference's token mask makes of them
    monkeypatch.setenv("LIK_BACKEND", backend)
    codes, residuals, _, centroids, weights = _index(gen, 4, 11, 32, 2)
    codes = codes.clamp_max(10)
    lengths = torch.tensor([11, 40, -3, 6])
    Q = torch.randn(2, 5, 32, generator=gen)
    got = lik.maxsim_residual(Q, codes, residuals, lengths, centroids, weights, 2)
    want = reference.maxsim_residual(Q.double(), codes, residuals, lengths, centroids.double(), weights, 2)
    assert rel_err(got, want) < 1e-5
    assert torch.equal(got[:, 2], torch.zeros(2))
    full = lik.maxsim_residual(Q, codes, residuals, torch.full((4,), 11), centroids, weights, 2)
    torch.testing.assert_close(got[:, :2], full[:, :2], rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_equals_padded(gen, monkeypatch, backend):
    monkeypatch.setenv("LIK_BACKEND", backend)
    codes, residuals, lengths, centroids, weights = _index(gen, 5, 13, 32, 4)
    valid = reference.lengths_mask(lengths, 13)
    cu = torch.zeros(6, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0)
    Q = torch.randn(2, 4, 32, generator=gen)
    padded = lik.maxsim_residual(Q, codes, residuals, lengths, centroids, weights, 4)
    lik.reset_routing_counts()
    for max_len in (None, 13, 20):                       # a bound above the longest is fine
        packed = lik.maxsim_residual_varlen(Q, codes[valid], residuals[valid], cu, centroids, weights, 4,
                                            max_seqlen_d=max_len)
        torch.testing.assert_close(packed, padded, rtol=1e-6, atol=1e-6)
    # without a gradient the packed tokens are scored in place, by their own op
    assert lik.routing_counts()["maxsim_residual_varlen"] == {backend: 3}
    # a gradient goes through the padded op's autograd: the same values and grad_Q
    Qg = Q.clone().requires_grad_()
    packed = lik.maxsim_residual_varlen(Qg, codes[valid], residuals[valid], cu, centroids, weights, 4)
    Qp = Q.clone().requires_grad_()
    padded = lik.maxsim_residual(Qp, codes, residuals, lengths, centroids, weights, 4)
    torch.testing.assert_close(packed, padded, rtol=0, atol=0)
    grad = torch.randn(packed.shape, generator=gen)
    packed.backward(grad)
    padded.backward(grad)
    torch.testing.assert_close(Qg.grad, Qp.grad, rtol=0, atol=0)
    # one query as [Lq, d]
    one = lik.maxsim_residual_varlen(Q[1], codes[valid], residuals[valid], cu, centroids, weights, 4)
    torch.testing.assert_close(one, padded[1].detach(), rtol=1e-6, atol=1e-6)


def test_residual_varlen_rejects_bad_offsets(gen):
    codes, residuals, lengths, centroids, weights = _index(gen, 3, 9, 32, 2)
    valid = reference.lengths_mask(lengths, 9)
    flat_c, flat_r = codes[valid], residuals[valid]
    n = flat_c.shape[0]
    Q = torch.randn(1, 4, 32, generator=gen)
    bad = torch.tensor([0, 5, 3, n], dtype=torch.int32)                  # decreasing
    for bound in (None, 9):           # one exception type, with or without the bound
        with pytest.raises(ValueError, match=r"cu_seqlens_d\[2\] = 3 is below cu_seqlens_d\[1\] = 5: offsets must "
                                             r"never decrease"):
            lik.maxsim_residual_varlen(Q, flat_c, flat_r, bad, centroids, weights, 2, max_seqlen_d=bound)
    short = torch.tensor([0, 1, 2, n - 1], dtype=torch.int32)           # does not end at N
    with pytest.raises(ValueError, match=rf"cu_seqlens_d\[3\] = {n - 1} \(the last offset\): offsets must end at "
                                         rf"the packed length {n}"):
        lik.maxsim_residual_varlen(Q, flat_c, flat_r, short, centroids, weights, 2)
    cu = torch.zeros(4, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0)
    # a bound below the longest document is an error, never a truncation
    longest = int(lengths.max())
    with pytest.raises(ValueError, match=rf"sequence {int(lengths.argmax())} .* has {longest} tokens: no sequence may "
                                         rf"be longer than max_seqlen_d={longest - 1}"):
        lik.maxsim_residual_varlen(Q, flat_c, flat_r, cu, centroids, weights, 2, max_seqlen_d=longest - 1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_approx_score(gen, monkeypatch, backend):
    monkeypatch.setenv("LIK_BACKEND", backend)
    lik.reset_routing_counts()
    codes, _, lengths, centroids, _ = _index(gen, 7, 150, 32, 2)      # Ld over two kernel tiles
    codes = codes.clamp_max(10)
    S = torch.randn(11, 5, generator=gen)                                # [C, Lq]
    got = lik.plaid_approx_score(S, codes, lengths)
    assert lik.routing_counts()["plaid_approx_score"] == {backend: 1}
    # independent: loop over documents and query tokens
    want = torch.zeros(7)
    for b in range(7):
        c = codes[b, : lengths[b]]
        if len(c):
            want[b] = S[c].max(dim=0).values.sum()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(reference.plaid_approx_score(S, codes, lengths), want)
    assert got[1] == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_plaid_approx_score_propagates_nan_of_scored_tokens_only(gen, monkeypatch, backend):
    # the Triton kernel's max drops NaN and tracks it beside: a NaN centroid score that a
    # document's valid token reads makes its score NaN (as torch's max in the reference);
    # one that only its padding points at does not
    monkeypatch.setenv("LIK_BACKEND", backend)
    S = torch.randn(8, 5, generator=gen)
    S[3, 2] = float("nan")
    codes = torch.tensor([[1, 3, 2], [1, 2, 3], [0, 0, 0]])
    lengths = torch.tensor([3, 2, 0])
    got = lik.plaid_approx_score(S, codes, lengths)
    assert torch.isnan(got[0]) and torch.isfinite(got[1]) and got[2] == 0
    torch.testing.assert_close(got[1:], reference.plaid_approx_score(S, codes, lengths)[1:])


def test_residual_rejects_bad_input(gen):
    codes, residuals, lengths, centroids, weights = _index(gen, 3, 8, 32, 2)
    Q = torch.randn(1, 4, 32)
    with pytest.raises(ValueError, match="nbits"):
        lik.maxsim_residual(Q, codes, residuals, lengths, centroids, weights, 3)
    with pytest.raises(ValueError, match="residuals must be uint8"):
        lik.maxsim_residual(Q, codes, residuals[..., :4], lengths, centroids, weights, 2)
    with pytest.raises(ValueError, match="embedding dims differ"):
        lik.maxsim_residual(torch.randn(1, 4, 16), codes, residuals, lengths, centroids, weights, 2)
    with pytest.raises(ValueError, match="multiple of 8"):
        plaid.compress(torch.randn(4, 12), torch.randn(3, 12), 1)


# ------------------------------------------------------------------ fused projection head
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bias,normalize", [(True, True), (False, False)])
def test_maxsim_from_hidden_matches_the_reference(gen, monkeypatch, backend, bias, normalize):
    monkeypatch.setenv("LIK_BACKEND", backend)
    Q = torch.randn(3, 6, 24, generator=gen, requires_grad=True)
    H = torch.randn(5, 13, 40, generator=gen, requires_grad=True)
    W = (torch.randn(24, 40, generator=gen) / 6).requires_grad_()
    b = torch.randn(24, generator=gen, requires_grad=True) if bias else None
    dm = torch.rand(5, 13, generator=gen) > 0.3
    dm[1] = False                     # a fully masked document
    g = torch.randn(3, 5, generator=gen)
    got = lik.maxsim_from_hidden(Q, H, W, b, dm, normalize=normalize)
    inputs = [t for t in (Q, H, W, b) if t is not None]
    grads = torch.autograd.grad((got * g).sum(), inputs)
    ref_in = [t.detach().double().requires_grad_() for t in inputs]
    Q64, H64, W64 = ref_in[:3]
    want = reference.maxsim_from_hidden(Q64, H64, W64, ref_in[3] if bias else None, dm, normalize=normalize)
    want_grads = torch.autograd.grad((want * g.double()).sum(), ref_in)
    assert rel_err(got, want) < 1e-5
    for a, w in zip(grads, want_grads):
        assert rel_err(a, w) < 1e-5
    assert torch.equal(got[:, 1], torch.zeros(3))
    assert torch.equal(grads[1][1], torch.zeros(13, 40))        # exact zeros, fully masked document
    assert torch.equal(grads[1][~dm], torch.zeros_like(grads[1][~dm]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_maxsim_from_hidden_only_some_grads(gen, monkeypatch, backend):
    monkeypatch.setenv("LIK_BACKEND", backend)
    Q = torch.randn(2, 4, 16, generator=gen)
    H = torch.randn(3, 9, 20, generator=gen)
    W = torch.randn(16, 20, generator=gen, requires_grad=True)
    got = lik.maxsim_from_hidden(Q, H, W)
    (gw,) = torch.autograd.grad(got.sum(), W)
    W64 = W.detach().double().requires_grad_()
    (want,) = torch.autograd.grad(reference.maxsim_from_hidden(Q.double(), H.double(), W64).sum(), W64)
    assert rel_err(gw, want) < 1e-5
    with pytest.raises(ValueError, match="W must be"):
        lik.maxsim_from_hidden(Q, H, W.t())


@pytest.mark.parametrize("backend", BACKENDS)
def test_plaid_approx_score_ignores_codes_in_the_padding(gen, monkeypatch, backend):
    monkeypatch.setenv("LIK_BACKEND", backend)
    S = torch.randn(16, 5, generator=gen)                                # [C, Lq]
    codes = torch.randint(0, 16, (4, 7), generator=gen)
    lengths = torch.tensor([7, 3, 0, 5])
    padded = codes.clone()
    padded[1, 3:] = 10**6                                # padding: out-of-range ids, as an index may hold
    padded[3, 5:] = -4
    want = reference.plaid_approx_score(S.double(), codes, lengths)
    torch.testing.assert_close(lik.plaid_approx_score(S, padded, lengths).double(), want, rtol=1e-6, atol=1e-6)
