"""Fused smooth MaxSim (``sum_s tau * logsumexp_t(S[s, t] / tau)``), forward and backward.

Forward: one program owns ``BLOCK_M = QPB * ROWS`` query-token rows (``QPB`` queries of
``ROWS >= Lq`` rows) against one document and streams the document in ``BLOCK_N``-token
tiles, keeping an online log-sum-exp per row (running max ``m`` and sum ``l``, base 2) —
the similarity tensor never exists outside one ``[BLOCK_M, BLOCK_N]`` tile.  Epilogue:
``tau * lse`` per row, a segmented sum over each query's rows, and the per-row ``lse``
(natural log of ``sum_t exp(S / tau)``) saved for the backward.

Backward: the softmax weights ``P = exp(S / tau - lse)`` are recomputed tile by tile from
the saved ``lse`` (inherent to smooth max: every document token gets gradient).
* ``dD`` kernel: one program per (document, token tile) loops over the query blocks and
  writes ``dD[j, tile] = sum_q g[q, j] P^T Q`` once (no atomics);
* ``dQ`` kernel: one program per (query block, split of the documents) accumulates
  ``sum_j g[q, j] P D[j]`` in registers and adds it atomically into an fp32 buffer.

Layouts share the kernels through strides: in the cross product ``s_di == 0`` (every
query block sees document ``j``); for per-query candidates ``QPB == 1`` and document
``j`` of query ``i`` sits at ``i * s_di + j * s_dj``.

Under ``TRITON_INTERPRET=1`` (CI) bf16 tiles are upcast to fp32 before ``tl.dot``
(``UPCAST``): the interpreter multiplies raw bf16 bits otherwise.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import SMOOTH_FUSED_MAX_DIM as MAX_DIM
from ..device import sm_count
from .direct import launch
from .tuning import cdiv, interpreting, next_pow2

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _load_rows(Q, i_qb, n_q, lq, dim, s_qi, s_qs, s_qh,
               QPB: tl.constexpr, ROWS: tl.constexpr, D_PAD: tl.constexpr, UPCAST: tl.constexpr):
    """The query block ``[BLOCK_M, D_PAD]``, each row's query index and validity."""
    o_m = tl.arange(0, QPB * ROWS)
    o_k = tl.arange(0, D_PAD)
    q_idx = i_qb * QPB + o_m // ROWS
    t_idx = o_m % ROWS
    m_row = (q_idx < n_q) & (t_idx < lq)
    p_q = Q + q_idx.to(tl.int64)[:, None] * s_qi + t_idx[:, None] * s_qs + o_k[None, :] * s_qh
    b_q = tl.load(p_q, mask=m_row[:, None] & (o_k[None, :] < dim), other=0.0)
    if UPCAST:
        b_q = b_q.to(tl.float32)
    return b_q, q_idx, t_idx, m_row


@triton.jit
def _load_doc_tile(p_doc, n0, ld, dim, s_dt, s_dh,
                   BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, UPCAST: tl.constexpr):
    o_n = n0 + tl.arange(0, BLOCK_N)
    o_k = tl.arange(0, D_PAD)
    m_n = o_n < ld
    b_d = tl.load(p_doc + o_n[:, None] * s_dt + o_k[None, :] * s_dh,
                  mask=m_n[:, None] & (o_k[None, :] < dim), other=0.0)
    if UPCAST:
        b_d = b_d.to(tl.float32)
    return b_d, m_n


@triton.jit(do_not_specialize=["n_q", "n_j", "lq", "ld", "n_qblocks", "s_oi", "s_li", "s_lj"])
def _smooth_fwd_kernel(
    Q, D, OUT, LSE,
    n_q, n_j, lq, ld, dim, n_qblocks, scale2, tau,
    s_qi, s_qs, s_qh,
    s_di, s_dj, s_dt, s_dh,
    s_oi, s_oj, s_li, s_lj, s_lt,
    QPB: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    # query blocks vary fastest: consecutive programs read the same document (L2 reuse)
    i_j = pid // n_qblocks
    i_qb = pid % n_qblocks
    b_q, q_idx, t_idx, m_row = _load_rows(Q, i_qb, n_q, lq, dim, s_qi, s_qs, s_qh, QPB, ROWS, D_PAD, UPCAST)
    p_doc = D + i_qb.to(tl.int64) * s_di + i_j.to(tl.int64) * s_dj

    # online log-sum-exp in base 2: m = running max of S * scale2, l = sum exp2(S * scale2 - m)
    b_m = tl.full([QPB * ROWS], float("-inf"), tl.float32)
    b_l = tl.zeros([QPB * ROWS], tl.float32)
    for n0 in range(0, ld, BLOCK_N):
        b_d, m_n = _load_doc_tile(p_doc, n0, ld, dim, s_dt, s_dh, BLOCK_N, D_PAD, UPCAST)
        b_s = tl.dot(b_q, tl.trans(b_d), input_precision=PRECISION) * scale2   # [BM, BK] @ [BK, BN] -> [BM, BN]
        b_s = tl.where(m_n[None, :], b_s, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, axis=1))
        b_l = b_l * tl.exp2(b_m - b_m_new) + tl.sum(tl.exp2(b_s - b_m_new[:, None]), axis=1)
        b_m = b_m_new

    b_lse = (b_m + tl.log2(b_l)) * 0.6931471805599453                          # [BM] natural-log LSE of S / tau
    tl.store(LSE + q_idx.to(tl.int64) * s_li + i_j * s_lj + t_idx * s_lt, b_lse, mask=m_row)
    b_row = tl.where(m_row, b_lse * tau, 0.0)
    b_score = tl.sum(tl.reshape(b_row, [QPB, ROWS]), axis=1)                   # [QPB] segmented sum per query
    o_q = i_qb * QPB + tl.arange(0, QPB)
    tl.store(OUT + o_q.to(tl.int64) * s_oi + i_j * s_oj, b_score, mask=o_q < n_q)


@triton.jit
def _weights(b_q, b_d, m_n, b_lse, b_g, m_row, scale2, PRECISION: tl.constexpr):
    """``g * exp(S / tau - lse)`` for one tile, zero outside the valid rows/columns."""
    b_s = tl.dot(b_q, tl.trans(b_d), input_precision=PRECISION) * scale2       # [BM, BN]
    b_p = tl.exp2(b_s - b_lse[:, None] * 1.4426950408889634)
    return tl.where(m_row[:, None] & m_n[None, :], b_p * b_g[:, None], 0.0)


@triton.jit(do_not_specialize=["n_q", "n_j", "lq", "ld", "n_qblocks", "n_ntiles", "s_li", "s_lj", "s_gi"])
def _smooth_bwd_dd_kernel(
    Q, D, LSE, G, GD, n_q, n_j, lq, ld, dim, n_qblocks, n_ntiles, scale2,
    s_qi, s_qs, s_qh, s_di, s_dj, s_dt, s_dh, s_li, s_lj, s_lt, s_gi, s_gj, s_ei, s_ej, s_et, s_eh,
    CROSS: tl.constexpr, QPB: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
    D_PAD: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    i_n = pid % n_ntiles
    i_j = (pid // n_ntiles) % n_j
    i_own = pid // (n_ntiles * n_j)        # the owning query for candidates; 0 for the cross product
    n0 = i_n * BLOCK_N
    p_doc = D + i_own.to(tl.int64) * s_di + i_j.to(tl.int64) * s_dj
    b_d, m_n = _load_doc_tile(p_doc, n0, ld, dim, s_dt, s_dh, BLOCK_N, D_PAD, UPCAST)
    if CROSS:
        qb_lo = 0
        qb_hi = n_qblocks
    else:
        qb_lo = i_own
        qb_hi = i_own + 1

    b_acc = tl.zeros([BLOCK_N, D_PAD], tl.float32)
    for i_qb in range(qb_lo, qb_hi):
        b_q, q_idx, t_idx, m_row = _load_rows(Q, i_qb, n_q, lq, dim, s_qi, s_qs, s_qh, QPB, ROWS, D_PAD, UPCAST)
        b_lse = tl.load(LSE + q_idx.to(tl.int64) * s_li + i_j * s_lj + t_idx * s_lt, mask=m_row, other=0.0)
        b_g = tl.load(G + q_idx.to(tl.int64) * s_gi + i_j * s_gj, mask=q_idx < n_q, other=0.0).to(tl.float32)
        b_p = _weights(b_q, b_d, m_n, b_lse, b_g, m_row, scale2, PRECISION)
        b_acc += tl.dot(tl.trans(b_p.to(b_q.dtype)), b_q, input_precision=PRECISION)   # [BN, BM] @ [BM, BK]

    o_n = n0 + tl.arange(0, BLOCK_N)
    o_k = tl.arange(0, D_PAD)
    p_gd = GD + i_own.to(tl.int64) * s_ei + i_j.to(tl.int64) * s_ej + o_n[:, None] * s_et + o_k[None, :] * s_eh
    tl.store(p_gd, b_acc.to(GD.dtype.element_ty), mask=m_n[:, None] & (o_k[None, :] < dim))


@triton.jit(do_not_specialize=["n_q", "n_j", "lq", "ld", "n_qblocks", "n_split", "s_li", "s_lj", "s_gi"])
def _smooth_bwd_dq_kernel(
    Q, D, LSE, G, GQ, n_q, n_j, lq, ld, dim, n_qblocks, n_split, scale2,
    s_qi, s_qs, s_qh, s_di, s_dj, s_dt, s_dh, s_li, s_lj, s_lt, s_gi, s_gj, s_ei, s_es, s_eh,
    QPB: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    i_qb = pid % n_qblocks
    i_split = pid // n_qblocks
    b_q, q_idx, t_idx, m_row = _load_rows(Q, i_qb, n_q, lq, dim, s_qi, s_qs, s_qh, QPB, ROWS, D_PAD, UPCAST)
    b_acc = tl.zeros([QPB * ROWS, D_PAD], tl.float32)
    for i_j in range(i_split, n_j, n_split):
        b_lse = tl.load(LSE + q_idx.to(tl.int64) * s_li + i_j * s_lj + t_idx * s_lt, mask=m_row, other=0.0)
        b_g = tl.load(G + q_idx.to(tl.int64) * s_gi + i_j * s_gj, mask=q_idx < n_q, other=0.0).to(tl.float32)
        p_doc = D + i_qb.to(tl.int64) * s_di + tl.cast(i_j, tl.int64) * s_dj
        for n0 in range(0, ld, BLOCK_N):
            b_d, m_n = _load_doc_tile(p_doc, n0, ld, dim, s_dt, s_dh, BLOCK_N, D_PAD, UPCAST)
            b_p = _weights(b_q, b_d, m_n, b_lse, b_g, m_row, scale2, PRECISION)
            b_acc += tl.dot(b_p.to(b_d.dtype), b_d, input_precision=PRECISION)          # [BM, BN] @ [BN, BK]

    o_k = tl.arange(0, D_PAD)
    p_gq = GQ + q_idx.to(tl.int64)[:, None] * s_ei + t_idx[:, None] * s_es + o_k[None, :] * s_eh
    tl.atomic_add(p_gq, b_acc, mask=m_row[:, None] & (o_k[None, :] < dim))


# --------------------------------------------------------------------------- launchers
def _geometry(Q: torch.Tensor, D: torch.Tensor, cross: bool):
    nq, lq, dim = Q.shape
    if dim > MAX_DIM:
        raise ValueError(f"the fused smooth-max kernel takes d <= {MAX_DIM}, got {dim}")
    rows = max(16, next_pow2(lq))
    qpb = max(1, 128 // rows) if cross else 1
    qpb = min(qpb, next_pow2(nq))
    n_j, ld = (D.shape[0], D.shape[1]) if cross else (D.shape[1], D.shape[2])
    d_pad = max(16, next_pow2(dim))
    # D strides as [owner, j, t, h]: the cross product has no owner axis
    if cross:
        s_d = (0, D.stride(0), D.stride(1), D.stride(2))
    else:
        s_d = D.stride()
    return dict(nq=nq, lq=lq, dim=dim, rows=rows, qpb=qpb, n_j=n_j, ld=ld, d_pad=d_pad, s_d=s_d,
                n_qblocks=cdiv(nq, qpb))


def _meta(Q: torch.Tensor, g: dict) -> dict:
    upcast = interpreting() and Q.dtype == torch.bfloat16
    precision = "ieee" if Q.dtype == torch.float32 else "tf32"
    meta = dict(QPB=g["qpb"], ROWS=g["rows"], D_PAD=g["d_pad"], UPCAST=upcast, PRECISION=precision)
    if interpreting():
        meta["BLOCK_N"] = 64
    else:
        block_m = g["qpb"] * g["rows"]
        meta.update(BLOCK_N=64 if g["d_pad"] <= 128 else 32, num_warps=8 if block_m >= 128 else 4, num_stages=2)
    return meta


def smooth_forward(Q: torch.Tensor, D: torch.Tensor, tau: float, cross: bool):
    """``(scores [Nq, NJ] fp32, lse [Nq, NJ, Lq] fp32)``; launcher of the chunked path's signature."""
    g = _geometry(Q, D, cross)
    out = torch.empty((g["nq"], g["n_j"]), dtype=torch.float32, device=Q.device)
    lse = torch.empty((g["nq"], g["n_j"], g["lq"]), dtype=torch.float32, device=Q.device)
    if out.numel() == 0:
        return out, lse
    meta = _meta(Q, g)
    grid = (g["n_qblocks"] * g["n_j"],)
    launch(_smooth_fwd_kernel, grid, (
        Q, D, out, lse,
        g["nq"], g["n_j"], g["lq"], g["ld"], g["dim"], g["n_qblocks"], LOG2E / tau, tau,
        *Q.stride(), *g["s_d"], *out.stride(), *lse.stride(),
    ), meta)
    return out, lse


def smooth_backward(Q, D, lse, grad, tau: float, cross: bool, need_q: bool, need_d: bool):
    """``(dQ fp32 or None, dD in D.dtype or None)`` from the saved per-row ``lse``."""
    g = _geometry(Q, D, cross)
    meta = _meta(Q, g)
    grad = grad.to(torch.float32)
    scale2 = LOG2E / tau
    common = (g["nq"], g["n_j"], g["lq"], g["ld"], g["dim"], g["n_qblocks"])
    gq = gd = None
    if need_d:
        gd = torch.empty_like(D)
        gd_s = (0, *gd.stride()) if cross else gd.stride()
        n_ntiles = cdiv(g["ld"], meta["BLOCK_N"])
        n_own = 1 if cross else g["nq"]
        grid = (n_own * g["n_j"] * n_ntiles,)
        if grid[0] > 0:
            launch(_smooth_bwd_dd_kernel, grid, (
                Q, D, lse, grad, gd, *common, n_ntiles, scale2,
                *Q.stride(), *g["s_d"], *lse.stride(), *grad.stride(), *gd_s,
            ), {"CROSS": cross, **meta})
    if need_q:
        gq = torch.zeros(Q.shape, dtype=torch.float32, device=Q.device)
        # enough programs to fill the device; each adds its partial dQ once (atomically)
        target = 1 if interpreting() else 4 * sm_count(Q.device)
        n_split = max(1, min(g["n_j"], cdiv(target, g["n_qblocks"])))
        if interpreting() and g["n_j"] > 1:
            n_split = 2  # exercise the split (atomic) accumulation in CI
        grid = (g["n_qblocks"] * n_split,)
        if grid[0] > 0 and g["n_j"] > 0:
            launch(_smooth_bwd_dq_kernel, grid, (
                Q, D, lse, grad, gq, *common, n_split, scale2,
                *Q.stride(), *g["s_d"], *lse.stride(), *grad.stride(), *gq.stride(),
            ), meta)
    return gq, gd

