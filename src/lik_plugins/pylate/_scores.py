"""PyLate's scoring functions, served by ``lik_plugins`` with PyLate's exact semantics.

Each adapter keeps the host's contract and nothing else:

* multiplicative masks (``mask_mode="zero"``): a masked document token scores 0 and
  still takes part in the max; a masked query token adds 0; masks of any dtype;
* the output dtype PyLate's own einsum path gives (type promotion of the embeddings
  and the masks), although the op itself always returns float32;
* positional and keyword calls, ``backend=``, numpy arrays and lists, ragged lists in
  pairwise scoring (packed: ``score_pairs_packed``);
* anything the op cannot serve goes to PyLate's original function, silently under
  ``auto`` and with an error under an explicit ``backend="lik"``.

Backend values (read on every call) as :func:`lik_plugins.pylate.patch_pylate` lists them;
other values raise PyLate's ``ValueError``.  ``LIK_DISABLE=1`` runs PyLate's code as if the
plugin were not installed (:func:`_call_unpatched`).
"""
from __future__ import annotations

import functools
import threading
from typing import Any, Callable, NamedTuple

import torch

from .._config import disabled, scores_backend
from .._routing import record
from ._layout import PyLateLayout

ACCEPTED_BACKENDS = ("auto", "torch", "flash", "lik")
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

#: Set by the patcher; the adapters read it on every call.
_layout: PyLateLayout | None = None
_active = False


def bind(layout: PyLateLayout | None, active: bool) -> None:
    global _layout, _active
    _layout, _active = layout, active


# ---------------------------------------------------------------------------- backend


def requested_backend(backend: str | None) -> str:
    """The backend a call asks for, validated exactly like PyLate >= 1.5.1 does."""
    layout = _layout
    if layout is not None and layout.resolve_backend is not None:
        return layout.resolve_backend(backend)
    value = scores_backend("PYLATE_SCORES_BACKEND") if backend is None else backend.lower()
    if value not in ACCEPTED_BACKENDS:
        raise ValueError(f"backend must be one of 'auto', 'torch', 'flash', 'lik'; got {value!r}")
    return value


class _Fallback(NamedTuple):
    """Why the op does not serve a call.  ``strict``: raise under ``backend="lik"``."""

    reason: str
    strict: bool = True


def _call_original(entry: str, original: Callable, args: tuple, backend: str | None, choice: str | None,
                   takes_backend: bool) -> Any:
    """PyLate's own function for a call the patch declined (``torch`` / ``flash``, or a
    fallback).  A ``lik`` request that falls back runs PyLate's torch path: ``lik`` names
    lik_plugins while the patch is in place, and PyLate's own LIK hook would raise on CPU.
    A function without a ``backend`` parameter (``rank.rerank``) gets the caller's arguments."""
    record(entry, "original")
    layout = _layout
    if not takes_backend:
        return original(*args)
    if layout is None or not layout.has_backend:
        if choice == "flash":
            raise RuntimeError(
                f"backend='flash' needs PyLate >= 1.5.1 (installed: {layout.version if layout else 'unknown'})"
            )
        return original(*args)
    if choice == "lik":
        backend = "torch"
    return original(*args, backend=backend)


def _call_unpatched(entry: str, original: Callable, args: tuple, backend: str | None) -> Any:
    """The kill switch (or a stale adapter after unpatch): PyLate's own function with the
    caller's arguments exactly, as if lik_plugins were not installed -- ``backend`` is
    forwarded only when the caller gave one, so PyLate resolves ``PYLATE_SCORES_BACKEND``
    itself and a ``lik`` request meets PyLate's own LIK backend (or its own error)."""
    record(entry, "original")
    return original(*args) if backend is None else original(*args, backend=backend)


#: ``active`` while PyLate's own ``rerank`` loop serves a call where it is the faster path
#: (:mod:`._rerank`): its ``colbert_scores`` calls then run PyLate's code as well.
host_loop = threading.local()


def _call_in_host_loop(entry: str, original: Callable, args: tuple, backend: str | None, choice: str,
                       takes_backend: bool) -> Any:
    """A scoring call made by PyLate's own ``rerank`` loop, which the patch picked as the
    faster path (a plain CPU, MPS).  PyLate's code runs it, with the caller's backend -- except
    that a ``lik`` request (``PYLATE_SCORES_BACKEND=lik``, which names lik_plugins while the
    patch is in place) means PyLate's torch path here: PyLate's own LIK backend, which its loop
    would otherwise resolve from the same variable, raises on a CPU."""
    if choice == "lik" and takes_backend and _layout is not None and _layout.has_backend:
        record(entry, "original")
        return original(*args, backend="torch")
    return _call_unpatched(entry, original, args, backend)


def _dispatch(name: str, args: tuple, backend: str | None, prepare: Callable, original=None,
              takes_backend: bool = True) -> Any:
    """One patched entry (counted as ``pylate.<name>``): PyLate's original (``originals[name]``
    unless given) where the switches or the backend ask for it, else ``prepare(*args)``'s plan:
    ``(path, run)``, or a :class:`_Fallback` to PyLate's code."""
    entry = f"pylate.{name}"
    if original is None:
        original = _layout.originals[name]
    if not _active or disabled():
        return _call_unpatched(entry, original, args, backend)
    choice = requested_backend(backend)
    if getattr(host_loop, "active", False):
        return _call_in_host_loop(entry, original, args, backend, choice, takes_backend)
    if choice in ("torch", "flash"):
        return _call_original(entry, original, args, backend, choice, takes_backend)
    plan = prepare(*args)
    if isinstance(plan, _Fallback):
        if choice == "lik" and plan.strict:
            raise RuntimeError(f"backend='lik': lik_plugins cannot serve this {name} call ({plan.reason})")
        return _call_original(entry, original, args, backend, choice, takes_backend)
    path, run = plan
    record(entry, path)
    return run()


# ------------------------------------------------------------------------ input checks


def _as_tensor(x: Any) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    converted = _layout.convert_to_tensor(x)
    if not isinstance(converted, torch.Tensor):
        raise TypeError(f"cannot convert {type(x).__name__} to a tensor")
    return converted


def _out_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """Type promotion of PyLate's ``einsum(Q, D) * q_mask * d_mask``."""
    return functools.reduce(torch.promote_types, dtypes)


def _check_embeddings(Q: torch.Tensor, D: torch.Tensor, d_dim: int) -> str | None:
    if Q.dim() != 3 or D.dim() != d_dim:
        return f"expected 3-D queries and {d_dim}-D documents, got {Q.dim()}-D and {D.dim()}-D"
    if Q.dtype != D.dtype or Q.dtype not in SUPPORTED_DTYPES:
        return f"dtypes {Q.dtype} / {D.dtype} (supported: float16, bfloat16, float32, both the same)"
    if Q.device != D.device:
        return f"queries on {Q.device}, documents on {D.device}"
    if Q.shape[-1] != D.shape[-1]:
        return f"embedding sizes {Q.shape[-1]} / {D.shape[-1]}"
    return None


def _check_mask(mask: torch.Tensor | None, shape: tuple, device: torch.device, what: str) -> str | None:
    if mask is None:
        return None
    if tuple(mask.shape) != tuple(shape):
        return f"{what} mask of shape {tuple(mask.shape)}, expected {tuple(shape)}"
    if mask.device != device:
        return f"{what} mask on {mask.device}, embeddings on {device}"
    if mask.is_complex():
        return f"{what} mask of dtype {mask.dtype}"
    if mask.dtype != torch.bool and not bool(((mask == 0) | (mask == 1)).all()):
        # PyLate multiplies by the mask: a weight other than 0/1 scales similarities.
        return f"{what} mask has values other than 0 and 1"
    return None


def _prepare_masked(Q, D, q_mask, d_mask, *, d_dim: int, fold_groups: bool):
    """Shared checks of the masked layouts.

    ``d_dim=3``: ``colbert_scores`` ``[Nd, Ld, H]``.  ``d_dim=4``: ``colbert_kd_scores``
    (``fold_groups=False``, ``[Nq, K, Ld, H]`` per-query candidates) or ``ColBERTScores``
    (``fold_groups=True``, ``[Qd, N, Ld, H]`` groups folded into ``Qd*N`` documents,
    query-major columns ``d*N + k``).
    """
    try:
        Q, D = _as_tensor(Q), _as_tensor(D)
        q_mask, d_mask = (None if m is None else _as_tensor(m) for m in (q_mask, d_mask))
    except Exception as exc:  # the original raises its own error for these
        return _Fallback(f"inputs not convertible to tensors: {exc}")
    reason = _check_embeddings(Q, D, d_dim)
    if reason is None and d_dim == 4 and not fold_groups and D.shape[0] != Q.shape[0]:
        reason = f"{Q.shape[0]} queries but candidates for {D.shape[0]}"
    if reason is None:
        reason = _check_mask(q_mask, Q.shape[:2], Q.device, "query") or _check_mask(
            d_mask, D.shape[:-1], D.device, "document"
        )
    if reason is not None:
        return _Fallback(reason)
    if Q.shape[1] == 0 or D.shape[-2] == 0:
        return _Fallback("zero-length token axis", strict=False)
    out_dtype = _out_dtype(Q.dtype, *(m.dtype for m in (q_mask, d_mask) if m is not None))
    if fold_groups:
        n_docs = D.shape[0] * D.shape[1]
        D = D.reshape(n_docs, D.shape[2], D.shape[3])
        d_mask = None if d_mask is None else d_mask.reshape(n_docs, d_mask.shape[2])
    from .. import ops

    return ops.served_by(Q), lambda: ops.maxsim(Q, D, q_mask, d_mask, mask_mode="zero").to(out_dtype)


# the adapters pass all four arguments positionally
_prepare_cross = functools.partial(_prepare_masked, d_dim=3, fold_groups=False)
_prepare_kd = functools.partial(_prepare_masked, d_dim=4, fold_groups=False)
_prepare_groups = functools.partial(_prepare_masked, d_dim=4, fold_groups=True)


def _prepare_pairwise(Q, D):
    """Pairs ``Q[i]`` x ``D[i]``: ``[B, L, H]`` tensors, or sequences of ``[L_i, H]``
    (ragged: packed, one :func:`lik_plugins.score_pairs_packed` launch)."""
    try:
        if isinstance(Q, torch.Tensor) and isinstance(D, torch.Tensor):
            Qs, Ds, ragged = Q, D, False
        else:
            Qs = [_as_tensor(q) for q in Q]
            Ds = [_as_tensor(d) for d in D]
            ragged = True
    except Exception as exc:
        return _Fallback(f"inputs not convertible to tensors: {exc}")
    if len(Qs) != len(Ds):
        return _Fallback(f"{len(Qs)} queries but {len(Ds)} documents", strict=False)
    if len(Qs) == 0:
        return _Fallback("empty batch", strict=False)
    from .. import ops

    if not ragged:
        reason = _check_embeddings(Qs, Ds, 3)
        if reason is not None:
            return _Fallback(reason)
        if Qs.shape[1] == 0 or Ds.shape[1] == 0:
            return _Fallback("zero-length token axis", strict=False)
        return ops.served_by(Qs), lambda: ops.maxsim_pairs(Qs, Ds, mask_mode="zero").to(Qs.dtype)
    first = Qs[0]
    for x in (*Qs, *Ds):
        if x.dim() != 2 or x.dtype != first.dtype or x.device != first.device or x.shape[-1] != first.shape[-1]:
            return _Fallback("pairwise items must be [L, H] tensors of one dtype, device and size")
    if first.dtype not in SUPPORTED_DTYPES:
        return _Fallback(f"dtype {first.dtype}")
    if any(x.shape[0] == 0 for x in (*Qs, *Ds)):
        return _Fallback("zero-length item", strict=False)

    def run_packed() -> torch.Tensor:
        # Packed, not padded: PyLate's per-pair loop has no padding, and packed pairs have
        # none either (each pair scores exactly its own tokens, one launch, no padded copy).
        Qp, cu_q, max_q = ops.pack(Qs)
        Dp, cu_d, max_d = ops.pack(Ds)
        pairs = torch.arange(len(Qs), dtype=torch.int32, device=first.device)
        return ops.score_pairs_packed(Qp, Dp, cu_q, cu_d, pairs, pairs, max_seqlen_q=max_q,
                                      max_seqlen_d=max_d).to(first.dtype)

    return ops.served_by(first), run_packed


# --------------------------------------------------------------------------- adapters


def colbert_scores(queries_embeddings, documents_embeddings, queries_mask=None, documents_mask=None,
                   backend: str | None = None):
    """``pylate.scores.colbert_scores`` served by ``lik_plugins``: ``[Nq, Lq, H]`` x
    ``[Nd, Ld, H]`` -> ``[Nq, Nd]`` with PyLate's multiplicative masks."""
    args = (queries_embeddings, documents_embeddings, queries_mask, documents_mask)
    return _dispatch("colbert_scores", args, backend, _prepare_cross)


def colbert_kd_scores(queries_embeddings, documents_embeddings, queries_mask=None, documents_mask=None,
                      backend: str | None = None):
    """``pylate.scores.colbert_kd_scores`` served by ``lik_plugins``: ``[B, Lq, H]`` x
    ``[B, N, Ld, H]`` (each query's own candidates) -> ``[B, N]``."""
    args = (queries_embeddings, documents_embeddings, queries_mask, documents_mask)
    return _dispatch("colbert_kd_scores", args, backend, _prepare_kd)


def colbert_scores_pairwise(queries_embeddings, documents_embeddings, backend: str | None = None):
    """``pylate.scores.colbert_scores_pairwise`` served by ``lik_plugins``: pairs
    ``Q[i]`` x ``D[i]`` -> ``[B]``; ragged lists are packed."""
    args = (queries_embeddings, documents_embeddings)
    return _dispatch("colbert_scores_pairwise", args, backend, _prepare_pairwise)


def colbert_scores_call(self, queries_embeddings, documents_embeddings, queries_mask=None, documents_mask=None,
                        backend: str | None = None):
    """``ColBERTScores.__call__`` as one fused call: ``[Qq, Lq, H]`` x ``[Qd, N, Ld, H]``
    -> ``[Qq, Qd*N]``, query-major (column ``d*N + k`` is document ``d``, slot ``k``)."""
    args = (self, queries_embeddings, documents_embeddings, queries_mask, documents_mask)
    return _dispatch("ColBERTScores", args, backend, lambda _self, *rest: _prepare_groups(*rest),
                     original=_layout.originals["ColBERTScores.__call__"])


ADAPTERS = {
    "colbert_scores": colbert_scores,
    "colbert_kd_scores": colbert_kd_scores,
    "colbert_scores_pairwise": colbert_scores_pairwise,
}
