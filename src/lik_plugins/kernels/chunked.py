"""Bounded-memory PyTorch path: same semantics as the kernels, for CPU (and any device
the kernels do not serve).

It never materialises the full ``[Nq, Nd, Lq, Ld]`` similarity tensor: queries and
documents are scored in chunks of at most ``LIK_CHUNK_ELEMENTS`` similarities, only the
per-row winner index (the argmax) is kept for the backward, and the backward gathers /
scatters through that index in chunks too.  So CPU training gets the memory win as well.
Every product runs in fp32 (fp64 for fp64 inputs): half-precision matmuls on CPU are slow
and accumulate in low precision.

Launcher signatures match :mod:`lik_plugins.kernels.triton.launch`.
"""
from __future__ import annotations

import torch

from .._config import chunk_elements
from .common import accumulation_dtype, argmax_dtype, inverse_norms, project_out_norm
from .reference import packed_positions

_NO_WINNER = -1


def _scaled(x: torch.Tensor, inv_norm: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    x = x.to(dtype)
    return x if inv_norm is None else x * inv_norm.to(dtype).unsqueeze(-1)


def _rows_per_chunk(per_row: int, total: int) -> int:
    return max(1, min(total, chunk_elements() // max(per_row, 1)))


def chunk_slices(n_outer: int, per_outer: int) -> list[slice]:
    """``range(n_outer)`` cut into slices of at most ``LIK_CHUNK_ELEMENTS // per_outer`` (at least 1)."""
    step = _rows_per_chunk(per_outer, n_outer)
    return [slice(i, i + step) for i in range(0, n_outer, step)]


def _reduce_rows(sim, q_valid, d_valid, zero_mode, d_present=None):
    """sim ``[a, b, Lq, Ld]`` -> (row values ``[a, b, Lq]``, winner ``[a, b, Lq]`` or -1).

    ``d_present`` (packed layouts, padded here per chunk): the columns that are real
    tokens; padding never takes part, not even as a zero-mode masked 0.  ``d_valid`` must
    then be False on padding too."""
    if sim.shape[-1] == 0:
        shape = sim.shape[:-1]
        return sim.new_zeros(shape), torch.full(shape, _NO_WINNER, dtype=torch.int64, device=sim.device)
    if d_valid is not None:
        sim = sim.masked_fill(~d_valid.unsqueeze(-2), float("-inf"))
    best, winner = sim.max(dim=-1)
    has_winner = best > float("-inf")
    if zero_mode and d_valid is not None:
        masked = ~d_valid if d_present is None else d_present & ~d_valid
        has_masked = masked.any(dim=-1).unsqueeze(-1)
        has_winner = has_winner & ~(has_masked & (best < 0))
    has_winner = has_winner | torch.isnan(best)
    if q_valid is not None:
        has_winner = has_winner & q_valid.unsqueeze(1)
    values = torch.where(has_winner, best, torch.zeros_like(best))
    winner = torch.where(has_winner, winner, torch.full_like(winner, _NO_WINNER))
    return values, winner


def _similarity_chunks(Q, D, cross, cdt, rq=None, rd=None):
    """``(index, qc, dc, sim)`` for every chunk of the similarities, tokens in ``cdt`` (scaled
    by the inverse norms ``rq`` / ``rd`` when given).  A cross product: a chunk of queries
    ``qc`` against a chunk of documents ``dc``, ``index = (qs, ds)`` into the ``[Nq, NJ]``
    scores; candidates: a chunk of queries with all their documents, ``index = qs``."""
    nq, lq, _ = Q.shape
    nj, ld = (D.shape[0], D.shape[1]) if cross else (D.shape[1], D.shape[2])
    if cross:
        for qs in chunk_slices(nq, _rows_per_chunk(lq * ld, nj) * lq * ld):
            qc = _scaled(Q[qs], None if rq is None else rq[qs], cdt)
            for ds in chunk_slices(nj, lq * ld):
                dc = _scaled(D[ds], None if rd is None else rd[ds], cdt)
                yield (qs, ds), qc, dc, torch.einsum("ash,bth->abst", qc, dc)
    else:
        for qs in chunk_slices(nq, nj * lq * ld):
            qc = _scaled(Q[qs], None if rq is None else rq[qs], cdt)
            dc = _scaled(D[qs], None if rd is None else rd[qs], cdt)
            yield qs, qc, dc, torch.einsum("ash,akth->akst", qc, dc)


def forward(Q, D, q_mask, d_mask, *, cross, normalize, zero_mode, save_argmax):
    """Scores ``[Nq, NJ]`` (fp32, or fp64 for fp64 inputs) and, if asked, the argmax
    (``[Nq, NJ, Lq]`` of :func:`~lik_plugins.kernels.common.argmax_dtype`, -1: no winner)."""
    nq, lq, _ = Q.shape
    nj, ld = (D.shape[0], D.shape[1]) if cross else (D.shape[1], D.shape[2])
    cdt = accumulation_dtype(Q.dtype)
    rq = inverse_norms(Q) if normalize else None
    rd = inverse_norms(D) if normalize else None
    scores = torch.empty((nq, nj), dtype=cdt, device=Q.device)
    argmax = torch.empty((nq, nj, lq), dtype=argmax_dtype(ld), device=Q.device) if save_argmax else None
    for index, _, _, sim in _similarity_chunks(Q, D, cross, cdt, rq, rd):
        qs, ds = index if cross else (index, index)
        qv = None if q_mask is None else q_mask[qs]
        # a cross product's document masks hold for every query of the chunk
        dv = None if d_mask is None else d_mask[ds].expand(*sim.shape[:2], -1)
        values, winner = _reduce_rows(sim, qv, dv, zero_mode)
        scores[index] = values.sum(-1)
        if argmax is not None:
            argmax[index] = winner
    return scores, argmax


def backward(grad, Q, D, argmax, *, cross, normalize, need_q, need_d, strategy="lowmem", q_masked=True):
    """Gradients through the saved winners only: gather for Q, scatter-add for D."""
    del strategy, q_masked  # one deterministic strategy here; masked rows are gathered, never multiplied
    dim = Q.shape[-1]
    nj, ld = (D.shape[0], D.shape[1]) if cross else (D.shape[1], D.shape[2])
    rq = inverse_norms(Q) if normalize else None
    rd = inverse_norms(D) if normalize else None
    doc_ids = torch.arange(nj, device=Q.device).view(1, nj, 1)

    def winners(qs):
        win = argmax[qs]                                                        # [a, NJ, Lq]
        docs = doc_ids
        if not cross:  # candidates: query q's k-th document is document q * NJ + k of D's rows
            docs = torch.arange(qs.start, qs.start + win.shape[0], device=Q.device).view(-1, 1, 1) * nj + doc_ids
        return docs * ld + win.clamp_min(0), win >= 0

    d_rows = _scaled(D, rd, accumulation_dtype(Q.dtype)).reshape(-1, dim) if need_q else None  # only for Q's gather
    gq, gd = _winner_gradients(grad, Q, rq, winners, d_rows, D.numel() // max(dim, 1), need_q=need_q,
                               need_rows=need_d)
    return _finish(gq, Q, rq, normalize), _finish(None if gd is None else gd.view(D.shape), D, rd, normalize)


def _winner_gradients(grad, Q, rq, winners, rows, n_rows, *, need_q, need_rows):
    """The chunk loop of every backward through saved winners: ``winners(qs)`` gives, for
    the queries ``qs``, each row's winning row among ``n_rows`` and whether it has one
    (``[a, NJ, Lq]`` each; the index of a row without a winner is any row in bounds).
    ``rows [n_rows, d]`` (compute dtype, needed for grad_Q only) are those rows as scored,
    ``rq`` the inverse norms the forward scaled ``Q`` by.  Returns (grad_Q before the
    normalisation's Jacobian, grad of the rows ``[n_rows, d]``), None where not needed."""
    nq, lq, dim = Q.shape
    nj = grad.shape[1]
    cdt = accumulation_dtype(Q.dtype)
    gq = torch.zeros((nq, lq, dim), dtype=cdt, device=Q.device) if need_q else None
    g_rows = torch.zeros((n_rows, dim), dtype=cdt, device=Q.device) if need_rows else None
    for qs in chunk_slices(nq if n_rows else 0, nj * lq * dim):  # no rows: no winners, zero gradients
        index, ok = winners(qs)
        weight = grad[qs].to(cdt).unsqueeze(-1) * ok.to(cdt)                  # [a, NJ, Lq]
        if need_q:
            # rows without a winner point at some row: zero them so a NaN there cannot leak
            gathered = rows[index.reshape(-1)].view(*index.shape, dim).masked_fill(~ok.unsqueeze(-1), 0)
            gq[qs] = torch.einsum("ajs,ajsh->ash", weight, gathered)
        if need_rows:
            qh = _scaled(Q[qs], None if rq is None else rq[qs], cdt)
            contrib = (weight.unsqueeze(-1) * qh.unsqueeze(1)).masked_fill(~ok.unsqueeze(-1), 0)  # [a, NJ, Lq, d]
            g_rows.index_add_(0, index.reshape(-1), contrib.reshape(-1, dim))
    return gq, g_rows


def _finish(g, X, inv_norm, normalize):
    """An accumulated gradient (or None) through the normalisation's Jacobian, in ``X``'s dtype."""
    if g is None:
        return None
    if normalize:
        g = project_out_norm(g, X.to(g.dtype), inv_norm.to(g.dtype))
    return g.to(X.dtype)


# --------------------------------------------------------------------------- smooth max
# ``score = sum_s tau * logsumexp_t(S / tau)`` (reference.smooth_maxsim).  The forward keeps
# only the per-row log-sum-exp ``lse[q, j, s]`` (``[Nq, NJ, Lq]``); the backward recomputes
# each chunk's similarities and softmax weights ``exp(S / tau - lse)`` from it.

def smooth_forward(Q, D, tau: float, cross: bool):
    """``(scores [Nq, NJ], lse [Nq, NJ, Lq])`` in fp32 (fp64 for fp64 inputs); ``lse`` is
    the log-sum-exp of ``S / tau`` per query row."""
    cdt = accumulation_dtype(Q.dtype)
    nq, lq, _ = Q.shape
    nj, ld = (D.shape[0], D.shape[1]) if cross else (D.shape[1], D.shape[2])
    lse = torch.empty((nq, nj, lq), dtype=cdt, device=Q.device)
    inv_tau = 1.0 / tau
    for index, _, _, sim in _similarity_chunks(Q, D, cross, cdt):
        lse[index] = torch.logsumexp(sim.mul_(inv_tau), dim=-1)
    return lse.sum(dim=-1) * tau, lse


def smooth_backward(Q, D, lse, grad, tau: float, cross: bool, need_q: bool, need_d: bool):
    """Gradients from recomputed softmax weights ``P = exp(S / tau - lse)``:
    ``dQ[q, s] = sum_j g[q, j] sum_t P D[j, t]``, ``dD[j, t] = sum_q g[q, j] sum_s P Q[q, s]``."""
    cdt = lse.dtype
    gq = torch.zeros(Q.shape, dtype=cdt, device=Q.device) if need_q else None
    gd = torch.zeros(D.shape, dtype=cdt, device=D.device) if need_d else None
    grad = grad.to(cdt)
    inv_tau = 1.0 / tau
    for index, qc, dc, sim in _similarity_chunks(Q, D, cross, cdt):
        w = sim.mul_(inv_tau).sub_(lse[index].unsqueeze(-1)).exp_().mul_(grad[index][..., None, None])
        if cross:  # a chunk of the queries' gradient sums over document chunks, and the other way round
            qs, ds = index
            if need_q:
                gq[qs] += torch.einsum("abst,bth->ash", w, dc)
            if need_d:
                gd[ds] += torch.einsum("abst,ash->bth", w, qc)
        else:
            if need_q:
                gq[index] = torch.einsum("akst,akth->ash", w, dc)
            if need_d:
                gd[index] = torch.einsum("akst,ash->akth", w, qc)
    return gq, gd


# --------------------------------------------------------------------------- built documents
# Documents that are made on the fly from something else -- PLAID residuals, hidden states
# through a projection head -- are built chunk by chunk (never the whole corpus at once) and
# scored like float tokens; the backward rebuilds only the tokens that won a max.

def forward_built(Q, build, n_docs, ld, d_mask, *, normalize_docs, normalize_queries, save_argmax):
    """Cross-product scores of ``Q [Nq, Lq, d]`` against ``n_docs`` documents of ``ld`` tokens,
    ``build(docs) -> [len, ld, d]`` fp32 (unnormalised) making the documents of the slice
    ``docs`` a chunk at a time.  Each built token is normalised in fp32 (``normalize_docs``)
    and rounded to ``Q``'s dtype, as the Triton kernel does; the queries are normalised only with
    ``normalize_queries`` (the residual ops normalise both sides, the projection head the
    documents only).  Returns (scores, argmax or None)."""
    nq, lq, dim = Q.shape
    scores = torch.empty((nq, n_docs), dtype=accumulation_dtype(Q.dtype), device=Q.device)
    argmax = torch.empty((nq, n_docs, lq), dtype=argmax_dtype(ld), device=Q.device) if save_argmax else None
    doc_dtype = Q.dtype
    if normalize_queries:
        # once for every chunk, in the compute dtype, as forward() would scale each chunk
        Q = _scaled(Q, inverse_norms(Q), accumulation_dtype(Q.dtype))
    for docs in chunk_slices(n_docs, ld * max(dim, 1)):
        tokens = build(docs)
        if normalize_docs:
            tokens = tokens * inverse_norms(tokens).unsqueeze(-1)
        dm = None if d_mask is None else d_mask[docs]
        part, arg = forward(Q, tokens.to(doc_dtype), None, dm, cross=True, normalize=False,
                            zero_mode=False, save_argmax=save_argmax)
        scores[:, docs] = part
        if argmax is not None:
            argmax[:, docs] = arg
    return scores, argmax


def winner_positions(argmax: torch.Tensor, ld: int):
    """``(positions, inverse, ok)`` of the saved winners ``[Nq, NJ, Lq]`` of a cross product:
    the distinct flat token ids ``j * ld + t`` that won somewhere (sorted), each winner's
    index into them, and which rows had a winner at all."""
    ok = argmax >= 0
    nj = argmax.shape[1]
    flat = torch.arange(nj, device=argmax.device).view(1, nj, 1) * ld + argmax.long().clamp_min(0)
    positions, inverse = torch.unique(flat[ok], sorted=True, return_inverse=True)
    full_inverse = torch.zeros(flat.shape, dtype=torch.long, device=flat.device)
    full_inverse[ok] = inverse
    return positions, full_inverse, ok


def backward_built(grad, Q, inverse, ok, rows_hat, *, normalize_queries, need_q, need_rows):
    """Gradients of cross-product scores through the winners, for documents whose winning
    tokens ``rows_hat [U, d]`` (fp32, as scored: normalised by the caller where the op
    normalises documents; one per entry of :func:`winner_positions`' ``positions``, whose
    ``inverse`` and ``ok`` come along) were rebuilt.  ``normalize_queries``: the forward
    normalised ``Q`` (its Jacobian is applied here).  Returns ``(grad_Q or None,
    grad_rows_hat [U, d] or None)``: the gradient at each distinct winning token."""
    rq = inverse_norms(Q) if normalize_queries else None
    rows = rows_hat.to(accumulation_dtype(Q.dtype))
    gq, g_rows = _winner_gradients(grad, Q, rq, lambda qs: (inverse[qs], ok[qs]), rows, rows.shape[0], need_q=need_q,
                                   need_rows=need_rows)
    return _finish(gq, Q, rq, normalize_queries), g_rows


# --------------------------------------------------------------------------- packed layouts
# Tokens packed as ``[sum L, d]`` with offsets ``cu_seqlens`` (int32, ``[N + 1]``).  The
# forward gathers each chunk of sequences into a padded block (padding marked absent, so it
# never takes part, not even as a zero-mode masked 0) and reduces it as above; the backward
# goes through the winners only, with global row indices into the packed tensors.  Both are
# shared by the Triton path (``kernels/triton/launch.py``), whose forward is a kernel and
# whose backward is this one.

def _gather_padded(X, inv_norm, mask, cu, seq, length_bound, cdt):
    """Sequences ``seq`` (``[n]`` int64 ids) of packed ``X`` as ``[n, length_bound, d]``, the
    presence mask and the validity mask ``[n, length_bound]``.  Rows past a sequence are
    left as whatever row the clamped index read (not zeroed: a third of a CPU rerank's time
    went to zeroing them); every use masks them through ``present`` / ``valid``, and
    :func:`_reduce_rows` replaces masked similarities instead of multiplying them, so even a
    NaN there cannot leak."""
    rows, present = packed_positions(cu, seq, length_bound, X.shape[0])
    if X.shape[0] == 0:
        x = X.new_zeros((seq.shape[0], length_bound, X.shape[-1]), dtype=cdt)
        return x, present, present
    x = _scaled(X[rows], None if inv_norm is None else inv_norm[rows], cdt)
    valid = present if mask is None else present & mask[rows]
    return x, present, valid


def _score_run(Q, D, rq, rd, q_mask, d_mask, cu_q, cu_d, q, docs, max_q, max_d, cdt, zero_mode):
    """One query (``q``, ``[1]``) against documents ``docs`` (a run of the pair list): row
    values and winners ``[n, max_q]``.  Consecutive documents are one span of packed rows:
    the query multiplies the span once and the similarities (``Lq`` a token) are gathered
    into the padded layout instead of the tokens (``d`` a token)."""
    qc, _, qv = _gather_padded(Q, rq, q_mask, cu_q, q, max_q, cdt)
    t0, t1 = int(cu_d[docs[0]]), int(cu_d[docs[-1] + 1])
    if t1 > t0 and bool((docs[1:] - docs[:-1] == 1).all()):
        rows, present = packed_positions(cu_d, docs, max_d, D.shape[0])
        valid = present if d_mask is None else present & d_mask[rows]
        span = _scaled(D[t0:t1], None if rd is None else rd[t0:t1], cdt)
        sim = (qc[0] @ span.T)[:, (rows - t0).clamp_(0, t1 - t0 - 1)]                  # [Lq, n, Ld]
        sim = sim.permute(1, 0, 2).unsqueeze(0)
    else:
        x, present, valid = _gather_padded(D, rd, d_mask, cu_d, docs, max_d, cdt)
        sim = torch.einsum("ash,bth->abst", qc, x)
    values, winner = _reduce_rows(sim, qv, valid.unsqueeze(0), zero_mode, present.unsqueeze(0))
    return values[0], winner[0]


def _query_runs(pair_q: torch.Tensor):
    """``[(query id [1], start, stop)]`` for runs of one query in a chunk of the pair list, or
    None where the runs are not worth it: fewer than four pairs a run on average, or a
    tensor off the CPU (finding the runs reads them on the host, a sync on a GPU).  On a
    CPU a product per run beats one per pair (:func:`_score_run`)."""
    if pair_q.device.type != "cpu" or pair_q.numel() == 0:
        return None
    ids, counts = torch.unique_consecutive(pair_q, return_counts=True)
    if 4 * ids.numel() > pair_q.numel():
        return None
    stops = counts.cumsum(0).tolist()
    return [(ids[i:i + 1], start, stop) for i, (start, stop) in enumerate(zip([0] + stops[:-1], stops))]


def varlen_forward(Q, D, cu_q, cu_d, pairs, q_mask, d_mask, *, max_q, max_d, normalize, zero_mode, save_argmax):
    """Packed MaxSim.  ``pairs``: None (every query against every document: scores
    ``[Nq, Nd]``, winners ``[Nq, Nd, max_q]``) or ``(pair_q, pair_d)`` (scores ``[P]``,
    winners ``[P, max_q]``).  Winners index the document's own tokens (-1: none)."""
    cdt = accumulation_dtype(Q.dtype)
    rq = inverse_norms(Q) if normalize else None
    rd = inverse_norms(D) if normalize else None
    nq, nd = cu_q.numel() - 1, cu_d.numel() - 1
    arg_dtype = argmax_dtype(max_d)
    device = Q.device
    if pairs is not None:
        pair_q, pair_d = pairs[0].long(), pairs[1].long()
        n_pairs = pair_q.shape[0]
        scores = torch.empty((n_pairs,), dtype=cdt, device=device)
        argmax = torch.empty((n_pairs, max_q), dtype=arg_dtype, device=device) if save_argmax else None
        for ps in chunk_slices(n_pairs, max(max_q, 1) * max(max_d, 1)):
            runs = _query_runs(pair_q[ps])
            if runs is None:
                # one small product per pair, every pair's query gathered
                dc, dp, dv = _gather_padded(D, rd, d_mask, cu_d, pair_d[ps], max_d, cdt)
                qc, _, qv = _gather_padded(Q, rq, q_mask, cu_q, pair_q[ps], max_q, cdt)
                sim = torch.einsum("ash,ath->ast", qc, dc).unsqueeze(1)
                values, winner = _reduce_rows(sim, qv, dv.unsqueeze(1), zero_mode, dp.unsqueeze(1))
                values, winner = values.squeeze(1), winner.squeeze(1)
            else:
                # consecutive pairs of one query (a rerank's candidate lists): one product of the
                # query against all of them, as the cross product computes it
                pd = pair_d[ps]
                parts = [_score_run(Q, D, rq, rd, q_mask, d_mask, cu_q, cu_d, q, pd[a:b], max_q, max_d, cdt,
                                    zero_mode) for q, a, b in runs]
                values, winner = (torch.cat(column) for column in zip(*parts))
            scores[ps] = values.sum(-1)
            if argmax is not None:
                argmax[ps] = winner
        return scores, argmax

    scores = torch.empty((nq, nd), dtype=cdt, device=device)
    argmax = torch.empty((nq, nd, max_q), dtype=arg_dtype, device=device) if save_argmax else None
    per_doc = max(max_q, 1) * max(max_d, 1)
    cd = _rows_per_chunk(per_doc, nd)
    q_ids = torch.arange(nq, device=device)
    d_ids = torch.arange(nd, device=device)
    for qs in chunk_slices(nq, cd * per_doc):
        qc, _, qv = _gather_padded(Q, rq, q_mask, cu_q, q_ids[qs], max_q, cdt)
        for ds in chunk_slices(nd, per_doc):
            dc, dp, dv = _gather_padded(D, rd, d_mask, cu_d, d_ids[ds], max_d, cdt)
            sim = torch.einsum("ash,bth->abst", qc, dc)
            masks_shape = (*sim.shape[:2], -1)  # the documents' masks hold for every query of the chunk
            values, winner = _reduce_rows(sim, qv, dv.expand(masks_shape), zero_mode, dp.expand(masks_shape))
            scores[qs, ds] = values.sum(-1)
            if argmax is not None:
                argmax[qs, ds] = winner
    return scores, argmax


def varlen_backward(grad, Q, D, cu_q, cu_d, pairs, argmax, *, normalize, need_q, need_d):
    """Gradients of :func:`varlen_forward` through its winners: grad_Q gathers each winning
    document row, grad_D scatter-adds ``g * q`` into it (``index_add_``: duplicate pairs
    accumulate).  No boolean indexing, so no host synchronisation on a GPU."""
    dim = Q.shape[-1]
    cdt = accumulation_dtype(Q.dtype)
    grad = grad.to(cdt)
    rq = inverse_norms(Q) if normalize else None
    rd = inverse_norms(D) if normalize else None
    q_hat = _scaled(Q, rq, cdt) if need_d else None
    d_hat = _scaled(D, rd, cdt) if need_q else None
    gq = torch.zeros((Q.shape[0], dim), dtype=cdt, device=Q.device) if need_q else None
    gd = torch.zeros((D.shape[0], dim), dtype=cdt, device=D.device) if need_d else None
    max_q = argmax.shape[-1]
    if Q.shape[0] and D.shape[0] and argmax.numel():
        t = torch.arange(max_q, device=Q.device)
        q_last, d_last = Q.shape[0] - 1, D.shape[0] - 1
        if pairs is not None:
            pair_q, pair_d = pairs[0].long(), pairs[1].long()
            for ps in chunk_slices(pair_q.shape[0], max_q * dim):
                win = argmax[ps].long()
                q_rows = cu_q[pair_q[ps]].long()[:, None] + t[None, :]
                d_rows = cu_d[pair_d[ps]].long()[:, None] + win.clamp_min(0)
                _scatter_winners(grad[ps].unsqueeze(-1), win, q_rows, d_rows, q_last, d_last, q_hat, d_hat, gq, gd)
        else:
            nd = cu_d.numel() - 1
            d_starts = cu_d[:-1].long().view(1, nd, 1)
            q_starts = cu_q[:-1].long()      # one start per query: ``cu_q`` has Nq + 1 entries
            for qs in chunk_slices(q_starts.numel(), nd * max_q * dim):
                win = argmax[qs].long()                                             # [a, Nd, Lq]
                q_rows = (q_starts[qs][:, None] + t[None, :]).unsqueeze(1).expand_as(win)
                d_rows = d_starts + win.clamp_min(0)
                _scatter_winners(grad[qs].unsqueeze(-1), win, q_rows, d_rows, q_last, d_last, q_hat, d_hat, gq, gd)
    return _finish(gq, Q, rq, normalize), _finish(gd, D, rd, normalize)


def _scatter_winners(g, win, q_rows, d_rows, q_last, d_last, q_hat, d_hat, gq, gd):
    """One chunk: ``g`` the score gradients broadcast over ``win``'s shape; rows without a
    winner (-1) contribute exact zeros (their indices are clamped, their weights 0)."""
    ok = win >= 0
    weight = (g * ok).reshape(-1, 1)
    ok = ok.reshape(-1, 1)
    q_rows = q_rows.reshape(-1).clamp(0, q_last)
    d_rows = d_rows.reshape(-1).clamp(0, d_last)
    if gq is not None:
        # a masked-out row may hold anything (NaN): select, never multiply, what has no winner
        gq.index_add_(0, q_rows, torch.where(ok, d_hat[d_rows] * weight, 0))
    if gd is not None:
        gd.index_add_(0, d_rows, torch.where(ok, q_hat[q_rows] * weight, 0))
