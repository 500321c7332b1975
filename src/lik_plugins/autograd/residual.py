"""MaxSim against PLAID / ColBERTv2 residual documents (``maxsim_residual``,
``maxsim_residual_varlen``) and PLAID's candidate score (``plaid_approx_score``): the
registered ops and the autograd Function (the gradient flows into the queries only).

``lik::maxsim_residual_forward``   scores against residual documents (and the winners)
``lik::maxsim_residual_backward``  grad_Q through the winners' decompressed tokens
``lik::maxsim_residual_varlen``    scores against a packed residual index (no gradient)
``lik::plaid_approx_score``        PLAID's centroid-only candidate score
"""
from __future__ import annotations

import torch

from ..kernels.dispatch import serve
from ..kernels.common import accumulation_dtype
from .registry import or_empty, registered, scores_fake

__all__ = ["maxsim_residual", "maxsim_residual_varlen", "plaid_approx_score"]


def _forward_fake(Q, codes, residuals, doc_lengths, centroids, bucket_weights, nbits, normalize, save_argmax, entry):
    return scores_fake(Q, (Q.shape[0], codes.shape[0]), codes.shape[0], codes.shape[1], save_argmax)


@registered("maxsim_residual_forward", _forward_fake)
def maxsim_residual_forward(
    Q: torch.Tensor, codes: torch.Tensor, residuals: torch.Tensor, doc_lengths: torch.Tensor,
    centroids: torch.Tensor, bucket_weights: torch.Tensor, nbits: int, normalize: bool, save_argmax: bool,
    entry: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of ``Q [Nq, Lq, d]`` against documents stored as PLAID residuals (codes
    ``[Nd, Ld]`` int32, residuals ``[Nd, Ld, d*nbits/8]`` uint8, ``doc_lengths [Nd]`` int32),
    and the winners when ``save_argmax``."""
    scores, argmax = serve(Q, "residual", entry).residual.residual_forward(
        Q, codes, residuals, doc_lengths, centroids, bucket_weights, nbits, normalize=normalize,
        save_argmax=save_argmax)
    return scores, or_empty(argmax, Q, torch.int16)


def _backward_fake(grad, Q, codes, residuals, centroids, bucket_weights, argmax, nbits, normalize):
    return Q.new_empty(Q.shape)


@registered("maxsim_residual_backward", _backward_fake)
def maxsim_residual_backward(
    grad: torch.Tensor, Q: torch.Tensor, codes: torch.Tensor, residuals: torch.Tensor, centroids: torch.Tensor,
    bucket_weights: torch.Tensor, argmax: torch.Tensor, nbits: int, normalize: bool,
) -> torch.Tensor:
    """grad_Q: each winning token is decompressed once (only those)."""
    return serve(Q, "residual").residual.residual_backward(grad, Q, codes, residuals, centroids, bucket_weights,
                                                           argmax, nbits, normalize=normalize)


class _ResidualMaxSim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, Q, codes, residuals, doc_lengths, centroids, bucket_weights, options):
        nbits, normalize, entry = options
        scores, argmax = maxsim_residual_forward(Q, codes, residuals, doc_lengths, centroids, bucket_weights, nbits,
                                                 normalize, True, entry)
        ctx.save_for_backward(Q, codes, residuals, centroids, bucket_weights, argmax)
        ctx.options = (nbits, normalize)
        return scores

    @staticmethod
    def backward(ctx, grad):
        Q, codes, residuals, centroids, bucket_weights, argmax = ctx.saved_tensors
        nbits, normalize = ctx.options
        gq = maxsim_residual_backward(grad.contiguous(), Q, codes, residuals, centroids, bucket_weights, argmax,
                                      nbits, normalize)
        return gq, None, None, None, None, None, None


def maxsim_residual(Q, codes, residuals, doc_lengths, centroids, bucket_weights, *, nbits: int, normalize: bool,
                    entry: str) -> torch.Tensor:
    """Validated inputs in, scores out (autograd into ``Q`` when it requires grad)."""
    if torch.is_grad_enabled() and Q.requires_grad:
        return _ResidualMaxSim.apply(Q, codes, residuals, doc_lengths, centroids, bucket_weights,
                                     (nbits, normalize, entry))
    return maxsim_residual_forward(Q, codes, residuals, doc_lengths, centroids, bucket_weights, nbits, normalize,
                                   False, entry)[0]


def _varlen_fake(Q, codes_flat, residuals_flat, cu_d, centroids, bucket_weights, nbits, max_d, normalize, entry):
    return Q.new_empty((Q.shape[0], cu_d.shape[0] - 1), dtype=accumulation_dtype(Q.dtype))


@registered("maxsim_residual_varlen", _varlen_fake)
def maxsim_residual_varlen(
    Q: torch.Tensor, codes_flat: torch.Tensor, residuals_flat: torch.Tensor, cu_d: torch.Tensor,
    centroids: torch.Tensor, bucket_weights: torch.Tensor, nbits: int, max_d: int, normalize: bool, entry: str,
) -> torch.Tensor:
    """Scores (no gradient) of ``Q [Nq, Lq, d]`` against a packed residual index (int32
    offsets ``cu_d``, checked by the caller; ``max_d`` bounds the documents)."""
    return serve(Q, "residual", entry).residual.residual_varlen(Q, codes_flat, residuals_flat, cu_d, centroids,
                                                                bucket_weights, nbits, max_d, normalize=normalize)


def _approx_fake(query_centroid_scores, codes, doc_lengths):
    return query_centroid_scores.new_empty((codes.shape[0],), dtype=torch.float32)


@registered("plaid_approx_score", _approx_fake)
def plaid_approx_score(query_centroid_scores: torch.Tensor, codes: torch.Tensor,
                       doc_lengths: torch.Tensor) -> torch.Tensor:
    """``[B]`` fp32: ``sum_s max_{t < len} S[codes[b, t], s]`` (0 for an empty document) from
    ``S [C, Lq]``."""
    scores = query_centroid_scores.float().contiguous()                        # [C, Lq]: one row per code
    return serve(query_centroid_scores, "approx", "plaid_approx_score").residual.plaid_approx_score(
        scores, codes, doc_lengths)
