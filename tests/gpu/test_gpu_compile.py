"""torch.compile on CUDA through the registered op layer: fullgraph, default and
``reduce-overhead`` (CUDA graphs), values and gradients equal eager, no graph break, and
the compiled steps run the Triton kernels."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lik_plugins as lik

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _inputs(seed, kd=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    Q = F.normalize(torch.randn(32, 24, 128, device="cuda", generator=g), dim=-1).bfloat16().requires_grad_()
    shape = (32, 4, 180, 128) if kd else (48, 180, 128)
    D = F.normalize(torch.randn(*shape, device="cuda", generator=g), dim=-1).bfloat16().requires_grad_()
    dm = torch.rand(*shape[:-1], device="cuda", generator=g) > 0.2
    return Q, D, dm


def _cross(Q, D, dm):
    return F.cross_entropy(lik.maxsim(Q, D, None, dm)[:, :32] / 0.05, torch.arange(32, device="cuda"))


def _kd(Q, D, dm):
    return F.log_softmax(lik.maxsim(Q, D, None, dm, mask_mode="zero"), -1)[:, 0].mean()


def _smooth(Q, D, dm):
    return lik.smooth_maxsim(Q, D * dm.unsqueeze(-1), tau=0.1).logsumexp(-1).mean()


@pytest.mark.parametrize("mode", ["fullgraph", "default", "reduce-overhead"])
@pytest.mark.parametrize("fn", [_cross, _kd, _smooth], ids=["cross", "kd", "smooth"])
def test_compiled_equals_eager_on_cuda(mode, fn):
    torch._dynamo.reset()
    kd = fn is _kd
    compiled = torch.compile(fn, fullgraph=mode == "fullgraph", mode="reduce-overhead" if mode == "reduce-overhead" else None)
    lik.reset_routing_counts()
    for seed in range(3):   # reduce-overhead: warm-up, recording, then a replay
        Q, D, dm = _inputs(seed, kd)
        loss = compiled(Q, D, dm)
        got = (loss.detach().clone(), *[g.clone() for g in torch.autograd.grad(loss, (Q, D))])
        eager = fn(Q, D, dm)
        want = (eager.detach(), *torch.autograd.grad(eager, (Q, D)))
        for a, b in zip(got, want):
            torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-3)
    assert any("triton" in paths for paths in lik.routing_counts().values())


@pytest.mark.parametrize("fn", [_cross, _kd, _smooth], ids=["cross", "kd", "smooth"])
def test_no_graph_break_on_cuda(fn):
    torch._dynamo.reset()
    explained = torch._dynamo.explain(fn)(*_inputs(7, fn is _kd))
    assert explained.graph_break_count == 0, explained.break_reasons
