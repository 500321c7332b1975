"""Public ops: validation with clear errors, the contract in the docstrings, routing.

Data path: public op (here) -> :class:`~lik_plugins.autograd.MaxSimFunction` -> device
dispatch -> kernels.  Host adapters (``lik_plugins.pylate``, ``lik_plugins.colpali``) call
these functions, never the kernels.
"""
from __future__ import annotations

import torch

from . import _routing
from .autograd import BACKWARD_STRATEGIES, MaxSimFunction
from .kernels import reference
from .kernels.dispatch import implementation, served_by
from .kernels.reference import MASK_MODES

__all__ = ["maxsim", "maxsim_pairs", "retrieve", "served_by"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_options(backward: str, mask_mode: str) -> None:
    if backward not in BACKWARD_STRATEGIES:
        raise ValueError(f"backward must be one of {', '.join(map(repr, BACKWARD_STRATEGIES))}; got {backward!r}")
    if mask_mode not in MASK_MODES:
        raise ValueError(f"mask_mode must be one of {', '.join(map(repr, MASK_MODES))}; got {mask_mode!r}")


def _check_tensor(name: str, x, rank: int | tuple[int, ...]) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    ranks = (rank,) if isinstance(rank, int) else rank
    if x.dim() not in ranks:
        want = " or ".join(f"{r}-D" for r in ranks)
        raise ValueError(f"{name} must be {want}, got shape {tuple(x.shape)}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}")


def _check_mask(name: str, mask, shape: tuple[int, ...], owner) -> torch.Tensor | None:
    """``owner``: the tokens the mask belongs to (its ``.device`` is read only when there is a mask)."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(mask).__name__}")
    if tuple(mask.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(mask.shape)}")
    if mask.device != owner.device:
        raise ValueError(f"{name} is on {mask.device} but the embeddings are on {owner.device}")
    if mask.is_complex():
        raise TypeError(f"{name} must be bool or a real 0/1 tensor, got {mask.dtype}")
    # Non-zero = valid.  bool stays as is (the kernels read its bytes without a copy).
    return mask if mask.dtype == torch.bool else mask != 0


def _prepare(Q, D, q_mask, d_mask, *, pairs: bool):
    """Validate; return (Q, D, q_mask, d_mask, cross).  Pairs keep ``D`` 3-D: the
    one-candidate view is taken inside the autograd Function (see :func:`_run`)."""
    _check_tensor("Q", Q, 3)
    if pairs:
        _check_tensor("D", D, 3)
    else:
        _check_tensor("D", D, (3, 4))
    if Q.dtype != D.dtype:
        raise TypeError(f"Q and D must have the same dtype, got {Q.dtype} and {D.dtype}")
    if pairs and D.shape[0] != Q.shape[0]:
        raise ValueError(f"maxsim_pairs needs one document per query: Q has B={Q.shape[0]}, D has B={D.shape[0]}")
    # pairs' D [B, Ld, d] and its mask [B, Ld] have the cross product's shapes
    q_mask, d_mask, cross = _check_geometry(Q, D, q_mask, d_mask)
    return Q, D, q_mask, d_mask, cross and not pairs


def _check_geometry(Q: torch.Tensor, D: torch.Tensor, q_mask, d_mask):
    """Device, embedding dim, per-query candidate count and masks of ``Q [Nq, Lq, d]``
    against ``D [Nd, Ld, d]`` or ``[Nq, K, Ld, d]`` (token tensors of any dtype: the fp8
    path checks its values with it too).  Returns ``(q_mask, d_mask, cross)``."""
    # is_cuda and the device index are plain attributes; a torch.device is built only off CUDA
    if Q.is_cuda != D.is_cuda or Q.get_device() != D.get_device() or (not Q.is_cuda and Q.device != D.device):
        raise ValueError(f"Q is on {Q.device} but D is on {D.device}; move both to one device")
    if Q.shape[-1] != D.shape[-1]:
        raise ValueError(f"embedding dims differ: Q has d={Q.shape[-1]}, D has d={D.shape[-1]}")
    nq, lq = Q.shape[0], Q.shape[1]
    if D.dim() == 4 and D.shape[0] != nq:
        raise ValueError(
            f"per-query candidates D [Nq, K, Ld, d] must have Nq={nq} like Q, got D shape {tuple(D.shape)}"
        )
    q_mask = _check_mask("q_mask", q_mask, (nq, lq), Q)
    d_mask = _check_mask("d_mask", d_mask, tuple(D.shape[:-1]), D)
    return q_mask, d_mask, D.dim() == 3


def _run(entry, Q, D, q_mask, d_mask, cross, *, normalize, backward, mask_mode, pairs=False):
    path = served_by(Q)
    if entry is not None:
        _routing.record(entry, path)
    if path == "reference" or not (torch.is_grad_enabled() and (Q.requires_grad or D.requires_grad)):
        if pairs:
            D = D.unsqueeze(1)
            d_mask = None if d_mask is None else d_mask.unsqueeze(1)
        if path == "reference":
            # The plain formulation (kill switch, or LIK_BACKEND=reference), in the inputs' dtype.
            out = reference.maxsim(Q, D, q_mask, d_mask, normalize=normalize, mask_mode=mask_mode)
            out = out if out.dtype == torch.float64 else out.float()
        else:
            # Nothing to differentiate: skip the autograd machinery (it costs ~20 us a call).
            out, _ = implementation(path).forward(Q, D, q_mask, d_mask, cross=cross, normalize=bool(normalize),
                                                  zero_mode=mask_mode == "zero", save_argmax=False)
        return out.squeeze(1) if pairs else out
    return MaxSimFunction.apply(Q, D, q_mask, d_mask,
                                (cross, bool(normalize), mask_mode == "zero", backward, path, pairs))


def maxsim(
    Q: torch.Tensor,
    D: torch.Tensor,
    q_mask: torch.Tensor | None = None,
    d_mask: torch.Tensor | None = None,
    *,
    normalize: bool = False,
    backward: str = "auto",
    mask_mode: str = "exclude",
) -> torch.Tensor:
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
            :func:`lik_plugins.autograd.choose_backward`).
        mask_mode: ``"exclude"`` — a masked document token cannot win; a query token with
            no valid document token contributes 0.  ``"zero"`` — PyLate's multiplicative
            mask: a masked document token's similarity is 0 and competes for the max.

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
    _check_options(backward, mask_mode)
    Q, D, q_mask, d_mask, cross = _prepare(Q, D, q_mask, d_mask, pairs=False)
    return _run("maxsim", Q, D, q_mask, d_mask, cross, normalize=normalize, backward=backward, mask_mode=mask_mode)


def maxsim_pairs(
    Q: torch.Tensor,
    D: torch.Tensor,
    q_mask: torch.Tensor | None = None,
    d_mask: torch.Tensor | None = None,
    *,
    normalize: bool = False,
    backward: str = "auto",
    mask_mode: str = "exclude",
) -> torch.Tensor:
    """MaxSim of aligned pairs: ``Q [B, Lq, d]`` with ``D [B, Ld, d]`` -> ``[B]``.

    Masks ``[B, Lq]`` / ``[B, Ld]``; every other argument as in :func:`maxsim`.
    """
    _check_options(backward, mask_mode)
    Q, D, q_mask, d_mask, _ = _prepare(Q, D, q_mask, d_mask, pairs=True)
    return _run("maxsim_pairs", Q, D, q_mask, d_mask, False, normalize=normalize, backward=backward,
                mask_mode=mask_mode, pairs=True)


def retrieve(
    Q: torch.Tensor,
    D: torch.Tensor,
    top_k: int,
    q_mask: torch.Tensor | None = None,
    d_mask: torch.Tensor | None = None,
    *,
    normalize: bool = False,
    mask_mode: str = "exclude",
    chunk: int | None = None,
    largest: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` documents per query: ``Q [Nq, Lq, d]``, ``D [Nd, Ld, d]`` ->
    ``(scores [Nq, k], indices [Nq, k])``, best first.

    ``top_k`` is clamped to ``Nd``.  ``chunk`` scores the corpus ``chunk`` documents at a
    time and keeps a running top-k, so memory stays ``O(Nq * (k + chunk))`` for any corpus
    size.  No gradient is computed.  ``D`` may be an fp8 index (:class:`lik_plugins.Fp8Tokens`
    from :func:`lik_plugins.quantize_fp8`): then every chunk is scored by
    :func:`lik_plugins.maxsim_fp8` (``Q`` quantised once) and ``normalize`` must be off --
    normalise before quantising (``quantize_fp8(D, normalize=True)``).
    """
    from .fp8 import Fp8Tokens

    if isinstance(D, Fp8Tokens):
        return _retrieve_fp8(Q, D, top_k, q_mask, d_mask, normalize=normalize, mask_mode=mask_mode, chunk=chunk,
                             largest=largest)
    _check_tensor("D", D, 3)
    _check_retrieve_args(top_k, chunk)
    _check_options("auto", mask_mode)
    Q, D, q_mask, d_mask, _ = _prepare(Q, D, q_mask, d_mask, pairs=False)
    _routing.record("retrieve", served_by(Q))
    score_dtype = torch.float64 if Q.dtype == torch.float64 else torch.float32

    def score(start, stop, dm):
        return _run(None, Q, D[start:stop], q_mask, dm, True, normalize=normalize, backward="auto",
                    mask_mode=mask_mode)

    return _running_top_k(score, Q.shape[0], D.shape[0], d_mask, top_k, chunk, largest, score_dtype, Q.device)


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


def _retrieve_fp8(Q, D, top_k, q_mask, d_mask, *, normalize, mask_mode, chunk, largest):
    from .fp8 import _as_tokens, maxsim_fp8, served_by_fp8

    _check_retrieve_args(top_k, chunk)
    if normalize:
        raise ValueError("retrieve over an fp8 index cannot normalise: quantise normalised tokens "
                         "(quantize_fp8(D, normalize=True)) and pass normalized queries")
    if D.values.dim() != 3:
        raise ValueError(f"retrieve needs an fp8 index [Nd, Ld, d], got shape {tuple(D.values.shape)}")
    q = _as_tokens("Q", Q, (3,))  # quantised once for every chunk
    d_mask = _check_mask("d_mask", d_mask, tuple(D.values.shape[:-1]), D)
    _routing.record("retrieve", served_by_fp8(q.values))

    def score(start, stop, dm):
        return maxsim_fp8(q, D.select(slice(start, stop)), q_mask, dm, mask_mode=mask_mode)

    return _running_top_k(score, q.values.shape[0], D.values.shape[0], d_mask, top_k, chunk, largest,
                          torch.float32, q.device)
