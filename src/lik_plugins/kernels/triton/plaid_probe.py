"""PLAID's candidate generation and exact rerank for a batch of queries on the GPU
(``lik_plugins.plaid_search``).

Three kernels, no host synchronisation between them (the caller cuts the candidates between
the second and the third with torch ops):

* :func:`mark_candidates` -- one program per (query, probed IVF cell): it walks the cell's
  inverted list and sets ``mask[query, pid] = 1``.  A document reached through several
  cells is written several times with the same value, so the union needs no atomics and no
  deduplication pass (fast-plaid sorts and de-duplicates the concatenated lists per query).
* :func:`approx_scores` -- one program per (document, query): a candidate's centroid
  interaction ``sum_s max_t S[b, code_t, s]`` from its codes, read in place from the packed
  index; a non-candidate stores ``-inf`` and returns.  The running max stays a
  ``[tokens, query tokens]`` tile reduced once at the end, as in :mod:`.approx`.
* :func:`fast_plaid_scores` -- one program per (query, document) pair: the document's tokens
  decompressed from the packed index with fast-plaid's fp16 roundings and its norm's
  summation order, each token similarity rounded to fp16, its MaxSim (the rule is written out
  in ``lik_plugins.plaid_search``'s docstring; :func:`_torch_cuda_row_sum` the norm's order).

``mask`` and the scores are dense ``[B, N]`` over the whole collection: the caller sizes
``B`` so that they stay within its memory budget, and a top-k over each row replaces the
variable-length candidate lists (whose sizes only the host could learn).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .approx import centroid_rows_max
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
        acc, m_q = centroid_rows_max(S + b * s_sb, CODES + start, 1, n, lq, 0, BLOCK_T, LQ_PAD,
                                     CLAMP=False, KEEP_NAN=False, WIDE=True)
        best = tl.max(acc, axis=0)                                                             # [LQ]
        score = tl.sum(tl.where(m_q, best, 0.0), axis=0)
        score = tl.where(n > 0, score, 0.0)          # an empty document scores 0
    tl.store(OUT + b * n_docs + j, score)


@triton.jit
def _sum_left_to_right4(x, SHAPE0: tl.constexpr, SHAPE1: tl.constexpr):
    """``((x0 + x1) + x2) + x3`` over the last axis of ``x [SHAPE0, SHAPE1, 4]``."""
    even, odd = tl.split(tl.reshape(x, [SHAPE0, SHAPE1, 2, 2]))
    x0, x2 = tl.split(even)
    x1, x3 = tl.split(odd)
    return ((x0 + x1) + x2) + x3


@triton.jit
def _torch_cuda_row_sum(sq, BLOCK_T: tl.constexpr, D_PAD: tl.constexpr, LANES: tl.constexpr,
                        VECTORIZED: tl.constexpr):
    """Each row of ``sq [BLOCK_T, D_PAD]`` (fp32, zeros past the embedding) summed in the order
    of PyTorch's CUDA reduction of a contiguous row (``Reduce.cuh``, the order fast-plaid's
    ``norm`` runs in): ``LANES`` threads each sum their elements left to right in up to four
    accumulators, ``((a0 + a1) + a2) + a3``, then a shuffle tree with offsets ``LANES / 2, ...,
    1``.  Rows of 128 or more elements are read as 4-vectors (``VECTORIZED``: thread ``t`` holds
    elements ``4t .. 4t + 3``, then ``4(t + 32) ..``), shorter ones element by element (thread
    ``t`` holds ``t, t + LANES, ..``).  Exact order for rows of up to 256 elements; a sum of two
    is the same in either order, so pairs need no care."""
    if VECTORIZED:
        CHUNKS: tl.constexpr = D_PAD // (4 * LANES)
        x = tl.permute(tl.reshape(sq, [BLOCK_T, CHUNKS, LANES, 4]), (0, 2, 3, 1))   # [BT, LANES, 4, CHUNKS]
        x = tl.sum(x, axis=3)                         # one or two chunks: order-free
        lanes = _sum_left_to_right4(x, BLOCK_T, LANES)
    else:
        PER_LANE: tl.constexpr = D_PAD // LANES
        x = tl.permute(tl.reshape(sq, [BLOCK_T, PER_LANE, LANES]), (0, 2, 1))           # [BT, LANES, PER_LANE]
        if PER_LANE == 4:
            lanes = _sum_left_to_right4(x, BLOCK_T, LANES)
        else:
            lanes = tl.sum(x, axis=2)                 # one or two elements: order-free
    # the shuffle tree: lane t adds lane t + offset, offsets halving
    if LANES >= 32:
        lanes = tl.sum(tl.reshape(lanes, [BLOCK_T, 2, 16]), axis=1)
    if LANES >= 16:
        lanes = tl.sum(tl.reshape(lanes, [BLOCK_T, 2, 8]), axis=1)
    if LANES >= 8:
        lanes = tl.sum(tl.reshape(lanes, [BLOCK_T, 2, 4]), axis=1)
    if LANES >= 4:
        lanes = tl.sum(tl.reshape(lanes, [BLOCK_T, 2, 2]), axis=1)
    return tl.sum(lanes, axis=1)


@triton.jit
def _fast_plaid_tokens(RES, CODES, CENT, W, start, o_t, m_t, o_k, m_k, dim, s_res,
                       NBITS: tl.constexpr, BLOCK_T: tl.constexpr, D_PAD: tl.constexpr,
                       LANES: tl.constexpr, VECTORIZED: tl.constexpr):
    """Tokens ``start + o_t`` of the packed index as fast-plaid reconstructs them, ``[BLOCK_T,
    D_PAD]`` fp16 (zeros outside ``m_t`` / ``m_k``): ``x = fp16(centroid + weight)``, its norm
    ``fp16(sqrt(sum x^2))`` summed in PyTorch's order, ``fp16(x / norm)`` with IEEE division.
    Field ``f`` of a residual byte is dimension ``8 / NBITS * byte + f``, its bits ``f * NBITS``
    from the top; ``W`` holds the weights in stream order (indexed by the field as stored)."""
    PER_BYTE: tl.constexpr = 8 // NBITS
    m = m_t[:, None] & m_k[None, :]
    code = tl.load(CODES + start + o_t, mask=m_t, other=0).to(tl.int64)
    centroid = tl.load(CENT + code[:, None] * dim + o_k[None, :], mask=m, other=0.0).to(tl.float32)
    byte = tl.load(RES + (start + o_t)[:, None] * s_res + (o_k // PER_BYTE)[None, :], mask=m, other=0).to(tl.int32)
    field = (byte >> (8 - NBITS - (o_k % PER_BYTE) * NBITS)[None, :]) & ((1 << NBITS) - 1)
    if NBITS == 1:
        weight = tl.where(field != 0, tl.load(W + 1), tl.load(W))
    elif NBITS == 2:
        # two selects on the field's bits: a gather from the table is an L1 request per element
        weight = tl.where((field & 2) != 0, tl.where((field & 1) != 0, tl.load(W + 3), tl.load(W + 2)),
                          tl.where((field & 1) != 0, tl.load(W + 1), tl.load(W)))
    else:
        weight = tl.load(W + field, mask=m, other=0.0)
    # zero past the embedding and the document: the selects above give those a weight too
    x = tl.where(m, (centroid + weight).to(tl.float16).to(tl.float32), 0.0)
    norm = tl.sqrt_rn(_torch_cuda_row_sum(x * x, BLOCK_T, D_PAD, LANES, VECTORIZED))
    # fast-plaid clamps at 1e-12, which is 0 in fp16; only a zero token differs (0 here, NaN there)
    norm = tl.maximum(norm.to(tl.float16).to(tl.float32), 1e-12)
    return tl.div_rn(x, norm[:, None]).to(tl.float16)


@triton.jit(do_not_specialize=["lq"])
def plaid_rerank_kernel(Q, RES, CODES, CENT, W, DOC_OFF, PAIR_Q, PAIR_D, OUT, lq, dim, s_res,
                        NBITS: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_T: tl.constexpr, D_PAD: tl.constexpr,
                        LANES: tl.constexpr, VECTORIZED: tl.constexpr):
    p = tl.program_id(0).to(tl.int64)
    b = tl.load(PAIR_Q + p).to(tl.int64)
    j = tl.load(PAIR_D + p).to(tl.int64)
    start = tl.load(DOC_OFF + j).to(tl.int64)
    n = (tl.load(DOC_OFF + j + 1).to(tl.int64) - start).to(tl.int32)
    o_k = tl.arange(0, D_PAD)
    m_k = o_k < dim
    score = 0.0
    # query blocks outside, so a long query re-reads the document instead of holding more rows
    for q0 in range(0, lq, BLOCK_Q):
        o_q = q0 + tl.arange(0, BLOCK_Q)
        m_q = o_q < lq
        q = tl.load(Q + (b * lq + o_q)[:, None] * dim + o_k[None, :], mask=m_q[:, None] & m_k[None, :], other=0.0)
        best = tl.full([BLOCK_Q], float("-inf"), tl.float32)
        for t0 in range(0, n, BLOCK_T):
            o_t = t0 + tl.arange(0, BLOCK_T)
            m_t = o_t < n
            tokens = _fast_plaid_tokens(RES, CODES, CENT, W, start, o_t, m_t, o_k, m_k, dim, s_res,
                                        NBITS, BLOCK_T, D_PAD, LANES, VECTORIZED)
            # fp32 accumulation rounded to fp16, as an fp16 matmul stores it
            sim = tl.dot(q, tl.trans(tokens)).to(tl.float16).to(tl.float32)                  # [BQ, BT]
            best = tl.maximum(best, tl.max(tl.where(m_t[None, :], sim, float("-inf")), axis=1))
        # fp16 maxima summed in fp32: exact in any order while the sums stay below 2**24 of the
        # smallest maximum's last bit (``plaid_search`` states the bound)
        score += tl.sum(tl.where(m_q, best, 0.0), axis=0)
    score = tl.where(n > 0, score, 0.0)               # an empty document scores 0
    tl.store(OUT + p, score)


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
        lq_pad = max(16, next_pow2(lq))
        # the running max is a [tokens, query tokens] tile on one warp: fewer tokens for long queries
        plaid_approx_batch_kernel[(n_docs, nq)](scores, codes, doc_offsets, mask, out, n_docs, lq,
                                                scores.stride(0), BLOCK_T=max(4, min(BLOCK_T, 1024 // lq_pad)),
                                                LQ_PAD=lq_pad, num_warps=1)
    return out


def _norm_order(dim: int) -> tuple[int, bool]:
    """``(lanes, vectorized)`` of PyTorch's CUDA reduction of a contiguous fp16 row of ``dim``
    elements (``Reduce.cuh``'s ``setReduceConfig``: rows of 128 or more are read as 4-vectors;
    a warp's lanes cover the row, fewer for short rows)."""
    if dim >= 128:
        return 32, True
    return min(32, 1 << (dim.bit_length() - 1)), False


def fast_plaid_scores(Q: torch.Tensor, pair_q: torch.Tensor, pair_d: torch.Tensor, codes: torch.Tensor,
                      residuals: torch.Tensor, centroids: torch.Tensor, weights: torch.Tensor,
                      doc_offsets: torch.Tensor, nbits: int) -> torch.Tensor:
    """``[P]`` fp32: fast-plaid's exact score of each pair ``(pair_q[p], pair_d[p])``.

    ``Q [Nq, Lq, d]`` fp16 queries as given (contiguous); ``codes [T]`` int32, ``residuals
    [T, d * nbits / 8]`` uint8, ``doc_offsets [N + 1]`` the packed index; ``centroids [C, d]``
    fp16; ``weights [2**nbits]`` fp32 bucket weights in stream order
    (``operands.stream_order_weights``).  The roundings are fast-plaid's bit for bit for
    ``d`` a multiple of 4 up to 256 (the norm's summation order); other sizes sum the norm in
    the kernel's own order."""
    nq, lq, dim = Q.shape
    out = torch.empty(pair_q.shape[0], dtype=torch.float32, device=Q.device)
    if out.numel() == 0:
        return out
    d_pad = max(16, next_pow2(dim))
    lanes, vectorized = _norm_order(dim)
    block_q = min(128, max(16, next_pow2(lq)))
    plaid_rerank_kernel[(out.numel(),)](
        Q, residuals, codes, centroids, weights, doc_offsets, pair_q, pair_d, out, lq, dim, residuals.stride(0),
        NBITS=nbits, BLOCK_Q=block_q, BLOCK_T=32, D_PAD=d_pad, LANES=lanes, VECTORIZED=vectorized,
        num_warps=4 if block_q <= 64 else 8)
    return out
