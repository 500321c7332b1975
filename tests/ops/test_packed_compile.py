"""torch.compile through the packed ops (CPU: chunked path and the Triton interpreter):
fullgraph and default modes equal eager (values and gradients), no graph break when the
length bounds are given, and the fake kernels agree with the real ops."""
from __future__ import annotations

import pytest
import torch

import lik_plugins as lik


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    Qp, cu_q, mq = lik.pack([torch.randn(n, 16, generator=g) for n in (4, 6, 1)])
    Dp, cu_d, md = lik.pack([torch.randn(n, 16, generator=g) for n in (7, 0, 9, 3)])
    dm = torch.rand(Dp.shape[0], generator=g) > 0.3
    return Qp.requires_grad_(), Dp.requires_grad_(), cu_q, cu_d, mq, md, dm


def _loss_varlen(Qp, Dp, cu_q, cu_d, mq, md, dm):
    s = lik.maxsim_varlen(Qp, Dp, cu_q, cu_d, mq, md, d_mask=dm, mask_mode="zero", normalize=True)
    return torch.nn.functional.cross_entropy(s[:, :3] / 0.05, torch.arange(3))


def _loss_pairs(Qp, Dp, cu_q, cu_d, mq, md, dm):
    pq, pd = torch.tensor([2, 0, 2, 1]), torch.tensor([3, 2, 3, 1])
    return lik.score_pairs_packed(Qp, Dp, cu_q, cu_d, pq, pd, max_seqlen_q=mq, max_seqlen_d=md,
                                  d_mask=dm).square().mean()


CASES = {"varlen": _loss_varlen, "pairs": _loss_pairs}


def _run(fn, inputs):
    loss = fn(*inputs)
    gq, gd = torch.autograd.grad(loss, inputs[:2])
    return loss.detach(), gq, gd


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "default"])
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_equals_eager(check_compiled, case, fullgraph):
    check_compiled(_run, CASES[case], _inputs(len(case)), fullgraph)


@pytest.mark.parametrize("case", list(CASES))
def test_no_graph_breaks(case):
    explained = torch._dynamo.explain(CASES[case])(*_inputs(3))
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def test_maxsim_padded_compiles_without_breaks():
    def f(Q, D, ql, dl):
        return lik.maxsim_padded(Q, D, ql, dl).sum()

    g = torch.Generator().manual_seed(4)
    args = (torch.randn(2, 5, 16, generator=g), torch.randn(2, 3, 7, 16, generator=g), torch.tensor([5, 2]),
            torch.tensor([[7, 0, 3], [1, 7, 4]]))
    explained = torch._dynamo.explain(f)(*args)
    assert explained.graph_break_count == 0, explained.break_reasons
    torch.testing.assert_close(torch.compile(f, fullgraph=True)(*args), f(*args))


def test_fake_kernels_agree_with_the_real_ops():
    from lik_plugins.autograd import packed

    Qp, Dp, cu_q, cu_d, mq, md, dm = (a.detach() if isinstance(a, torch.Tensor) else a for a in _inputs(5))
    pq, pd = torch.tensor([2, 0, 2], dtype=torch.int32), torch.tensor([3, 1, 0], dtype=torch.int32)
    cases = [
        (packed.maxsim_varlen_forward.op, (Qp, Dp, cu_q, cu_d, None, None, None, dm, mq, md, True, True, True, "", True, True)),
        (packed.maxsim_varlen_forward.op, (Qp, Dp, cu_q, cu_d, pq, pd, None, None, mq, md, False, False, True, "", True, False)),
        (packed.maxsim_varlen_forward.op, (Qp, Dp, cu_q, cu_d, pq, pd, None, None, mq, md, False, False, False, "", False, False)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
