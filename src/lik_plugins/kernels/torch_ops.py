"""The PyTorch implementations of the op families that are not plain float tokens: fp8 / int8
scores, PLAID residual documents, documents given as hidden states (the fused projection
head), PLAID's centroid-only score.

They are kernels in the dispatcher's sense (:mod:`lik_plugins.kernels.dispatch` hands them
out as the ``"torch-chunked"`` path's ``quantized``, ``residual`` and ``hidden`` launchers),
written with torch ops on top of the bounded-memory primitives of :mod:`.chunked`: no more
than ``LIK_CHUNK_ELEMENTS`` similarities at a time, and the documents built (decompressed,
dequantised, projected) a chunk at a time.  :mod:`.triton_ops` has the same functions with
the same signatures for the Triton path; the registered ops (:mod:`lik_plugins.autograd`)
call whichever the dispatcher names and never branch on the device themselves.

Some pieces serve both paths (the residual backward, the projection head's gradient past
the winning rows): :mod:`.triton_ops` imports them from here.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import chunked, reference
from .common import accumulation_dtype, inverse_norms, project_out_norm


# ----------------------------------------------------------------------------- fp8 / int8
def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, scales)``: e4m3 tokens of ``x``, unchecked (a NaN/inf token quantises to
    NaN values).  The same bits as the Triton quantisation kernel."""
    values, scales = reference.quantize_fp8(x)
    return values.contiguous(), scales.contiguous()


def maxsim_fp8(Q, q_scales, d_values, d_scales, q_mask, d_mask, *, zero_mode: bool) -> torch.Tensor:
    """fp8 scores without fp8 matrix units: the same numbers from the dequantised tokens on
    the bounded-memory path (it materialises fp32 tokens, 4x the fp8 bytes).  A float ``Q``
    (``q_scales`` None) is quantised first."""
    return _dequantised_scores(quantize_fp8, Q, q_scales, d_values, d_scales, q_mask, d_mask, zero_mode)


def maxsim_int8(Q, q_scales, d_values, d_scales, q_mask, d_mask, *, zero_mode: bool) -> torch.Tensor:
    """int8 scores without the int8 kernel: the same numbers from the dequantised tokens."""
    return _dequantised_scores(reference.quantize_int8, Q, q_scales, d_values, d_scales, q_mask, d_mask, zero_mode)


def _dequantised_scores(quantize, Q, q_scales, d_values, d_scales, q_mask, d_mask, zero_mode: bool) -> torch.Tensor:
    if q_scales is None:
        Q, q_scales = quantize(Q)
    return chunked.forward(reference.dequantize(Q, q_scales), reference.dequantize(d_values, d_scales),
                           q_mask, d_mask, cross=d_values.dim() == 3, normalize=False, zero_mode=zero_mode,
                           save_argmax=False)[0]


# ----------------------------------------------------------------------------- PLAID residuals
def residual_forward(Q, codes, residuals, doc_lengths, centroids, bucket_weights, nbits: int, *, normalize: bool,
                     save_argmax: bool):
    """``(scores, argmax or None)`` of ``Q`` against residual documents, a bounded chunk of
    documents decompressed at a time."""
    nd, ld = codes.shape

    def build(docs):
        # padding may hold any code (as in the kernel): clamp its (ignored) lookup in bounds
        chunk_codes = codes[docs].clamp(0, centroids.shape[0] - 1)
        return reference.decompress_residual(chunk_codes, residuals[docs], centroids, bucket_weights, nbits).float()

    return chunked.forward_built(Q, build, nd, ld, reference.lengths_mask(doc_lengths, ld), normalize_docs=normalize,
                                 normalize_queries=normalize, save_argmax=save_argmax)


def residual_backward(grad, Q, codes, residuals, centroids, bucket_weights, argmax, nbits: int, *,
                      normalize: bool) -> torch.Tensor:
    """grad_Q: each winning token is decompressed once (only those).  Every path runs this:
    the winners are few, and the gradient flows into ``Q`` only."""
    ld, rbytes = residuals.shape[1], residuals.shape[2]
    positions, inverse, ok = chunked.winner_positions(argmax, ld)
    rows = reference.decompress_residual(codes.reshape(-1)[positions], residuals.reshape(-1, rbytes)[positions],
                                         centroids, bucket_weights, nbits).float()
    if normalize:
        rows = rows * inverse_norms(rows).unsqueeze(-1)
    gq, _ = chunked.backward_built(grad, Q, inverse, ok, rows, normalize_queries=normalize, need_q=True,
                                   need_rows=False)
    return gq


def residual_varlen(Q, codes_flat, residuals_flat, cu_d, centroids, bucket_weights, nbits: int, max_d: int, *,
                    normalize: bool) -> torch.Tensor:
    """Scores against a packed residual index: its compressed tokens padded first (a copy of
    the compressed bytes, never of decompressed tokens), then :func:`residual_forward`."""
    codes, residuals, lengths = reference.pad_packed_index(codes_flat, residuals_flat, cu_d, max_d)
    return residual_forward(Q, codes, residuals, lengths.to(torch.int32), centroids, bucket_weights, nbits,
                            normalize=normalize, save_argmax=False)[0]


def plaid_approx_score(scores: torch.Tensor, codes: torch.Tensor, doc_lengths: torch.Tensor) -> torch.Tensor:
    """``[B]`` fp32 ``sum_s max_{t < len} S[codes[b, t], s]`` from fp32 ``S [C, Lq]``, a
    bounded chunk of documents at a time (a gather and a max)."""
    n, ld = codes.shape
    out = torch.empty((n,), dtype=torch.float32, device=codes.device)
    for chunk in chunked.chunk_slices(n, ld * scores.shape[1]):
        # padding may hold any code (as maxsim_residual allows): look up centroid 0 there
        valid_codes = torch.where(reference.lengths_mask(doc_lengths[chunk], ld), codes[chunk], 0)
        out[chunk] = reference.plaid_approx_score(scores, valid_codes, doc_lengths[chunk])
    return out


# ----------------------------------------------------------------------------- hidden states
def project_hidden(H, W, b):
    """``H @ W.T + b`` in fp32 (fp64 for fp64 inputs): the tokens the kernel builds."""
    if H.is_cuda and H.dtype in (torch.bfloat16, torch.float16) and W.dtype == H.dtype:
        # 16-bit products on the matrix units summed into fp32, as the kernel's tiles are
        # (each product exact, fp32 sums): no fp32 copy of H and no fp32 GEMM, which took a
        # large share of a small training step's GPU time (docs/performance-notes.md)
        rows = torch.mm(H.reshape(-1, H.shape[-1]), W.t(), out_dtype=torch.float32)
        rows = rows.view(*H.shape[:-1], W.shape[0])
        return rows if b is None else rows + b.float()
    cdt = accumulation_dtype(H.dtype)
    return torch.nn.functional.linear(H.to(cdt), W.to(cdt), None if b is None else b.to(cdt))


def hidden_forward(Q, H, W, b, d_mask, *, normalize: bool, save_argmax: bool):
    """``(scores, argmax or None)`` of ``Q`` (as given) against ``normalize(H @ W.T + b)``,
    a bounded chunk of documents projected at a time."""
    nd, ld = H.shape[0], H.shape[1]
    return chunked.forward_built(Q, lambda docs: project_hidden(H[docs], W, b), nd, ld, d_mask,
                                 normalize_docs=normalize, normalize_queries=False, save_argmax=save_argmax)


def hidden_backward(grad, Q, H, W, b, argmax, *, normalize: bool, need_q: bool, need_h: bool, need_w: bool,
                    need_b: bool):
    """``(grad_Q, grad_H, grad_W, grad_b)`` (None where not needed): the hidden states at the
    winning positions are gathered (each distinct one once), projected and normalised again,
    and the gradient flows back through that small product only.  Exact: a token that won
    nowhere has a zero gradient."""
    nd, ld, hidden = H.shape
    need_rows = need_h or need_w or need_b
    positions, inverse, ok = chunked.winner_positions(argmax, ld)
    h_rows = H.reshape(-1, hidden)[positions]
    rows = project_hidden(h_rows, W, b)                                         # [U, d] fp32
    inv = inverse_norms(rows) if normalize else None
    rows_hat = rows * inv.unsqueeze(-1) if normalize else rows
    gq, g_hat = chunked.backward_built(grad, Q, inverse, ok, rows_hat, normalize_queries=False, need_q=need_q,
                                       need_rows=need_rows)
    if not need_rows:
        return gq, None, None, None
    g_h, g_w, g_b = projection_gradients(g_hat, rows, inv, h_rows, H, W, b, need_h=need_h, need_w=need_w,
                                         need_b=need_b)
    if g_h is not None:
        full = torch.zeros((nd * ld, hidden), dtype=H.dtype, device=H.device)
        full[positions] = g_h
        g_h = full.view(H.shape)
    return gq, g_h, g_w, g_b


def projection_gradients(g_hat, rows, inv, h_rows, H, W, b, *, need_h: bool, need_w: bool, need_b: bool):
    """``(grad of h_rows, grad_W, grad_b)`` (None where not needed) from ``g_hat``, the
    gradient of the scored (normalised when ``inv`` is given) rows ``rows = h_rows @ W.T + b``:
    through the normalisation, then the affine map (d rows = g, dW = g^T h, db = sum g).
    ``grad of h_rows`` is in ``H``'s dtype, shaped as ``h_rows``."""
    g_rows = project_out_norm(g_hat, rows, inv) if inv is not None else g_hat
    split = _split_gradient(g_rows, H, W)
    g_h = g_w = g_b = None
    if need_h:
        # with the split, straight into bf16 (fp32 sums inside the GEMM, one rounding): no
        # [rows, h] fp32 intermediate, 4x the hidden states' gradient in bytes
        g_h = (g_rows @ W.to(g_rows.dtype)) if split is None else torch.mm(split, torch.cat([W, W]))
        g_h = g_h.to(H.dtype)
    if need_w:
        if split is None:
            g_w = (g_rows.t() @ h_rows.to(g_rows.dtype)).to(W.dtype)
        else:
            # [hi | lo]^T h stacks the two terms' products; their sum is g^T h
            g_w = torch.mm(split.t(), h_rows, out_dtype=torch.float32).view(2, *W.shape).sum(0).to(W.dtype)
    if need_b:
        g_b = g_rows.sum(0).to(b.dtype)
    return g_h, g_w, g_b


def _split_gradient(g_rows: torch.Tensor, H: torch.Tensor, W: torch.Tensor) -> Optional[torch.Tensor]:
    """``[hi | lo]`` (bf16, ``[rows, 2d]``) with ``hi + lo`` the fp32 row gradients to 16 bits of
    mantissa, for bf16 hidden states on CUDA (None elsewhere): the backward's two products then
    run on the matrix units into fp32 -- its gradients, rounded to bf16 at the end, differ from
    fp32 products' by about 2**-17 of their size against bf16's 2**-9 -- instead of fp32 GEMMs
    and an fp32 copy of the hidden states (what that saved: docs/performance-notes.md).  Not
    for fp16: its range would flush small gradients."""
    if not (g_rows.is_cuda and H.dtype == torch.bfloat16 and W.dtype == torch.bfloat16
            and g_rows.dtype == torch.float32):
        return None
    hi = g_rows.to(torch.bfloat16)
    lo = (g_rows - hi.float()).to(torch.bfloat16)
    return torch.cat([hi, lo], dim=1)
