"""MaxSim backward through the saved argmax — never the forward's matrix product again.

* :func:`maxsim_bwd_gather_kernel` — one program per (query, block of its tokens): walks
  the query's documents, gathers each row's winning document token for ``grad_Q``
  (registers, fp32, one write in the input dtype) and, for the ``unified`` strategy,
  scatters ``g * q`` into an fp32 ``grad_D`` buffer with atomics.
* :func:`maxsim_bwd_doc_kernel` — ``lowmem``: destination-owned ``grad_D`` (and, in the
  same launch, the gather for ``grad_Q`` when it needs no split).  One program
  per (document, tile of its tokens) collects every query row whose winner lies in its
  tile as a one-hot ``[BLOCK_T, BLOCK_R]`` x ``[BLOCK_R, d]`` product, so no atomics, no
  fp32 buffer, bitwise deterministic, written once in the input dtype.  With ``COMPACT``
  (cross product) a program first lists the rows that picked a token of its tile (two
  scans of the document's winners, the list in global memory), so the one-hot product
  walks ``Nq*Lq*BLOCK_T/Ld`` rows instead of all ``Nq*Lq``.  (Compacting in registers,
  a [hits x rows] comparison per round, was slower than the dense walk, and sorting each
  document's rows first -- ``tl.sort`` or a two-launch counting sort -- cost more than it
  saved: docs/performance-notes.md, Backward.)
* :func:`maxsim_bwd_winners_kernel` — ``lowmem`` for candidates and pairs: each document
  is owned by one query, so grad_D is zero-filled (memset speed) and only its winning rows
  are written, duplicates summed by a tiny equality-matrix MMA (one writer per row): the
  one-hot tile product above costs more than the zero-fill does here.
* :func:`project_rows_kernel` — the normalisation Jacobian for an fp32 buffer.

With ``NORMALIZE`` the kernels work on ``dL/dx_hat`` and apply
``dL/dx = (g - <g, x_hat> x_hat) / ||x||`` in their epilogue.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _project(b_g, b_x, b_r):
    """``(g - <g, x_hat> x_hat) * r`` row-wise, ``r = 1/||x||``: [R, DP], [R, DP], [R]."""
    b_xh = b_x * b_r[:, None]
    b_radial = tl.sum(b_g * b_xh, axis=1)
    return (b_g - b_radial[:, None] * b_xh) * b_r[:, None]


@triton.jit
def _gather_rows(pid, Q, RQ, lq, dim, s_q, NORMALIZE: tl.constexpr, BLOCK_S: tl.constexpr, D_PAD: tl.constexpr):
    """Program ``pid``'s query and token block: (query, tokens, token mask, dim mask,
    fp32 rows, q_hat rows, 1/||q||) -- the rows are loaded once for the whole walk."""
    s_qi, s_qs, s_qh = s_q
    n_sb = tl.cdiv(lq, BLOCK_S)
    i_q = (pid // n_sb).to(tl.int64)
    o_s = (pid % n_sb) * BLOCK_S + tl.arange(0, BLOCK_S)
    o_h = tl.arange(0, D_PAD)
    m_s = o_s < lq
    m_h = o_h < dim
    b_q = tl.load(Q + i_q * s_qi + o_s[:, None] * s_qs + o_h[None, :] * s_qh,
                  mask=m_s[:, None] & m_h[None, :], other=0.0).to(tl.float32)           # [BS, DP]
    b_rq = tl.load(RQ + i_q * lq + o_s, mask=m_s & NORMALIZE, other=1.0)
    b_qs = b_q * b_rq[:, None] if NORMALIZE else b_q                                   # q_hat
    return i_q, o_s, m_s, m_h, b_q, b_qs, b_rq


@triton.jit
def _gather_walk(
    b_acc, i_q, o_s, m_s, m_h, b_qs, j_lo, j_hi, G, D, RD, ARG, GD32, lq, dim, s_g, s_d, s_rd, s_gd, s_ai, gd_j0,
    NEED_Q: tl.constexpr, SCATTER_D: tl.constexpr, NORMALIZE: tl.constexpr, BLOCK_J: tl.constexpr, D_PAD: tl.constexpr,
    CU_D=None, PAIR_D=None, VARLEN: tl.constexpr = False, PAIRS: tl.constexpr = False,
):
    # BLOCK_J documents per step, unrolled: BLOCK_J * BLOCK_S independent row gathers in
    # flight instead of one dependent (argmax -> row) load chain per document.  Each
    # document is its own [BLOCK_S, D_PAD] tile: one 3-D [BLOCK_J, BLOCK_S, D_PAD] tile
    # summed over its first axis is slower at BLOCK_J >= 4 (the sum crosses warps).  grad_Q
    # accumulates in ``b_acc``; with SCATTER_D, ``g * q`` goes to GD32 (document ``j`` at
    # ``j - gd_j0``) with relaxed atomics.  Strides come as tuples: s_g (grad: query,
    # document), s_d (documents: query, document, token, dim), s_rd (inverse norms), s_gd
    # (GD32: query, document).
    # VARLEN (packed documents, zero document strides): document ``j`` starts at packed row
    # CU_D[j] -- or CU_D[PAIR_D[i_q]] for PAIRS, where ``i_q`` is a pair with one document --
    # and its inverse norms and fp32 gradient rows are packed alike.
    s_gi, s_gj = s_g
    s_di, s_dj, s_dt, s_dh = s_d
    s_rdi, s_rdj = s_rd
    s_gdi, s_gdj = s_gd
    o_h = tl.arange(0, D_PAD)
    for j0 in range(j_lo, j_hi, BLOCK_J):
        for jj in tl.static_range(BLOCK_J):
            i_j = j0 + jj
            m_j = i_j < j_hi
            b_g = tl.load(G + i_q * s_gi + i_j * s_gj, mask=m_j, other=0.0)
            b_a = tl.load(ARG + i_q * s_ai + i_j * lq + o_s, mask=m_j & m_s, other=-1).to(tl.int32)   # [BS]
            m_a = b_a >= 0
            m_ah = m_a[:, None] & m_h[None, :]
            p_doc = i_q * s_di + i_j.to(tl.int64) * s_dj
            p_rd = RD + i_q * s_rdi + i_j.to(tl.int64) * s_rdj
            p_gd = GD32 + i_q * s_gdi + (i_j - gd_j0).to(tl.int64) * s_gdj
            if VARLEN:
                if PAIRS:
                    doc = tl.load(PAIR_D + i_q)
                else:
                    doc = i_j
                d_first = tl.load(CU_D + doc, mask=m_j, other=0).to(tl.int64)
                p_doc += d_first * s_dt
                p_rd += d_first
                p_gd += d_first * dim
            if NEED_Q:
                p_d = D + p_doc + b_a[:, None] * s_dt + o_h[None, :] * s_dh
                b_d = tl.load(p_d, mask=m_ah, other=0.0).to(tl.float32)                  # [BS, DP]
                b_w = tl.where(m_a, b_g, 0.0)                                           # [BS]
                if NORMALIZE:
                    b_w = b_w * tl.load(p_rd + b_a, mask=m_a, other=0.0)
                b_acc += b_d * b_w[:, None]
            if SCATTER_D:
                p_gd = p_gd + b_a[:, None] * dim + o_h[None, :]
                tl.atomic_add(p_gd, b_qs * b_g, mask=m_ah, sem="relaxed")             # fire-and-forget red
    return b_acc


@triton.jit
def _store_grad_q(GQ, b_acc, b_q, b_rq, row0, o_s, m_s, m_h, dim, NORMALIZE: tl.constexpr):
    """Write grad_Q rows ``row0 + o_s`` (contiguous ``[.., dim]``) in GQ's dtype."""
    if NORMALIZE:
        b_acc = _project(b_acc, b_q, b_rq)
    o_h = tl.arange(0, b_acc.shape[1])
    p_gq = GQ + (row0 + o_s[:, None]) * dim + o_h[None, :]
    tl.store(p_gq, b_acc.to(GQ.dtype.element_ty), mask=m_s[:, None] & m_h[None, :])


@triton.jit
def _gather_body(
    pid, G, Q, D, RQ, RD, ARG, GQ, GD32, n_q, n_j, lq, dim, s_g, s_q, s_d, s_rd, s_gd, s_ai, n_split, j_per_split,
    NEED_Q: tl.constexpr, SCATTER_D: tl.constexpr, NORMALIZE: tl.constexpr, PARTIAL: tl.constexpr,
    BLOCK_J: tl.constexpr, BLOCK_S: tl.constexpr, D_PAD: tl.constexpr,
):
    # Few queries (rerank) split their documents over ``n_split`` programs; fp32 partials
    # (PARTIAL) are then summed on the host in a fixed order, so grad_Q stays deterministic.
    i_split = pid % n_split
    i_q, o_s, m_s, m_h, b_q, b_qs, b_rq = _gather_rows(pid // n_split, Q, RQ, lq, dim, s_q, NORMALIZE, BLOCK_S, D_PAD)
    j_lo = i_split * j_per_split
    b_acc = _gather_walk(
        tl.zeros([BLOCK_S, D_PAD], tl.float32), i_q, o_s, m_s, m_h, b_qs, j_lo, tl.minimum(j_lo + j_per_split, n_j),
        G, D, RD, ARG, GD32, lq, dim, s_g, s_d, s_rd, s_gd, s_ai, 0, NEED_Q, SCATTER_D, NORMALIZE, BLOCK_J, D_PAD,
    )
    if NEED_Q:
        if PARTIAL:
            o_h = tl.arange(0, D_PAD)
            p_gq = GQ + ((i_split * n_q + i_q) * lq + o_s[:, None]) * dim + o_h[None, :]
            tl.store(p_gq, b_acc, mask=m_s[:, None] & m_h[None, :])
        else:
            _store_grad_q(GQ, b_acc, b_q, b_rq, i_q * lq, o_s, m_s, m_h, dim, NORMALIZE)


@triton.jit
def _grad_d_program(
    grad_d_tile: tl.constexpr, tile_args, G, Q, D, RQ, RD, ARG, GQ, GD, n_q, n_j, lq, dim, s_g, s_q, s_d, s_rd,
    s_ai, n_gather_programs, WITH_GATHER: tl.constexpr, NORMALIZE: tl.constexpr, BLOCK_J: tl.constexpr,
    BLOCK_S: tl.constexpr, D_PAD: tl.constexpr,
):
    """A program of a grad_D launch: ``grad_d_tile(tile, *tile_args)`` for the tile it owns.
    With ``WITH_GATHER`` the first ``n_gather_programs`` programs compute grad_Q instead --
    the gather, unsplit, scattering nothing -- and the tiles are numbered from 0 after them.
    Callers write ``tile_args`` in the call: a tuple assigned to a name first would turn its
    constexprs (the tile's block sizes and flags) into tensors."""
    pid = tl.program_id(0)
    if WITH_GATHER:
        if pid < n_gather_programs:
            _gather_body(pid, G, Q, D, RQ, RD, ARG, GQ, GD, n_q, n_j, lq, dim, s_g, s_q, s_d, s_rd, (0, 0), s_ai, 1,
                         n_j, True, False, NORMALIZE, False, BLOCK_J, BLOCK_S, D_PAD)
        else:
            grad_d_tile(pid - n_gather_programs, *tile_args)
    else:
        grad_d_tile(pid, *tile_args)


@triton.jit
def _doc_winners(ARG, o_rr, r_hi, i_j, n_j, lq):
    """Winning token in document ``i_j`` of the flat query rows ``o_rr`` (-1: none)."""
    return tl.load(ARG + ((o_rr // lq) * n_j + i_j) * lq + o_rr % lq, mask=o_rr < r_hi, other=-1).to(tl.int32)


@triton.jit
def _one_hot_round(b_acc, b_a, i_q, i_s, m_r, o_t, o_h, m_h, i_j, G, Q, RQ, lq, s_g, s_q,
                   NORMALIZE: tl.constexpr, F32_DOT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                   GUARD_ROWS: tl.constexpr):
    """One round of a grad_D tile's one-hot product: query rows ``(i_q, i_s)`` (valid where
    ``m_r``) whose winning token ``b_a`` (-1: none) is among ``o_t`` add ``g * q`` to that
    token's row of ``b_acc``."""
    s_gi, s_gj = s_g
    s_qi, s_qs, s_qh = s_q
    b_g = tl.load(G + i_q * s_gi + i_j * s_gj, mask=m_r, other=0.0)
    if NORMALIZE:
        b_g = b_g * tl.load(RQ + i_q * lq + i_s, mask=m_r, other=0.0)
    b_q = tl.load(Q + i_q[:, None] * s_qi + i_s[:, None] * s_qs + o_h[None, :] * s_qh,
                  mask=m_r[:, None] & m_h[None, :], other=0.0)                        # [BR, DP]
    if GUARD_ROWS:
        # rows without a winner (masked query tokens): 0 * NaN must not leak.  Only
        # with a query mask: the select sends the rows through registers and back to
        # shared memory, a large share of the kernel's time
        b_q = tl.where((b_a >= 0)[:, None], b_q, 0.0)
    if F32_DOT or UPCAST:
        b_q = b_q.to(tl.float32)
    b_w = tl.where(b_a[None, :] == o_t[:, None], b_g[None, :], 0.0)                      # [BT, BR] one-hot * g
    # bf16 operands, as the host's own bf16 backward rounds its incoming gradient
    if not (F32_DOT or UPCAST):
        b_w = b_w.to(b_q.dtype)
    return tl.dot(b_w, b_q, b_acc, input_precision=PRECISION)                          # [BT, BR] @ [BR, DP]


@triton.jit
def _doc_body(
    pid, G, Q, D, RQ, RD, ARG, GD, n_q, n_j, lq, ld, dim, s_g, s_q, s_d, s_rd,
    CROSS: tl.constexpr, NORMALIZE: tl.constexpr, F32_DOT: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, D_PAD: tl.constexpr, GUARD_ROWS: tl.constexpr,
):
    n_tb = tl.cdiv(ld, BLOCK_T)
    i_doc = (pid // n_tb).to(tl.int64)
    o_t = (pid % n_tb) * BLOCK_T + tl.arange(0, BLOCK_T)
    o_h = tl.arange(0, D_PAD)
    o_r = tl.arange(0, BLOCK_R)
    m_t = o_t < ld
    m_h = o_h < dim
    if CROSS:
        # every query row may have picked a token of document j
        i_own = i_doc * 0
        i_j = i_doc
        r_lo = i_doc * 0
        r_hi = n_q * lq
    else:
        # candidate j of query i is only seen by query i's rows
        i_own = i_doc // n_j
        i_j = i_doc % n_j
        r_lo = i_own * lq
        r_hi = r_lo + lq

    # The argmax is int16, too narrow for the pipeliner's asynchronous copies, so a plain
    # load of it would stall every step: it is fetched one step ahead by hand (a register
    # load only blocks at first use).  The query rows and weights are pipelined by Triton;
    # their addresses must not depend on the argmax for that (docs/performance-notes.md).
    b_a_next = _doc_winners(ARG, r_lo + o_r, r_hi, i_j, n_j, lq)
    b_acc = tl.zeros([BLOCK_T, D_PAD], tl.float32)
    for r0 in range(r_lo, r_hi, BLOCK_R):
        b_a = b_a_next
        b_a_next = _doc_winners(ARG, r0 + BLOCK_R + o_r, r_hi, i_j, n_j, lq)
        o_rr = r0 + o_r
        b_acc = _one_hot_round(b_acc, b_a, o_rr // lq, o_rr % lq, o_rr < r_hi, o_t, o_h, m_h, i_j, G, Q, RQ, lq,
                               s_g, s_q, NORMALIZE, F32_DOT, PRECISION, UPCAST, GUARD_ROWS)

    _store_grad_d(b_acc, D, RD, GD, i_own, i_j, i_doc, o_t, m_t, m_h, ld, dim, s_d, s_rd, NORMALIZE)


@triton.jit
def _store_grad_d(b_acc, D, RD, GD, i_own, i_j, i_doc, o_t, m_t, m_h, ld, dim, s_d, s_rd, NORMALIZE: tl.constexpr):
    """Write the fp32 ``[BLOCK_T, D_PAD]`` grad_D tile of document ``i_doc`` (tokens
    ``o_t``), through the normalisation Jacobian when ``NORMALIZE``."""
    s_di, s_dj, s_dt, s_dh = s_d
    s_rdi, s_rdj = s_rd
    o_h = tl.arange(0, b_acc.shape[1])
    p_d = D + i_own * s_di + i_j * s_dj
    if NORMALIZE:
        b_d = tl.load(p_d + o_t[:, None] * s_dt + o_h[None, :] * s_dh,
                      mask=m_t[:, None] & m_h[None, :], other=0.0).to(tl.float32)
        b_rd = tl.load(RD + i_own * s_rdi + i_j * s_rdj + o_t, mask=m_t, other=0.0)
        b_acc = _project(b_acc, b_d, b_rd)
    p_gd = GD + i_doc * ld * dim + o_t[:, None] * dim + o_h[None, :]
    tl.store(p_gd, b_acc.to(GD.dtype.element_ty), mask=m_t[:, None] & m_h[None, :])


@triton.jit
def _compact_doc_body(
    pid, G, Q, D, RQ, RD, ARG, ROWS, GD, n_q, n_j, lq, ld, dim, s_g, s_q, s_d, s_rd,
    NORMALIZE: tl.constexpr, F32_DOT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, D_PAD: tl.constexpr, SCAN: tl.constexpr,
):
    # The cross product's grad_D tile (document j, tokens t0..t1) from only the query rows
    # whose winner lies in it.  The program lists them itself: one scan of the document's
    # winners counts the rows that picked an earlier token (``base``), a second writes the
    # hitting row ids, in row order, to ROWS[j, base:] -- a stretch no other program
    # writes, since every row has one winner -- and the one-hot product then walks that
    # list: Nq*Lq*BLOCK_T/Ld rows instead of all Nq*Lq.  Row order keeps the sums the same
    # on every run.
    n_tb = tl.cdiv(ld, BLOCK_T)
    i_j = (pid // n_tb).to(tl.int64)
    t0 = (pid % n_tb) * BLOCK_T
    t1 = tl.minimum(t0 + BLOCK_T, ld)
    o_t = t0 + tl.arange(0, BLOCK_T)
    o_h = tl.arange(0, D_PAD)
    o_r = tl.arange(0, BLOCK_R)
    o_c = tl.arange(0, SCAN)
    m_t = o_t < ld
    m_h = o_h < dim
    n_rows = n_q * lq
    base = 0
    for c0 in range(0, n_rows, SCAN):
        b_w = _doc_winners(ARG, c0 + o_c, n_rows, i_j, n_j, lq)      # -1: no winner or padding
        base += tl.sum(((b_w >= 0) & (b_w < t0)).to(tl.int32), axis=0)
    p_rows = ROWS + i_j * n_rows + base
    n_hits = 0
    for c0 in range(0, n_rows, SCAN):
        b_w = _doc_winners(ARG, c0 + o_c, n_rows, i_j, n_j, lq)
        hit = (b_w >= t0) & (b_w < t1)
        b_slot = n_hits + tl.cumsum(hit.to(tl.int32), axis=0) - 1
        tl.store(p_rows + b_slot, (c0 + o_c).to(tl.int16), mask=hit)
        n_hits += tl.sum(hit.to(tl.int32), axis=0)
    tl.debug_barrier()   # the list, written by every thread of the program, is read by all
    b_acc = tl.zeros([BLOCK_T, D_PAD], tl.float32)
    # 16-bit row ids are too narrow for the pipeliner's asynchronous copies: fetched one
    # step ahead by hand, as the dense kernel does with the argmax (docs/performance-notes.md)
    b_r_next = tl.load(p_rows + o_r, mask=o_r < n_hits, other=0).to(tl.int32)
    for k0 in range(0, n_hits, BLOCK_R):
        b_r = b_r_next
        o_k = k0 + o_r
        b_r_next = tl.load(p_rows + o_k + BLOCK_R, mask=o_k + BLOCK_R < n_hits, other=0).to(tl.int32)
        m_k = o_k < n_hits
        # past the list's end: no winner (-1), like the dense walk's padding
        b_a = tl.where(m_k, _doc_winners(ARG, b_r, n_rows, i_j, n_j, lq), -1)
        # a listed row always has a winner: nothing to guard
        b_acc = _one_hot_round(b_acc, b_a, b_r // lq, b_r % lq, m_k, o_t, o_h, m_h, i_j, G, Q, RQ, lq,
                               s_g, s_q, NORMALIZE, F32_DOT, PRECISION, UPCAST, False)
    _store_grad_d(b_acc, D, RD, GD, i_j * 0, i_j, i_j, o_t, m_t, m_h, ld, dim, s_d, s_rd, NORMALIZE)


@triton.jit(do_not_specialize=["n_q", "n_j", "lq", "ld", "s_gi", "s_rdi", "s_rdj", "s_ai", "n_split", "j_per_split"])
def maxsim_bwd_gather_kernel(
    G, Q, D, RQ, RD, ARG, GQ, GD32, n_q, n_j, lq, ld, dim,
    s_gi, s_gj, s_qi, s_qs, s_qh, s_di, s_dj, s_dt, s_dh, s_rdi, s_rdj, s_gdi, s_gdj, s_ai,
    n_split, j_per_split,
    NEED_Q: tl.constexpr, SCATTER_D: tl.constexpr, NORMALIZE: tl.constexpr, PARTIAL: tl.constexpr,
    BLOCK_J: tl.constexpr, BLOCK_S: tl.constexpr, D_PAD: tl.constexpr,
):
    """grad_Q gathered from the winners and, with ``SCATTER_D``, ``g * q`` scattered into the
    fp32 ``GD32`` (the ``unified`` strategy); ``PARTIAL``: fp32 grad_Q partials of a split walk."""
    _gather_body(
        tl.program_id(0), G, Q, D, RQ, RD, ARG, GQ, GD32, n_q, n_j, lq, dim, (s_gi, s_gj), (s_qi, s_qs, s_qh),
        (s_di, s_dj, s_dt, s_dh), (s_rdi, s_rdj), (s_gdi, s_gdj), s_ai, n_split, j_per_split,
        NEED_Q, SCATTER_D, NORMALIZE, PARTIAL, BLOCK_J, BLOCK_S, D_PAD,
    )


@triton.jit(do_not_specialize=["n_q", "n_j", "lq", "ld", "n_gather_programs", "s_gi", "s_rdi", "s_rdj", "s_ai"])
def maxsim_bwd_doc_kernel(
    G, Q, D, RQ, RD, ARG, GD, GQ, n_q, n_j, lq, ld, dim,
    s_gi, s_gj, s_qi, s_qs, s_qh, s_di, s_dj, s_dt, s_dh, s_rdi, s_rdj, s_ai,
    n_gather_programs, ROWS,
    CROSS: tl.constexpr, NORMALIZE: tl.constexpr, F32_DOT: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, D_PAD: tl.constexpr,
    WITH_GATHER: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_S: tl.constexpr,
    GUARD_ROWS: tl.constexpr, COMPACT: tl.constexpr = False, SCAN: tl.constexpr = 1024,
):
    """``lowmem`` grad_D (``COMPACT``: each tile lists its own rows first, into ``ROWS``, an
    int16 scratch the size of the argmax); with ``WITH_GATHER`` the first
    ``n_gather_programs`` programs compute grad_Q (the gather, unsplit) in the same launch:
    one launch less per step, which is what bounds the small training shapes on the host."""
    s_g, s_q, s_d, s_rd = (s_gi, s_gj), (s_qi, s_qs, s_qh), (s_di, s_dj, s_dt, s_dh), (s_rdi, s_rdj)
    _grad_d_program(_grad_d_tile, (G, Q, D, RQ, RD, ARG, ROWS, GD, n_q, n_j, lq, ld, dim, s_g, s_q, s_d, s_rd,
                                   CROSS, NORMALIZE, F32_DOT, PRECISION, UPCAST, BLOCK_T, BLOCK_R, D_PAD, GUARD_ROWS,
                                   COMPACT, SCAN),
                    G, Q, D, RQ, RD, ARG, GQ, GD, n_q, n_j, lq, dim, s_g, s_q, s_d, s_rd, s_ai, n_gather_programs,
                    WITH_GATHER, NORMALIZE, BLOCK_J, BLOCK_S, D_PAD)


@triton.jit
def _grad_d_tile(
    pid, G, Q, D, RQ, RD, ARG, ROWS, GD, n_q, n_j, lq, ld, dim, s_g, s_q, s_d, s_rd,
    CROSS: tl.constexpr, NORMALIZE: tl.constexpr, F32_DOT: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, D_PAD: tl.constexpr,
    GUARD_ROWS: tl.constexpr, COMPACT: tl.constexpr, SCAN: tl.constexpr,
):
    if COMPACT:
        _compact_doc_body(pid, G, Q, D, RQ, RD, ARG, ROWS, GD, n_q, n_j, lq, ld, dim, s_g, s_q, s_d, s_rd,
                          NORMALIZE, F32_DOT, PRECISION, UPCAST, BLOCK_T, BLOCK_R, D_PAD, SCAN)
    else:
        _doc_body(pid, G, Q, D, RQ, RD, ARG, GD, n_q, n_j, lq, ld, dim, s_g, s_q, s_d, s_rd, CROSS, NORMALIZE,
                  F32_DOT, PRECISION, UPCAST, BLOCK_T, BLOCK_R, D_PAD, GUARD_ROWS)


@triton.jit
def _winners_body(
    pid, G, Q, D, RQ, RD, ARG, GD, n_j, lq, ld, dim, s_g, s_q, s_d, s_rd, s_ai,
    NORMALIZE: tl.constexpr, F32_DOT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_S: tl.constexpr, D_PAD: tl.constexpr,
):
    # Candidates / pairs: document j of query i is seen by query i's rows only, so its
    # grad_D is the few winning rows (zeros elsewhere, filled beforehand at memset speed).
    # Rows of the query that picked the same token are summed by an [S, S] equality
    # matrix times the query rows (one MMA, fixed order), and only the first of them
    # stores: every written row has exactly one writer -> no atomics, bitwise
    # deterministic, and the store traffic is Lq rows instead of the whole document.
    s_gi, s_gj = s_g
    s_qi, s_qs, s_qh = s_q
    s_di, s_dj, s_dt, s_dh = s_d
    s_rdi, s_rdj = s_rd
    i_doc = pid.to(tl.int64)
    i_q = i_doc // n_j
    i_j = i_doc % n_j
    o_s = tl.arange(0, BLOCK_S)
    o_h = tl.arange(0, D_PAD)
    m_s = o_s < lq
    m_h = o_h < dim
    b_a = tl.load(ARG + i_q * s_ai + i_j * lq + o_s, mask=m_s, other=-1).to(tl.int32)          # [S]
    valid = b_a >= 0
    b_g = tl.load(G + i_q * s_gi + i_j * s_gj)
    m_rows = valid[:, None] & m_h[None, :]
    # rows without a winner (masked query tokens) are not loaded: 0 * NaN must not leak
    b_q = tl.load(Q + i_q * s_qi + o_s[:, None] * s_qs + o_h[None, :] * s_qh, mask=m_rows, other=0.0)
    same = (b_a[:, None] == b_a[None, :]) & valid[:, None] & valid[None, :]                    # [S, S]
    earlier = same & (o_s[None, :] < o_s[:, None])
    first = valid & (tl.sum(earlier.to(tl.int32), axis=1) == 0)
    if NORMALIZE:
        # dL/d(d_hat) = g * q_hat
        b_rq = tl.load(RQ + i_q * lq + o_s, mask=m_s, other=0.0)
        b_acc = tl.dot(same.to(tl.float32), b_q.to(tl.float32) * b_rq[:, None], input_precision=PRECISION)
    elif F32_DOT or UPCAST:
        b_acc = tl.dot(same.to(tl.float32), b_q.to(tl.float32), input_precision=PRECISION)
    else:
        b_acc = tl.dot(same.to(b_q.dtype), b_q)                         # 0/1 x bf16: exact products
    b_acc = b_acc * b_g
    p_row = b_a[:, None].to(tl.int64)
    if NORMALIZE:
        p_d = D + i_q * s_di + i_j * s_dj + p_row * s_dt + o_h[None, :] * s_dh
        b_d = tl.load(p_d, mask=m_rows, other=0.0).to(tl.float32)
        b_rd = tl.load(RD + i_q * s_rdi + i_j * s_rdj + b_a, mask=valid, other=0.0)
        b_acc = _project(b_acc, b_d, b_rd)
    p_gd = GD + i_doc * ld * dim + p_row * dim + o_h[None, :]
    tl.store(p_gd, b_acc.to(GD.dtype.element_ty), mask=first[:, None] & m_h[None, :])


@triton.jit(do_not_specialize=["n_q", "n_j", "lq", "ld", "n_gather_programs", "s_gi", "s_rdi", "s_rdj", "s_ai"])
def maxsim_bwd_winners_kernel(
    G, Q, D, RQ, RD, ARG, GD, GQ, n_q, n_j, lq, ld, dim,
    s_gi, s_gj, s_qi, s_qs, s_qh, s_di, s_dj, s_dt, s_dh, s_rdi, s_rdj, s_ai,
    n_gather_programs,
    NORMALIZE: tl.constexpr, F32_DOT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    WITH_GATHER: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_SW: tl.constexpr,
    D_PAD: tl.constexpr,
):
    """``lowmem`` grad_D for candidates and pairs (``Lq <= BLOCK_SW``) into a zeroed
    buffer; with ``WITH_GATHER`` the first ``n_gather_programs`` programs compute grad_Q
    in the same launch."""
    s_g, s_q, s_d, s_rd = (s_gi, s_gj), (s_qi, s_qs, s_qh), (s_di, s_dj, s_dt, s_dh), (s_rdi, s_rdj)
    _grad_d_program(_winners_body, (G, Q, D, RQ, RD, ARG, GD, n_j, lq, ld, dim, s_g, s_q, s_d, s_rd, s_ai,
                                    NORMALIZE, F32_DOT, PRECISION, UPCAST, BLOCK_SW, D_PAD),
                    G, Q, D, RQ, RD, ARG, GQ, GD, n_q, n_j, lq, dim, s_g, s_q, s_d, s_rd, s_ai, n_gather_programs,
                    WITH_GATHER, NORMALIZE, BLOCK_J, BLOCK_S, D_PAD)


@triton.jit(do_not_specialize=["n_rows", "n_j", "lq", "s_gi", "s_ai", "n_split", "j_per_split"])
def maxsim_bwd_varlen_kernel(
    G, Q, D, RQ, RD, ARG, GQ, GD32, CU_Q, CU_D, PAIR_Q, PAIR_D, n_rows, n_j, lq, dim,
    s_gi, s_gj, s_qs, s_qh, s_dt, s_dh, s_ai, n_split, j_per_split,
    NEED_Q: tl.constexpr, SCATTER_D: tl.constexpr, NORMALIZE: tl.constexpr, ATOMIC_Q: tl.constexpr,
    PAIRS: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_S: tl.constexpr, D_PAD: tl.constexpr,
):
    """The packed backward (``forward.py``'s VARLEN / PAIRS layouts): the gather walk of the
    dense kernels over packed rows.  One program per (row of ``G``, block of ``BLOCK_S``
    query tokens, split of the documents): a row is a query against every document (``n_j``
    of them) or, with PAIRS, one pair (``n_j == 1``).  grad_D is scattered into the fp32
    ``GD32 [sum Ld, d]`` with relaxed atomics; grad_Q is stored (projected, in Q's dtype) by
    the one program that owns the rows, or -- ``ATOMIC_Q``: pairs, whose queries repeat, and
    split walks -- added into an fp32 ``GQ [sum Lq, d]`` for the host to finish.  Winners
    are relative to their document's first row; -1 (none, or past the query) adds nothing."""
    pid = tl.program_id(0)
    i_split = pid % n_split
    pid = pid // n_split
    n_sb = tl.cdiv(lq, BLOCK_S)
    i_row = (pid // n_sb).to(tl.int64)
    o_s = (pid % n_sb) * BLOCK_S + tl.arange(0, BLOCK_S)
    o_h = tl.arange(0, D_PAD)
    m_h = o_h < dim
    if PAIRS:
        query = tl.load(PAIR_Q + i_row)
    else:
        query = i_row
    q_first = tl.load(CU_Q + query).to(tl.int64)
    q_len = tl.load(CU_Q + query + 1) - q_first
    m_s = (o_s < lq) & (o_s < q_len)
    b_q = tl.load(Q + (q_first + o_s[:, None]) * s_qs + o_h[None, :] * s_qh,
                  mask=m_s[:, None] & m_h[None, :], other=0.0).to(tl.float32)          # [BS, DP]
    b_rq = tl.load(RQ + q_first + o_s, mask=m_s & NORMALIZE, other=1.0)
    b_qs = b_q * b_rq[:, None] if NORMALIZE else b_q                                  # q_hat
    j_lo = i_split * j_per_split
    b_acc = _gather_walk(
        tl.zeros([BLOCK_S, D_PAD], tl.float32), i_row, o_s, m_s, m_h, b_qs, j_lo,
        tl.minimum(j_lo + j_per_split, n_j),
        G, D, RD, ARG, GD32, lq, dim, (s_gi, s_gj), (0, 0, s_dt, s_dh), (0, 0), (0, 0), s_ai, 0,
        NEED_Q, SCATTER_D, NORMALIZE, BLOCK_J, D_PAD, CU_D, PAIR_D, True, PAIRS,
    )
    if NEED_Q:
        if ATOMIC_Q:
            p_gq = GQ + (q_first + o_s[:, None]) * dim + o_h[None, :]
            tl.atomic_add(p_gq, b_acc, mask=m_s[:, None] & m_h[None, :], sem="relaxed")
        else:
            _store_grad_q(GQ, b_acc, b_q, b_rq, q_first, o_s, m_s, m_h, dim, NORMALIZE)


@triton.jit(do_not_specialize=["n_rows"])
def project_rows_kernel(G32, X, RX, OUT, n_rows, dim, s_xr, s_xh, BLOCK_R: tl.constexpr, D_PAD: tl.constexpr):
    """OUT[r] = (G32[r] - <G32[r], x_hat> x_hat) / ||x||, for an fp32 buffer of rows."""
    o_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    o_h = tl.arange(0, D_PAD)
    m = (o_r < n_rows)[:, None] & (o_h < dim)[None, :]
    b_g = tl.load(G32 + o_r[:, None].to(tl.int64) * dim + o_h[None, :], mask=m, other=0.0)
    b_x = tl.load(X + o_r[:, None].to(tl.int64) * s_xr + o_h[None, :] * s_xh, mask=m, other=0.0).to(tl.float32)
    b_r = tl.load(RX + o_r, mask=o_r < n_rows, other=0.0)
    b_out = _project(b_g, b_x, b_r)
    tl.store(OUT + o_r[:, None].to(tl.int64) * dim + o_h[None, :], b_out.to(OUT.dtype.element_ty), mask=m)
