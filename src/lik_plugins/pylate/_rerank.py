"""``pylate.rank.rerank`` with every candidate scored where it lies, in one launch.

PyLate's own ``rerank`` loops over the queries: it right-pads each query's candidates with
zeros (``pad_sequence``), moves them to the device, calls ``colbert_scores`` without masks,
sorts, and reads the scores back -- one padded copy, one launch and one synchronisation per
query.  Here the candidates are never concatenated: an address table (each candidate's
first-token address and length, :func:`lik_plugins.kernels.triton.listed.candidate_table`)
goes to the device in one copy and one kernel launch scores query ``i`` against each of its
own candidates in place.  Candidates on the CPU for a CUDA device are copied once into one
pinned buffer and moved in one transfer.  Each list is then sorted on the device and all
lists are read back in one copy.

The rule (same rankings as PyLate's at the embeddings' precision):

* zero padding: PyLate's padding takes part in the max (a zero vector scores exactly 0), so
  a candidate shorter than the longest of its query's list scores as if a zero token were
  appended (a row whose similarities are all negative scores 0); the longest ones do not;
* precision (16-bit embeddings): PyLate's einsum rounds every similarity to the embeddings'
  dtype, the max over a candidate's tokens is exact, the sum over the query tokens
  accumulates in fp32 and is rounded to the dtype.  Here each row's fp32 max is rounded to
  the dtype (rounding is monotone: the same value as the max of rounded similarities), the
  rounded maxima are summed in fp32 (exact for sums of 16-bit maxima of any realistic
  magnitude, so the order of the additions does not matter) and the sum is rounded to the
  dtype: PyLate's scores, bit for bit.  The exception: a similarity whose exact value lies
  within fp32 accumulation error of a midpoint of the 16-bit grid may round the other way
  (the two matrix products add their terms in different orders), moving that candidate's
  score by one 16-bit step.  fp32 embeddings: the same sums in another order (last-bit
  differences, so near-equal candidates may swap);
* ties: each list is sorted by the very ``torch.sort(descending=True)`` call PyLate makes
  (same length, dtype and device; ``torch.sort`` is not stable there, and a batched or
  stable sort orders ties differently), so exactly equal scores -- frequent once sums are
  rounded to 16 bits -- come out in PyLate's order.

Where it runs: on the devices the Triton kernels serve (CUDA; the CPU under
``TRITON_INTERPRET=1`` with ``LIK_BACKEND=triton``).  Everywhere else (a plain CPU, MPS)
PyLate's own loop runs, its ``colbert_scores`` calls included, recorded as ``original`` in
:func:`lik_plugins.routing_counts`: on a CPU it was measured faster than the packed path
(``docs/performance-notes.md``).  Anything this cannot read in
place exactly (mixed dtypes or devices, non-contiguous candidates, an empty candidate list,
more candidates than ids, ...) runs PyLate's own ``rerank`` too (which raises its own errors),
under the same backend rules as the scoring adapters (``PYLATE_SCORES_BACKEND`` /
``LIK_DISABLE``).  Output: PyLate's ``list[list[RerankResult]]``.
"""
from __future__ import annotations

import functools
from operator import itemgetter

import torch

from ..ops.listed import paused_gc, plan_lists, score_lists
from . import _scores
from ._scores import SUPPORTED_DTYPES, _Fallback


def rerank(documents_ids, queries_embeddings, documents_embeddings, device=None):
    """``pylate.rank.rerank`` served by ``lik_plugins``: one launch over every query's
    candidates where they lie, PyLate's output structure and ordering."""
    args = (documents_ids, queries_embeddings, documents_embeddings, device)
    return _scores._dispatch("rerank", args, None, _prepare, takes_backend=False)


def _host_loop(original, args):
    """PyLate's loop, all of it (its ``colbert_scores`` calls too): the faster path where the
    kernels do not run."""
    _scores.host_loop.active = True
    try:
        return original(*args)
    finally:
        _scores.host_loop.active = False


def _as_queries(queries_embeddings):
    # PyLate's reshape_embeddings: one [Lq, H] query (tensor or array) becomes a batch of one
    if getattr(queries_embeddings, "ndim", None) == 2:
        return [queries_embeddings]
    return queries_embeddings


def _prepare(documents_ids, queries_embeddings, documents_embeddings, device):
    layout = _scores._layout
    convert = layout.convert_to_tensor
    try:
        groups = list(zip(_as_queries(queries_embeddings), documents_ids, _as_queries(documents_embeddings)))
        queries = [convert(q) for q, _, _ in groups]
        tensor = torch.Tensor
        candidates = [[d if type(d) is tensor else convert(d) for d in docs] for _, _, docs in groups]
    except Exception as exc:  # PyLate raises its own error for these
        return _Fallback(f"inputs not convertible to tensors: {exc}", strict=False)
    if not groups:
        return _Fallback("no queries", strict=False)
    first = queries[0]
    if not isinstance(first, torch.Tensor) or first.dtype not in SUPPORTED_DTYPES:
        return _Fallback(f"query dtype {getattr(first, 'dtype', None)}")
    dim, dtype = first.shape[-1], first.dtype
    for q, docs, (_, ids, _) in zip(queries, candidates, groups):
        if q.dim() != 2 or q.shape[0] == 0 or q.shape[1] != dim or q.dtype != dtype or q.device != first.device:
            return _Fallback("queries must be non-empty [Lq, H] tensors of one dtype, device and H")
        if not docs or len(ids) < len(docs):
            return _Fallback("a query without candidates, or fewer ids than candidates", strict=False)
    target = torch.device(device) if device is not None else first.device
    counts = [len(docs) for docs in candidates]
    flat = [d for docs in candidates for d in docs]
    path, table = plan_lists(first, target, flat, extra=[q.shape[0] for q in queries] + counts)
    if table is None:
        args = (documents_ids, queries_embeddings, documents_embeddings, device)
        return "original", functools.partial(_host_loop, layout.originals["rerank"], args)
    if isinstance(table, str):
        return _Fallback(table, strict=False)
    lengths, start, longest = table.host_lengths, 0, []
    for n in counts:
        longest.append(max(lengths[start:start + n]))
        start += n
    if min(longest) == 0:
        return _Fallback("a candidate list of empty documents", strict=False)
    def run():
        with paused_gc():        # a result dict per candidate (listed.paused_gc says why)
            return _rerank_listed(queries, table, counts, longest, [ids for _, ids, _ in groups], target)

    return path, run


def _rerank_listed(queries, table, counts, longest, ids, target):
    nq, dtype = len(queries), queries[0].dtype
    q_lens, n_cands = table.extra[:nq], table.extra[nq:]
    total = len(table.host_lengths)       # addresses is None for a staged (host-resident) table
    query_index = torch.repeat_interleave(torch.arange(nq, device=target), n_cands, output_size=total)
    # PyLate's zero padding joins the max of every candidate shorter than its list's longest
    pad = table.lengths < torch.tensor(longest).to(target, non_blocking=True)[query_index]
    with torch.no_grad():
        flat = score_lists(queries, q_lens, table, query_index, pad, round_maxima=True)
    flat = flat.to(dtype)            # PyLate's scores are in the embeddings' dtype
    # each list sorted by the very call PyLate makes on it (module docstring: ties)
    parts = [torch.sort(part, descending=True) for part in torch.split(flat, counts)]
    values = torch.cat([v for v, _ in parts]).float().view(torch.int32)
    order = torch.cat([i for _, i in parts]).to(torch.int32)
    host = torch.cat([values, order]).cpu()          # one read-back for every list
    values = host[:total].view(torch.float32).tolist()
    order = host[total:].tolist()
    results, start = [], 0
    for n, ids_q in zip(counts, ids):
        # the ids in ranked order in one C call (itemgetter), not one Python index per candidate
        ranked = itemgetter(*order[start:start + n])(ids_q) if n > 1 else (ids_q[order[start]],)
        results.append([{"id": i, "score": v} for i, v in zip(ranked, values[start:start + n])])
        start += n
    return results
