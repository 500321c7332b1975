"""One rank of the PyLate cross-device training test (started by ``support.dist_launch.run_ranks``).

For each loss (``Contrastive``, ``CachedContrastive``, both ``gather_across_devices=True``)
this rank trains the tiny offline ColBERT of ``pylate_tiny`` with the real
``SentenceTransformerTrainer`` (accelerate sets up gloo and DDP from the environment)
three times: unpatched, patched, and patched under ``LIK_DISABLE=1``.  It records the
per-step losses, the routing counts, and the shape of every score matrix the loss saw
(it must span the documents of every rank), and saves the trained weights for the
parent to compare across runs and ranks.

It also takes one direct ``Contrastive`` step (no trainer) on a fixed shard of
``pylate_tiny.TRIPLES``, unpatched and patched, and beside it the single-process loss
over the whole global batch, so the parent can check what gathering means in PyLate 1.6.0
(see ``test_pylate_gather.py``): the all-reduced gradient and loss against the
full-batch ones.

Usage: ``python pylate_gather_worker.py OUT_DIR ENCODER_DIR``.
"""
from __future__ import annotations

import os
import sys

import torch

torch.set_num_threads(1)

import lik_plugins  # noqa: E402
from support import pylate_tiny as tiny  # noqa: E402  (tests/ is on PYTHONPATH)
from support.dist_launch import write_result  # noqa: E402


class ShapeSpy:
    """Wraps a loss's ``score_metric``: records each score matrix's shape, then calls
    the wrapped scorer unchanged (a ``ColBERTScores`` instance, patched or not)."""

    def __init__(self, scorer):
        self.scorer, self.shapes = scorer, []

    def __call__(self, *args, **kwargs):
        out = self.scorer(*args, **kwargs)
        self.shapes.append(list(out.shape))
        return out


def make_loss(kind: str, model):
    from pylate import losses

    if kind == "contrastive":
        return losses.Contrastive(model=model, gather_across_devices=True)
    if kind == "cached":
        return losses.CachedContrastive(model=model, mini_batch_size=2, gather_across_devices=True)
    raise ValueError(kind)


def run(kind: str, encoder_dir: str, work_dir: str):
    model = tiny.load_colbert(encoder_dir)
    loss = make_loss(kind, model)
    spy = loss.score_metric = ShapeSpy(loss.score_metric)
    lik_plugins.reset_routing_counts()
    values = tiny.train(model, loss, kind, work_dir)
    return {"losses": values, "counts": lik_plugins.routing_counts(), "shapes": spy.shapes}, tiny.parameters(model)


def _flat_grad(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def direct_step(encoder_dir: str, per_rank: int = 3) -> dict:
    """One gathered ``Contrastive`` forward/backward on this rank's shard of the first
    ``per_rank * world_size`` triples, all-reduced (what DDP sums before it divides by the
    world size); plus, on every rank, the plain single-process loss over all of them."""
    import torch.distributed as dist
    from pylate import losses

    rank, world = dist.get_rank(), dist.get_world_size()
    rows = tiny.TRIPLES[: per_rank * world]

    def features(model, part):
        return [
            model.tokenize([t[0] for t in part], is_query=True, pad=True),
            model.tokenize([t[1] for t in part], is_query=False, pad=True),
            model.tokenize([t[2] for t in part], is_query=False, pad=True),
        ]

    lik_plugins.reset_routing_counts()
    model = tiny.load_colbert(encoder_dir)
    loss = losses.Contrastive(model=model, gather_across_devices=True)
    value = loss(features(model, rows[rank * per_rank : (rank + 1) * per_rank]))
    value.backward()
    summed = torch.cat([value.detach().reshape(1), _flat_grad(model)])
    dist.all_reduce(summed)
    counts = lik_plugins.routing_counts()

    full = tiny.load_colbert(encoder_dir)
    full_value = losses.Contrastive(model=full)(features(full, rows))
    full_value.backward()
    return {
        "loss_sum": float(summed[0]),
        "grad_sum": summed[1:],
        "full_loss": float(full_value.detach()),
        "full_grad": _flat_grad(full),
        "counts": counts,
    }


def main(out_dir: str, encoder_dir: str) -> None:
    import datetime

    import torch.distributed as dist

    # our own group, so a collective that waits on a dead peer fails within a minute
    # (accelerate reuses an initialised group)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = int(os.environ["RANK"])
    work = os.path.join(out_dir, f"work{rank}")
    result: dict = {"rank": rank}
    params: dict = {"initial": tiny.parameters(tiny.load_colbert(encoder_dir))}
    for kind in ("contrastive", "cached"):
        lik_plugins.unpatch_pylate()
        result[f"{kind}/vanilla"], params[f"{kind}/vanilla"] = run(kind, encoder_dir, work)
        lik_plugins.patch_pylate()
        result[f"{kind}/patched"], params[f"{kind}/patched"] = run(kind, encoder_dir, work)
        os.environ["LIK_DISABLE"] = "1"
        try:
            result[f"{kind}/disabled"], params[f"{kind}/disabled"] = run(kind, encoder_dir, work)
        finally:
            del os.environ["LIK_DISABLE"]
        lik_plugins.unpatch_pylate()
    for mode in ("vanilla", "patched"):
        if mode == "patched":
            lik_plugins.patch_pylate()
        step = direct_step(encoder_dir)
        lik_plugins.unpatch_pylate()
        params[f"direct/{mode}/grad_sum"] = step.pop("grad_sum")
        params[f"direct/{mode}/full_grad"] = step.pop("full_grad")
        result[f"direct/{mode}"] = step
    result["world_size"] = dist.get_world_size()
    result["backend"] = dist.get_backend()
    torch.save(params, os.path.join(out_dir, f"params{rank}.pt"))
    write_result(out_dir, rank, result)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
