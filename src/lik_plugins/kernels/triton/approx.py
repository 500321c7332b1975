"""PLAID's centroid-only candidate score (``lik_plugins.plaid_approx_score``) on the GPU.

One program per document: its codes, a tile of ``BLOCK_T`` tokens at a time, gather their
rows of the query's centroid scores (``[C, Lq]``, one contiguous row per centroid, so each
gather reads ``Lq`` consecutive floats), and keep each query token's running max; the
score is the sum over query tokens.  The ``[B, Ld, Lq]`` similarity tensor a gather-and-max
in torch builds is never formed.

The loop runs to the document's own length (padding is never read).  The running max is a
``[BLOCK_T, Lq]`` tile updated elementwise with the NaN-keeping max (one instruction), and
reduced over tokens once at the end; the reduction's hardware max drops NaN, so a NaN left in
the tile poisons the document's score beside it, as the specification's max does.  (A
per-tile reduction with a NaN test beside it cost more; the NaN-propagating max as a custom
reduction made the kernel issue-bound: docs/performance-notes.md, PLAID.)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .direct import launch
from .tuning import next_pow2

# 32 tokens a tile on one warp: the fastest of 32 / 64 / 128-token tiles on 1 / 2 / 4 warps
# for one query against 10k documents (docs/performance-notes.md, PLAID).
BLOCK_T = 32
NUM_WARPS = 1


@triton.jit
def centroid_rows_max(S, CODES, code_stride, n, lq, n_centroids, BLOCK_T: tl.constexpr, LQ_PAD: tl.constexpr,
                      CLAMP: tl.constexpr, KEEP_NAN: tl.constexpr, WIDE: tl.constexpr):
    """The running max over one document's ``n`` codes (``CODES``, ``code_stride`` apart) of
    their rows of the centroid scores ``S`` (``lq`` per row): a ``[BLOCK_T, LQ_PAD]`` fp32
    tile, reduced over tokens by the caller, and the query-token mask.  The tile stays 2-D so
    the update is one elementwise max instead of a cross-lane reduction per tile; ``KEEP_NAN``:
    the max that keeps NaN; ``CLAMP``: codes clamped into ``[0, n_centroids)``; ``WIDE``:
    64-bit row offsets."""
    o_q = tl.arange(0, LQ_PAD)
    m_q = o_q < lq
    acc = tl.full([BLOCK_T, LQ_PAD], float("-inf"), tl.float32)
    for t0 in range(0, n, BLOCK_T):
        o_t = t0 + tl.arange(0, BLOCK_T)
        valid = o_t < n
        code = tl.load(CODES + o_t * code_stride, mask=valid, other=0)
        code = code.to(tl.int64) if WIDE else code.to(tl.int32)
        if CLAMP:
            code = tl.minimum(tl.maximum(code, 0), n_centroids - 1)
        sim = tl.load(S + (code * lq)[:, None] + o_q[None, :], mask=valid[:, None] & m_q[None, :],
                      other=float("-inf")).to(tl.float32)                                 # [BT, LQ]
        if KEEP_NAN:
            acc = tl.maximum(acc, sim, propagate_nan=tl.PropagateNan.ALL)
        else:
            acc = tl.maximum(acc, sim)
    return acc, m_q


# ``lq`` is specialised: it is the row stride of the centroid scores, and only a known
# multiple of 16 lets each gathered row load as vectors (4 floats a load, not 1).  Query
# lengths fall in 3 classes (1, a multiple of 16, other): at most 3 binaries.
@triton.jit(do_not_specialize=["ld", "n_centroids", "s_cb", "s_ct"])
def plaid_approx_kernel(S, CODES, LENS, OUT, ld, lq, n_centroids, s_cb, s_ct,
                        BLOCK_T: tl.constexpr, LQ_PAD: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    n = tl.minimum(tl.load(LENS + b).to(tl.int32), ld)
    # an out-of-range code is clamped like the residual kernel's (the reference indexes it);
    # 32-bit offsets: the host checks C * Lq < 2**31
    acc, m_q = centroid_rows_max(S, CODES + b * s_cb, s_ct, n, lq, n_centroids, BLOCK_T, LQ_PAD,
                                 CLAMP=True, KEEP_NAN=True, WIDE=False)
    best = tl.max(acc, axis=0)           # drops NaN: a NaN score is flagged beside it
    total = tl.sum(tl.where(m_q, best, 0.0), axis=0)
    any_nan = tl.max(tl.max((acc != acc).to(tl.int32), axis=1), axis=0) > 0
    total = tl.where(any_nan, float("nan"), total)
    tl.store(OUT + b, tl.where(n > 0, total, 0.0))      # an empty document scores 0


def plaid_approx_score(scores: torch.Tensor, codes: torch.Tensor, doc_lengths: torch.Tensor) -> torch.Tensor:
    """``[B]`` fp32 from ``scores [C, Lq]`` fp32 contiguous (the query's centroid scores,
    one row per centroid), ``codes [B, Ld]`` int32/int64 and ``doc_lengths [B]``."""
    n, ld = codes.shape
    out = torch.empty((n,), dtype=torch.float32, device=codes.device)
    if n == 0:
        return out
    lq = scores.shape[1]
    if scores.numel() >= 2**31:
        raise ValueError(f"query_centroid_scores has {scores.numel()} elements; at most 2**31 - 1 are supported")
    # the static key fixes every non-tensor argument and dtype: a repeated candidate shape
    # skips featurising the arguments (the call is host-bound on the device machines)
    launch(plaid_approx_kernel, (n,),
           (scores, codes, doc_lengths, out, ld, lq, scores.shape[0], *codes.stride()),
           dict(BLOCK_T=BLOCK_T, LQ_PAD=max(16, next_pow2(lq)), num_warps=NUM_WARPS),
           static_key=("approx", n, ld, scores.shape, codes.stride(), codes.dtype, doc_lengths.dtype),
           caller_tensors=(scores, codes, doc_lengths))
    return out
