"""The quantized scoring kernels on a CUDA device (marker ``gpu``): fp8 (e4m3 tokens with
per-token scales, the query quantised inside the scoring kernel) and int8, against their
specification in ``lik_plugins.kernels.reference`` computed in float64."""
from __future__ import annotations

import pytest
import torch

import lik_plugins as lik
from lik_plugins.kernels import reference
from support.cuda_testlib import (  # noqa: F401  (fresh_routing_counts: a fixture)
    CUDA, DEVICE, SIZES, cuda_generator, dense_inputs, fresh_routing_counts, served,
)
from support.maxsim_testlib import rel_err

pytestmark = [*CUDA, pytest.mark.usefixtures("fresh_routing_counts")]


# ------------------------------------------------------------------ fp8
@pytest.mark.parametrize("shape", [
    (64, 512, 32, 256, 128, False),    # search: 128-row programs of 4 documents (fp8, Lq <= 32), autotuned
    (4, 100, 32, 1030, 128, False),    # ColPali documents
    (2, 64, 300, 200, 128, False),     # long queries: row chunks
    (16, 8, 32, 180, 96, True),        # per-query candidates, d not a power of two
    (3, 5, 32, 70, 200, False),        # d > 128: the K loop
    (5, 7, 8, 20, 16, False),          # d = 16: padded to the fp8 MMA's K of 32
], ids=["search", "colpali", "long-query", "kd", "wide", "tiny-d"])
@pytest.mark.parametrize("mode", ["exclude", "zero"])
def test_fp8_kernel_equals_the_specification(shape, mode):
    nq, nj, lq, ld, d, kd = shape
    Q, D, qm, dm = dense_inputs(nq, nj, lq, ld, d, torch.bfloat16, kd)
    q, dd = lik.quantize_fp8(Q), lik.quantize_fp8(D)
    lik.reset_routing_counts()
    out = lik.maxsim_fp8(q, dd, qm, dm, mask_mode=mode)
    assert lik.routing_counts() == {"maxsim_fp8": {"triton": 1}}
    spec = reference.maxsim_fp8(q, dd, qm, dm, mask_mode=mode, dtype=torch.float64)
    # Hopper's fp8 MMA adds its products at reduced internal precision (measured 0.6-1.3e-4
    # of the score; promoting into fp32 every 32 products still left 4e-5 and cost 10-30 %,
    # docs/performance-notes.md, fp8), a hundredth of what e4m3 rounding itself changes (~1e-2)
    assert rel_err(out, spec) < 3e-4


@pytest.mark.parametrize("shape", [
    (8, 8, 32, 256, 128, False),       # the unit-test regime
    (2, 32, 300, 200, 128, False),     # long queries: row chunks
    (4, 6, 32, 180, 96, True),         # per-query candidates, d not a power of two
    (3, 5, 32, 70, 200, False),        # d = 200: a 256-wide K tile
    (5, 7, 8, 20, 16, False),          # d = 16: padded to the fp8 MMA's K of 32
], ids=["small", "long-query", "kd", "wide", "tiny-d"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_fp8_fused_query_quantisation_matches_the_two_launch_path(monkeypatch, shape, dtype):
    """A float query is quantised inside the scoring kernel (QUANT_Q): the scores of
    quantising it first, to the last bit or one -- a NaN token included -- and no separate
    launch.  Measured on an H100 (docs/performance-notes.md, fp8): 1-ulp differences in up to
    40 % of the scores (relative <= 1.1e-7) and the same error against the specification; a
    query token quantised differently would move its score by ~1e-3."""
    nq, nj, lq, ld, d, kd = shape
    Q, D, qm, dm = dense_inputs(nq, nj, lq, ld, d, dtype, kd)
    Q[0, 1, 2] = float("nan")
    qm[0, 1] = True
    index = lik.quantize_fp8(D)
    from lik_plugins.kernels.triton import quantize
    from lik_plugins.ops.quantized import FP8

    # the public quantize_fp8 refuses a NaN token (an index must not hold one); the op's own
    # quantisation step keeps the token NaN, as the fused kernel does
    two_launches = lik.maxsim_fp8(FP8.tokens(*FP8.quantize(Q)), index, qm, dm)

    def no_separate_quantisation(x):
        raise AssertionError("the query was quantised outside the scoring kernel")

    monkeypatch.setattr(quantize, "quantize_fp8", no_separate_quantisation)
    fused = lik.maxsim_fp8(Q, index, qm, dm)
    # query 0's NaN poisons its scores, except against the fully masked document 0 of
    # dense_inputs (no similarity is taken there: 0)
    assert fused[0, 1:].isnan().all() and fused[0, 0] == 0 and not fused[1:].isnan().any()
    assert rel_err(fused[1:], two_launches[1:]) < 1e-6


@pytest.mark.parametrize("shape", [(1, 1000, 32, 300), (64, 512, 32, 256)], ids=["rerank", "search"])
def test_fp8_fused_query_quantisation_on_tuned_shapes_meets_the_specification(monkeypatch, shape):
    from lik_plugins.kernels import triton_ops

    monkeypatch.setattr(triton_ops, "FUSED_QUANTISATION_ELEMENTS", 1 << 40)  # fuse the search shape too
    nq, nj, lq, ld = shape
    Q, D, qm, dm = dense_inputs(nq, nj, lq, ld, 128, torch.bfloat16, False)
    index = lik.quantize_fp8(D)
    spec = reference.maxsim_fp8(lik.quantize_fp8(Q), index, qm, dm, dtype=torch.float64)
    assert rel_err(lik.maxsim_fp8(Q, index, qm, dm), spec) < 3e-4


def test_fp8_quantize_kernel_is_bitwise_the_specification():
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(64, 300, 128, device="cuda", generator=g) * torch.logspace(-4, 4, 300, device="cuda")[None, :, None]
    x[1, 5] = 0
    for src in (x, x.bfloat16(), x[:, ::3]):
        q = lik.quantize_fp8(src)
        values, scales = reference.quantize_fp8(src)
        assert torch.equal(q.values.view(torch.uint8), values.view(torch.uint8))
        assert torch.equal(q.scales, scales)


def test_fp8_non_finite_query_poisons_its_scores():
    Q = torch.randn(3, 8, 128, device="cuda")
    Q[1, 2, 3] = float("nan")
    Q[2, 4, 0] = float("inf")
    scores = lik.maxsim_fp8(Q, torch.randn(300, 40, 128, device="cuda"))
    assert scores[0].isfinite().all() and scores[1:].isnan().all()


# ------------------------------------------------------------------ int8
@pytest.mark.parametrize("kd,mode,dtype,d,prequantised", [
    (False, "exclude", torch.bfloat16, 128, False), (False, "zero", torch.float32, 96, False),
    (True, "zero", torch.bfloat16, 128, True), (True, "exclude", torch.float32, 128, False)],
    ids=["cross-exclude-bf16", "cross-zero-fp32-d96", "kd-zero-bf16-int8query", "kd-exclude-fp32"])
def test_maxsim_int8(kd, mode, dtype, d, prequantised):
    g = cuda_generator(17)
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
    served("maxsim_int8")
    q_spec = reference.quantize_int8(Q)
    want = reference.maxsim_int8(q_spec, tuple(index), qm, dm, mask_mode=mode, dtype=torch.float64)
    assert out.shape == want.shape and out.dtype == torch.float32
    # exact int32 products, each scaled by two fp32 scales: fp32 rounding only
    assert rel_err(out, want) < 1e-5
    assert not out[-1].any()
    assert not (out[0, 1] if kd else out[:, 1]).any()
