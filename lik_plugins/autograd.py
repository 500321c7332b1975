"""The one autograd path: forward saves only the argmax, backward reads it.

Device dispatch happens before this (a path name comes in); this module only decides
what to save and which backward strategy runs.
"""
from __future__ import annotations

import torch

from .kernels.dispatch import implementation

BACKWARD_STRATEGIES = ("auto", "unified", "lowmem")


# The unified backward runs one program per (query, 32 query tokens): below one program per
# SM of an H100 it cannot fill the GPU.
UNIFIED_MIN_PROGRAMS = 132
# Short documents, small batches: the fp32 buffer of unified (Nd * Ld * d * 4 bytes) would
# be at most this big -- and more than the whole rest of the step's memory.
LOWMEM_BUFFER_BYTES = 32 << 20


def choose_backward(strategy: str, *, cross: bool, shape: tuple[int, int, int, int, int] | None = None) -> str:
    """Resolve ``backward="auto"``; ``shape = (Nq, Lq, Nd, Ld, d)`` of a cross product.

    * per-query candidates and pairs: ``lowmem`` — each document is owned by one query,
      so destination-owned gradients have no contention, need no fp32 buffer and are
      deterministic; atomics would buy nothing.
    * in-batch cross product: ``unified`` — one pass over the argmax that gathers for
      grad_Q and scatters ``g * q`` into fp32 with relaxed atomics (slab by slab from the
      host above 64 MiB of buffer) — except where ``lowmem`` (a one-hot product per
      document tile, as many FLOPs as the forward) measured better on an H100
      (benchmarks/NOTES.md v11, results/h100/sweep_backward_memory.json):
      - fewer than ``UNIFIED_MIN_PROGRAMS`` query programs (ColPali 64: lowmem 0.47 ms at
        17 MiB against unified 0.74 ms at 49 MiB);
      - short documents (Ld <= 256) whose fp32 buffer is at most ``LOWMEM_BUFFER_BYTES``
        (ColBERT 256: lowmem 1.05 ms at 22 MiB against unified 0.87 ms at 54 MiB; the
        peers use 26-58 MiB): there the buffer would double the step's memory for 20 %.
      Above that (ColBERT 1024: 12.7 against 17.4 ms; ColPali 256: 1.9 against 4.1 ms)
      ``unified`` wins by too much.  The price of ``unified`` is run-to-run rounding
      differences in grad_D; pass ``backward="lowmem"`` for bitwise determinism.
    """
    if strategy not in BACKWARD_STRATEGIES:
        raise ValueError(f"backward must be one of {', '.join(map(repr, BACKWARD_STRATEGIES))}; got {strategy!r}")
    if strategy != "auto":
        return strategy
    if not cross:
        return "lowmem"
    if shape is not None:
        nq, lq, nd, ld, dim = shape
        if nq * -(-max(lq, 1) // 32) < UNIFIED_MIN_PROGRAMS:
            return "lowmem"
        if ld <= 256 and nd * ld * dim * 4 <= LOWMEM_BUFFER_BYTES:
            return "lowmem"
    return "unified"


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
            shape = (Q.shape[0], Q.shape[1], D.shape[0], D.shape[1], Q.shape[2]) if cross else None
            ctx.config = (impl, cross, normalize, choose_backward(strategy, cross=cross, shape=shape), pairs,
                          q_mask is not None)
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
