"""MaxSim against documents given as hidden states (``maxsim_from_hidden``: a ColBERT model's
projection head fused into its scoring): the registered forward and backward, and their
autograd Function.

``lik::maxsim_hidden_forward``   scores against ``normalize(H @ W.T + b)`` built in the kernel
``lik::maxsim_hidden_backward``  grads of Q, H, W, b through the winning hidden states
"""
from __future__ import annotations

from typing import Optional

import torch

from ..kernels.dispatch import serve
from .registry import grads_fake, or_empty, registered, scores_fake

__all__ = ["maxsim_hidden"]


def _forward_fake(Q, H, W, b, d_mask, normalize, save_argmax, entry):
    return scores_fake(Q, (Q.shape[0], H.shape[0]), H.shape[0], H.shape[1], save_argmax)


@registered("maxsim_hidden_forward", _forward_fake)
def maxsim_hidden_forward(
    Q: torch.Tensor, H: torch.Tensor, W: torch.Tensor, b: Optional[torch.Tensor], d_mask: Optional[torch.Tensor],
    normalize: bool, save_argmax: bool, entry: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of ``Q [Nq, Lq, d]`` (as given: ``normalize`` acts on the documents only)
    against ``normalize(H @ W.T + b)`` (``H [Nd, Ld, h]``, ``W [d, h]``), and the winners
    when ``save_argmax``."""
    scores, argmax = serve(Q, "hidden", entry).hidden.hidden_forward(Q, H, W, b, d_mask, normalize=normalize,
                                                                     save_argmax=save_argmax)
    return scores, or_empty(argmax, Q, torch.int16)


def _backward_fake(grad, Q, H, W, b, argmax, normalize, need_q, need_h, need_w, need_b):
    return grads_fake((Q, need_q), (H, need_h), (W, need_w), (b, need_b))


@registered("maxsim_hidden_backward", _backward_fake)
def maxsim_hidden_backward(
    grad: torch.Tensor, Q: torch.Tensor, H: torch.Tensor, W: torch.Tensor, b: Optional[torch.Tensor],
    argmax: torch.Tensor, normalize: bool, need_q: bool, need_h: bool, need_w: bool, need_b: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(grad_Q, grad_H, grad_W, grad_b)`` (empty where not needed)."""
    grads = serve(Q, "hidden").hidden.hidden_backward(grad, Q, H, W, b, argmax, normalize=normalize, need_q=need_q,
                                                      need_h=need_h, need_w=need_w, need_b=need_b)
    return tuple(or_empty(g if need else None, Q) for g, need in zip(grads, (need_q, need_h, need_w, need_b)))


class _HiddenMaxSim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, Q, H, W, b, d_mask, options):
        normalize, entry = options
        scores, argmax = maxsim_hidden_forward(Q, H, W, b, d_mask, normalize, True, entry)
        ctx.save_for_backward(Q, H, W, b, argmax)
        ctx.normalize = normalize
        return scores

    @staticmethod
    def backward(ctx, grad):
        Q, H, W, b, argmax = ctx.saved_tensors
        need = ctx.needs_input_grad  # False for an absent b
        grads = maxsim_hidden_backward(grad.contiguous(), Q, H, W, b, argmax, ctx.normalize, *need[:4])
        return (*(g if n else None for g, n in zip(grads, need)), None, None)


def maxsim_hidden(Q, H, W, b, d_mask, *, normalize: bool, entry: str) -> torch.Tensor:
    """Validated inputs in, scores out (autograd into whichever of Q, H, W, b require grad)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (Q, H, W, b)):
        return _HiddenMaxSim.apply(Q, H, W, b, d_mask, (normalize, entry))
    return maxsim_hidden_forward(Q, H, W, b, d_mask, normalize, False, entry)[0]
