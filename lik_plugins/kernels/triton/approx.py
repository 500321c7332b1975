"""PLAID's centroid-only candidate score (``lik_plugins.plaid_approx_score``) on the GPU.

One program per document: its codes, a tile of ``BLOCK_T`` tokens at a time, gather their
rows of the query's centroid scores (``[C, Lq]``, one contiguous row per centroid, so each
gather reads ``Lq`` consecutive floats), and keep each query token's running max; the
score is the sum over query tokens.  The ``[B, Ld, Lq]`` similarity tensor a gather-and-max
in torch builds is never formed.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .direct import launch
from .forward import _max_nan
from .tuning import next_pow2

BLOCK_T = 64


@triton.jit(do_not_specialize=["ld", "lq", "n_centroids", "s_cb", "s_ct", "s_mb", "s_mt"])
def plaid_approx_kernel(S, CODES, DM, OUT, ld, lq, n_centroids, s_cb, s_ct, s_mb, s_mt,
                        BLOCK_T: tl.constexpr, LQ_PAD: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    o_q = tl.arange(0, LQ_PAD)
    m_q = o_q < lq
    best = tl.full([LQ_PAD], float("-inf"), tl.float32)
    n_valid = 0
    for t0 in range(0, ld, BLOCK_T):
        o_t = t0 + tl.arange(0, BLOCK_T)
        valid = tl.load(DM + b * s_mb + o_t * s_mt, mask=o_t < ld, other=0) != 0
        code = tl.load(CODES + b * s_cb + o_t * s_ct, mask=valid, other=0)
        # padding may hold any code (it is masked); a valid one is clamped like the residual kernel's
        code = tl.minimum(tl.maximum(code, 0), n_centroids - 1).to(tl.int64)
        sim = tl.load(S + code[:, None] * lq + o_q[None, :], mask=valid[:, None] & m_q[None, :],
                      other=float("-inf"))                                             # [BT, LQ]
        best = _max_nan(best, tl.reduce(sim, 0, _max_nan))
        n_valid += tl.sum(valid.to(tl.int32), axis=0)
    total = tl.sum(tl.where(m_q, best, 0.0), axis=0)
    tl.store(OUT + b, tl.where(n_valid > 0, total, 0.0))      # an empty document scores 0


def plaid_approx_score(scores_t: torch.Tensor, codes: torch.Tensor, d_mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` fp32 from ``scores_t [C, Lq]`` fp32 contiguous (the query's centroid scores,
    one row per centroid), ``codes [B, Ld]`` int32/int64 and ``d_mask [B, Ld]`` bool."""
    n, ld = codes.shape
    out = torch.empty((n,), dtype=torch.float32, device=codes.device)
    if n == 0:
        return out
    lq = scores_t.shape[1]
    dm = d_mask.view(torch.uint8)
    launch(plaid_approx_kernel, (n,),
           (scores_t, codes, dm, out, ld, lq, scores_t.shape[0], *codes.stride(), *dm.stride()),
           dict(BLOCK_T=BLOCK_T, LQ_PAD=max(16, next_pow2(lq))))
    return out
