"""Dense MaxSim, the public ops on padded ``[N, L, d]`` tokens: :func:`maxsim`,
:func:`maxsim_pairs`, :func:`retrieve`, :func:`smooth_maxsim`, :func:`maxsim_from_hidden`.

Each validates its arguments (clear errors, before anything runs), holds the contract in its
docstring, and hands the validated tensors to the registered op layer
(:mod:`lik_plugins.autograd`), which asks the chooser (:mod:`lik_plugins.kernels.dispatch`)
for the device path at run time.  ``LIK_DISABLE=1`` / ``LIK_BACKEND=reference`` is the one
exception, also answered by the chooser: the op runs the plain formulation
(:mod:`lik_plugins.kernels.reference`) by torch's own autograd.  Host adapters call these
functions, never the kernels.
"""
from __future__ import annotations

import math

import torch

from .. import _routing
from .. import autograd
from ..autograd.registry import CANDIDATES, CROSS, PAIRS
from ..kernels import reference
from ..kernels.common import accumulation_dtype
from ..kernels.dispatch import reference_requested, served_by
from . import quantized
from .validate import check_mask, check_tensor, prepare, score_tensor

__all__ = ["maxsim", "maxsim_pairs", "maxsim_from_hidden", "smooth_maxsim", "retrieve"]


def score(entry, Q, D, q_mask, d_mask, layout, *, normalize, backward, mask_mode):
    """Validated dense inputs in, scores out: the one call into the registered op layer for
    :func:`maxsim`, :func:`maxsim_pairs`, :func:`retrieve` and ``packed.maxsim_padded``
    (``entry``: the public op counted in ``routing_counts``; empty: not counted)."""
    if reference_requested(entry):
        spec = reference.maxsim_pairs if layout == PAIRS else reference.maxsim
        return score_tensor(spec(Q, D, q_mask, d_mask, normalize=normalize, mask_mode=mask_mode))
    return autograd.dense.maxsim(Q, D, q_mask, d_mask, layout=layout, normalize=bool(normalize),
                                 zero_mode=mask_mode == "zero", strategy=backward, entry=entry)


def maxsim(Q: torch.Tensor, D: torch.Tensor, q_mask: torch.Tensor | None = None, d_mask: torch.Tensor | None = None,
           *, normalize: bool = False, backward: str = "auto", mask_mode: str = "exclude") -> torch.Tensor:
    """MaxSim scores ``sum_s max_t <Q[q, s], D[d, t]>`` for a batch, fused.

    Args:
        Q: query token embeddings ``[Nq, Lq, d]``.
        D: either ``[Nd, Ld, d]`` — every query against every document (in-batch cross
            product) -> scores ``[Nq, Nd]`` — or ``[Nq, K, Ld, d]`` — each query against its
            own ``K`` candidates (knowledge distillation, hard negatives) -> ``[Nq, K]``,
            in one launch.
        q_mask: ``[Nq, Lq]``, bool or 0/1 of any dtype, non-zero = valid.  A masked query
            token contributes 0.
        d_mask: ``[Nd, Ld]`` (or ``[Nq, K, Ld]``), same conventions; holes anywhere.
        normalize: L2-normalise every token first (fused; its Jacobian in the backward).
        backward: ``"auto"``, ``"unified"`` (gather + atomic scatter; fastest where
            contention is low) or ``"lowmem"`` (deterministic — bitwise identical across
            runs — gradients written in the input dtype, no full-size fp32 buffer).
            ``"auto"`` picks ``"lowmem"`` for candidates and pairs, and for the cross
            product ``"unified"`` except for small batches and short documents, where
            ``"lowmem"`` measured faster or much leaner (see
            :func:`lik_plugins.autograd.dense.choose_backward`).
        mask_mode: ``"exclude"`` — a masked document token cannot win; a query token with
            no valid document token contributes 0.  ``"zero"`` — PyLate's multiplicative
            mask: a masked document token's similarity is 0 and competes for the max.
            Either way a document with no valid token scores 0.0, without a warning, as in
            PyLate and colpali-engine.

    Returns:
        float32 scores (float64 for float64 inputs).  fp16/bf16/fp32 inputs accumulate in
        fp32; fp32 inputs are never computed in half precision.

    Gradients flow to ``Q`` and ``D`` (only those that require them) through the saved
    winner of each query token; under ``torch.no_grad()`` nothing is saved.

    Example::

        >>> Q = torch.randn(4, 32, 128); D = torch.randn(8, 180, 128)
        >>> maxsim(Q, D).shape
        torch.Size([4, 8])
    """
    q_mask, d_mask, cross = prepare(Q, D, q_mask, d_mask, pairs=False, backward=backward, mask_mode=mask_mode)
    return score("maxsim", Q, D, q_mask, d_mask, CROSS if cross else CANDIDATES,
                  normalize=normalize, backward=backward, mask_mode=mask_mode)


def maxsim_pairs(Q: torch.Tensor, D: torch.Tensor, q_mask: torch.Tensor | None = None,
                 d_mask: torch.Tensor | None = None, *, normalize: bool = False, backward: str = "auto",
                 mask_mode: str = "exclude") -> torch.Tensor:
    """MaxSim of aligned pairs: ``Q [B, Lq, d]`` with ``D [B, Ld, d]`` -> ``[B]``.

    Masks ``[B, Lq]`` / ``[B, Ld]``; every other argument as in :func:`maxsim`.
    """
    q_mask, d_mask, _ = prepare(Q, D, q_mask, d_mask, pairs=True, backward=backward, mask_mode=mask_mode)
    return score("maxsim_pairs", Q, D, q_mask, d_mask, PAIRS, normalize=normalize, backward=backward,
                  mask_mode=mask_mode)


def maxsim_from_hidden(Q: torch.Tensor, H_d: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None = None,
                       d_mask: torch.Tensor | None = None, normalize: bool = True) -> torch.Tensor:
    """MaxSim against documents given as hidden states: ``D = normalize(H_d @ W.T + b)`` is
    computed tile by tile inside the scoring kernel (the projection head of a ColBERT model
    fused into its scoring), never written to memory.  ``Q`` is scored as given, as
    late-interaction-kernels' ``maxsim_from_hidden`` does: pass the model's (normalised)
    query embeddings.

    Args:
        Q: ``[Nq, Lq, d]`` query token embeddings, or ``[Lq, d]`` for one query.
        H_d: ``[Nd, Ld, h]`` document hidden states (the encoder's output), Q's dtype.
        W: ``[d, h]`` projection (``nn.Linear(h, d).weight``); ``b``: ``[d]`` or None.
        d_mask: ``[Nd, Ld]`` bool or 0/1, non-zero = valid (excluded otherwise; a document
            with no valid token scores 0).
        normalize: L2-normalise the projected document tokens (the documents only; the
            gradient into ``Q`` has no normalisation Jacobian).

    Returns:
        ``[Nq, Nd]`` float32 (float64 for float64 inputs; ``[Nd]`` for a 2-D ``Q``).
        Gradients flow into whichever of ``Q``, ``H_d``, ``W``, ``b`` require them: the
        backward gathers the hidden states at the winning positions only (each distinct one
        once) and projects them again; fully masked documents get exact zero gradients.

    Example::

        >>> head = torch.nn.Linear(768, 128)
        >>> scores = maxsim_from_hidden(Q, H, head.weight, head.bias, d_mask)
    """
    single = isinstance(Q, torch.Tensor) and Q.dim() == 2      # one query, as late-interaction-kernels takes it
    if single:
        Q = Q.unsqueeze(0)
    check_tensor("Q", Q, 3)
    check_tensor("H_d", H_d, 3)
    check_tensor("W", W, 2)
    if Q.dtype != H_d.dtype or W.dtype != H_d.dtype:
        raise TypeError(f"Q, H_d and W must share a dtype, got {Q.dtype}, {H_d.dtype}, {W.dtype}")
    if W.shape != (Q.shape[-1], H_d.shape[-1]):
        raise ValueError(f"W must be [d, h] = [{Q.shape[-1]}, {H_d.shape[-1]}], got {tuple(W.shape)}")
    if b is not None:
        check_tensor("b", b, 1)
        if b.shape != (Q.shape[-1],):
            raise ValueError(f"b must be [{Q.shape[-1]}], got {tuple(b.shape)}")
        b = b.to(H_d.dtype) if b.dtype != H_d.dtype else b
    for name, t in (("H_d", H_d), ("W", W), ("b", b)):
        if t is not None and t.device != Q.device:
            raise ValueError(f"{name} is on {t.device} but Q on {Q.device}")
    d_mask = check_mask("d_mask", d_mask, tuple(H_d.shape[:2]), H_d)
    if reference_requested("maxsim_from_hidden"):
        out = score_tensor(reference.maxsim_from_hidden(Q, H_d, W, b, d_mask, normalize=normalize))
    else:
        out = autograd.hidden.maxsim_hidden(Q, H_d, W, b, d_mask, normalize=bool(normalize),
                                            entry="maxsim_from_hidden")
    return out.squeeze(0) if single else out


def retrieve(Q: torch.Tensor, D: torch.Tensor, top_k: int, q_mask: torch.Tensor | None = None,
             d_mask: torch.Tensor | None = None, *, normalize: bool = False, mask_mode: str = "exclude",
             chunk: int | None = None, largest: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` documents per query: ``Q [Nq, Lq, d]``, ``D [Nd, Ld, d]`` ->
    ``(scores [Nq, k], indices [Nq, k])``, best first.

    ``top_k`` above ``Nd`` gives ``Nd`` columns, without a warning -- the hosts' own top-k
    (PyLate's, sentence-transformers') clamp the same way, silently; ``top_k=0`` gives empty
    ``[Nq, 0]`` results.  A document with no valid token (``d_mask`` all zero) scores 0.0, in
    either ``mask_mode``, and competes for the top-k like any other (PyLate's and
    colpali-engine's convention; patched sentence-transformers keeps ST's ``-1e9`` and its
    warning).  ``chunk`` scores the corpus ``chunk`` documents at a time and keeps a running top-k, so memory stays ``O(Nq * (k + chunk))`` for any corpus
    size.  No gradient is computed.  ``D`` may be an fp8 or int8 index
    (:class:`lik_plugins.Fp8Tokens` from :func:`lik_plugins.quantize_fp8`,
    :class:`lik_plugins.Int8Tokens` from :func:`lik_plugins.quantize_int8`): then every chunk
    is scored by :func:`lik_plugins.maxsim_fp8` / :func:`lik_plugins.maxsim_int8` (``Q``
    quantised once) and ``normalize`` must be off -- normalise before quantising
    (``quantize_int8(D, normalize=True)``).
    """
    if isinstance(D, (quantized.Fp8Tokens, quantized.Int8Tokens)):
        return _retrieve_quantised(Q, D, top_k, q_mask, d_mask, normalize=normalize, mask_mode=mask_mode,
                                   chunk=chunk, largest=largest)
    check_tensor("D", D, 3)
    _check_retrieve_args(top_k, chunk)
    q_mask, d_mask, _ = prepare(Q, D, q_mask, d_mask, pairs=False, backward="auto", mask_mode=mask_mode)
    _routing.record("retrieve", served_by(Q))

    def score_chunk(start, stop, dm):
        return score("", Q, D[start:stop], q_mask, dm, CROSS, normalize=normalize, backward="auto",
                     mask_mode=mask_mode)

    return _running_top_k(score_chunk, Q.shape[0], D.shape[0], d_mask, top_k, chunk, largest,
                          accumulation_dtype(Q.dtype), Q.device)


def _check_retrieve_args(top_k, chunk) -> None:
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
        raise ValueError(f"top_k must be a non-negative int, got {top_k!r}")
    if chunk is not None and (not isinstance(chunk, int) or chunk <= 0):
        raise ValueError(f"chunk must be a positive int or None, got {chunk!r}")


def _running_top_k(score, nq, nd, d_mask, top_k, chunk, largest, score_dtype, device):
    """Top-k over the corpus, ``chunk`` documents at a time: ``score(start, stop, d_mask
    slice)`` gives the chunk's ``[Nq, stop - start]`` scores."""
    k = min(top_k, nd)
    step = nd if chunk is None else chunk
    best_scores = torch.empty((nq, 0), dtype=score_dtype, device=device)
    best_index = torch.empty((nq, 0), dtype=torch.long, device=device)
    with torch.no_grad():
        for start in range(0, nd, max(step, 1)):
            stop = min(start + step, nd)
            part = score(start, stop, None if d_mask is None else d_mask[start:stop])
            index = torch.arange(start, stop, device=device).expand(nq, -1)
            cand_scores = torch.cat([best_scores, part.to(best_scores.dtype)], dim=1)
            cand_index = torch.cat([best_index, index], dim=1)
            keep = min(k, cand_scores.shape[1])
            best_scores, pos = cand_scores.topk(keep, dim=1, largest=largest, sorted=True)
            best_index = cand_index.gather(1, pos)
    return best_scores, best_index


def _retrieve_quantised(Q, D, top_k, q_mask, d_mask, *, normalize, mask_mode, chunk, largest):
    """:func:`retrieve` over an fp8 or int8 index."""
    fmt = quantized.format_of(D)
    kind = fmt.kind
    _check_retrieve_args(top_k, chunk)
    if normalize:
        raise ValueError(f"retrieve over an {kind} index cannot normalise: quantise normalised tokens "
                         f"(quantize_{kind}(D, normalize=True)) and pass normalized queries")
    if D.values.dim() != 3:
        raise ValueError(f"retrieve needs an {kind} index [Nd, Ld, d], got shape {tuple(D.values.shape)}")
    q = quantized.as_tokens(fmt, "Q", Q, (3,))  # quantised once for every chunk
    d_mask = check_mask("d_mask", d_mask, tuple(D.values.shape[:-1]), D)
    _routing.record("retrieve", served_by(q.values, kind))

    def score_chunk(start, stop, dm):
        return quantized.maxsim_quantized(fmt, q, D.select(slice(start, stop)), q_mask, dm, mask_mode)

    return _running_top_k(score_chunk, q.values.shape[0], D.values.shape[0], d_mask, top_k, chunk, largest,
                          torch.float32, q.device)


def smooth_maxsim(Q: torch.Tensor, D: torch.Tensor, *, tau: float, layout: str = "auto") -> torch.Tensor:
    """Smooth MaxSim ``sum_s tau * logsumexp_t(<Q[s], D[t]> / tau)`` without materialising
    the similarities (colpali-engine's ``use_smooth_max=True``).

    Args:
        Q: ``[Nq, Lq, d]`` query tokens (fp16 / bf16 / fp32 / fp64), zero rows allowed.
        D: ``[Nd, Ld, d]`` (``cross``, ``pairs``) or ``[Nq, K, Ld, d]`` (``candidates``).
            No masks: zero-padded tokens score 0 and take part in the log-sum-exp (a zero
            query row adds ``tau * log(Ld)``), as in colpali-engine.
        tau: the temperature (> 0, finite); ``tau -> 0`` tends to the hard max.
        layout: ``"auto"`` (4-D ``D`` -> ``candidates``, else ``cross``), ``"cross"``,
            ``"candidates"`` or ``"pairs"``.

    Returns:
        float32 scores (float64 for float64 inputs): ``[Nq, Nd]``, ``[Nq, K]`` or ``[B]``.
        Gradients flow to whichever of ``Q``, ``D`` require them.

    Example::

        >>> Q, D = torch.randn(4, 8, 16), torch.randn(5, 12, 16)
        >>> smooth_maxsim(Q, D, tau=0.1).shape
        torch.Size([4, 5])
    """
    layout_id = _smooth_layout(Q, D, layout)
    tau = float(tau)
    if not tau > 0 or math.isinf(tau):
        raise ValueError(f"tau must be a positive finite number, got {tau}")
    if Q.device != D.device:
        raise ValueError(f"Q and D are on different devices ({Q.device} vs {D.device})")
    if not (Q.is_floating_point() and D.is_floating_point()):
        raise TypeError("smooth_maxsim: Q and D must be floating point")
    out_dtype = torch.float64 if torch.float64 in (Q.dtype, D.dtype) else torch.float32
    if reference_requested("smooth_maxsim"):
        return reference.smooth_maxsim(Q.to(out_dtype), D.to(out_dtype), tau=tau, layout=_SMOOTH_LAYOUTS[layout_id])
    if Q.dtype != D.dtype:
        common = torch.promote_types(Q.dtype, D.dtype)
        Q, D = Q.to(common), D.to(common)
    return autograd.smooth.smooth_maxsim(Q, D, tau=tau, layout=layout_id, entry="smooth_maxsim")


_SMOOTH_LAYOUTS = {CROSS: "cross", CANDIDATES: "candidates", PAIRS: "pairs"}


def _smooth_layout(Q: torch.Tensor, D: torch.Tensor, layout: str) -> int:
    if layout == "auto":
        layout = "candidates" if isinstance(D, torch.Tensor) and D.dim() == 4 else "cross"
    ids = {name: i for i, name in _SMOOTH_LAYOUTS.items()}
    if layout not in ids:
        raise ValueError(f"layout must be one of {tuple(ids)} or 'auto', got {layout!r}")
    want = 4 if layout == "candidates" else 3
    if Q.dim() != 3 or D.dim() != want:
        raise ValueError(f"smooth_maxsim[{layout}]: expected Q 3-D and D {want}-D, got {tuple(Q.shape)} and "
                         f"{tuple(D.shape)}")
    if Q.shape[-1] != D.shape[-1]:
        raise ValueError(f"smooth_maxsim: embedding dims differ ({Q.shape[-1]} vs {D.shape[-1]})")
    if layout != "cross" and D.shape[0] != Q.shape[0]:
        raise ValueError(f"smooth_maxsim[{layout}]: D must have one entry per query ({D.shape[0]} vs {Q.shape[0]})")
    return ids[layout]
