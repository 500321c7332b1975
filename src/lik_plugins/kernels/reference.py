"""The specification: MaxSim in plain PyTorch, float64-capable, autograd by torch.

Every kernel in this package is tested against these functions.  They materialise the
full similarity tensor, so they are for tests, tiny inputs and the ``LIK_DISABLE=1``
kill switch only.

Semantics (shared by every path):

* ``score(q, d) = sum_s max_t <Q[q, s], D[d, t]>``.
* Masks are ``True``/non-zero = valid.  A masked *query* token contributes 0.
* ``mask_mode="exclude"``: a masked doc token cannot win; a query token with no valid
  doc token contributes 0 (and gets zero gradient).
* ``mask_mode="zero"`` (PyLate's multiplicative mask): a masked doc token's similarity
  *is* 0 and takes part in the max, so a row whose valid similarities are all negative
  scores 0.  The gradient through a masked winner is 0.  A valid token wins a tie with
  a masked 0.
* ``normalize=True``: each token is L2-normalised first, ``x / max(||x||, 1e-12)``.
* Ties between valid doc tokens: the gradient goes to the lowest index.

fp8 (inference only): a token ``x`` is stored as ``values = e4m3(x / scale)`` with one
fp32 ``scale = max_h |x_h| / 448`` per token (1 for an all-zero token), so its largest
component lands on e4m3's largest finite value.  A score is MaxSim over the dequantised
tokens ``values * scale`` -- :func:`maxsim_fp8`.  The kernels multiply the fp8 product by
the two scales instead, which is the same number up to fp32 rounding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

MASK_MODES = ("exclude", "zero")
NORM_EPS = 1e-12
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value


def _valid(mask: torch.Tensor | None, shape: tuple[int, ...], device) -> torch.Tensor:
    if mask is None:
        return torch.ones(shape, dtype=torch.bool, device=device)
    return mask != 0


def _reduce(sim: torch.Tensor, q_valid: torch.Tensor, d_valid: torch.Tensor, mask_mode: str) -> torch.Tensor:
    """sim ``[..., Lq, Ld]``, q_valid ``[..., Lq]``, d_valid ``[..., Ld]`` -> ``[...]``."""
    if mask_mode not in MASK_MODES:
        raise ValueError(f"mask_mode must be one of {MASK_MODES}, got {mask_mode!r}")
    dv = d_valid.unsqueeze(-2)
    if sim.shape[-1] == 0:
        row = sim.sum(dim=-1)  # zeros that stay on the autograd graph
    else:
        best = sim.masked_fill(~dv, float("-inf")).max(dim=-1).values  # over the valid tokens
        if mask_mode == "exclude":
            row = torch.where(dv.any(dim=-1), best, torch.zeros_like(best))
        else:
            # a valid token wins a tie with a masked 0: the masked 0 wins only when a masked
            # token exists and every valid similarity is below 0
            row = torch.where((~dv).any(dim=-1) & (best < 0), torch.zeros_like(best), best)
    row = torch.where(q_valid, row, torch.zeros_like(row))  # not a product: NaN * 0 is NaN
    return row.sum(dim=-1)


def _maybe_normalize(x: torch.Tensor, normalize: bool) -> torch.Tensor:
    return F.normalize(x, p=2, dim=-1, eps=NORM_EPS) if normalize else x


def maxsim(Q: torch.Tensor, D: torch.Tensor, q_mask: torch.Tensor | None = None,
           d_mask: torch.Tensor | None = None, *, normalize: bool = False, mask_mode: str = "exclude",
           ) -> torch.Tensor:
    """Reference of :func:`lik_plugins.maxsim`.

    ``Q [Nq, Lq, d]`` with ``D [Nd, Ld, d]`` -> ``[Nq, Nd]`` (in-batch cross product), or
    with ``D [Nq, K, Ld, d]`` -> ``[Nq, K]`` (per-query candidates).  Computed in the
    promoted dtype of the inputs (use float64 inputs for an oracle).
    """
    Qn, Dn = _maybe_normalize(Q, normalize), _maybe_normalize(D, normalize)
    sim = torch.einsum("ash,bth->abst" if D.dim() == 3 else "ash,akth->akst", Qn, Dn)
    qv = _valid(q_mask, Q.shape[:2], Q.device)
    dv = _valid(d_mask, D.shape[:-1], D.device)  # a cross product's [Nd, Ld] broadcasts over the queries
    return _reduce(sim, qv[:, None, :], dv, mask_mode)


def maxsim_pairs(Q: torch.Tensor, D: torch.Tensor, q_mask: torch.Tensor | None = None,
                 d_mask: torch.Tensor | None = None, *, normalize: bool = False, mask_mode: str = "exclude",
                 ) -> torch.Tensor:
    """Reference of :func:`lik_plugins.maxsim_pairs`: ``[B, Lq, d] x [B, Ld, d] -> [B]``."""
    dm = None if d_mask is None else d_mask.unsqueeze(1)
    return maxsim(Q, D.unsqueeze(1), q_mask, dm, normalize=normalize, mask_mode=mask_mode).squeeze(1)


def retrieve(Q: torch.Tensor, D: torch.Tensor, top_k: int, q_mask: torch.Tensor | None = None,
             d_mask: torch.Tensor | None = None, *, normalize: bool = False, mask_mode: str = "exclude",
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`lik_plugins.retrieve`: top-``k`` documents per query."""
    scores = maxsim(Q, D, q_mask, d_mask, normalize=normalize, mask_mode=mask_mode)
    return scores.topk(min(int(top_k), scores.shape[1]), dim=1)


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, scales)``: e4m3 values ``[..., L, d]`` and fp32 per-token scales ``[..., L]``."""
    amax = x.abs().amax(dim=-1).float()
    # a tensor divisor, not the Python scalar: CUDA torch divides by a scalar as a product
    # with its reciprocal (1/448 is inexact), which would make the spec device-dependent
    scales = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    values = (x.float() / scales.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return values, scales


def dequantize(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The tokens a quantised pair (fp8 or int8 values, fp32 scales) stands for:
    ``values * scales`` in ``dtype``."""
    return values.to(dtype) * scales.to(dtype).unsqueeze(-1)


def maxsim_dequantised(Q: tuple[torch.Tensor, torch.Tensor], D: tuple[torch.Tensor, torch.Tensor],
                       q_mask: torch.Tensor | None = None, d_mask: torch.Tensor | None = None, *,
                       mask_mode: str = "exclude", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reference of :func:`lik_plugins.maxsim_fp8` and :func:`lik_plugins.maxsim_int8`:
    MaxSim of the dequantised ``(values, scales)`` tokens.  (The int8 kernels take exact
    int32 products and multiply by the two scales: the same number up to fp32 rounding.)"""
    return maxsim(dequantize(*Q, dtype), dequantize(*D, dtype), q_mask, d_mask, mask_mode=mask_mode)


maxsim_fp8 = maxsim_int8 = maxsim_dequantised


def smooth_maxsim(Q: torch.Tensor, D: torch.Tensor, *, tau: float, layout: str = "auto") -> torch.Tensor:
    """Reference of :func:`lik_plugins.smooth_maxsim`: ``sum_s tau * logsumexp_t(S / tau)``
    (colpali-engine's ``use_smooth_max``; no masks: zero padding takes part).  Materialises
    every similarity, in the promoted input dtype, so float64 inputs give an oracle."""
    if layout == "auto":
        layout = "candidates" if D.dim() == 4 else "cross"
    if layout == "pairs":
        return smooth_maxsim(Q, D.unsqueeze(1), tau=tau, layout="candidates").squeeze(1)
    sim = torch.einsum("ash,bth->abst" if layout == "cross" else "ash,akth->akst", Q, D)
    return (tau * torch.logsumexp(sim / tau, dim=-1)).sum(dim=-1)


# ----------------------------------------------------------------------------- int8
INT8_MAX = 127  # symmetric: -127..127 (the code -128 is never produced)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, scales)``: int8 values ``[..., L, d]`` and fp32 per-token scales ``[..., L]``.

    Symmetric per token: ``scale = max_h |x_h| / 127`` (1 for an all-zero token), values
    ``round_half_even(x / scale)`` in ``-127..127``.  Token ``t`` is ``values[t] * scales[t]``."""
    amax = x.abs().amax(dim=-1).float()
    # a tensor divisor, as in quantize_fp8: the spec must not depend on the device's scalar division
    scales = torch.where(amax > 0, amax / torch.full_like(amax, float(INT8_MAX)), torch.ones_like(amax))
    values = torch.round(x.float() / scales.unsqueeze(-1)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return values, scales


# ----------------------------------------------------------------------------- PLAID residuals
# ColBERTv2's residual format (Santhanam et al., 2022, "ColBERTv2", section 3.3; colbert-ai's
# ResidualCodec): a token ``x`` is stored as the id ``c`` of its nearest centroid and, per
# dimension, the bucket ``b_h`` of the residual ``x_h - C[c, h]`` among ``2**nbits`` buckets
# (cut at ``bucket_cutoffs``); it decompresses to ``C[c, h] + bucket_weights[b_h]``.
# Bit layout: the buckets of a token form one bit stream, dimension by dimension, each
# bucket written least significant bit first; the stream is packed into bytes most
# significant bit first (numpy.packbits' default order).  So dimension ``h``'s bit ``k``
# sits in byte ``(h * nbits + k) // 8`` at bit ``7 - (h * nbits + k) % 8`` (bit 0 = the
# byte's least significant).  With nbits in (1, 2, 4, 8) a bucket never straddles a byte.
PLAID_NBITS = (1, 2, 4, 8)


def residual_bytes(dim: int, nbits: int) -> int:
    """Bytes of one token's packed residual: ``dim * nbits / 8``."""
    return dim * nbits // 8


def pack_buckets(buckets: torch.Tensor, nbits: int) -> torch.Tensor:
    """Bucket ids ``[N, d]`` (0 .. 2**nbits - 1) -> packed residuals ``[N, d * nbits / 8]`` uint8."""
    n, dim = buckets.shape
    shifts = torch.arange(nbits, device=buckets.device)
    bits = (buckets.long().unsqueeze(-1) >> shifts) & 1                       # [N, d, nbits], LSB first
    bits = bits.reshape(n, dim * nbits // 8, 8)                                # the stream, 8 bits a byte
    weights = (1 << torch.arange(7, -1, -1, device=buckets.device))            # first bit = the MSB
    return (bits * weights).sum(-1).to(torch.uint8)


def unpack_buckets(residuals: torch.Tensor, nbits: int, dim: int) -> torch.Tensor:
    """Packed residuals ``[..., d * nbits / 8]`` uint8 -> bucket ids ``[..., d]`` (int64)."""
    lead = residuals.shape[:-1]
    shifts = torch.arange(7, -1, -1, device=residuals.device)
    bits = (residuals.long().unsqueeze(-1) >> shifts) & 1                     # [..., R, 8], MSB first
    bits = bits.reshape(*lead, dim, nbits)
    return (bits << torch.arange(nbits, device=residuals.device)).sum(-1)


def decompress_residual(codes: torch.Tensor, residuals: torch.Tensor, centroids: torch.Tensor,
                        bucket_weights: torch.Tensor, nbits: int) -> torch.Tensor:
    """Tokens ``[..., d]`` (centroids' dtype) of codes ``[...]`` and residuals ``[..., d*nbits/8]``:
    ``centroids[code] + bucket_weights[bucket]``, summed in fp32 (fp64 for fp64 centroids)."""
    dim = centroids.shape[-1]
    cdt = torch.float64 if centroids.dtype == torch.float64 else torch.float32
    buckets = unpack_buckets(residuals, nbits, dim)
    out = centroids.to(cdt)[codes.long()] + bucket_weights.to(cdt)[buckets]
    return out.to(centroids.dtype)


def lengths_mask(doc_lengths: torch.Tensor, ld: int) -> torch.Tensor:
    """``[..., Ld]`` bool of lengths ``[...]``: token ``t`` of sequence ``j`` is valid when
    ``t < doc_lengths[j]``."""
    return torch.arange(ld, device=doc_lengths.device) < doc_lengths.to(torch.long).unsqueeze(-1)


def maxsim_residual(Q, codes, residuals, doc_lengths, centroids, bucket_weights, nbits, *, normalize=True):
    """Reference of :func:`lik_plugins.plaid.maxsim_residual`: MaxSim of ``Q [Nq, Lq, d]``
    against the decompressed documents ``[Nd, Ld, d]`` (tokens past ``doc_lengths`` excluded),
    the documents cast to ``Q``'s dtype as a float index would be.  ``normalize``
    L2-normalises both the queries and the decompressed tokens, as late-interaction-kernels
    0.4.5's ``maxsim_residual`` does (unlike :func:`maxsim_from_hidden`'s documents-only)."""
    valid = lengths_mask(doc_lengths, codes.shape[1])
    # padding may hold any code: only valid tokens are looked up
    D = decompress_residual(torch.where(valid, codes, torch.zeros_like(codes)), residuals, centroids,
                            bucket_weights, nbits)
    if normalize:
        wide = torch.promote_types(Q.dtype, torch.float32)
        Q = F.normalize(Q.to(wide), p=2, dim=-1, eps=NORM_EPS)
        D = F.normalize(D.to(torch.promote_types(D.dtype, torch.float32)), p=2, dim=-1, eps=NORM_EPS)
    return maxsim(Q, D.to(Q.dtype), None, valid)


def packed_positions(cu: torch.Tensor, seq: torch.Tensor, length_bound: int,
                     n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded view of packed sequences ``seq`` (``[n]`` ids, offsets ``cu``): the packed row of
    each position ``[n, length_bound]`` (clamped into the ``n_rows`` packed rows past a
    sequence's end, so gathering it is safe) and whether it is a real token."""
    start = cu[seq].long()
    length = cu[seq + 1].long() - start
    pos = torch.arange(length_bound, device=cu.device)
    present = pos[None, :] < length[:, None]
    rows = (start[:, None] + pos[None, :]).clamp_(0, max(n_rows - 1, 0))
    return rows, present


def pad_packed_index(codes_flat: torch.Tensor, residuals_flat: torch.Tensor, cu_seqlens_d: torch.Tensor,
                     max_seqlen_d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes [Nd, Ld], residuals [Nd, Ld, R], lengths [Nd])`` of a packed index (valid
    offsets, ``Ld = max_seqlen_d``): one gather of the *compressed* tokens.  The padding
    repeats some packed token (past the lengths, which every use masks)."""
    cu = cu_seqlens_d.to(torch.long)
    lengths = cu[1:] - cu[:-1]
    n = codes_flat.shape[0]
    if n == 0:
        shape = (lengths.shape[0], max_seqlen_d)
        return codes_flat.new_zeros(shape), residuals_flat.new_zeros((*shape, residuals_flat.shape[1])), lengths
    rows, _ = packed_positions(cu, torch.arange(lengths.shape[0], device=cu.device), max_seqlen_d, n)
    return codes_flat[rows], residuals_flat[rows], lengths


def plaid_approx_score(query_centroid_scores: torch.Tensor, codes: torch.Tensor,
                       doc_lengths: torch.Tensor) -> torch.Tensor:
    """Reference of :func:`lik_plugins.plaid.plaid_approx_score`: ``[C, Lq]`` centroid scores of
    one query, codes ``[B, Ld]`` -> ``[B]``: ``sum_s max_{t < len} S[codes[t], s]`` (0 for an
    empty document)."""
    sim = query_centroid_scores[codes.long()]                                   # [B, Ld, Lq]
    valid = lengths_mask(doc_lengths, codes.shape[1])
    best = sim.masked_fill(~valid[..., None], float("-inf")).amax(1)            # [B, Lq]
    best = torch.where(valid.any(-1, keepdim=True), best, torch.zeros_like(best))
    return best.sum(-1)


# ----------------------------------------------------------------------------- projection head
def maxsim_from_hidden(Q, H_d, W, b=None, d_mask=None, *, normalize=True):
    """Reference of :func:`lik_plugins.maxsim_from_hidden`: ``D = H_d @ W.T (+ b)``, then
    MaxSim, masked document tokens excluded.  ``normalize`` L2-normalises the projected
    document tokens only; the queries are used as given (late-interaction-kernels 0.4.5's
    meaning of the same name: its queries come out of the model's own head, normalised)."""
    D = _maybe_normalize(F.linear(H_d, W, b), normalize)
    return maxsim(Q, D, None, d_mask)


# ------------------------------------------------------------------ packed (varlen) layouts
def _sequences(x: torch.Tensor | None, cu_seqlens: torch.Tensor) -> list:
    """The sequences of packed ``x`` (``[None] * N`` for no ``x``): one split, so autograd
    keeps one node for all of them (a slice per pair would make each pair's backward write
    a zero gradient the size of the whole packed tensor)."""
    bounds = [int(v) for v in cu_seqlens.tolist()]
    sizes = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    if x is None:
        return [None] * len(sizes)
    return list(torch.split(x.narrow(0, 0, bounds[-1]), sizes))


def _unpacked(Q_packed, D_packed, cu_seqlens_q, cu_seqlens_d, q_mask, d_mask) -> tuple[list, list, list, list]:
    """The queries, documents and their masks of packed inputs, one sequence each."""
    return (_sequences(Q_packed, cu_seqlens_q), _sequences(D_packed, cu_seqlens_d),
            _sequences(q_mask, cu_seqlens_q), _sequences(d_mask, cu_seqlens_d))


def _packed_pair(q, d, qm, dm, normalize, mask_mode) -> torch.Tensor:
    """One query ``q [Lq, h]`` against one document ``d [Ld, h]``, both unpadded: a scalar."""
    qm = None if qm is None else qm.unsqueeze(0)
    dm = None if dm is None else dm.unsqueeze(0)
    return maxsim(q.unsqueeze(0), d.unsqueeze(0), qm, dm, normalize=normalize, mask_mode=mask_mode)[0, 0]


def maxsim_varlen(Q_packed: torch.Tensor, D_packed: torch.Tensor, cu_seqlens_q: torch.Tensor,
                  cu_seqlens_d: torch.Tensor, *, q_mask: torch.Tensor | None = None,
                  d_mask: torch.Tensor | None = None, normalize: bool = False, mask_mode: str = "exclude",
                  ) -> torch.Tensor:
    """Reference of :func:`lik_plugins.maxsim_varlen`: every packed query against every
    packed document, each pair scored on its own unpadded tokens (so a document of no
    tokens scores 0, and padding never exists to take part in a max)."""
    qs, ds, qms, dms = _unpacked(Q_packed, D_packed, cu_seqlens_q, cu_seqlens_d, q_mask, d_mask)
    rows = [torch.stack([_packed_pair(q, d, qm, dm, normalize, mask_mode) for d, dm in zip(ds, dms)])
            if ds else _empty_scores(Q_packed, D_packed)
            for q, qm in zip(qs, qms)]
    if not rows:
        return _empty_scores(Q_packed, D_packed).reshape(0, len(ds))
    return torch.stack(rows)


def score_pairs_packed(Q_packed: torch.Tensor, D_packed: torch.Tensor, cu_seqlens_q: torch.Tensor,
                       cu_seqlens_d: torch.Tensor, pair_q_idx: torch.Tensor, pair_d_idx: torch.Tensor, *,
                       q_mask: torch.Tensor | None = None, d_mask: torch.Tensor | None = None,
                       normalize: bool = False, mask_mode: str = "exclude") -> torch.Tensor:
    """Reference of :func:`lik_plugins.score_pairs_packed`: ``[num_pairs]``, pair ``p``
    being query ``pair_q_idx[p]`` against document ``pair_d_idx[p]``."""
    qs, ds, qms, dms = _unpacked(Q_packed, D_packed, cu_seqlens_q, cu_seqlens_d, q_mask, d_mask)
    scores = [_packed_pair(qs[i], ds[j], qms[i], dms[j], normalize, mask_mode)
              for i, j in zip(pair_q_idx.tolist(), pair_d_idx.tolist())]
    return torch.stack(scores) if scores else _empty_scores(Q_packed, D_packed)


def _empty_scores(Q: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    # no scores, but on the autograd graph of both inputs
    return (Q.sum() + D.sum()).mul(0).reshape(1)[:0]


def maxsim_padded(queries: torch.Tensor, documents: torch.Tensor, query_lengths: torch.Tensor,
                  doc_lengths: torch.Tensor, *, normalize: bool = False) -> torch.Tensor:
    """Reference of :func:`lik_plugins.maxsim_padded`: ``[B, Lq, d]`` queries, each with
    its own ``[C, Ld, d]`` candidates; only the first ``query_lengths[b]`` /
    ``doc_lengths[b, c]`` tokens exist (the rest never take part)."""
    q_mask, d_mask = lengths_mask(query_lengths, queries.shape[1]), lengths_mask(doc_lengths, documents.shape[2])
    return maxsim(queries, documents, q_mask, d_mask, normalize=normalize, mask_mode="exclude")
