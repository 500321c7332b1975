"""The one autograd path: forward saves only the argmax, backward reads it.

Device dispatch happens before this (a path name comes in); this module only decides
what to save and which backward strategy runs.
"""
from __future__ import annotations

import torch

from .kernels.dispatch import implementation

BACKWARD_STRATEGIES = ("auto", "unified", "lowmem")


def choose_backward(strategy: str, *, cross: bool) -> str:
    """Resolve ``backward="auto"``.

    * per-query candidates and pairs: ``lowmem`` — each document is owned by one query,
      so destination-owned gradients have no contention, need no fp32 buffer and are
      deterministic; atomics would buy nothing.
    * in-batch cross product: ``unified`` — one pass over the argmax that gathers for
      grad_Q and scatters ``g * q`` into fp32 with relaxed atomics.  The fp32 buffer
      covers the documents (slab by slab from the host above 64 MiB); a one-launch
      two-slab ring exists but is off (wrong on the H100 in part of the runs,
      ``launch.RING_ENABLED``).  The deterministic alternative (a one-hot product per document tile) costs as
      many FLOPs as the forward and measured 1.6-2x slower on an H100 even after tuning
      (benchmarks/NOTES.md, v9).  The price of ``unified`` is run-to-run rounding
      differences in grad_D; pass ``backward="lowmem"`` for bitwise determinism.
    """
    if strategy not in BACKWARD_STRATEGIES:
        raise ValueError(f"backward must be one of {', '.join(map(repr, BACKWARD_STRATEGIES))}; got {strategy!r}")
    if strategy != "auto":
        return strategy
    return "unified" if cross else "lowmem"


class MaxSimFunction(torch.autograd.Function):
    """``pairs``: ``D`` is ``[B, Ld, d]`` and the scores ``[B]``; the launchers see it as one
    candidate per query.  The views are taken in here, not by the caller, so autograd
    records one node per call instead of three (each node costs host time per step)."""

    @staticmethod
    def forward(ctx, Q, D, q_mask, d_mask, cross, normalize, zero_mode, strategy, path, pairs=False):
        impl = implementation(path)
        needs_grad = bool(ctx.needs_input_grad[0] or ctx.needs_input_grad[1])
        D_view = D.unsqueeze(1) if pairs else D
        if pairs and d_mask is not None:
            d_mask = d_mask.unsqueeze(1)
        scores, argmax = impl.forward(
            Q, D_view, q_mask, d_mask, cross=cross, normalize=normalize, zero_mode=zero_mode, save_argmax=needs_grad
        )
        if needs_grad:
            ctx.save_for_backward(Q, D, argmax)
            ctx.config = (impl, cross, normalize, choose_backward(strategy, cross=cross), pairs, q_mask is not None)
        return scores.squeeze(1) if pairs else scores

    @staticmethod
    def backward(ctx, grad_scores):
        Q, D, argmax = ctx.saved_tensors
        impl, cross, normalize, strategy, pairs, q_masked = ctx.config
        if pairs:
            D, grad_scores = D.unsqueeze(1), grad_scores.unsqueeze(1)
        grad_q, grad_d = impl.backward(
            grad_scores, Q, D, argmax, cross=cross, normalize=normalize,
            need_q=ctx.needs_input_grad[0], need_d=ctx.needs_input_grad[1], strategy=strategy, q_masked=q_masked,
        )
        if pairs and grad_d is not None:
            grad_d = grad_d.squeeze(1)
        return grad_q, grad_d, None, None, None, None, None, None, None, None
