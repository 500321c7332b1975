"""Packed MaxSim (``maxsim_varlen``, ``score_pairs_packed``): the registered forward and
backward, and their autograd Function.

``lik::maxsim_varlen_forward``   packed (``cu_seqlens``) scores, every pair or a pair list, + winners
``lik::maxsim_varlen_backward``  grad of the packed tokens through those winners

Tokens packed as ``[sum L, d]`` with int32 offsets (``cu_seqlens``), validated by the public
ops (:mod:`lik_plugins.ops.packed`).  ``pair_q`` / ``pair_d`` given: only those pairs are
scored (``[P]``); absent: every query against every document (``[Nq, Nd]``).  ``max_q`` /
``max_d``: bounds on the lengths, fixed on the host (the fake kernel's shapes).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..kernels.common import accumulation_dtype, argmax_dtype
from ..kernels.dispatch import serve
from .registry import grads_fake, no_tensor, or_empty, registered

__all__ = ["maxsim_varlen"]


def _forward_fake(Q, D, cu_q, cu_d, pair_q, pair_d, q_mask, d_mask, max_q, max_d, normalize, zero_mode, save_argmax,
                  entry, need_q, need_d):
    shape = (pair_q.shape[0],) if pair_q is not None else (cu_q.shape[0] - 1, cu_d.shape[0] - 1)
    scores = Q.new_empty(shape, dtype=accumulation_dtype(Q.dtype))
    if not save_argmax:
        return scores, no_tensor(Q, torch.int16)
    return scores, Q.new_empty((*shape, max_q), dtype=argmax_dtype(max_d))


@registered("maxsim_varlen_forward", _forward_fake)
def maxsim_varlen_forward(
    Q: torch.Tensor, D: torch.Tensor, cu_q: torch.Tensor, cu_d: torch.Tensor,
    pair_q: Optional[torch.Tensor], pair_d: Optional[torch.Tensor],
    q_mask: Optional[torch.Tensor], d_mask: Optional[torch.Tensor], max_q: int, max_d: int,
    normalize: bool, zero_mode: bool, save_argmax: bool, entry: str, need_q: bool, need_d: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed scores (``[Nq, Nd]``, or ``[P]`` for a pair list) and, when ``save_argmax``,
    the winners (``[Nq, Nd, max_q]`` / ``[P, max_q]``; -1: none).  ``save_argmax``: the
    backward (``need_q``, ``need_d``) follows."""
    pairs = None if pair_q is None else (pair_q, pair_d)
    scores, argmax = serve(Q, "varlen", entry).maxsim.varlen_forward(
        Q, D, cu_q, cu_d, pairs, q_mask, d_mask, max_q=max_q, max_d=max_d,
        normalize=normalize, zero_mode=zero_mode, save_argmax=save_argmax)
    return scores, or_empty(argmax, Q, torch.int16)


def _backward_fake(grad, Q, D, cu_q, cu_d, pair_q, pair_d, argmax, normalize, need_q, need_d):
    return grads_fake((Q, need_q), (D, need_d))


@registered("maxsim_varlen_backward", _backward_fake)
def maxsim_varlen_backward(
    grad: torch.Tensor, Q: torch.Tensor, D: torch.Tensor, cu_q: torch.Tensor, cu_d: torch.Tensor,
    pair_q: Optional[torch.Tensor], pair_d: Optional[torch.Tensor], argmax: torch.Tensor,
    normalize: bool, need_q: bool, need_d: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_Q, grad_D)`` of the packed tokens through the saved winners (empty where not
    needed); duplicate pairs accumulate."""
    pairs = None if pair_q is None else (pair_q, pair_d)
    gq, gd = serve(Q, "varlen").maxsim.varlen_backward(grad, Q, D, cu_q, cu_d, pairs, argmax, normalize=normalize,
                                                       need_q=need_q, need_d=need_d)
    return or_empty(gq, Q), or_empty(gd, D)


class _MaxSimVarlen(torch.autograd.Function):
    """``options = (max_q, max_d, normalize, zero_mode, entry)``."""

    @staticmethod
    def forward(ctx, Q, D, cu_q, cu_d, pair_q, pair_d, q_mask, d_mask, options):
        max_q, max_d, normalize, zero_mode, entry = options
        scores, argmax = maxsim_varlen_forward(Q, D, cu_q, cu_d, pair_q, pair_d, q_mask, d_mask, max_q, max_d,
                                               normalize, zero_mode, True, entry, *ctx.needs_input_grad[:2])
        ctx.save_for_backward(Q, D, cu_q, cu_d, argmax, pair_q, pair_d)  # the pair list: None when absent
        ctx.normalize = normalize
        return scores

    @staticmethod
    def backward(ctx, grad):
        Q, D, cu_q, cu_d, argmax, pair_q, pair_d = ctx.saved_tensors
        need_q, need_d = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gq, gd = maxsim_varlen_backward(grad.contiguous(), Q, D, cu_q, cu_d, pair_q, pair_d, argmax, ctx.normalize,
                                        need_q, need_d)
        return (gq if need_q else None), (gd if need_d else None), None, None, None, None, None, None, None


def maxsim_varlen(Q, D, cu_q, cu_d, pair_q, pair_d, q_mask, d_mask, *, max_q: int, max_d: int, normalize: bool,
                  zero_mode: bool, entry: str) -> torch.Tensor:
    """Validated packed inputs in, scores out (through autograd when a gradient is needed)."""
    if torch.is_grad_enabled() and (Q.requires_grad or D.requires_grad):
        return _MaxSimVarlen.apply(Q, D, cu_q, cu_d, pair_q, pair_d, q_mask, d_mask,
                                   (max_q, max_d, normalize, zero_mode, entry))
    return maxsim_varlen_forward(Q, D, cu_q, cu_d, pair_q, pair_d, q_mask, d_mask, max_q, max_d, normalize,
                                 zero_mode, False, entry, False, False)[0]
