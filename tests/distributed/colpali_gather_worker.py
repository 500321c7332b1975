"""One rank of the colpali-engine cross-device training test (started by
``support.dist_launch.run_ranks``).

For each head this rank trains the tiny encoder of ``tests/support/colpali_helpers.py`` with the
real ``ContrastiveTrainer`` (accelerate sets up gloo and DDP from the environment), which
left-pads the page embeddings to a common length across ranks, all-gathers them with
gradients and calls the head with ``offset = rank * batch``.  Pages are 12 tokens on rank 0
and 15 on rank 1, so the gathered pages of rank 0 carry 3 zero tokens at the front.  Each
head is trained unpatched, patched and (patched) under ``LIK_DISABLE=1``; the worker
records every call the head received (shapes, offset), the head's loss per step, the
routing counts and the trained weights.  ``ColbertSigmoidLoss`` cannot take gathered pages
in colpali-engine 0.3.18 (its flat positive mask assumes a square score matrix); it is
called directly on the gathered pages to record the error, unpatched and patched.

A torch bug on gloo must be worked around for the unpatched run to be correct at all: the
backward of ``torch.distributed.nn.all_gather`` (torch 2.13) receives the gradient slices
into ``torch.empty_like(grad)`` buffers, which keep a *permuted* gradient's strides, while
gloo's scatter writes them as contiguous bytes -- the owner rank gets a scrambled page
gradient.  colpali's einsum backward yields exactly such a permuted gradient; ours is
contiguous.  (NCCL takes a reduce-scatter path that makes its output contiguous and is
not affected.)  ``gather_gradient_check`` measures this on one direct call before the
fix; the training runs then use :func:`contiguous_all_gather_grads`, identically for
every arm.

Usage: ``python colpali_gather_worker.py OUT_DIR``.
"""
from __future__ import annotations

import datetime
import os
import sys

import torch

torch.set_num_threads(1)

import torch.distributed as dist  # noqa: E402

import lik_plugins  # noqa: E402
from support.colpali_helpers import DIM, train_tiny  # noqa: E402  (tests/ is on PYTHONPATH)
from support.dist_launch import write_result  # noqa: E402

HEADS = [  # (name, class, kwargs, explicit negatives per query)
    ("ColbertLoss", "ColbertLoss", {}, 0),
    ("ColbertLoss-smooth", "ColbertLoss", {"use_smooth_max": True}, 0),
    ("ColbertPairwiseCELoss", "ColbertPairwiseCELoss", {}, 0),
    ("ColbertNegativeCELoss", "ColbertNegativeCELoss", {}, 2),
    ("ColbertPairwiseNegativeCELoss", "ColbertPairwiseNegativeCELoss", {}, 2),
]
BATCH = 4


def run(cls_name: str, kwargs: dict, n_neg: int, work: str, ld: int):
    from colpali_engine.loss import late_interaction_losses as L

    head = getattr(L, cls_name)(**kwargs)
    calls, losses = [], []

    def before(_module, args, kw):
        q, d = kw.get("query_embeddings", args[0] if args else None), kw.get("doc_embeddings")
        calls.append({"q": list(q.shape), "d": list(d.shape), "offset": kw.get("offset"),
                      "zero_tokens": int((d.abs().sum(-1) == 0).sum())})

    hooks = [head.register_forward_pre_hook(before, with_kwargs=True),
             head.register_forward_hook(lambda _m, _i, out: losses.append(float(out.detach())))]
    lik_plugins.reset_routing_counts()
    _, params = train_tiny(head, n_neg, work, steps=2, batch=BATCH, ld=ld)
    for h in hooks:
        h.remove()
    return {"calls": calls, "losses": losses, "counts": lik_plugins.routing_counts()}, params


def sigmoid_on_gathered_pages(rank: int) -> dict:
    """colpali's own outcome for the Sigmoid head on pages gathered from every rank."""
    from colpali_engine.loss import late_interaction_losses as L
    from colpali_engine.trainer.contrastive_trainer import concat_all_gather

    g = torch.Generator().manual_seed(100 + rank)
    q = torch.nn.functional.normalize(torch.randn(BATCH, 5, DIM, generator=g), dim=-1)
    d = concat_all_gather(torch.nn.functional.normalize(torch.randn(BATCH, 7, DIM, generator=g), dim=-1))
    lik_plugins.reset_routing_counts()
    try:
        L.ColbertSigmoidLoss()(query_embeddings=q, doc_embeddings=d, offset=rank * BATCH)
        outcome = "no error"
    except Exception as exc:  # noqa: BLE001 - the outcome is the result
        outcome = f"{type(exc).__name__}: {exc}"
    return {"outcome": outcome, "counts": lik_plugins.routing_counts()}


def contiguous_all_gather_grads() -> None:
    """Make the all-gather backward see contiguous gradients (the torch/gloo workaround
    described above), for the unpatched and patched runs alike."""
    from torch.distributed.nn import functional as F

    original = F._AllGather.backward

    def backward(ctx, *grads):
        return original(ctx, *(g.contiguous() for g in grads))

    F._AllGather.backward = staticmethod(backward)


def gather_gradient_check(rank: int) -> dict:
    """One ``ColbertLoss`` call on pages gathered with gradients (front-padded with zero
    tokens, as the trainer does), unpatched and patched: the page gradient each rank
    receives, against the sum over ranks of the gradients every rank computed for its
    pages (gathered independently, without autograd)."""
    from colpali_engine.loss import late_interaction_losses as L
    from colpali_engine.trainer.contrastive_trainer import concat_all_gather

    g = torch.Generator().manual_seed(200 + rank)
    q0 = torch.randn(BATCH, 5, DIM, generator=g)
    d0 = torch.randn(BATCH, 9, DIM, generator=g)
    keep = torch.ones(BATCH, 9, 1)
    keep[:, :2] = 0  # zero tokens at the front of every page
    out = {}
    for mode in ("vanilla", "patched"):
        if mode == "patched":
            lik_plugins.patch_colpali_engine()
        q = torch.nn.functional.normalize(q0, dim=-1).requires_grad_()
        d = (torch.nn.functional.normalize(d0, dim=-1) * keep).requires_grad_()
        gathered = concat_all_gather(d)
        seen = {}
        gathered.register_hook(lambda grad: seen.__setitem__("grad", grad.detach().clone()))
        L.ColbertLoss()(query_embeddings=q, doc_embeddings=gathered, offset=rank * BATCH).backward()
        every = [torch.empty_like(seen["grad"]) for _ in range(dist.get_world_size())]
        dist.all_gather(every, seen["grad"].contiguous())
        expected = sum(x[rank * BATCH : (rank + 1) * BATCH] for x in every)
        out[mode] = {"error": float((d.grad - expected).abs().max()), "scale": float(expected.abs().max())}
        lik_plugins.unpatch_colpali_engine()
    return out


def main(out_dir: str) -> None:
    # our own group, so a collective waiting on a dead peer fails within a minute
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    work = os.path.join(out_dir, f"work{rank}")
    ld = 12 + 3 * rank
    result: dict = {"rank": rank, "world_size": dist.get_world_size(), "backend": dist.get_backend()}
    params: dict = {}
    result["gather_gradient_unfixed"] = gather_gradient_check(rank)
    contiguous_all_gather_grads()
    result["gather_gradient_fixed"] = gather_gradient_check(rank)
    for name, cls_name, kwargs, n_neg in HEADS:
        lik_plugins.unpatch_colpali_engine()
        result[f"{name}/vanilla"], params[f"{name}/vanilla"] = run(cls_name, kwargs, n_neg, work, ld)
        lik_plugins.patch_colpali_engine()
        result[f"{name}/patched"], params[f"{name}/patched"] = run(cls_name, kwargs, n_neg, work, ld)
        os.environ["LIK_DISABLE"] = "1"
        try:
            result[f"{name}/disabled"], params[f"{name}/disabled"] = run(cls_name, kwargs, n_neg, work, ld)
        finally:
            del os.environ["LIK_DISABLE"]
        lik_plugins.unpatch_colpali_engine()
    result["sigmoid/vanilla"] = sigmoid_on_gathered_pages(rank)
    lik_plugins.patch_colpali_engine()
    result["sigmoid/patched"] = sigmoid_on_gathered_pages(rank)
    lik_plugins.unpatch_colpali_engine()
    torch.save(params, os.path.join(out_dir, f"params{rank}.pt"))
    write_result(out_dir, rank, result)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
