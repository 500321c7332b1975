"""Smooth MaxSim (``smooth_maxsim``, colpali-engine's ``use_smooth_max=True``): the registered
forward and backward, and their autograd Function.

``lik::smooth_maxsim_forward``   smooth-max scores and the per-row log-sum-exp
``lik::smooth_maxsim_backward``  its gradients, recomputed from the log-sum-exp
"""
from __future__ import annotations

import torch

from ..kernels.dispatch import serve
from ..kernels.common import accumulation_dtype
from .registry import CROSS, PAIRS, grads_fake, no_tensor, registered, shape_of_scores

__all__ = ["smooth_maxsim"]


def _forward_fake(Q, D, tau, layout, entry, need_q, need_d):
    shape, n_docs, _ = shape_of_scores(Q, D, layout)
    dtype = accumulation_dtype(Q.dtype)
    return Q.new_empty(shape, dtype=dtype), Q.new_empty((Q.shape[0], n_docs, Q.shape[1]), dtype=dtype)


@registered("smooth_maxsim_forward", _forward_fake)
def smooth_maxsim_forward(Q: torch.Tensor, D: torch.Tensor, tau: float, layout: int, entry: str, need_q: bool,
                          need_d: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Smooth-max scores and the per-row log-sum-exp ``[Nq, NJ, Lq]`` (fp32; fp64 inputs: fp64).
    ``need_q`` / ``need_d``: the backward that follows (neither: none)."""
    D_view = D.unsqueeze(1) if layout == PAIRS else D
    scores, lse = serve(Q, "smooth", entry).smooth.smooth_forward(Q, D_view, tau, layout == CROSS)
    return (scores.squeeze(1) if layout == PAIRS else scores), lse


def _backward_fake(grad, Q, D, lse, tau, layout, need_q, need_d):
    return grads_fake((Q, need_q), (D, need_d))


@registered("smooth_maxsim_backward", _backward_fake)
def smooth_maxsim_backward(grad: torch.Tensor, Q: torch.Tensor, D: torch.Tensor, lse: torch.Tensor, tau: float,
                           layout: int, need_q: bool, need_d: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients from the recomputed softmax weights ``exp(S / tau - lse)``."""
    pairs = layout == PAIRS
    gq, gd = serve(Q, "smooth").smooth.smooth_backward(Q, D.unsqueeze(1) if pairs else D, lse,
                                                       grad.unsqueeze(1) if pairs else grad, tau, layout == CROSS,
                                                       need_q, need_d)
    gq = no_tensor(Q) if gq is None else gq.to(Q.dtype)
    gd = no_tensor(D) if gd is None else (gd.squeeze(1) if pairs else gd).to(D.dtype)
    return gq, gd


class _SmoothMaxSim(torch.autograd.Function):
    """Saves ``Q``, ``D`` and the per-row log-sum-exp; never its output (callers such as
    colpali's negative filtering edit the scores in place)."""

    @staticmethod
    def forward(ctx, Q, D, options):
        tau, layout, entry = options
        scores, lse = smooth_maxsim_forward(Q, D, tau, layout, entry, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        ctx.save_for_backward(Q, D, lse)
        ctx.options = (tau, layout)
        return scores

    @staticmethod
    def backward(ctx, grad):
        Q, D, lse = ctx.saved_tensors
        tau, layout = ctx.options
        need_q, need_d = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gq, gd = smooth_maxsim_backward(grad.contiguous(), Q, D, lse, tau, layout, need_q, need_d)
        return (gq if need_q else None), (gd if need_d else None), None


def smooth_maxsim(Q, D, *, tau: float, layout: int, entry: str) -> torch.Tensor:
    """Validated inputs in, scores out (through autograd when a gradient is needed)."""
    if torch.is_grad_enabled() and (Q.requires_grad or D.requires_grad):
        return _SmoothMaxSim.apply(Q, D, (tau, layout, entry))
    return smooth_maxsim_forward(Q, D, tau, layout, entry, False, False)[0]
