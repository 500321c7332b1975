"""Candidate lists scored where they lie: the op layer under the hosts' list entry points
(PyLate ``rank.rerank``, colpali-engine ``score_multi_vector`` on lists, sentence-transformers'
list scoring).

A host holds its candidates as a Python list of separate ``[Ld, d]`` tensors.  Only the Triton
kernels read such a list in place (:mod:`lik_plugins.kernels.triton.listed`: an address table,
one launch); on every other path the host's own loop is the faster one, so the adapters ask
:func:`plan_lists` first and run their host's loop where it answers no table.
"""
from __future__ import annotations

import torch

from ..kernels.dispatch import served_by


def plan_lists(first: torch.Tensor, target: torch.device, candidates: list, extra: list[int]):
    """``(path, table)`` for a list of ``[Ld, d]`` candidates against queries like ``first``
    scored on ``target``: ``path`` is the chooser's answer (:func:`served_by`); ``table`` is
    None where that path is not the Triton kernels, else the candidates' address table with
    ``extra`` uploaded beside it, or a reason string where the list cannot be read in place
    (mixed dtypes, an unaligned candidate, ...)."""
    probe = first.to(target) if first.device != target else first
    path = served_by(probe)
    if path != "triton":
        return path, None
    from ..kernels.triton.listed import candidate_table

    return path, candidate_table(candidates, first.dtype, first.shape[-1], target, extra=extra)


def score_lists(queries: list, q_lens: torch.Tensor, table, query_index: torch.Tensor | None,
                pad: torch.Tensor | None, round_maxima: bool = False) -> torch.Tensor:
    """fp32 MaxSim of a list of ``[Lq_i, d]`` queries against a :func:`plan_lists` table:
    ``query_index`` ``[P]`` gives each candidate its one query (-> ``[P]``), None scores every
    query against every candidate (-> ``[n_q, P]``); ``pad`` marks the candidates whose max the
    host's zero padding joins; ``round_maxima`` rounds each row's max to the queries' dtype, as
    a host whose einsum outputs that dtype does (:func:`kernels.triton.listed.score_listed`)."""
    from ..kernels.triton.listed import score_table

    return score_table(queries, q_lens, table, query_index, pad, round_maxima=round_maxima)


def paused_gc():
    """Python's cyclic garbage collector paused for the block: a walk over thousands of
    candidates builds an object or two per candidate (see ``kernels.triton.listed.paused_gc``)."""
    from ..kernels.triton.listed import paused_gc as pause

    return pause()


__all__ = ["plan_lists", "score_lists", "paused_gc"]
