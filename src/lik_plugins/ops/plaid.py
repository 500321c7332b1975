"""PLAID / ColBERTv2 residual compression, and MaxSim straight from the compressed index.

ColBERTv2 (Santhanam et al., 2022) stores each document token as the id of its nearest
centroid plus, per dimension, an ``nbits``-bit bucket of the residual; PLAID (Santhanam
et al., 2022) ranks candidates by centroids alone and reranks the survivors exactly.
This module writes and reads that format and scores it without decompressing the
documents into memory:

    >>> centroids = fit_centroids(tokens, 256)                     # fastkmeans
    >>> index = compress(tokens, centroids, nbits=2)               # codes, residuals, cutoffs, weights
    >>> scores = maxsim_residual(Q, codes, residuals, doc_lengths, centroids, index.bucket_weights, 2)

Format (``reference.py`` holds the specification): codes int32 ``[N]``; residuals uint8
``[N, d * nbits / 8]``; a dimension's bucket is written least significant bit first into a
bit stream packed into bytes most significant bit first, as colbert-ai's ``ResidualCodec``
does (``bucketize``, ``>> arange(nbits) & 1``, ``numpy.packbits``).  ``nbits`` is 1, 2, 4 or 8.
Checked against fast-plaid 1.4.6 (PyLate's PLAID index): :func:`decompress` of the codes and
residuals fast-plaid stores, normalised, equals its own reconstruction within fp16 rounding
at 2, 4 and 8 bits (``benchmarks/fast_plaid_parity.py``).

Where it runs: the residual MaxSim on the Triton kernel (CUDA, capability 8.0+; CPU under
``TRITON_INTERPRET=1`` with ``LIK_BACKEND=triton``), which decompresses and normalises each
document tile on chip; elsewhere the chunked path decompresses a bounded chunk at a time.
The candidate score is a gather and a max (torch on every device).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .. import autograd
from ..kernels import reference
from ..kernels.dispatch import reference_requested
from ..kernels.reference import PLAID_NBITS, residual_bytes
from .validate import check_max_seqlen, check_offsets, check_tensor, settle_checks

__all__ = ["ResidualIndex", "fit_centroids", "compress", "decompress", "maxsim_residual",
           "maxsim_residual_varlen", "plaid_approx_score"]


class ResidualIndex(NamedTuple):
    """What :func:`compress` returns: ``codes [N]`` int32, ``residuals [N, d*nbits/8]`` uint8,
    ``bucket_cutoffs [2**nbits - 1]`` and ``bucket_weights [2**nbits]`` (fp32)."""

    codes: torch.Tensor
    residuals: torch.Tensor
    bucket_cutoffs: torch.Tensor
    bucket_weights: torch.Tensor


def _check_nbits(nbits, dim: int) -> int:
    if isinstance(nbits, bool) or not isinstance(nbits, int) or nbits not in PLAID_NBITS:
        raise ValueError(f"nbits must be one of {PLAID_NBITS}, got {nbits!r}")
    if (dim * nbits) % 8:
        raise ValueError(f"d * nbits must be a multiple of 8 (whole bytes per token), got d={dim}, nbits={nbits}")
    return nbits


def fit_centroids(embeddings: torch.Tensor, n_centroids: int, *, seed: int = 0, niter: int = 20) -> torch.Tensor:
    """``[n_centroids, d]`` fp32 centroids of ``embeddings [N, d]`` by k-means (``fastkmeans``,
    PyLate's dependency; imported here only), normalised to unit length as ColBERTv2's are.

    Example::

        >>> centroids = fit_centroids(torch.randn(5000, 128), 64)
    """
    check_tensor("embeddings", embeddings, 2)
    try:
        from fastkmeans import FastKMeans
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("fit_centroids needs fastkmeans (pip install fastkmeans), or pass your own centroids") \
            from err
    x = embeddings.detach().float().cpu().numpy()
    km = FastKMeans(d=x.shape[1], k=int(n_centroids), niter=niter, seed=seed, gpu=False, verbose=False)
    km.train(x)
    centroids = torch.as_tensor(km.centroids, dtype=torch.float32)
    return torch.nn.functional.normalize(centroids, dim=-1).to(embeddings.device)


def _codes(embeddings: torch.Tensor, centroids: torch.Tensor, chunk: int = 1 << 14) -> torch.Tensor:
    """Nearest centroid by inner product (ColBERTv2's rule; for unit vectors, nearest in L2)."""
    out = torch.empty(embeddings.shape[0], dtype=torch.int32, device=embeddings.device)
    c = centroids.float()
    for start in range(0, embeddings.shape[0], chunk):
        out[start:start + chunk] = (embeddings[start:start + chunk].float() @ c.t()).argmax(-1).to(torch.int32)
    return out


def compress(embeddings: torch.Tensor, centroids: torch.Tensor, nbits: int, *,
             bucket_cutoffs: torch.Tensor | None = None,
             bucket_weights: torch.Tensor | None = None) -> ResidualIndex:
    """Compress token embeddings ``[N, d]`` against ``centroids [C, d]`` into ColBERTv2's
    residual format (module docstring).

    The buckets are fitted to these embeddings' residuals as ColBERTv2 fits them: cutoffs at
    the quantiles ``i / 2**nbits`` (i = 1 .. 2**nbits - 1) of all residual components,
    weights at ``(i + 0.5) / 2**nbits`` (i = 0 .. 2**nbits - 1).  Pass ``bucket_cutoffs`` and
    ``bucket_weights`` to compress more tokens with an existing codec.

    Returns:
        :class:`ResidualIndex` ``(codes, residuals, bucket_cutoffs, bucket_weights)``.

    Example::

        >>> index = compress(torch.nn.functional.normalize(torch.randn(1000, 128), dim=-1), centroids, 2)
        >>> index.residuals.shape
        torch.Size([1000, 32])
    """
    check_tensor("embeddings", embeddings, 2)
    check_tensor("centroids", centroids, 2)
    dim = embeddings.shape[1]
    if centroids.shape[1] != dim:
        raise ValueError(f"centroids must be [C, {dim}], got {tuple(centroids.shape)}")
    if centroids.shape[0] == 0:
        raise ValueError("centroids must not be empty")
    nbits = _check_nbits(nbits, dim)
    with torch.no_grad():
        codes = _codes(embeddings, centroids)
        residual = embeddings.float() - centroids.float()[codes.long()]
        n_buckets = 1 << nbits
        if (bucket_cutoffs is None) != (bucket_weights is None):
            raise ValueError("pass both bucket_cutoffs and bucket_weights, or neither")
        if bucket_cutoffs is None:
            flat = residual.flatten()
            if flat.numel() > (1 << 24):  # torch.quantile's input limit: a strided sample
                flat = flat[:: -(-flat.numel() // (1 << 24))]
            steps = torch.arange(n_buckets, dtype=torch.float32, device=flat.device)
            bucket_cutoffs = torch.quantile(flat, steps[1:] / n_buckets) if flat.numel() else steps[1:] * 0
            bucket_weights = torch.quantile(flat, (steps + 0.5) / n_buckets) if flat.numel() else steps * 0
        bucket_cutoffs = bucket_cutoffs.float().to(embeddings.device)
        bucket_weights = bucket_weights.float().to(embeddings.device)
        if bucket_cutoffs.shape != (n_buckets - 1,) or bucket_weights.shape != (n_buckets,):
            raise ValueError(f"nbits={nbits} needs {n_buckets - 1} cutoffs and {n_buckets} weights, got "
                             f"{tuple(bucket_cutoffs.shape)} and {tuple(bucket_weights.shape)}")
        buckets = torch.bucketize(residual, bucket_cutoffs)
        residuals = reference.pack_buckets(buckets, nbits) if embeddings.shape[0] else \
            torch.empty((0, residual_bytes(dim, nbits)), dtype=torch.uint8, device=embeddings.device)
    return ResidualIndex(codes, residuals, bucket_cutoffs, bucket_weights)


def decompress(codes: torch.Tensor, residuals: torch.Tensor, centroids: torch.Tensor, bucket_weights: torch.Tensor,
               nbits: int) -> torch.Tensor:
    """Tokens ``[..., d]`` (centroids' dtype): ``centroids[code] + bucket_weights[bucket]`` for
    codes ``[...]`` and residuals ``[..., d*nbits/8]``.  Not normalised (ColBERTv2 normalises
    after decompressing; :func:`maxsim_residual` does with ``normalize=True``)."""
    _check_index(codes, residuals, centroids, bucket_weights, nbits, lead=codes.dim())
    return reference.decompress_residual(codes, residuals, centroids, bucket_weights, nbits)


def _check_index(codes, residuals, centroids, bucket_weights, nbits, *, lead: int) -> None:
    for name, t in (("codes", codes), ("residuals", residuals), ("centroids", centroids),
                    ("bucket_weights", bucket_weights)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check_tensor("centroids", centroids, 2)
    dim = centroids.shape[1]
    _check_nbits(nbits, dim)
    if codes.dtype not in (torch.int32, torch.int64) or codes.dim() != lead:
        raise TypeError(f"codes must be a {lead}-D int32/int64 tensor, got {codes.dtype} {tuple(codes.shape)}")
    want = (*codes.shape, residual_bytes(dim, nbits))
    if residuals.dtype != torch.uint8 or tuple(residuals.shape) != want:
        raise ValueError(f"residuals must be uint8 of shape {want}, got {residuals.dtype} {tuple(residuals.shape)}")
    if bucket_weights.shape != (1 << nbits,) or not bucket_weights.is_floating_point():
        raise ValueError(f"bucket_weights must be float [{1 << nbits}], got {bucket_weights.dtype} "
                         f"{tuple(bucket_weights.shape)}")
    for name, t in (("residuals", residuals), ("centroids", centroids), ("bucket_weights", bucket_weights)):
        if t.device != codes.device:
            raise ValueError(f"{name} is on {t.device} but codes on {codes.device}")


def _queries(Q, centroids: torch.Tensor, index_device: torch.device) -> tuple[torch.Tensor, bool]:
    """``(Q [Nq, Lq, d], single)``, checked against the index; a 2-D ``Q`` is one query."""
    single = isinstance(Q, torch.Tensor) and Q.dim() == 2
    if single:
        Q = Q.unsqueeze(0)
    check_tensor("Q", Q, 3)
    if Q.shape[-1] != centroids.shape[1]:
        raise ValueError(f"embedding dims differ: Q has d={Q.shape[-1]}, centroids d={centroids.shape[1]}")
    if Q.device != index_device:
        raise ValueError(f"Q is on {Q.device} but the index on {index_device}")
    return Q, single


def maxsim_residual(Q: torch.Tensor, codes: torch.Tensor, residuals: torch.Tensor, doc_lengths: torch.Tensor,
                    centroids: torch.Tensor, bucket_weights: torch.Tensor, nbits: int, *,
                    normalize: bool = True) -> torch.Tensor:
    """MaxSim of queries against documents in ColBERTv2's residual format, decompressed
    tile by tile inside the kernel (never materialised).

    Args:
        Q: ``[Nq, Lq, d]`` query tokens (fp16 / bf16 / fp32), or ``[Lq, d]`` for one query.
        codes: ``[Nd, Ld]`` int32 centroid ids (padded; entries past a length are ignored).
        residuals: ``[Nd, Ld, d*nbits/8]`` uint8 packed residuals.
        doc_lengths: ``[Nd]`` tokens per document (0 allowed: the document scores 0).
        centroids: ``[C, d]``; bucket_weights: ``[2**nbits]``; nbits: 1, 2, 4 or 8.
        normalize: L2-normalise the query tokens and the decompressed document tokens
            (ColBERTv2's scoring); off: raw inner products.

    Returns:
        ``[Nq, Nd]`` float32 (``[Nd]`` for a 2-D ``Q``); the gradient flows into ``Q``.
        Equals ``maxsim(Q, decompress(...), d_mask=lengths)`` up to float rounding (the
        decompressed tokens are rounded to ``Q``'s dtype, as a float index would be).

    Example::

        >>> scores = maxsim_residual(Q, codes, residuals, lengths, centroids, weights, 2)
    """
    _check_index(codes, residuals, centroids, bucket_weights, nbits, lead=2)
    Q, single = _queries(Q, centroids, codes.device)
    if not isinstance(doc_lengths, torch.Tensor) or doc_lengths.shape != (codes.shape[0],) \
            or doc_lengths.is_floating_point():
        raise ValueError(f"doc_lengths must be an integer tensor of shape ({codes.shape[0]},)")
    if reference_requested("maxsim_residual"):
        out = reference.maxsim_residual(Q, codes, residuals, doc_lengths, centroids, bucket_weights, nbits,
                                        normalize=normalize).float()
    else:
        lengths = doc_lengths.to(codes.device, torch.int32).contiguous()
        out = autograd.residual.maxsim_residual(Q, codes.to(torch.int32).contiguous(), residuals.contiguous(),
                                                lengths, centroids.contiguous(), bucket_weights.float().contiguous(),
                                                nbits=nbits, normalize=bool(normalize), entry="maxsim_residual")
    return out.squeeze(0) if single else out


def maxsim_residual_varlen(Q: torch.Tensor, codes_flat: torch.Tensor, residuals_flat: torch.Tensor,
                           cu_seqlens_d: torch.Tensor, centroids: torch.Tensor, bucket_weights: torch.Tensor,
                           nbits: int, *, max_seqlen_d: int | None = None, normalize: bool = True) -> torch.Tensor:
    """:func:`maxsim_residual` over a packed index: document ``j`` is tokens
    ``cu_seqlens_d[j] .. cu_seqlens_d[j + 1]`` of ``codes_flat [N]`` / ``residuals_flat [N, R]``.

    ``max_seqlen_d``: the longest document; omitted, it is read from ``cu_seqlens_d`` (one
    host sync).  Offsets and bound follow :mod:`lik_plugins.ops.packed`'s rule: a broken rule
    is a ``ValueError`` naming it and its index (on a GPU with the bound given, a device-side
    assertion); a bound below the longest document is an error, never a truncation.  Without
    a gradient the Triton kernel reads the packed tokens in place (no copy); when ``Q`` needs
    a gradient, and off the Triton path, the compressed tokens are first gathered into a
    padded layout (a copy of these documents' compressed bytes -- about 1/8 of a bf16 index
    at nbits 2 -- never the decompressed tokens).

    Returns ``[Nq, Nd]`` float32 (``[Nd]`` for a 2-D ``Q``), as :func:`maxsim_residual`.

    Example::

        >>> cu = torch.tensor([0, 30, 75, 75, 120], dtype=torch.int32)   # 4 documents, one empty
        >>> maxsim_residual_varlen(Q, codes, residuals, cu, centroids, weights, 4).shape
        torch.Size([Nq, 4])
    """
    if not isinstance(cu_seqlens_d, torch.Tensor) or cu_seqlens_d.dim() != 1 or cu_seqlens_d.numel() < 1 \
            or cu_seqlens_d.is_floating_point():
        raise ValueError("cu_seqlens_d must be a 1-D integer tensor [Nd + 1] of cumulative lengths")
    _check_index(codes_flat, residuals_flat, centroids, bucket_weights, nbits, lead=1)
    max_seqlen_d = check_max_seqlen("max_seqlen_d", max_seqlen_d)
    cu = cu_seqlens_d.to(codes_flat.device)
    check = check_offsets("cu_seqlens_d", cu, codes_flat.shape[0], max_seqlen_d, "max_seqlen_d")
    longest = settle_checks([check], host_read_needed=max_seqlen_d is None)  # no bound given: one host sync
    if longest is not None:
        max_seqlen_d = longest[0]
    wants_grad = isinstance(Q, torch.Tensor) and Q.requires_grad and torch.is_grad_enabled()
    if wants_grad or reference_requested():
        codes, residuals, lengths = reference.pad_packed_index(codes_flat, residuals_flat, cu, max_seqlen_d)
        return maxsim_residual(Q, codes, residuals, lengths, centroids, bucket_weights, nbits, normalize=normalize)
    Q3, single = _queries(Q, centroids, codes_flat.device)
    out = autograd.residual.maxsim_residual_varlen(Q3, codes_flat.to(torch.int32).contiguous(),
                                                   residuals_flat.contiguous(), cu.to(torch.int32),
                                                   centroids.contiguous(), bucket_weights.float().contiguous(), nbits,
                                                   int(max_seqlen_d), bool(normalize), "maxsim_residual_varlen")
    return out.squeeze(0) if single else out


def plaid_approx_score(query_centroid_scores: torch.Tensor, codes: torch.Tensor,
                       doc_lengths: torch.Tensor) -> torch.Tensor:
    """PLAID's centroid interaction: the candidate score of each document from its codes alone.

    Args:
        query_centroid_scores: ``[C, Lq]`` -- every centroid against one query's tokens
            (``centroids @ Q.T``; late-interaction-kernels' layout: one contiguous row per
            centroid, which is what the kernel gathers).
        codes: ``[B, Ld]`` centroid ids of ``B`` candidate documents (padded; entries past a
            length are never read).
        doc_lengths: ``[B]`` their lengths.

    Returns:
        ``[B]`` float32: ``sum_s max_{t < len} S[codes[t], s]`` (0 for an empty document; NaN
        where a scored entry is NaN).

    Example::

        >>> approx = plaid_approx_score(centroids @ Q[0].T, codes, lengths)
        >>> candidates = approx.topk(100).indices
    """
    check_tensor("query_centroid_scores", query_centroid_scores, 2)
    if codes.dim() != 2 or codes.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"codes must be [B, Ld] int32/int64, got {codes.dtype} {tuple(codes.shape)}")
    if not isinstance(doc_lengths, torch.Tensor) or doc_lengths.shape != (codes.shape[0],) \
            or doc_lengths.is_floating_point():
        raise ValueError(f"doc_lengths must be an integer tensor of shape ({codes.shape[0]},)")
    if query_centroid_scores.device != codes.device or doc_lengths.device != codes.device:
        raise ValueError("query_centroid_scores, codes and doc_lengths must be on one device")
    if reference_requested("plaid_approx_score"):
        return reference.plaid_approx_score(query_centroid_scores, codes, doc_lengths).float()
    return autograd.residual.plaid_approx_score(query_centroid_scores, codes, doc_lengths)
