"""Patched colpali-engine loss heads under torch.compile: no graph break from our code,
losses and gradients equal eager, the compiled calls run our op.  (colpali's own score
normalisation branches on a tensor's value -- its range check -- which breaks the graph
with or without the patch; those breaks are the host's.)"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import lik_plugins

from support.colpali_helpers import env

# our package's own files: a checkout folder named ``lik_plugins`` holds the host's
# environment too, so a name test on the path would count the host's frames as ours
PACKAGE_DIR = os.path.dirname(os.path.abspath(lik_plugins.__file__)) + os.sep

L = pytest.importorskip("colpali_engine.loss.late_interaction_losses")


@pytest.mark.parametrize("head", ["ColbertLoss", "ColbertPairwiseCELoss", "ColbertNegativeCELoss"])
@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "default"])
def test_patched_heads_compile(head, fullgraph):
    g = torch.Generator().manual_seed(6)
    Q = F.normalize(torch.randn(4, 5, 16, generator=g), dim=-1).requires_grad_()
    D = F.normalize(torch.randn(4, 11, 16, generator=g), dim=-1).requires_grad_()
    N = F.normalize(torch.randn(4, 2, 11, 16, generator=g), dim=-1).requires_grad_()
    Q.data[:, -1] = 0  # colpali's zero padding
    with env(COLPALI_SCORES_BACKEND="lik"):
        lik_plugins.patch_colpali_engine()
        try:
            torch._dynamo.reset()
            # fullgraph: without colpali's score normalisation, whose range check breaks the
            # graph unpatched too
            loss_fn = getattr(L, head)(normalize_scores=not fullgraph)
            args = (Q, D, N) if head == "ColbertNegativeCELoss" else (Q, D)
            explained = torch._dynamo.explain(loss_fn)(*args)
            ours = [r for r in explained.break_reasons
                    if r.user_stack and os.path.abspath(r.user_stack[-1].filename).startswith(PACKAGE_DIR)]
            assert not ours, ours
            lik_plugins.reset_routing_counts()
            compiled = torch.compile(loss_fn, fullgraph=fullgraph)(*args)
            counts = lik_plugins.routing_counts()
            got = (compiled.detach(), *torch.autograd.grad(compiled, args))
            eager = loss_fn(*args)
            want = (eager.detach(), *torch.autograd.grad(eager, args))
        finally:
            lik_plugins.unpatch_colpali_engine()
            torch._dynamo.reset()
    assert any("torch-chunked" in paths for name, paths in counts.items() if not name.startswith("colpali")), counts
    # inductor fuses colpali's softmax over scores / 0.02 (a 50x gain) in its own order:
    # fp32 rounding differences of a few 1e-5 relative, nothing from the scores themselves
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
