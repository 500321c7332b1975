"""A patched PyLate scoring step under torch.compile: no graph break from our code,
values and gradients equal eager, and the compiled calls run our op."""
from __future__ import annotations

import pytest

pytest.importorskip("pylate")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import lik_plugins  # noqa: E402
from lik_plugins.pylate import patch_pylate, unpatch_pylate  # noqa: E402


@pytest.fixture
def patched(monkeypatch):
    monkeypatch.delenv("PYLATE_SCORES_BACKEND", raising=False)
    monkeypatch.delenv("LIK_DISABLE", raising=False)
    torch._dynamo.reset()
    patch_pylate()
    yield
    unpatch_pylate()
    torch._dynamo.reset()


def _contrastive(Q, D, qm, dm):
    from pylate import scores

    s = scores.colbert_scores(Q, D, qm, dm)
    return F.cross_entropy(s, torch.arange(s.shape[0]))


def _distillation(Q, D, qm, dm):
    from pylate import scores

    s = scores.colbert_kd_scores(Q, D.view(Q.shape[0], -1, *D.shape[1:]), qm, dm.view(Q.shape[0], -1, dm.shape[-1]))
    teacher = torch.linspace(0, 1, s.numel()).view(s.shape)
    return F.kl_div(F.log_softmax(s, -1), F.softmax(teacher, -1), reduction="batchmean")


@pytest.mark.parametrize("loss", [_contrastive, _distillation], ids=["contrastive", "distillation"])
@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "default"])
def test_patched_scores_compile(patched, loss, fullgraph):
    g = torch.Generator().manual_seed(4)
    Q = F.normalize(torch.randn(4, 6, 16, generator=g), dim=-1).requires_grad_()
    D = F.normalize(torch.randn(8, 9, 16, generator=g), dim=-1).requires_grad_()
    qm = torch.rand(4, 6, generator=g) > 0.2
    dm = torch.rand(8, 9, generator=g) > 0.3
    explained = torch._dynamo.explain(loss)(Q, D, qm, dm)
    assert explained.graph_break_count == 0, explained.break_reasons
    lik_plugins.reset_routing_counts()
    got = loss_and_grads(torch.compile(loss, fullgraph=fullgraph), Q, D, qm, dm)
    assert "torch-chunked" in lik_plugins.routing_counts().get("maxsim", {})
    want = loss_and_grads(loss, Q, D, qm, dm)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def loss_and_grads(fn, Q, D, qm, dm):
    loss = fn(Q, D, qm, dm)
    return (loss.detach(), *torch.autograd.grad(loss, (Q, D)))
