"""fp8 (e4m3) inference: quantisation contract, scores against the specification, errors."""
from __future__ import annotations

import pytest
import torch

import lik_plugins as lik
from lik_plugins.kernels import reference
from support.maxsim_testlib import backend_params, make_inputs, rel_err

BACKENDS = backend_params()
E4M3_MAX = 448.0


# ------------------------------------------------------------------ quantisation
def test_quantize_error_is_within_e4m3_rounding(gen):
    x = torch.randn(6, 40, 64, generator=gen) * torch.logspace(-3, 3, 40)[None, :, None]
    q = lik.quantize_fp8(x)
    assert q.values.dtype == torch.float8_e4m3fn and q.scales.dtype == torch.float32
    assert q.values.shape == x.shape and q.scales.shape == x.shape[:-1]
    # each token's largest component lands on e4m3's largest finite value
    assert torch.equal(q.values.float().abs().amax(-1), torch.full((6, 40), E4M3_MAX))
    # 3 mantissa bits: round-to-nearest error <= 2^-4 relative for normals; below e4m3's
    # smallest normal (2^-6) the spacing is 2^-9, so the error is <= 2^-10 absolute
    err = (q.dequantize(torch.float64) - x.double()).abs()
    bound = torch.maximum(x.double().abs() * 2.0**-4, q.scales.double()[..., None] * 2.0**-10)
    assert (err <= bound * (1 + 1e-6)).all()


def test_quantize_zero_token_and_normalize(gen):
    x = torch.randn(2, 5, 16, generator=gen)
    x[0, 3] = 0
    q = lik.quantize_fp8(x)
    assert q.scales[0, 3] == 1 and not q.values[0, 3].float().any()
    unit = lik.quantize_fp8(x * 7.5, normalize=True).dequantize(torch.float64)
    norms = unit.norm(dim=-1)
    norms[0, 3] = 1.0  # the zero token stays zero
    assert (norms - 1).abs().max() < 0.07  # unit vectors, up to e4m3 rounding


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_is_bitwise_the_specification(gen, monkeypatch, backend, dtype):
    # the fused kernel (triton) and the torch formulation give the same bits
    monkeypatch.setenv("LIK_BACKEND", backend)
    x = (torch.randn(3, 70, 40, generator=gen) * torch.logspace(-4, 4, 70)[None, :, None]).to(dtype)
    x[1, 5] = 0
    x = x[:, ::2]  # non-contiguous rows
    q = lik.quantize_fp8(x)
    values, scales = reference.quantize_fp8(x)
    assert q.values.is_contiguous() and q.scales.is_contiguous()
    assert torch.equal(q.values.view(torch.uint8), values.view(torch.uint8))
    assert torch.equal(q.scales, scales)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_finite_query_poisons_its_scores(gen, monkeypatch, backend):
    # queries quantised on the fly are not checked (no host sync); NaN must still show
    if backend == "triton":
        pytest.skip("Triton's interpreter decodes the e4m3 NaN byte as 480; tests/kernels/test_quantized.py checks this on a GPU")
    monkeypatch.setenv("LIK_BACKEND", backend)
    Q = torch.randn(3, 8, 16, generator=gen)
    Q[1, 2, 3] = float("nan")
    Q[2, 4, 0] = float("inf")
    scores = lik.maxsim_fp8(Q, torch.randn(4, 10, 16, generator=gen))
    assert scores[0].isfinite().all() and scores[1:].isnan().all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_quantize_rejects_non_finite(gen, bad):
    x = torch.randn(2, 4, 8, generator=gen)
    x[1, 2, 5] = bad
    with pytest.raises(ValueError, match="NaN or inf"):
        lik.quantize_fp8(x)


def test_quantize_rejects_bad_input():
    with pytest.raises(TypeError, match="float16, bfloat16, float32 or float64 tokens"):
        lik.quantize_fp8(torch.ones(2, 3, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"tokens \[..., L, d\]"):
        lik.quantize_fp8(torch.ones(4))
    with pytest.raises(ValueError, match="d >= 1"):
        lik.quantize_fp8(torch.ones(2, 3, 0))
    with pytest.raises(TypeError, match="torch.Tensor"):
        lik.quantize_fp8([[1.0]])


# ------------------------------------------------------------------ scores
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_mode", ["exclude", "zero"])
@pytest.mark.parametrize("layout", ["cross", "kd"])
def test_maxsim_fp8_equals_the_specification(gen, monkeypatch, backend, mask_mode, layout):
    monkeypatch.setenv("LIK_BACKEND", backend)
    Q, D, qm, dm = make_inputs(gen, layout, 3, 5, 37, 70, 48)
    q, d = lik.quantize_fp8(Q), lik.quantize_fp8(D)
    lik.reset_routing_counts()
    scores = lik.maxsim_fp8(q, d, qm, dm, mask_mode=mask_mode)
    assert lik.routing_counts() == {"maxsim_fp8": {backend: 1}}
    spec = reference.maxsim_fp8(q, d, qm, dm, mask_mode=mask_mode, dtype=torch.float64)
    assert scores.dtype == torch.float32 and scores.shape == spec.shape
    assert rel_err(scores, spec) < 1e-5
    # quantising on the fly is the same as passing quantised tokens
    assert torch.equal(lik.maxsim_fp8(Q, D, qm, dm, mask_mode=mask_mode), scores)


@pytest.mark.parametrize("backend", BACKENDS)
def test_maxsim_fp8_long_query_and_wide_tokens(gen, monkeypatch, backend):
    # Lq > 128 splits queries into row chunks; d > 128 takes the K loop
    monkeypatch.setenv("LIK_BACKEND", backend)
    Q, D, qm, dm = make_inputs(gen, "cross", 2, 3, 150, 40, 160)
    q, d = lik.quantize_fp8(Q), lik.quantize_fp8(D)
    spec = reference.maxsim_fp8(q, d, qm, dm, dtype=torch.float64)
    assert rel_err(lik.maxsim_fp8(q, d, qm, dm), spec) < 1e-5


@pytest.mark.parametrize("backend", [p for p in BACKENDS if p.id == "triton"])
@pytest.mark.parametrize("mask_mode", ["exclude", "zero"])
def test_maxsim_fp8_short_queries_in_programs_of_several_documents(gen, monkeypatch, backend, mask_mode):
    """The blocking fp8 takes for short queries on big launches (128 rows, several
    documents per program), brought down to a small launch: same numbers as the spec."""
    from lik_plugins.kernels.triton import blocking, launch

    monkeypatch.setenv("LIK_BACKEND", backend)
    monkeypatch.setattr(blocking, "FORWARD_MULTI_DOC_MIN_PROGRAMS", 1)
    nq, lq, nj, ld, dim = 9, 32, 8, 70, 48
    rows, qpb, _, dpp = blocking.forward_blocking(nq, lq, nj, ld, cross=True, elem=1, d_pad=64, save_argmax=False)
    assert rows * qpb == blocking.TARGET_BLOCK_M and dpp == blocking.FORWARD_DOCS_PER_PROGRAM > 1
    Q, D, qm, dm = make_inputs(gen, "cross", nq, nj, lq, ld, dim)
    q, d = lik.quantize_fp8(Q), lik.quantize_fp8(D)
    launch.clear_plans()
    try:
        scores = lik.maxsim_fp8(q, d, qm, dm, mask_mode=mask_mode)
    finally:
        launch.clear_plans()
    spec = reference.maxsim_fp8(q, d, qm, dm, mask_mode=mask_mode, dtype=torch.float64)
    assert rel_err(scores, spec) < 1e-5


def test_maxsim_fp8_is_close_to_full_precision(gen):
    # what fp8 costs: a few tenths of a percent of a typical score, never more than 2 %
    Q = torch.nn.functional.normalize(torch.randn(8, 32, 128, generator=gen), dim=-1)
    D = torch.nn.functional.normalize(torch.randn(16, 100, 128, generator=gen), dim=-1)
    exact = reference.maxsim(Q.double(), D.double())
    assert rel_err(lik.maxsim_fp8(Q, D), exact) < 0.02


def test_maxsim_fp8_kill_switch_uses_the_reference(gen, monkeypatch):
    monkeypatch.setenv("LIK_DISABLE", "1")
    Q, D, qm, dm = make_inputs(gen, "cross", 2, 3, 8, 12, 16)
    lik.reset_routing_counts()
    scores = lik.maxsim_fp8(Q, D, qm, dm)
    assert lik.routing_counts() == {"maxsim_fp8": {"reference": 1}}
    assert torch.equal(scores, reference.maxsim_fp8(lik.quantize_fp8(Q), lik.quantize_fp8(D), qm, dm))


def test_maxsim_fp8_empty_batch():
    q = lik.quantize_fp8(torch.randn(0, 8, 16))
    d = lik.quantize_fp8(torch.randn(4, 10, 16))
    assert lik.maxsim_fp8(q, d).shape == (0, 4)
    assert lik.maxsim_fp8(lik.quantize_fp8(torch.randn(3, 8, 16)), d.select(slice(0, 0))).shape == (3, 0)


def test_fp8_tokens_select_slices_values_and_scales(gen):
    Q = torch.randn(2, 8, 16, generator=gen)
    D = torch.randn(9, 12, 16, generator=gen)
    d = lik.quantize_fp8(D)
    part = d.select(slice(2, 5))
    assert torch.equal(lik.maxsim_fp8(Q, part), lik.maxsim_fp8(Q, d)[:, 2:5])


# ------------------------------------------------------------------ errors
def test_maxsim_fp8_is_inference_only(gen):
    Q = torch.randn(2, 4, 8, generator=gen, requires_grad=True)
    D = torch.randn(3, 5, 8, generator=gen)
    with pytest.raises(RuntimeError, match="inference-only"):
        lik.maxsim_fp8(Q, D)
    with torch.no_grad():
        assert lik.maxsim_fp8(Q, D).shape == (2, 3)


def test_maxsim_fp8_rejects_malformed_tokens(gen):
    Q = torch.randn(2, 4, 8, generator=gen)
    d = lik.quantize_fp8(torch.randn(3, 5, 8, generator=gen))
    with pytest.raises(ValueError, match="scales must be float32 of shape"):
        lik.maxsim_fp8(Q, lik.Fp8Tokens(d.values, d.scales[:, :4]))
    with pytest.raises(TypeError, match="values must be torch.float8_e4m3fn"):
        lik.maxsim_fp8(Q, lik.Fp8Tokens(d.values.float(), d.scales))
    with pytest.raises(TypeError, match="Fp8Tokens"):
        lik.maxsim_fp8(Q, (d.values, d.scales, None))
    with pytest.raises(ValueError, match="embedding dims differ"):
        lik.maxsim_fp8(torch.randn(2, 4, 6), d)
    with pytest.raises(ValueError, match="must be 3-D"):
        lik.maxsim_fp8(torch.randn(4, 8), d)
    with pytest.raises(ValueError, match="q_mask must have shape"):
        lik.maxsim_fp8(Q, d, q_mask=torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask_mode"):
        lik.maxsim_fp8(Q, d, mask_mode="max")
    with pytest.raises(ValueError, match="per-query candidates"):
        lik.maxsim_fp8(Q, lik.quantize_fp8(torch.randn(3, 2, 5, 8)))


# ------------------------------------------------------------------ retrieve over an fp8 index
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunk", [None, 4])
def test_retrieve_over_an_fp8_index(gen, monkeypatch, backend, chunk):
    monkeypatch.setenv("LIK_BACKEND", backend)
    Q, D, qm, dm = make_inputs(gen, "cross", 3, 11, 6, 9, 32, special_rows=False)
    index = lik.quantize_fp8(D)
    scores, ids = lik.retrieve(Q, index, 5, qm, dm, chunk=chunk)
    full = reference.maxsim_fp8(lik.quantize_fp8(Q), index, qm, dm, dtype=torch.float64)
    want = full.topk(5, dim=1)
    assert torch.equal(ids, want.indices)
    assert rel_err(scores, want.values) < 1e-5
    assert (scores[:, :-1] >= scores[:, 1:]).all()


def test_retrieve_over_an_fp8_index_rejects_normalize_and_bad_masks(gen):
    Q = torch.randn(2, 4, 16, generator=gen)
    index = lik.quantize_fp8(torch.randn(5, 6, 16, generator=gen))
    with pytest.raises(ValueError, match="normalize=True"):
        lik.retrieve(Q, index, 2, normalize=True)
    with pytest.raises(ValueError, match="d_mask must have shape"):
        lik.retrieve(Q, index, 2, d_mask=torch.ones(4, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="top_k"):
        lik.retrieve(Q, index, -1)


def test_query_quantisation_is_fused_only_where_its_repetition_is_small(monkeypatch):
    """Every program of the fused kernel quantises its own query rows, so the work grows
    with the documents per query: fused for a rerank of a thousand documents, not for a
    4096-document search or a 1024-token query against 2000 documents (measured slower)."""
    from lik_plugins.kernels import triton_ops

    monkeypatch.setattr(triton_ops, "triton_interpret", lambda: False)  # the GPU's decision
    q32, q1024 = torch.empty(1, 32, 128), torch.empty(1, 1024, 128)
    assert triton_ops.fuse_query_quantisation(q32, torch.empty(1000, 300, 128, dtype=torch.uint8))
    assert triton_ops.fuse_query_quantisation(q32, torch.empty(1, 50, 300, 128, dtype=torch.uint8))  # candidates
    assert not triton_ops.fuse_query_quantisation(torch.empty(64, 32, 128), torch.empty(4096, 256, 128))
    assert not triton_ops.fuse_query_quantisation(q1024, torch.empty(2000, 1030, 128))
    assert not triton_ops.fuse_query_quantisation(torch.empty(1, 32, 384), torch.empty(10, 30, 384))  # K tile > 256
    assert not triton_ops.fuse_query_quantisation(lik.quantize_fp8(torch.randn(1, 4, 16)), torch.empty(10, 30, 16))
