"""PLAID's candidate generation for a batch of queries on the GPU (``lik_plugins.plaid_search``).

Two kernels, no host synchronisation between them:

* :func:`mark_candidates` -- one program per (query, probed IVF cell): it walks the cell's
  inverted list and sets ``mask[query, pid] = 1``.  A document reached through several
  cells is written several times with the same value, so the union needs no atomics and no
  deduplication pass (fast-plaid sorts and de-duplicates the concatenated lists per query).
* :func:`approx_scores` -- one program per (document, query): a candidate's centroid
  interaction ``sum_s max_t S[b, code_t, s]`` from its codes, read in place from the packed
  index; a non-candidate stores ``-inf`` and returns.  The running max stays a
  ``[tokens, query tokens]`` tile reduced once at the end, as in :mod:`.approx`.

``mask`` and the scores are dense ``[B, N]`` over the whole collection: the caller sizes
``B`` so that they stay within its memory budget, and a top-k over each row replaces the
variable-length candidate lists (whose sizes only the host could learn).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tuning import next_pow2

# 32 tokens a tile on one warp, as the single-query approximate score (.approx) measured best.
BLOCK_T = 32
# inverted-list entries marked per step of a cell's walk
BLOCK_IVF = 128


@triton.jit(do_not_specialize=["n_cells", "n_docs"])
def plaid_mark_kernel(CELLS, IVF, IVF_OFF, MASK, n_cells, n_docs, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cell = tl.load(CELLS + b * n_cells + c).to(tl.int64)
    start = tl.load(IVF_OFF + cell)
    stop = tl.load(IVF_OFF + cell + 1)
    for s in range(start, stop, BLOCK):
        o = s + tl.arange(0, BLOCK)
        m = o < stop
        pid = tl.load(IVF + o, mask=m, other=0).to(tl.int64)
        tl.store(MASK + b * n_docs + pid, tl.full([BLOCK], 1, tl.int8), mask=m)


# ``lq`` is specialised (the row stride of the centroid scores: a known multiple of 16 lets
# each gathered row load as vectors), as in .approx.
@triton.jit(do_not_specialize=["n_docs", "s_sb"])
def plaid_approx_batch_kernel(S, CODES, DOC_OFF, MASK, OUT, n_docs, lq, s_sb,
                              BLOCK_T: tl.constexpr, LQ_PAD: tl.constexpr):
    j = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    flag = tl.load(MASK + b * n_docs + j)
    score = float("-inf")
    if flag != 0:
        start = tl.load(DOC_OFF + j).to(tl.int64)
        n = (tl.load(DOC_OFF + j + 1).to(tl.int64) - start).to(tl.int32)
        o_q = tl.arange(0, LQ_PAD)
        m_q = o_q < lq
        acc = tl.full([BLOCK_T, LQ_PAD], float("-inf"), tl.float32)
        for t0 in range(0, n, BLOCK_T):
            o_t = t0 + tl.arange(0, BLOCK_T)
            valid = o_t < n
            code = tl.load(CODES + start + o_t, mask=valid, other=0).to(tl.int64)
            sim = tl.load(S + b * s_sb + (code * lq)[:, None] + o_q[None, :],
                          mask=valid[:, None] & m_q[None, :], other=float("-inf")).to(tl.float32)  # [BT, LQ]
            acc = tl.maximum(acc, sim)
        best = tl.max(acc, axis=0)                                                             # [LQ]
        score = tl.sum(tl.where(m_q, best, 0.0), axis=0)
        score = tl.where(n > 0, score, 0.0)          # an empty document scores 0
    tl.store(OUT + b * n_docs + j, score)


def mark_candidates(cells: torch.Tensor, ivf: torch.Tensor, ivf_offsets: torch.Tensor, n_docs: int) -> torch.Tensor:
    """``[B, N]`` int8, 1 where a document is in one of the query's probed cells.

    ``cells [B, P]`` centroid ids (any integer dtype), ``ivf [E]`` document ids of every
    inverted list back to back, ``ivf_offsets [C + 1]`` int64 where each list starts."""
    nq, n_cells = cells.shape
    mask = torch.zeros((nq, n_docs), dtype=torch.int8, device=cells.device)
    if nq * n_cells and n_docs:
        plaid_mark_kernel[(nq, n_cells)](cells.contiguous(), ivf, ivf_offsets, mask, n_cells, n_docs,
                                         BLOCK=BLOCK_IVF, num_warps=4)
    return mask


def approx_scores(scores: torch.Tensor, codes: torch.Tensor, doc_offsets: torch.Tensor,
                  mask: torch.Tensor) -> torch.Tensor:
    """``[B, N]`` fp32: each marked document's centroid interaction, ``-inf`` elsewhere.

    ``scores [B, C, Lq]`` (fp16 / bf16 / fp32, contiguous) the queries' centroid scores,
    ``codes [T]`` the packed index's centroid ids, ``doc_offsets [N + 1]`` where each
    document's tokens start, ``mask [B, N]`` from :func:`mark_candidates`."""
    nq, n_centroids, lq = scores.shape
    n_docs = mask.shape[1]
    out = torch.empty((nq, n_docs), dtype=torch.float32, device=scores.device)
    if nq and n_docs:
        plaid_approx_batch_kernel[(n_docs, nq)](scores, codes, doc_offsets, mask, out, n_docs, lq,
                                                scores.stride(0), BLOCK_T=BLOCK_T,
                                                LQ_PAD=max(16, next_pow2(lq)), num_warps=1)
    return out
