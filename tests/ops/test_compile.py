"""torch.compile and torch.export through the registered op layer (CPU, chunked path and
the Triton interpreter): fullgraph and default modes, values and gradients equal eager,
no graph break from our code, and the calls still routed and counted."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lik_plugins as lik


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _inputs(seed, *, kd=False, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    Q = torch.randn(4, 6, 16, generator=g).to(dtype).requires_grad_()
    shape = (4, 3, 9, 16) if kd else (5, 9, 16)
    D = torch.randn(*shape, generator=g).to(dtype).requires_grad_()
    qm = torch.rand(4, 6, generator=g) > 0.3
    qm[:, 0] = True
    dm = torch.rand(*shape[:-1], generator=g) > 0.3
    dm[1] = False  # a fully masked document (kd: every candidate of query 1)
    return Q, D, qm, dm


def _loss_cross(Q, D, qm, dm):
    s = lik.maxsim(Q, D, qm, dm, normalize=True)
    return F.cross_entropy(s[:, :4] / 0.05, torch.arange(4))


def _loss_kd(Q, D, qm, dm):
    s = lik.maxsim(Q, D, qm, dm, mask_mode="zero")
    return F.kl_div(F.log_softmax(s, -1), F.softmax(torch.arange(3.0).expand(4, 3), -1), reduction="batchmean")


def _loss_pairs(Q, D, qm, dm):
    return lik.maxsim_pairs(Q, D[:4], qm, dm[:4]).square().mean()


def _loss_smooth(Q, D, qm, dm):
    return lik.smooth_maxsim(Q, D, tau=0.1).logsumexp(-1).mean()


CASES = {"cross": (_loss_cross, False), "kd": (_loss_kd, True), "pairs": (_loss_pairs, False),
         "smooth": (_loss_smooth, False)}


def _run(fn, inputs):
    Q, D, qm, dm = inputs
    loss = fn(Q, D, qm, dm)
    gq, gd = torch.autograd.grad(loss, (Q, D))
    return loss.detach(), gq, gd


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "default"])
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_equals_eager(check_compiled, case, fullgraph):
    fn, kd = CASES[case]
    check_compiled(_run, fn, _inputs(hash(case) % 1000, kd=kd), fullgraph)


@pytest.mark.parametrize("case", list(CASES))
def test_no_graph_breaks(case):
    fn, kd = CASES[case]
    explained = torch._dynamo.explain(fn)(*_inputs(3, kd=kd))
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def test_compiled_fp8_scoring_and_retrieval_shapes():
    g = torch.Generator().manual_seed(5)
    Q = torch.randn(3, 5, 16, generator=g)
    index = lik.quantize_fp8(torch.randn(7, 11, 16, generator=g))

    def score(q, values, scales):
        return lik.maxsim_fp8(q, lik.Fp8Tokens(values, scales))

    compiled = torch.compile(score, fullgraph=True)(Q, index.values, index.scales)
    torch.testing.assert_close(compiled, score(Q, index.values, index.scales), rtol=0, atol=0)


def test_dynamic_lengths_compile_once():
    """``dynamic=True``: new lengths run the same graph (the fake kernels are symbolic)."""
    def f(Q, D):
        return lik.maxsim(Q, D).sum()

    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(f, backend=counter, dynamic=True, fullgraph=True)
    g = torch.Generator().manual_seed(9)
    for lq, ld in ((5, 9), (7, 13), (3, 21)):
        Q, D = torch.randn(2, lq, 16, generator=g), torch.randn(3, ld, 16, generator=g)
        torch.testing.assert_close(compiled(Q, D), f(Q, D))
    assert counter.frame_count == 1


def test_export_a_module_that_scores():
    class Reranker(torch.nn.Module):
        def forward(self, Q, D, d_mask):
            return lik.maxsim(Q, D, None, d_mask, normalize=True).topk(2, dim=1).indices

    g = torch.Generator().manual_seed(2)
    Q, D = torch.randn(2, 4, 16, generator=g), torch.randn(6, 8, 16, generator=g)
    dm = torch.rand(6, 8, generator=g) > 0.2
    exported = torch.export.export(Reranker(), (Q, D, dm))
    assert any("lik.maxsim_forward" in str(node.target) for node in exported.graph.nodes)
    assert torch.equal(exported.module()(Q, D, dm), Reranker()(Q, D, dm))


def test_fake_kernels_agree_with_the_real_ops():
    """The registered ops' own consistency check: schema, fake kernel and real kernel agree
    (shapes, dtypes, strides, aliasing) on each layout."""
    from lik_plugins.autograd import dense, smooth
    from lik_plugins.autograd.registry import CANDIDATES, CROSS, PAIRS

    Q, D, qm, dm = _inputs(11)
    Qk, Dk, _, dmk = _inputs(12, kd=True)
    cases = [
        (dense.maxsim_forward.op, (Q, D, qm, dm, CROSS, True, False, True, "", "auto", True, True)),
        (dense.maxsim_forward.op, (Qk, Dk, None, dmk, CANDIDATES, False, True, True, "", "lowmem", True, False)),
        (dense.maxsim_forward.op, (Q, D[:4], None, None, PAIRS, False, False, False, "", "auto", False, False)),
        (smooth.smooth_maxsim_forward.op, (Q, D, 0.1, CROSS, "", True, True)),
    ]
    for op, args in cases:
        args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def _compressed_inputs(seed):
    from lik_plugins.ops import plaid

    g = torch.Generator().manual_seed(seed)
    emb = F.normalize(torch.randn(5 * 9, 16, generator=g), dim=-1)
    centroids = F.normalize(torch.randn(6, 16, generator=g), dim=-1)
    index = plaid.compress(emb, centroids, 4)
    lengths = torch.tensor([9, 0, 4, 7, 1])
    return (index.codes.view(5, 9), index.residuals.view(5, 9, -1), lengths, centroids, index.bucket_weights)


@pytest.mark.usefixtures("compile_backend")
def test_compiled_compressed_ops_equal_eager():
    """maxsim_residual (grad into Q), maxsim_from_hidden (grads into Q, H, W, b) and
    maxsim_int8 under torch.compile(fullgraph=True): values and gradients equal eager."""
    codes, residuals, lengths, centroids, weights = _compressed_inputs(4)
    g = torch.Generator().manual_seed(6)
    Q = torch.randn(3, 4, 16, generator=g, requires_grad=True)
    H = torch.randn(5, 9, 24, generator=g, requires_grad=True)
    W = torch.randn(16, 24, generator=g, requires_grad=True)
    b = torch.randn(16, generator=g, requires_grad=True)
    dm = torch.rand(5, 9, generator=g) > 0.3
    dm[2] = False

    def f(Q, H, W, b):
        r = lik.maxsim_residual(Q, codes, residuals, lengths, centroids, weights, 4)
        h = lik.maxsim_from_hidden(Q, H, W, b, dm)
        return (r.square().sum() + (h * r).sum()), r, h

    def run(fn):
        loss, r, h = fn(Q, H, W, b)
        return (r.detach(), h.detach(), *torch.autograd.grad(loss, (Q, H, W, b)))

    compiled = run(torch.compile(f, fullgraph=True, dynamic=False))
    for got, want in zip(compiled, run(f)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    index = lik.quantize_int8(torch.randn(5, 9, 16, generator=g))

    def score(q, values, scales):
        return lik.maxsim_int8(q, lik.Int8Tokens(values, scales))

    with torch.no_grad():
        q = Q.detach()
        torch.testing.assert_close(torch.compile(score, fullgraph=True)(q, *index), score(q, *index), rtol=0, atol=0)


def test_fake_kernels_of_the_compressed_ops():
    from lik_plugins.autograd import hidden, quantized, residual
    from lik_plugins.kernels import reference

    codes, residuals, lengths, centroids, weights = _compressed_inputs(8)
    g = torch.Generator().manual_seed(3)
    Q = torch.randn(2, 4, 16, generator=g)
    H, W, b = torch.randn(5, 9, 24, generator=g), torch.randn(16, 24, generator=g), torch.randn(16, generator=g)
    dm = reference.lengths_mask(lengths, 9)
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).to(torch.int32)])
    lengths32 = lengths.to(torch.int32)
    scores, argmax = residual.maxsim_residual_forward(Q, codes, residuals, lengths32, centroids, weights, 4, True,
                                                      True, "")
    _, h_argmax = hidden.maxsim_hidden_forward(Q, H, W, b, dm, True, True, "")
    qv, qs = reference.quantize_int8(Q)
    dv, ds = reference.quantize_int8(H[..., :16])
    grad = torch.randn(2, 5, generator=g)
    cases = [
        (residual.maxsim_residual_forward.op, (Q, codes, residuals, lengths32, centroids, weights, 4, True, True, "")),
        (residual.maxsim_residual_backward.op, (grad, Q, codes, residuals, centroids, weights, argmax, 4, True)),
        (hidden.maxsim_hidden_forward.op, (Q, H, W, b, dm, False, True, "")),
        (hidden.maxsim_hidden_forward.op, (Q, H, W, None, None, True, False, "")),
        (hidden.maxsim_hidden_backward.op, (grad, Q, H, W, b, h_argmax, True, True, True, True, True)),
        (hidden.maxsim_hidden_backward.op, (grad, Q, H, W, None, h_argmax, False, False, True, False, False)),
        (quantized.maxsim_int8.op, (qv, qs, dv, ds, None, dm, False, "")),
        (residual.plaid_approx_score.op, (torch.randn(6, 4, generator=g), codes, lengths)),
        (residual.maxsim_residual_varlen.op, (Q, codes[dm].to(torch.int32), residuals[dm], cu, centroids, weights, 4, 9,
                                             True, "")),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


# ------------------------------------------------------------------ CUDA (marker gpu)
# fullgraph, default and ``reduce-overhead`` (CUDA graphs) on the compiled Triton kernels:
# values and gradients equal eager, no graph break.


def _cuda_inputs(seed, kd=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    Q = F.normalize(torch.randn(32, 24, 128, device="cuda", generator=g), dim=-1).bfloat16().requires_grad_()
    shape = (32, 4, 180, 128) if kd else (48, 180, 128)
    D = F.normalize(torch.randn(*shape, device="cuda", generator=g), dim=-1).bfloat16().requires_grad_()
    dm = torch.rand(*shape[:-1], device="cuda", generator=g) > 0.2
    return Q, D, dm


def _cuda_cross(Q, D, dm):
    return F.cross_entropy(lik.maxsim(Q, D, None, dm)[:, :32] / 0.05, torch.arange(32, device="cuda"))


def _cuda_kd(Q, D, dm):
    return F.log_softmax(lik.maxsim(Q, D, None, dm, mask_mode="zero"), -1)[:, 0].mean()


def _cuda_smooth(Q, D, dm):
    return lik.smooth_maxsim(Q, D * dm.unsqueeze(-1), tau=0.1).logsumexp(-1).mean()


CUDA_LOSSES = [pytest.param(_cuda_cross, id="cross"), pytest.param(_cuda_kd, id="kd"),
               pytest.param(_cuda_smooth, id="smooth")]


@pytest.mark.parametrize("mode", ["fullgraph", "default", "reduce-overhead"])
@pytest.mark.parametrize("fn", CUDA_LOSSES)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_equals_eager_on_cuda(mode, fn):
    kd = fn is _cuda_kd
    compiled = torch.compile(fn, fullgraph=mode == "fullgraph", mode="reduce-overhead" if mode == "reduce-overhead" else None)
    lik.reset_routing_counts()
    for seed in range(3):   # reduce-overhead: warm-up, recording, then a replay
        Q, D, dm = _cuda_inputs(seed, kd)
        loss = compiled(Q, D, dm)
        got = (loss.detach().clone(), *[g.clone() for g in torch.autograd.grad(loss, (Q, D))])
        eager = fn(Q, D, dm)
        want = (eager.detach(), *torch.autograd.grad(eager, (Q, D)))
        for a, b in zip(got, want):
            torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-3)
    assert any("triton" in paths for paths in lik.routing_counts().values())


@pytest.mark.parametrize("fn", CUDA_LOSSES)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_no_graph_break_on_cuda(fn):
    explained = torch._dynamo.explain(fn)(*_cuda_inputs(7, fn is _cuda_kd))
    assert explained.graph_break_count == 0, explained.break_reasons
