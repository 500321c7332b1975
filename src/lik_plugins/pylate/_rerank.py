"""``pylate.rank.rerank`` as one fused launch over every query's candidate list.

PyLate's own ``rerank`` loops over the queries: it right-pads each query's candidates with
zeros (``pad_sequence``), calls ``colbert_scores`` without masks, sorts, and moves the scores
to the host -- one padded copy, one launch and one synchronisation per query.  Here every
candidate of every query is packed once and scored by one :func:`lik_plugins.score_pairs_packed`
launch (query ``i`` against each of its own candidates), then the lists are sorted and read back in one transfer.

Same numbers as PyLate's: its zero padding takes part in the max (a zero vector scores exactly
0), so a candidate shorter than the longest of its query's list gets one zero token appended
(one zero scores as many zeros would); the others are packed as they are.  Scores are cast to
PyLate's output dtype (the embeddings' dtype) before they are read, as PyLate reads them.
Order: each list is sorted by the same ``torch.sort(descending=True)`` call PyLate makes, so
exact ties come out in PyLate's order.  Output: PyLate's ``list[list[RerankResult]]``.

Anything this cannot serve exactly (mixed dtypes or devices, an empty candidate list, more
candidates than ids, ...) runs PyLate's own ``rerank`` (which raises its own errors), under
the same backend rules as the scoring adapters (``PYLATE_SCORES_BACKEND`` / ``LIK_DISABLE``).
"""
from __future__ import annotations

import torch

from .._config import disabled
from .._routing import record
from . import _scores
from ._scores import SUPPORTED_DTYPES, _Fallback

ENTRY = "pylate.rerank"


def rerank(documents_ids, queries_embeddings, documents_embeddings, device=None):
    """``pylate.rank.rerank`` served by ``lik_plugins``: one packed pair-list launch for all
    queries, PyLate's output structure and ordering."""
    layout = _scores._layout
    original = layout.originals["rerank"]
    args = (documents_ids, queries_embeddings, documents_embeddings, device)
    if not _scores._active or disabled():
        record(ENTRY, "original")
        return original(*args)
    choice = _scores.requested_backend(None)
    if choice in ("torch", "flash"):
        record(ENTRY, "original")
        return original(*args)
    plan = _prepare(layout, *args)
    if isinstance(plan, _Fallback):
        if choice == "lik" and plan.strict:
            raise RuntimeError(f"backend='lik': lik_plugins cannot serve this rerank call ({plan.reason})")
        record(ENTRY, "original")
        return original(*args)
    path, run = plan
    record(ENTRY, path)
    return run()


def _as_queries(queries_embeddings):
    # PyLate's reshape_embeddings: one [Lq, H] query (tensor or array) becomes a batch of one
    if getattr(queries_embeddings, "ndim", None) == 2:
        return [queries_embeddings]
    return queries_embeddings


def _prepare(layout, documents_ids, queries_embeddings, documents_embeddings, device):
    convert = layout.convert_to_tensor
    try:
        groups = list(zip(_as_queries(queries_embeddings), documents_ids, _as_queries(documents_embeddings)))
        queries = [convert(q) for q, _, _ in groups]
        candidates = [[convert(d) for d in docs] for _, _, docs in groups]
    except Exception as exc:  # PyLate raises its own error for these
        return _Fallback(f"inputs not convertible to tensors: {exc}", strict=False)
    if not groups:
        return _Fallback("no queries", strict=False)
    first = queries[0]
    if not isinstance(first, torch.Tensor) or first.dtype not in SUPPORTED_DTYPES:
        return _Fallback(f"query dtype {getattr(first, 'dtype', None)}")
    dim, dtype = first.shape[-1], first.dtype
    src = candidates[0][0].device if candidates[0] else first.device
    for q, docs, (_, ids, _) in zip(queries, candidates, groups):
        if q.dim() != 2 or q.shape[0] == 0 or q.shape[1] != dim or q.dtype != dtype or q.device != first.device:
            return _Fallback("queries must be non-empty [Lq, H] tensors of one dtype, device and H")
        if not docs or len(ids) < len(docs):
            return _Fallback("a query without candidates, or fewer ids than candidates", strict=False)
        for d in docs:
            if d.dim() != 2 or d.shape[1] != dim or d.dtype != dtype or d.device != src:
                return _Fallback("candidates must be [Ld, H] tensors of the queries' dtype and H, on one device")
        if max(d.shape[0] for d in docs) == 0:
            return _Fallback("a candidate list of empty documents", strict=False)
    target = torch.device(device) if device is not None else first.device
    ops = _scores._ops()

    def run():
        return _rerank_packed(ops, queries, candidates, [ids for _, ids, _ in groups], target, src)

    return ops.served_by(first.to(target) if first.device != target else first), run


def _rerank_packed(ops, queries, candidates, ids, target, src):
    from ..packed import pack, score_pairs_packed

    dim, dtype = queries[0].shape[1], queries[0].dtype
    zero = torch.zeros((1, dim), dtype=dtype, device=src)
    pieces, offsets, counts = [], [0], []
    for docs in candidates:
        longest = max(d.shape[0] for d in docs)
        for d in docs:
            pieces.append(d)
            n = d.shape[0]
            if n < longest:          # PyLate's zero padding: one zero token scores as many would
                pieces.append(zero)
                n += 1
            offsets.append(offsets[-1] + n)
        counts.append(len(docs))
    D = torch.cat(pieces).to(target)
    cu_d = torch.tensor(offsets, dtype=torch.int32).to(target)
    Q, cu_q, max_q = pack([q.to(target) for q in queries])
    pair_q = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts)).to(torch.int32).to(target)
    pair_d = torch.arange(len(offsets) - 1, dtype=torch.int32).to(target)
    max_d = max(b - a for a, b in zip(offsets[:-1], offsets[1:]))
    with torch.no_grad():
        flat = score_pairs_packed(Q, D, cu_q, cu_d, pair_q, pair_d, max_seqlen_q=max_q, max_seqlen_d=max_d)
    flat = flat.to(dtype)            # PyLate's scores are in the embeddings' dtype
    # Each list sorted by the very call PyLate makes on it (same length, dtype and device), so
    # exact ties come out in PyLate's order -- torch.sort is not stable there, and a batched
    # or stable sort orders ties differently; then one transfer for every list.
    parts = [torch.sort(part, descending=True) for part in torch.split(flat, counts)]
    values = torch.cat([v for v, _ in parts]).cpu().tolist()
    order = torch.cat([i for _, i in parts]).cpu().tolist()
    starts = [0]
    for n in counts:
        starts.append(starts[-1] + n)
    values = [values[a:b] for a, b in zip(starts[:-1], starts[1:])]
    order = [order[a:b] for a, b in zip(starts[:-1], starts[1:])]
    results = []
    for n, ids_q, vals, idx in zip(counts, ids, values, order):
        results.append([{"id": ids_q[i], "score": v} for i, v in zip(idx[:n], vals[:n])])
    return results
