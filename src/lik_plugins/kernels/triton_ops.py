"""The Triton path's implementations of the op families that are not plain float tokens:
fp8 / int8 scores, PLAID residual documents, documents given as hidden states, PLAID's
centroid-only score, and the quantisation launches.

Same functions, same signatures as :mod:`.torch_ops` (the dispatcher hands out one module or
the other, :mod:`lik_plugins.kernels.dispatch`); here each one describes its documents to the
scoring kernel (:class:`.triton.launch.DocFormat`: the kernel builds every tile on chip --
dequantises, decompresses, projects -- and never writes the documents to memory) and
launches it.  What is the same on every path (the residual backward, the projection head's
gradient past the winning rows) comes from :mod:`.torch_ops`.

Importing this module imports Triton: the dispatcher imports it on the first Triton call.
"""
from __future__ import annotations

import torch

from .._config import triton_interpret
from .common import inverse_norms
from .torch_ops import projection_gradients, project_hidden, residual_backward  # noqa: F401  (same on every path)
from .triton import launch
from .triton.approx import plaid_approx_score  # noqa: F401  (one program per document)
from .triton.quantize import quantize_fp8, quantize_int8  # fused kernels, unchecked

# Largest re-quantisation the fused path may do: every program quantises its own query
# rows, i.e. about (documents per query) x (query elements) in all.  Fusing saves a launch,
# which decides a small rerank; the round-to-nearest divisions, repeated per document, cost
# more than that launch on search-sized calls (docs/performance-notes.md, fp8).
FUSED_QUANTISATION_ELEMENTS = 1 << 24


def fused_quantisation_fits(Q, d_values: torch.Tensor) -> bool:
    """A float query ``[Nq, Lq, d]`` the scoring kernel can quantise itself (``QUANT_Q``, fp8
    or int8 documents): embeddings up to 256 wide, and a small repeated quantisation (above)."""
    if not isinstance(Q, torch.Tensor) or Q.dim() != 3 or not 0 < Q.shape[-1] <= 256:
        return False
    docs_per_query = d_values.shape[-3] if d_values.dim() >= 3 else 1
    return docs_per_query * Q.numel() <= FUSED_QUANTISATION_ELEMENTS


def fuse_query_quantisation(Q, d_values: torch.Tensor) -> bool:
    """Quantise a float fp8 query inside the scoring kernel (kernels/triton/forward.py
    ``QUANT_Q``: one launch instead of two, the same quantised values) -- on a GPU, where
    :func:`fused_quantisation_fits`.  The interpreter keeps the separate quantisation: it
    casts fp32 to e4m3 wrongly (see kernels/triton/quantize.py)."""
    return not triton_interpret() and fused_quantisation_fits(Q, d_values)


# ----------------------------------------------------------------------------- fp8 / int8
def maxsim_fp8(Q, q_scales, d_values, d_scales, q_mask, d_mask, *, zero_mode: bool) -> torch.Tensor:
    """fp8 tensor-core scores; a float ``Q`` (``q_scales`` None) is quantised inside the
    scoring kernel where that is cheaper (:func:`fuse_query_quantisation`), else first."""
    if q_scales is None and not fuse_query_quantisation(Q, d_values):
        Q, q_scales = quantize_fp8(Q)
    return launch.forward(Q, d_values, q_mask, d_mask, cross=d_values.dim() == 3, normalize=False,
                          zero_mode=zero_mode, save_argmax=False, scales=(q_scales, d_scales))[0]


def maxsim_int8(Q, q_scales, d_values, d_scales, q_mask, d_mask, *, zero_mode: bool) -> torch.Tensor:
    """int8 x int8 -> int32 products, each similarity scaled by its two tokens' scales before
    the max.  A float query is quantised inside the scoring kernel where that is cheap
    (unlike fp8 also under the interpreter, whose int8 casts are exact), else by one
    quantisation launch -- never torch's several ops per call."""
    if q_scales is None and not fused_quantisation_fits(Q, d_values):
        Q, q_scales = quantize_int8(Q)
    return launch.forward(Q, d_values, q_mask, d_mask, cross=d_values.dim() == 3, normalize=False,
                          zero_mode=zero_mode, save_argmax=False,
                          scales=(None if q_scales is None else q_scales.contiguous(), d_scales),
                          doc_format=launch.DocFormat(launch.INT8))[0]


# ----------------------------------------------------------------------------- PLAID residuals
def residual_forward(Q, codes, residuals, doc_lengths, centroids, bucket_weights, nbits: int, *, normalize: bool,
                     save_argmax: bool):
    """``(scores, argmax or None)``: the kernel decompresses (and normalises) each document
    tile on chip, each document's loop bounded by its length (no token mask in memory, no
    work on the padding)."""
    weights = launch.stream_order_weights(bucket_weights, nbits)
    fmt = launch.DocFormat(launch.RESIDUAL, codes, centroids, weights, (0, *codes.stride()), centroids.shape[0], nbits)
    return launch.forward(Q, residuals, None, None, cross=True, normalize=normalize, zero_mode=False,
                          save_argmax=save_argmax, doc_format=fmt, d_lengths=doc_lengths)


def residual_varlen(Q, codes_flat, residuals_flat, cu_d, centroids, bucket_weights, nbits: int, max_d: int, *,
                    normalize: bool) -> torch.Tensor:
    """Scores against a packed residual index, each document's packed tokens read in place
    (the forward's ``VARLEN`` layout): no copy of the index."""
    nq, lq, dim = Q.shape
    Qp = Q.contiguous().reshape(nq * lq, dim)
    cu_q = torch.arange(0, (nq + 1) * lq, max(lq, 1), dtype=torch.int32, device=Q.device)[:nq + 1]
    weights = launch.stream_order_weights(bucket_weights, nbits)
    fmt = launch.DocFormat(launch.RESIDUAL, codes_flat, centroids, weights, (0, 0, codes_flat.stride(0)),
                           centroids.shape[0], nbits)
    return launch.varlen_forward(Qp, residuals_flat, cu_q, cu_d, None, None, None, max_q=lq, max_d=max_d,
                                 normalize=normalize, zero_mode=False, save_argmax=False, doc_format=fmt)[0]


# ----------------------------------------------------------------------------- hidden states
def hidden_forward(Q, H, W, b, d_mask, *, normalize: bool, save_argmax: bool):
    """``(scores, argmax or None)``: the kernel projects each document tile on chip."""
    fmt = launch.DocFormat(launch.HIDDEN, W.contiguous(), b, None, (0, 0, 0), H.shape[-1], 0, b is not None)
    return launch.forward(Q, H, None, d_mask, cross=True, normalize=normalize, zero_mode=False,
                          save_argmax=save_argmax, doc_format=fmt)


def hidden_backward(grad, Q, H, W, b, argmax, *, normalize: bool, need_q: bool, need_h: bool, need_w: bool,
                    need_b: bool):
    """``(grad_Q, grad_H, grad_W, grad_b)`` (None where not needed).  Every token is projected
    again (one GEMM; the ``[Nd, Ld, d]`` tokens live only during the backward, ``d/h`` of the
    hidden states autograd already keeps) so the dense kernels' own backward runs on them:
    finding the distinct winners, as :func:`.torch_ops.hidden_backward` does, needs a sort
    and a host sync, which cost more on a GPU (``benchmarks/bench_compressed.py``).  Exact: a
    token that won nowhere has a zero gradient."""
    nd, ld, hidden = H.shape
    need_rows = need_h or need_w or need_b
    h_rows = H.reshape(-1, hidden)
    rows = project_hidden(h_rows, W, b)                                         # [Nd*Ld, d] fp32
    # the documents as scored (normalised in fp32, then Q's dtype) through the dense
    # kernels' backward without normalisation: the queries were not normalised; the
    # documents' Jacobian follows in fp32 (projection_gradients)
    inv = inverse_norms(rows) if normalize else None
    rows_hat = rows * inv.unsqueeze(-1) if normalize else rows
    gq, g_hat = launch.backward(grad, Q, rows_hat.to(Q.dtype).view(nd, ld, -1), argmax, cross=True, normalize=False,
                                need_q=need_q, need_d=need_rows, strategy="lowmem", q_masked=False)
    if not need_rows:
        return gq, None, None, None
    g_h, g_w, g_b = projection_gradients(g_hat.reshape(rows.shape).to(rows.dtype), rows, inv, h_rows, H, W, b,
                                         need_h=need_h, need_w=need_w, need_b=need_b)
    return gq, (None if g_h is None else g_h.view(H.shape)), g_w, g_b
