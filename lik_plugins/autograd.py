"""The one autograd path: forward saves only the argmax, backward reads it.

Device dispatch happens before this (a path name comes in); this module only decides
what to save and which backward strategy runs.
"""
from __future__ import annotations

import torch

from .kernels.common import COMPACT_MAX_ROWS
from .kernels.dispatch import implementation

BACKWARD_STRATEGIES = ("auto", "unified", "lowmem")


# The unified backward runs one program per (query, 32 query tokens): below one program per
# SM of an H100 it cannot fill the GPU.
UNIFIED_MIN_PROGRAMS = 132
# Short documents (ColBERT): lowmem up to this length, where its tiles list their rows.
LOWMEM_MAX_LD = 256


def choose_backward(strategy: str, *, cross: bool, shape: tuple[int, int, int, int, int] | None = None) -> str:
    """Resolve ``backward="auto"``; ``shape = (Nq, Lq, Nd, Ld, d)`` of a cross product.

    * per-query candidates and pairs: ``lowmem`` — each document is owned by one query,
      so destination-owned gradients have no contention, need no fp32 buffer and are
      deterministic; atomics would buy nothing.
    * in-batch cross product: ``lowmem`` where it measured best on an H100 (each grad_D
      tile lists the query rows that picked one of its tokens, then multiplies only those;
      benchmarks/NOTES.md v14, results/h100/sweep_compact_step.json), else ``unified`` --
      one pass over the argmax that gathers for grad_Q and scatters ``g * q`` into fp32
      with relaxed atomics (slab by slab from the host above 64 MiB of buffer):
      - short documents (Ld <= ``LOWMEM_MAX_LD``) with at most ``COMPACT_MAX_ROWS`` query
        rows: ColBERT 256 lowmem 0.75 ms at 24 MiB against unified 0.87 at 54 MiB,
        ColBERT 1024 9.6 ms at 196 MiB against 12.7 at 204;
      - fewer than ``UNIFIED_MIN_PROGRAMS`` query programs, where unified cannot fill the
        GPU (ColPali 64: lowmem 0.35-0.47 ms at 17 MiB against unified 0.55-0.74 at 49);
      - otherwise unified (ColPali 256: 1.94 ms at 134 MiB against lowmem 2.09 at 73;
        beyond COMPACT_MAX_ROWS lowmem walks every row per tile: ColBERT 1024 17.5 ms).
      ``unified`` rounds grad_D differently from run to run; pass ``backward="lowmem"``
      for bitwise determinism.
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
        if ld <= LOWMEM_MAX_LD and nq * lq <= COMPACT_MAX_ROWS:
            return "lowmem"
    return "unified"


class MaxSimFunction(torch.autograd.Function):
    """``pairs``: ``D`` is ``[B, Ld, d]`` and the scores ``[B]``; the launchers see it as one
    candidate per query.  The views are taken in here, not by the caller, so autograd
    records one node per call instead of three (each node costs host time per step).
    ``options = (cross, normalize, zero_mode, strategy, path, pairs)``: one argument, not six,
    since ``apply`` walks every argument on every call."""

    @staticmethod
    def forward(ctx, Q, D, q_mask, d_mask, options):
        cross, normalize, zero_mode, strategy, path, pairs = options
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
        return grad_q, grad_d, None, None, None
