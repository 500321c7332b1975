"""Packed (``cu_seqlens``) and pair-list MaxSim, padded candidates with lengths, and the
packing helpers.

Names and argument order follow late-interaction-kernels 0.4.5, so code can switch::

    maxsim_varlen(Q_packed, D_packed, cu_seqlens_q, cu_seqlens_d, max_seqlen_q=None, max_seqlen_d=None)
    score_pairs_packed(Q_packed, D_packed, cu_seqlens_q, cu_seqlens_d, pair_q_idx, pair_d_idx)
    maxsim_padded(queries, documents, query_lengths, doc_lengths)
    pack(sequences) -> (packed, cu_seqlens, max_seqlen);  unpack(packed, cu_seqlens) -> sequences

Offsets (the rule every packed op applies):

* ``cu_seqlens`` is 1-D, int32 or int64 (int64 is converted to int32: the values are
  checked first, and a packed tensor of more than 2**31 - 1 tokens is refused), starts
  at 0, ends at the packed tensor's length and never decreases.  A sequence of length 0
  is allowed anywhere (an empty document scores 0).
* ``max_seqlen_*`` are loop bounds; a bound smaller than the longest sequence is an
  **error, never a truncation**.  Omitted, they are read from the offsets with one host
  synchronisation.
* A broken rule is a ``ValueError`` that names the rule and the first offending index
  (``cu_seqlens_d[2] = 7 is below cu_seqlens_d[1] = 8: offsets must never decrease``),
  with or without the bounds, wherever the offsets can be read without a cost: on the
  CPU, or on a GPU when a bound is omitted (that read happens anyway).  On a GPU with
  both bounds given nothing synchronises: the checks are a device-side assertion, which
  stops the process's CUDA context as any device assert does and cannot say which rule
  broke -- omit the bounds, or run the same call on CPU tensors, to have it named.  Under
  ``torch.compile`` pass the bounds (reading them from the offsets is a data-dependent
  host read); the checks are then asserted in the graph (a ``RuntimeError`` on CPU).
"""
from __future__ import annotations

import itertools
from typing import Sequence

import torch

from .. import autograd
from ..autograd.registry import CANDIDATES
from ..kernels import reference
from ..kernels.dispatch import packed_checks_kernel, reference_requested
from .dense import score
from .validate import (
    check_index_tensor, check_mask, check_max_seqlen, check_offsets, check_offsets_shape, check_options, check_tensor,
    index_problems, lengths_problems, offsets_problems, score_tensor, settle_checks,
)

__all__ = ["maxsim_varlen", "score_pairs_packed", "maxsim_padded", "pack", "unpack"]


def maxsim_varlen(Q_packed: torch.Tensor, D_packed: torch.Tensor, cu_seqlens_q: torch.Tensor,
                  cu_seqlens_d: torch.Tensor, max_seqlen_q: int | None = None, max_seqlen_d: int | None = None, *,
                  q_mask: torch.Tensor | None = None, d_mask: torch.Tensor | None = None, normalize: bool = False,
                  mask_mode: str = "exclude") -> torch.Tensor:
    """Every packed query against every packed document: ``[Nq, Nd]``.

    Args:
        Q_packed: ``[sum Lq, d]`` query tokens, the queries one after another.
        D_packed: ``[sum Ld, d]`` document tokens, same dtype (fp16 / bf16 / fp32 / fp64).
        cu_seqlens_q: ``[Nq + 1]`` offsets: query ``i`` is ``Q_packed[cu[i]:cu[i+1]]``.
        cu_seqlens_d: ``[Nd + 1]`` offsets of the documents.  See the module docstring
            for the offsets rule (int32, int64 converted, zero lengths allowed).
        max_seqlen_q, max_seqlen_d: bounds on the lengths (None: read from the offsets,
            one host sync).  Smaller than the longest sequence is an error.
        q_mask: ``[sum Lq]`` bool or 0/1, non-zero = valid (a masked query token adds 0).
        d_mask: ``[sum Ld]``, same conventions; holes anywhere.
        normalize: L2-normalise every token first (fused; its Jacobian in the backward).
        mask_mode: ``"exclude"`` or ``"zero"`` as in :func:`lik_plugins.maxsim`.  Only
            real tokens take part: a sequence has exactly its own tokens, never padding.

    Returns:
        float32 scores (float64 for float64 inputs) ``[Nq, Nd]``; gradients flow to
        ``Q_packed`` and ``D_packed`` through each query token's winning document token.

    Example::

        >>> Qp, cu_q, mq = pack([torch.randn(5, 16), torch.randn(3, 16)])
        >>> Dp, cu_d, md = pack([torch.randn(7, 16), torch.randn(0, 16), torch.randn(4, 16)])
        >>> maxsim_varlen(Qp, Dp, cu_q, cu_d, mq, md).shape
        torch.Size([2, 3])
    """
    return _packed("maxsim_varlen", Q_packed, D_packed, cu_seqlens_q, cu_seqlens_d, None, None, max_seqlen_q,
                   max_seqlen_d, q_mask, d_mask, normalize, mask_mode)


def score_pairs_packed(Q_packed: torch.Tensor, D_packed: torch.Tensor, cu_seqlens_q: torch.Tensor,
                       cu_seqlens_d: torch.Tensor, pair_q_idx: torch.Tensor, pair_d_idx: torch.Tensor, *,
                       max_seqlen_q: int | None = None, max_seqlen_d: int | None = None,
                       q_mask: torch.Tensor | None = None, d_mask: torch.Tensor | None = None,
                       normalize: bool = False, mask_mode: str = "exclude") -> torch.Tensor:
    """Only the listed (query, document) pairs of packed batches: ``[num_pairs]``.

    Pair ``p`` is query ``pair_q_idx[p]`` against document ``pair_d_idx[p]``; the cost is
    proportional to the number of pairs (one program per pair and query-row chunk), not
    to ``Nq * Nd``.  Pairs may come in any order and repeat; a repeated pair scores the
    same and its gradients add up.  Indices: 1-D int32/int64 of one length, in range
    (checked as the offsets are).  Every other argument as in :func:`maxsim_varlen`.

    Example::

        >>> Qp, cu_q, _ = pack([torch.randn(5, 16), torch.randn(3, 16)])
        >>> Dp, cu_d, _ = pack([torch.randn(7, 16), torch.randn(4, 16)])
        >>> score_pairs_packed(Qp, Dp, cu_q, cu_d, torch.tensor([1, 0, 1]), torch.tensor([0, 1, 0])).shape
        torch.Size([3])
    """
    if pair_q_idx is None or pair_d_idx is None:
        raise TypeError("score_pairs_packed needs pair_q_idx and pair_d_idx (1-D index tensors)")
    return _packed("score_pairs_packed", Q_packed, D_packed, cu_seqlens_q, cu_seqlens_d, pair_q_idx, pair_d_idx,
                   max_seqlen_q, max_seqlen_d, q_mask, d_mask, normalize, mask_mode)


def _packed(entry, Q, D, cu_q, cu_d, pair_q, pair_d, max_q, max_d, q_mask, d_mask, normalize, mask_mode):
    check_options("auto", mask_mode)
    check_tensor("Q_packed", Q, 2)
    check_tensor("D_packed", D, 2)
    if Q.dtype != D.dtype:
        raise TypeError(f"Q_packed and D_packed must have the same dtype, got {Q.dtype} and {D.dtype}")
    if Q.device != D.device:
        raise ValueError(f"Q_packed is on {Q.device} but D_packed is on {D.device}; move both to one device")
    if Q.shape[-1] != D.shape[-1]:
        raise ValueError(f"embedding dims differ: Q_packed has d={Q.shape[-1]}, D_packed has d={D.shape[-1]}")
    cu_q = check_index_tensor("cu_seqlens_q", cu_q, Q)
    cu_d = check_index_tensor("cu_seqlens_d", cu_d, D)
    max_q = check_max_seqlen("max_seqlen_q", max_q)
    max_d = check_max_seqlen("max_seqlen_d", max_d)
    q_mask = check_mask("q_mask", q_mask, (Q.shape[0],), Q)
    d_mask = check_mask("d_mask", d_mask, (D.shape[0],), D)
    if pair_q is not None:
        pair_q = check_index_tensor("pair_q_idx", pair_q, Q)
        pair_d = check_index_tensor("pair_d_idx", pair_d, D)
        if pair_q.shape != pair_d.shape:
            raise ValueError(f"pair_q_idx and pair_d_idx must have one length, got {pair_q.shape[0]} and "
                             f"{pair_d.shape[0]}")
    inputs_ok = packed_checks_kernel(Q) if max_q is not None and max_d is not None else None
    if inputs_ok is not None:
        # every check in one kernel launch: as torch ops they cost more host time than a
        # rerank of a thousand candidates takes on the GPU (kernels/triton/checks.py)
        check_offsets_shape("cu_seqlens_q", cu_q, Q.shape[0])
        check_offsets_shape("cu_seqlens_d", cu_d, D.shape[0])
        # (CUDA reports a failed device assert without its message, and the message must
        # be short: the offsets rule is in this module's docstring)
        torch._assert_async(inputs_ok(cu_q, Q.shape[0], max_q, cu_d, D.shape[0], max_d, pair_q, pair_d),
                            "packed offsets, max_seqlen or pair indices break lik_plugins.ops.packed's rule "
                            "(omit max_seqlen_q/_d to have the rule and its index named)")
    else:
        max_q, max_d = _check_on_device(cu_q, cu_d, pair_q, pair_d, Q.shape[0], D.shape[0], max_q, max_d)
    cu_q, cu_d = cu_q.to(torch.int32), cu_d.to(torch.int32)
    if pair_q is not None:
        pair_q, pair_d = pair_q.to(torch.int32), pair_d.to(torch.int32)

    if reference_requested(entry):
        kwargs = dict(q_mask=q_mask, d_mask=d_mask, normalize=normalize, mask_mode=mask_mode)
        if pair_q is None:
            return score_tensor(reference.maxsim_varlen(Q, D, cu_q, cu_d, **kwargs))
        return score_tensor(reference.score_pairs_packed(Q, D, cu_q, cu_d, pair_q, pair_d, **kwargs))
    return autograd.packed.maxsim_varlen(Q, D, cu_q, cu_d, pair_q, pair_d, q_mask, d_mask, max_q=int(max_q),
                                         max_d=int(max_d), normalize=bool(normalize), zero_mode=mask_mode == "zero",
                                         entry=entry)


def _check_on_device(cu_q, cu_d, pair_q, pair_d, rows_q, rows_d, max_q, max_d):
    """The offsets rule (module docstring) and the pair indices' range, as torch ops on the
    offsets' device, settled by :func:`.validate.settle_checks`; returns the bounds."""
    checks = [check_offsets("cu_seqlens_q", cu_q, rows_q, max_q, "max_seqlen_q"),
              check_offsets("cu_seqlens_d", cu_d, rows_d, max_d, "max_seqlen_d")]
    if pair_q is not None:
        nq, nd = cu_q.numel() - 1, cu_d.numel() - 1
        in_range = ((pair_q >= 0) & (pair_q < nq)).all() & ((pair_d >= 0) & (pair_d < nd)).all()
        checks.append((in_range, None,
                       lambda: index_problems("pair_q_idx", pair_q, nq, "Nq") + index_problems("pair_d_idx", pair_d,
                                                                                             nd, "Nd"),
                       f"pair indices must lie in [0, Nq={nq}) and [0, Nd={nd})"))
    longest = settle_checks(checks, host_read_needed=max_q is None or max_d is None)
    if longest is not None:
        max_q = longest[0] if max_q is None else max_q
        max_d = longest[1] if max_d is None else max_d
    return max_q, max_d


def maxsim_padded(queries: torch.Tensor, documents: torch.Tensor, query_lengths: torch.Tensor,
                  doc_lengths: torch.Tensor, *, normalize: bool = False) -> torch.Tensor:
    """Each query against its own padded candidates, with lengths: ``[B, C]``.

    Args:
        queries: ``[B, Lq, d]``; only the first ``query_lengths[b]`` tokens of query ``b``
            exist.
        documents: ``[B, C, Ld, d]``: ``C`` candidates per query; only the first
            ``doc_lengths[b, c]`` tokens of candidate ``c`` exist.
        query_lengths: ``[B]`` integer lengths in ``[0, Lq]``.
        doc_lengths: ``[B, C]`` integer lengths in ``[0, Ld]``.  A candidate of length 0
            scores 0.  Out of range is an error: a ``ValueError`` naming the first bad
            entry on the CPU, a device-side assertion on a GPU (no host sync).
        normalize: L2-normalise every token first.

    Tokens past a length never take part (padding is excluded, whatever it holds).  One
    launch of the per-query-candidates kernel with length-derived masks; gradients flow to
    ``queries`` and ``documents``.  Returns float32 (float64 for float64 inputs).

    Example::

        >>> Q, D = torch.randn(2, 8, 16), torch.randn(2, 5, 12, 16)
        >>> maxsim_padded(Q, D, torch.tensor([8, 3]), torch.randint(0, 13, (2, 5))).shape
        torch.Size([2, 5])
    """
    check_tensor("queries", queries, 3)
    check_tensor("documents", documents, 4)
    if queries.dtype != documents.dtype:
        raise TypeError(f"queries and documents must have the same dtype, got {queries.dtype} and {documents.dtype}")
    b, lq = queries.shape[0], queries.shape[1]
    c, ld = documents.shape[1], documents.shape[2]
    if documents.shape[0] != b:
        raise ValueError(f"documents must be [B={b}, C, Ld, d], got shape {tuple(documents.shape)}")
    for name, lengths, shape, bound in (("query_lengths", query_lengths, (b,), lq),
                                        ("doc_lengths", doc_lengths, (b, c), ld)):
        if not isinstance(lengths, torch.Tensor) or lengths.dtype.is_floating_point or lengths.dtype == torch.bool \
                or lengths.is_complex():
            raise TypeError(f"{name} must be an integer tensor")
        if tuple(lengths.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(lengths.shape)}")
        if lengths.device != queries.device:
            raise ValueError(f"{name} is on {lengths.device} but the embeddings are on {queries.device}")
        # never a host sync on a GPU (a ValueError naming the entry on the CPU)
        settle_checks([(((lengths >= 0) & (lengths <= bound)).all(), None,
                        lambda name=name, lengths=lengths, bound=bound: lengths_problems(name, lengths, bound),
                        f"{name} must lie in [0, {bound}]")],
                      host_read_needed=False)
    return score("maxsim_padded", queries, documents, reference.lengths_mask(query_lengths, lq),
                 reference.lengths_mask(doc_lengths, ld), CANDIDATES, normalize=normalize, backward="auto",
                 mask_mode="exclude")


def pack(sequences: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Pack ragged ``[L_i, d]`` tensors into ``(packed [sum L_i, d], cu_seqlens [N + 1]
    int32, max_seqlen)`` for :func:`maxsim_varlen` / :func:`score_pairs_packed`.

    One copy (``torch.cat``); the offsets are built on the host from the shapes (no
    device read) and copied to the tensors' device.  All tensors must share dtype, device
    and ``d``; zero-length tensors are allowed.  ``sequences`` must not be empty (the
    embedding width would be unknown).

    Example::

        >>> packed, cu, longest = pack([torch.randn(3, 8), torch.randn(5, 8)])
        >>> packed.shape, cu.tolist(), longest
        (torch.Size([8, 8]), [0, 3, 8], 5)
    """
    sequences = list(sequences)
    if not sequences:
        raise ValueError("pack needs at least one sequence")
    first = sequences[0]
    for i, x in enumerate(sequences):
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise ValueError(f"pack: sequence {i} must be a 2-D [L, d] tensor, got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        if x.shape[1] != first.shape[1] or x.dtype != first.dtype or x.device != first.device:
            raise ValueError(f"pack: sequence {i} is [{x.shape[1]}] {x.dtype} on {x.device}, sequence 0 is "
                             f"[{first.shape[1]}] {first.dtype} on {first.device}")
    lengths = [x.shape[0] for x in sequences]
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    return torch.cat(sequences), cu.to(first.device), max(lengths)


def unpack(packed: torch.Tensor, cu_seqlens: torch.Tensor) -> list[torch.Tensor]:
    """The sequences of a packed tensor, as views ``packed[cu[i]:cu[i+1]]`` (one host read
    of the offsets)."""
    problems = offsets_problems("cu_seqlens", cu_seqlens, packed.shape[0])
    if problems:
        raise ValueError("; ".join(problems))
    bounds = [int(x) for x in cu_seqlens.tolist()]
    return [packed[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
