"""Hard-max MaxSim on padded tokens (``maxsim``, ``maxsim_pairs``, ``retrieve``,
``maxsim_padded``): the registered forward and backward, and their autograd Function.

``lik::maxsim_forward``   scores and (for a gradient) the winning document token per query row
``lik::maxsim_backward``  grad_Q / grad_D through the saved winners

The backward keeps only the winners (int16/int32 argmax).  :func:`choose_backward` resolves
``backward="auto"``; the launchers come from :func:`lik_plugins.kernels.dispatch.serve`.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..kernels.common import COMPACT_MAX_ROWS
from ..kernels.device import sm_count
from ..kernels.dispatch import serve
from .registry import CROSS, PAIRS, grads_fake, or_empty, registered, scores_fake, shape_of_scores

__all__ = ["maxsim", "choose_backward", "BACKWARD_STRATEGIES"]

BACKWARD_STRATEGIES = ("auto", "unified", "lowmem")

# Short documents (ColBERT): lowmem up to this length, where its tiles list their rows.
LOWMEM_MAX_LD = 256


def _forward_fake(Q, D, q_mask, d_mask, layout, normalize, zero_mode, save_argmax, entry, strategy, need_q, need_d):
    shape, n_docs, ld = shape_of_scores(Q, D, layout)
    return scores_fake(Q, shape, n_docs, ld, save_argmax)


@registered("maxsim_forward", _forward_fake)
def maxsim_forward(
    Q: torch.Tensor, D: torch.Tensor, q_mask: Optional[torch.Tensor], d_mask: Optional[torch.Tensor],
    layout: int, normalize: bool, zero_mode: bool, save_argmax: bool, entry: str,
    strategy: str, need_q: bool, need_d: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MaxSim scores and, when ``save_argmax``, the winners ``[Nq, NJ, Lq]`` (-1: none).
    Pairs (``layout == PAIRS``) score ``D [B, Ld, d]`` as one candidate per query.

    ``save_argmax``: a training forward, whose backward (``maxsim_backward`` with ``strategy``,
    ``need_q``, ``need_d``) will follow."""
    launchers = serve(Q, "maxsim", entry).maxsim
    if layout == PAIRS:
        D = D.unsqueeze(1)
        d_mask = None if d_mask is None else d_mask.unsqueeze(1)
    scores, argmax = launchers.forward(Q, D, q_mask, d_mask, cross=layout == CROSS, normalize=normalize,
                                       zero_mode=zero_mode, save_argmax=save_argmax)
    if layout == PAIRS:
        scores = scores.squeeze(1)
    return scores, or_empty(argmax, Q, torch.int16)


def choose_backward(strategy: str, *, cross: bool, shape: tuple[int, int, int, int, int] | None = None,
                    sms: int | None = None) -> str:
    """Resolve ``backward="auto"``; ``shape = (Nq, Lq, Nd, Ld, d)`` of a cross product,
    ``sms`` the GPU's streaming multiprocessors (default: the device module's default).

    * per-query candidates and pairs: ``lowmem`` -- each document is owned by one query,
      so destination-owned gradients have no contention, need no fp32 buffer and are
      deterministic; atomics would buy nothing.
    * in-batch cross product: ``lowmem`` where it measured best (each grad_D tile lists the
      query rows that picked one of its tokens, then multiplies only those), else
      ``unified`` -- one pass over the argmax that gathers for grad_Q and scatters
      ``g * q`` into fp32 with relaxed atomics (slab by slab above 64 MiB of buffer):
      - short documents (Ld <= ``LOWMEM_MAX_LD``) with at most ``COMPACT_MAX_ROWS`` query
        rows (ColBERT shapes: faster and leaner);
      - fewer query programs (one per 32 query tokens) than the GPU has SMs, where unified
        cannot fill it (small ColPali batches);
      - otherwise unified (large ColPali batches).
      The measurements behind each rule: docs/performance-notes.md.  ``unified`` rounds
      grad_D differently from run to run; pass ``backward="lowmem"`` for bitwise determinism.
    """
    if strategy not in BACKWARD_STRATEGIES:
        raise ValueError(f"backward must be one of {', '.join(map(repr, BACKWARD_STRATEGIES))}; got {strategy!r}")
    if strategy != "auto":
        return strategy
    if not cross:
        return "lowmem"
    if shape is not None:
        nq, lq, nd, ld, dim = shape
        if nq * -(-max(lq, 1) // 32) < (sms if sms is not None else sm_count(None)):
            return "lowmem"
        if ld <= LOWMEM_MAX_LD and nq * lq <= COMPACT_MAX_ROWS:
            return "lowmem"
    return "unified"


def _backward_fake(grad, Q, D, argmax, layout, normalize, strategy, need_q, need_d, q_masked):
    return grads_fake((Q, need_q), (D, need_d))


@registered("maxsim_backward", _backward_fake)
def maxsim_backward(
    grad: torch.Tensor, Q: torch.Tensor, D: torch.Tensor, argmax: torch.Tensor, layout: int, normalize: bool,
    strategy: str, need_q: bool, need_d: bool, q_masked: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_Q, grad_D)`` through the winners (empty where not needed), in the inputs'
    dtypes and shapes, contiguous."""
    launchers = serve(Q, "maxsim").maxsim
    cross = layout == CROSS
    shape = (Q.shape[0], Q.shape[1], D.shape[0], D.shape[1], Q.shape[2]) if cross else None
    strategy = choose_backward(strategy, cross=cross, shape=shape, sms=sm_count(Q.device))
    D_view, grad = (D.unsqueeze(1), grad.unsqueeze(1)) if layout == PAIRS else (D, grad)
    gq, gd = launchers.backward(grad, Q, D_view, argmax, cross=cross, normalize=normalize, need_q=need_q,
                                need_d=need_d, strategy=strategy, q_masked=q_masked)
    if gd is not None and layout == PAIRS:
        gd = gd.squeeze(1)
    return or_empty(gq, Q), or_empty(gd, D)


class _MaxSim(torch.autograd.Function):
    """``options = (layout, normalize, zero_mode, strategy, entry)``: one argument, not five,
    since ``apply`` walks every argument on every call."""

    @staticmethod
    def forward(ctx, Q, D, q_mask, d_mask, options):
        layout, normalize, zero_mode, strategy, entry = options
        scores, argmax = maxsim_forward(Q, D, q_mask, d_mask, layout, normalize, zero_mode, True, entry, strategy,
                                        ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        ctx.save_for_backward(Q, D, argmax)
        ctx.options = (layout, normalize, strategy, q_mask is not None)
        return scores

    @staticmethod
    def backward(ctx, grad):
        Q, D, argmax = ctx.saved_tensors
        layout, normalize, strategy, q_masked = ctx.options
        need_q, need_d = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gq, gd = maxsim_backward(grad, Q, D, argmax, layout, normalize, strategy, need_q, need_d, q_masked)
        return (gq if need_q else None), (gd if need_d else None), None, None, None


def maxsim(Q, D, q_mask, d_mask, *, layout: int, normalize: bool, zero_mode: bool, strategy: str,
           entry: str) -> torch.Tensor:
    """Validated inputs in, scores out: through autograd when a gradient is needed, else
    the forward alone (nothing saved)."""
    if torch.is_grad_enabled() and (Q.requires_grad or D.requires_grad):
        return _MaxSim.apply(Q, D, q_mask, d_mask, (layout, normalize, zero_mode, strategy, entry))
    return maxsim_forward(Q, D, q_mask, d_mask, layout, normalize, zero_mode, False, entry, strategy, False, False)[0]
