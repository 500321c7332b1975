"""MaxSim forward as a GEMM with a segmented max/sum epilogue.

One program owns a block of ``BLOCK_M = QPB * ROWS_PER_Q`` query-token rows — several
queries (``QPB``) of ``ROWS_PER_Q`` tokens each — against ``DOCS_PER_PROGRAM`` documents,
one after another (:func:`_document_row_max`, :func:`_store_document`).  It streams each
document in ``BLOCK_N``-token tiles, so each document tile is loaded once per query
*block* (not once per query) and the matrix units see full-height tiles.  Epilogue per
tile: mask, row max (NaN-propagating) and, when a gradient is needed, the winning column.
After the document: mask semantics, then a segmented sum over each query's rows.

Queries longer than ``ROWS_PER_Q`` tokens are split into ``n_chunks`` row chunks whose
partial scores land in ``OUT[chunk]`` and are summed on the host (deterministic).

Layouts share the kernel through strides: in the cross product ``s_di == 0`` (every
query sees document ``j``); for per-query candidates ``QPB == 1`` and document ``j`` of
query ``qi`` sits at ``qi * s_di + j * s_dj``.  Packed layouts (``VARLEN``, ``PAIRS``)
change only the program setup: row pointers and document starts come from the offsets
(and the pair list), and each document's own length bounds its tile loop.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _max_nan(a, b):
    # NaN-propagating max: a NaN similarity must poison the score, never vanish.
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def quantize_rows(x, LIMIT: tl.constexpr, TO_INT: tl.constexpr):
    """Per-row symmetric quantisation of fp32 rows ``x [R, DP]`` (zero padding): (values
    scaled into +-LIMIT as fp32, scale per row), the numbers of ``reference.quantize_fp8``
    (``LIMIT`` 448) or, with ``TO_INT``, ``reference.quantize_int8`` (``LIMIT`` 127, values
    rounded half to even) bit for bit -- round-to-nearest divisions (Triton's plain ``/`` is
    approximate on NVIDIA GPUs), and a clamp that keeps NaN.  A NaN row keeps scale 1 and
    NaN values, so its fp8 scores are NaN.  The caller casts the values (e4m3: round to
    nearest even; int8: exact, they are whole numbers)."""
    amax = tl.reduce(tl.abs(x), 1, _max_nan)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, LIMIT), 1.0)
    y = tl.math.div_rn(x, scale[:, None])
    if TO_INT:
        # round half to even as torch.round: adding and removing 1.5 * 2**23 leaves the
        # nearest integer (ties to even) for |y| < 2**22; fp32 adds are never reassociated
        y = (y + 12582912.0) - 12582912.0
    # clamp as torch.clamp does: NaN stays NaN (a plain min/max would clamp it to +-LIMIT)
    y = tl.minimum(tl.maximum(y, -LIMIT, propagate_nan=tl.PropagateNan.ALL), LIMIT,
                   propagate_nan=tl.PropagateNan.ALL)
    return y, scale


# Document formats (``DOC_FORMAT``): how a tile's ``[BLOCK_K, WIDTH]`` operand is made.
DENSE = tl.constexpr(0)     # float tokens D [.., Ld, d]
INT8 = tl.constexpr(1)      # int8 tokens; the int32 products are scaled by RQ / RD like fp8's
RESIDUAL = tl.constexpr(2)  # PLAID residuals: D = packed residual bytes, A0 = codes, A1 = centroids, A2 = bucket weights
HIDDEN = tl.constexpr(3)    # projection head: D = hidden states H [.., Ld, h], A0 = W [d, h], A1 = bias [d]


@triton.jit
def _bucket_weights(A2, byte, m, NBITS: tl.constexpr, PER_BYTE: tl.constexpr, BLOCK_K: tl.constexpr,
                    WIDTH: tl.constexpr):
    """The weights ``[BLOCK_K, WIDTH]`` (fp32) of the fields of ``byte [BLOCK_K / PER_BYTE,
    WIDTH]`` (field f of a byte: dimension ``PER_BYTE * byte + f``, its bits ``f * NBITS``
    from the top).  Up to 2 bits the 2-4 weights are scalars picked by selects on the field's
    bits, each tested in place in the byte (one logic instruction a test; the field is never
    shifted out): a gather from the table was one more L1 request per element, and L1 bounds
    the residual forward.  At 4 bits a 15-select tree lost to that load; 4 bits take
    ``tl.gather`` from the weights held on chip, 8 bits (256 weights) the load
    (docs/performance-notes.md, PLAID residual)."""
    low = 8 - NBITS - tl.arange(0, PER_BYTE) * NBITS          # each field's lowest bit
    byte = byte[:, None, :]
    if NBITS == 1:
        weight = tl.where((byte & (1 << low)[None, :, None]) != 0, tl.load(A2 + 1), tl.load(A2))
        weight = tl.reshape(weight, [BLOCK_K, WIDTH])
    elif NBITS == 2:
        bit0 = (byte & (1 << low)[None, :, None]) != 0
        bit1 = (byte & (2 << low)[None, :, None]) != 0
        weight = tl.where(bit1, tl.where(bit0, tl.load(A2 + 3), tl.load(A2 + 2)),
                          tl.where(bit0, tl.load(A2 + 1), tl.load(A2)))
        weight = tl.reshape(weight, [BLOCK_K, WIDTH])
    else:
        field = tl.reshape((byte >> low[None, :, None]) & ((1 << NBITS) - 1), [BLOCK_K, WIDTH])
        if NBITS == 4:
            # the 16 weights on chip, each element's picked by tl.gather (shuffles and shared
            # memory): a load from the table per element kept the L1 busy
            table = tl.broadcast_to(tl.load(A2 + tl.arange(0, 16))[:, None], [16, WIDTH])
            weight = tl.gather(table, field, axis=0)
        else:
            weight = tl.load(A2 + field, mask=m, other=0.0)
    return weight.to(tl.float32)


@triton.jit
def _residual_tile(p_d, p_a0, A1, A2, o_t, m_t, dim, s_dt, s_dh, s_a0t, n_centroids,
                   WIDTH: tl.constexpr, BLOCK_K: tl.constexpr, NBITS: tl.constexpr):
    """Decompressed tokens ``[BLOCK_K, WIDTH]`` fp32 (zeros outside ``m_t`` and ``dim``):
    ``centroids[code] + bucket_weights[bucket]``, the bucket read from the packed residual
    bits (reference.py documents the layout: each dimension's ``NBITS`` bits least
    significant first, packed into bytes most significant first).  ``A2`` holds the weights
    in stream order -- indexed by the field as it sits in the byte, i.e. by the bucket's bits
    reversed (``operands.stream_order_weights``) -- so no per-element bit reversal is needed.

    The token's bytes are loaded as one ``[BLOCK_K * NBITS / 8, WIDTH]`` tile (contiguous:
    vector loads) and each byte is split into its ``8 / NBITS`` fields in registers.  Loading
    the byte of every element instead (``8 / NBITS`` loads of the same byte) kept the L1 busy
    (docs/performance-notes.md, PLAID residual)."""
    PER_BYTE: tl.constexpr = 8 // NBITS
    o_k = tl.arange(0, BLOCK_K)
    m_k = o_k < dim
    code = tl.load(p_a0 + o_t * s_a0t, mask=m_t, other=0)
    # a padding token may hold any code: keep its (ignored) centroid lookup in bounds
    code = tl.minimum(tl.maximum(code, 0), n_centroids - 1).to(tl.int64)
    m = m_k[:, None] & m_t[None, :]
    o_b = tl.arange(0, BLOCK_K // PER_BYTE)
    byte = tl.load(p_d + o_t[None, :] * s_dt + o_b[:, None] * s_dh,
                   mask=(o_b < dim // PER_BYTE)[:, None] & m_t[None, :], other=0).to(tl.int32)   # [BK/PB, WIDTH]
    weight = _bucket_weights(A2, byte, m, NBITS, PER_BYTE, BLOCK_K, WIDTH)
    centroid = tl.load(A1 + code[None, :] * dim + o_k[:, None], mask=m, other=0.0).to(tl.float32)
    # tokens past the document are not zeroed: their similarities are masked after the product
    # (a select an element, 1 of ~25 instructions)
    return tl.where(m_k[:, None], centroid + weight, 0.0)


@triton.jit
def _hidden_tile(p_d, A0, A1, o_t, m_t, dim, s_dt, s_dh, n_hidden, WIDTH: tl.constexpr,
                 BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
                 UPCAST: tl.constexpr):
    """Projected tokens ``H[t] @ W.T + b`` as ``[WIDTH, BLOCK_K]`` fp32 -- token-major: the
    tokens are the MMA's M, the hidden slices ``[WIDTH, BLOCK_H]`` its A operand as stored,
    ``W [dim, n_hidden]`` (contiguous) read as ``[BLOCK_H, BLOCK_K]`` slices -- accumulated
    over the hidden size.  The dimension-major tile (W as the A operand) was several times
    slower (docs/performance-notes.md, Projection head)."""
    o_k = tl.arange(0, BLOCK_K)
    o_h = tl.arange(0, BLOCK_H)
    m_k = o_k < dim
    acc = tl.zeros([WIDTH, BLOCK_K], tl.float32)
    for h0 in range(0, n_hidden, BLOCK_H):
        hh = h0 + o_h
        m_h = hh < n_hidden
        x = tl.load(p_d + o_t[:, None] * s_dt + hh[None, :] * s_dh, mask=m_t[:, None] & m_h[None, :],
                    other=0.0)                                                    # [WIDTH, BH]
        # int32 offsets: o_k * h + hh < 256 h, in range for any hidden size below 2**23
        w = tl.load(A0 + o_k[None, :] * n_hidden + hh[:, None], mask=m_h[:, None] & m_k[None, :],
                    other=0.0)                                                    # [BH, BK]
        if UPCAST:
            w = w.to(tl.float32)
            x = x.to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(A1 + o_k, mask=m_k, other=0.0).to(tl.float32)[None, :]
    # no select here: W's rows past dim load as zeros (their columns stay 0), and the
    # similarities of tokens past the document are masked after the product
    return acc


@triton.jit
def _doc_tile(p_d, n0, ld, dim, s_dt, s_dh, p_a0, A1, A2, s_a0t, aux_n,
              WIDTH: tl.constexpr, BLOCK_K: tl.constexpr, D_PAD: tl.constexpr, UPCAST: tl.constexpr,
              DOC_FORMAT: tl.constexpr, NBITS: tl.constexpr, BLOCK_H: tl.constexpr, HAS_BIAS: tl.constexpr,
              NORMALIZE: tl.constexpr, PRECISION: tl.constexpr):
    """Document tokens ``n0 .. n0 + WIDTH`` as the MMA's ``[BLOCK_K, WIDTH]`` operand (zeros
    past the document) when the whole embedding is one K tile -- ``[WIDTH, BLOCK_K]`` for
    HIDDEN (token-major, see :func:`_tile_similarities`); otherwise a placeholder (the
    K loop of :func:`_tile_similarities` loads its own slices).

    ``DOC_FORMAT`` RESIDUAL / HIDDEN build the operand from the compressed tokens or the
    hidden states (fp32, L2-normalised here when ``NORMALIZE``: the whole token is in the
    tile), so the documents are never written to memory; they need ``BLOCK_K == D_PAD``."""
    if DOC_FORMAT == RESIDUAL or DOC_FORMAT == HIDDEN:
        o_t = n0 + tl.arange(0, WIDTH)
        m_t = o_t < ld
        if DOC_FORMAT == RESIDUAL:
            b_d = _residual_tile(p_d, p_a0, A1, A2, o_t, m_t, dim, s_dt, s_dh, s_a0t, aux_n, WIDTH, BLOCK_K, NBITS)
        else:
            b_d = _hidden_tile(p_d, p_a0, A1, o_t, m_t, dim, s_dt, s_dh, aux_n, WIDTH, BLOCK_K, BLOCK_H, HAS_BIAS,
                               PRECISION, UPCAST)
        if NORMALIZE:
            # x / max(||x||, 1e-12), as reference.NORM_EPS, along the tile's embedding axis
            # (hidden tiles are token-major).  One reciprocal per token, then a multiply per
            # element: Triton's fp32 division is exactly that (MUFU.RCP, FMUL) behind two range
            # checks that rescale both operands when the divisor is beyond 2**126 or below
            # 2**-126 -- never the case here (1e-12 <= norm), so the bits are the division's,
            # without the checks' two predicated multiplies per element.
            DIM_AXIS: tl.constexpr = 0 if DOC_FORMAT == RESIDUAL else 1
            inv = 1.0 / tl.maximum(tl.sqrt(tl.sum(b_d * b_d, axis=DIM_AXIS)), 1e-12)
            b_d = b_d * tl.expand_dims(inv, DIM_AXIS)
    elif BLOCK_K == D_PAD:
        o_t = n0 + tl.arange(0, WIDTH)
        o_k = tl.arange(0, BLOCK_K)
        b_d = tl.load(p_d + o_t[None, :] * s_dt + o_k[:, None] * s_dh,
                      mask=(o_t < ld)[None, :] & (o_k[:, None] < dim), other=0.0)         # [BK, WIDTH]
        if UPCAST:
            b_d = b_d.to(tl.float32)
    else:
        b_d = 0
    return b_d


@triton.jit
def _tile_similarities(
    b_q, b_d, p_q, m_row, p_d, p_dm, p_rd, n0, ld, dim, s_qh, s_dt, s_dh, s_dmt, b_floor,
    HAS_DM: tl.constexpr, ZERO_MODE: tl.constexpr, NORMALIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, WIDTH: tl.constexpr, BLOCK_K: tl.constexpr, D_PAD: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, DOC_FORMAT: tl.constexpr = 0,
):
    """Similarities of the program's query rows with document tokens ``n0 .. n0 + WIDTH``
    (``[BLOCK_M, WIDTH]`` fp32, -inf where a token is past the document or masked), their
    columns, and the zero-mode floor updated for this tile.  ``b_d``: the tile from
    :func:`_doc_tile`."""
    o_t = n0 + tl.arange(0, WIDTH)
    o_k = tl.arange(0, BLOCK_K)
    m_col = o_t < ld
    if DOC_FORMAT == INT8:
        # int8 x int8 on the integer matrix units: exact int32 sums, scaled per element below
        b_s = tl.dot(b_q, b_d, out_dtype=tl.int32).to(tl.float32)
    elif DOC_FORMAT == RESIDUAL:
        # the built (normalised) fp32 tokens, rounded to the query's dtype like a float index
        b_s = tl.dot(b_q, b_d.to(b_q.dtype), input_precision=PRECISION)
    elif DOC_FORMAT == HIDDEN:
        # token-major: b_d [WIDTH, BK] and b_q = Q^T [BK, BM], so the tokens are the MMA's M
        # again (the projection's tile feeds it in its own layout); transposed back after
        b_s = tl.trans(tl.dot(b_d.to(b_q.dtype), b_q, input_precision=PRECISION))
    elif BLOCK_K == D_PAD:
        b_s = tl.dot(b_q, b_d, input_precision=PRECISION)                          # [BM, BK] @ [BK, WIDTH]
    else:
        b_s = tl.zeros([BLOCK_M, WIDTH], tl.float32)
        for k0 in range(0, dim, BLOCK_K):
            o_kk = k0 + o_k
            b_qk = tl.load(p_q[:, None] + o_kk[None, :] * s_qh,
                           mask=m_row[:, None] & (o_kk[None, :] < dim), other=0.0)
            b_dk = tl.load(p_d + o_t[None, :] * s_dt + o_kk[:, None] * s_dh,
                           mask=m_col[None, :] & (o_kk[:, None] < dim), other=0.0)
            if UPCAST:
                b_qk = b_qk.to(tl.float32)
                b_dk = b_dk.to(tl.float32)
            b_s = tl.dot(b_qk, b_dk, b_s, input_precision=PRECISION)
    if NORMALIZE and DOC_FORMAT != RESIDUAL and DOC_FORMAT != HIDDEN:   # those normalise in _doc_tile
        b_rd = tl.load(p_rd + o_t, mask=m_col, other=0.0)
        b_s = b_s * b_rd[None, :]
    if HAS_DM:
        b_dm = tl.load(p_dm + o_t * s_dmt, mask=m_col, other=0)
        m_valid = m_col & (b_dm != 0)
        if ZERO_MODE:
            n_masked = tl.sum((m_col & (b_dm == 0)).to(tl.int32), axis=0)
            b_floor = tl.where(n_masked > 0, 0.0, b_floor)
        b_s = tl.where(m_valid[None, :], b_s, float("-inf"))
    elif n0 + WIDTH > ld:
        # only the last tile runs past the document: a full tile skips the select, one
        # of the 2-3 CUDA-core operations per similarity that bound the fp8 forward
        b_s = tl.where(m_col[None, :], b_s, float("-inf"))
    return b_s, o_t, b_floor


@triton.jit
def _merge_tile(b_s, o_t, b_max, b_arg, SAVE_ARG: tl.constexpr):
    """Fold one tile into each row's running max (NaN-propagating) and winning column."""
    b_tile = tl.reduce(b_s, 1, _max_nan)                                                # [BM]
    if SAVE_ARG:
        # lowest column reaching the tile max; strict '>' keeps the earliest tile on ties
        b_targ = tl.min(tl.where(b_s == b_tile[:, None], o_t[None, :], 2147483647), axis=1)
        b_arg = tl.where(b_tile > b_max, b_targ, b_arg)
    return _max_nan(b_max, b_tile), b_arg


@triton.jit
def _document_row_max(
    b_q, p_q, m_row, p_d, p_dm, p_rd, ld, dim, s_qh, s_dt, s_dh, s_dmt, p_a0, A1, A2, s_a0t, aux_n,
    HAS_DM: tl.constexpr, ZERO_MODE: tl.constexpr, NORMALIZE: tl.constexpr, SAVE_ARG: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, D_PAD: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, RUNNING_MAX: tl.constexpr, TAIL_N: tl.constexpr,
    DOC_FORMAT: tl.constexpr, NBITS: tl.constexpr, BLOCK_H: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """One document against the program's query rows, tile by tile: each row's max
    similarity (NaN-propagating), its winning column when SAVE_ARG, and the zero-mode floor
    (0 once a masked document token competes, else -inf).

    With ``0 < TAIL_N < BLOCK_N`` the tokens past the last whole ``BLOCK_N`` tile go
    through narrower ``TAIL_N`` tiles, so a document of 1030 tokens costs 1030 + 10 columns
    of matrix and epilogue work instead of 1088 (or 1152): a masked column costs as much
    as a real one."""
    b_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    b_arg = tl.zeros([BLOCK_M], tl.int32)
    b_floor = tl.full([BLOCK_M], float("-inf"), tl.float32)
    SPLIT_TAIL: tl.constexpr = (TAIL_N > 0) & (TAIL_N < BLOCK_N)
    if SPLIT_TAIL:
        ld_main = ld - ld % BLOCK_N
    else:
        ld_main = ld
    if RUNNING_MAX:
        # Keep an elementwise max over the tiles in the accumulator's own layout and reduce
        # across columns (shuffles between threads) once, at the end, instead of per tile:
        # for 8-bit inference, whose MMA leaves the epilogue as the bound.  It keeps no
        # winners (the launcher never asks for both).
        tl.static_assert(not SAVE_ARG, "the running max keeps no winners")
        b_run = tl.full([BLOCK_M, BLOCK_N], float("-inf"), tl.float32)
    if SPLIT_TAIL:
        # The tail tile's tokens are loaded now and used after the main loop: outside the
        # loop's software pipeline its load would be waited for in full (a tail tile loaded
        # in place cost nearly a whole tile).
        b_d_tail = _doc_tile(p_d, ld_main, ld, dim, s_dt, s_dh, p_a0, A1, A2, s_a0t, aux_n, TAIL_N, BLOCK_K, D_PAD,
                             UPCAST, DOC_FORMAT, NBITS, BLOCK_H, HAS_BIAS, NORMALIZE, PRECISION)
    for n0 in range(0, ld_main, BLOCK_N):
        b_d = _doc_tile(p_d, n0, ld, dim, s_dt, s_dh, p_a0, A1, A2, s_a0t, aux_n, BLOCK_N, BLOCK_K, D_PAD,
                        UPCAST, DOC_FORMAT, NBITS, BLOCK_H, HAS_BIAS, NORMALIZE, PRECISION)
        b_s, o_t, b_floor = _tile_similarities(
            b_q, b_d, p_q, m_row, p_d, p_dm, p_rd, n0, ld, dim, s_qh, s_dt, s_dh, s_dmt, b_floor,
            HAS_DM, ZERO_MODE, NORMALIZE, BLOCK_M, BLOCK_N, BLOCK_K, D_PAD, UPCAST, PRECISION, DOC_FORMAT)
        if RUNNING_MAX:
            b_run = _max_nan(b_run, b_s)
        else:
            b_max, b_arg = _merge_tile(b_s, o_t, b_max, b_arg, SAVE_ARG)
    if RUNNING_MAX:
        b_max = tl.reduce(b_run, 1, _max_nan)
    if SPLIT_TAIL:
        # the tail's columns come after every main tile's, so merging them last keeps the
        # lowest winning column on ties, as one pass over the whole document would
        # (BLOCK_N 128 can leave a second tail tile: Ld % 128 > 64 with TAIL_N 64 or less)
        for n0 in range(ld_main, ld, TAIL_N):
            if n0 > ld_main:
                b_d_tail = _doc_tile(p_d, n0, ld, dim, s_dt, s_dh, p_a0, A1, A2, s_a0t, aux_n, TAIL_N, BLOCK_K,
                                     D_PAD, UPCAST, DOC_FORMAT, NBITS, BLOCK_H, HAS_BIAS, NORMALIZE, PRECISION)
            b_s, o_t, b_floor = _tile_similarities(
                b_q, b_d_tail, p_q, m_row, p_d, p_dm, p_rd, n0, ld, dim, s_qh, s_dt, s_dh, s_dmt, b_floor,
                HAS_DM, ZERO_MODE, NORMALIZE, BLOCK_M, TAIL_N, BLOCK_K, D_PAD, UPCAST, PRECISION, DOC_FORMAT)
            b_max, b_arg = _merge_tile(b_s, o_t, b_max, b_arg, SAVE_ARG)
    return b_max, b_arg, b_floor


@triton.jit
def _store_document(
    b_max, b_arg, b_floor, b_rq, m_keep, m_store, q_idx, t_idx, i_qb, i_chunk, i_j, OUT, ARG, n_q, n_j, lq,
    NORMALIZE: tl.constexpr, SAVE_ARG: tl.constexpr, ROWS_PER_Q: tl.constexpr, QPB: tl.constexpr,
):
    """Mask semantics, then each query's sum over its rows (and the winners) for document ``i_j``.
    ``m_store``: the winner slots to write (packed queries: also the rows past a query's
    length, which get -1)."""
    if NORMALIZE:
        b_max = b_max * b_rq      # 1/||q|| > 0 commutes with the max
    # A row scores its max if a valid token won (a masked 0 loses ties); NaN stays NaN.
    m_win = ((b_max > float("-inf")) & (b_max >= b_floor)) | (b_max != b_max)
    m_win = m_win & m_keep
    b_val = tl.where(m_win, b_max, 0.0)
    b_score = tl.sum(tl.reshape(b_val, [QPB, ROWS_PER_Q]), axis=1)                     # [QPB]
    o_q = i_qb * QPB + tl.arange(0, QPB)
    p_out = OUT + i_chunk.to(tl.int64) * n_q * n_j + o_q.to(tl.int64) * n_j + i_j
    tl.store(p_out, b_score, mask=o_q < n_q)
    if SAVE_ARG:
        b_win = tl.where(m_win, b_arg, -1)
        p_arg = ARG + (q_idx.to(tl.int64) * n_j + i_j) * lq + t_idx
        tl.store(p_arg, b_win.to(ARG.dtype.element_ty), mask=m_store)


# Lengths, and strides that follow them without mattering for vector loads (mask, norm,
# argmax and score strides), are not specialised: a new length compiles nothing (blocking.py).
# ``aux_n`` is: it is the projection head's hidden size, W's row stride and the bound of its
# K loop, and only a known multiple of 16 lets W and H load as vectors.  (A model's hidden
# size is fixed; a residual index's centroid count adds at most the usual 3 classes: 1, a
# multiple of 16, other.)
@triton.jit(do_not_specialize=["n_q", "n_j", "lq", "ld", "n_qblocks", "n_chunks", "size_class", "s_qmi", "s_dmi",
                               "s_dmj", "s_rdi", "s_rdj", "s_a0i", "s_a0j"])
def maxsim_fwd_kernel(
    Q, D, QM, DM, RQ, RD, OUT, ARG,
    # packed layouts (VARLEN): int32 offsets of the queries / documents, and (PAIRS) the
    # pair list; placeholders otherwise
    CU_Q, CU_D, PAIR_Q, PAIR_D,
    n_q, n_j, lq, ld, dim,
    s_qi, s_qs, s_qh,
    s_di, s_dj, s_dt, s_dh,
    s_qmi, s_qms,
    s_dmi, s_dmj, s_dmt,
    s_rdi, s_rdj,
    n_qblocks, n_chunks,
    # size_class: not read by the kernel; the autotuner's key holds it, so a launch of a
    # different size class (``tuning.size_class``) is tuned for itself
    size_class,
    # the document operand's other inputs (DOC_FORMAT, see _doc_tile): A0 per document at
    # (s_a0i, s_a0j) like D, token stride s_a0t; aux_n: centroids (RESIDUAL) or hidden size (HIDDEN)
    A0, A1, A2, s_a0i, s_a0j, s_a0t, aux_n,
    HAS_QM: tl.constexpr, HAS_DM: tl.constexpr, ZERO_MODE: tl.constexpr,
    # NORMALIZE: scale similarities by per-token factors RQ [n_q, lq] and RD (per document
    # token): inverse norms, or the fp8 path's dequantisation scales.  Both are > 0, so
    # the query factor commutes with the max; the document factor cannot and goes first.
    # (HIDDEN: documents only, RQ unread; RESIDUAL / HIDDEN normalise in _doc_tile, RD unread.)
    NORMALIZE: tl.constexpr, SAVE_ARG: tl.constexpr,
    ROWS_PER_Q: tl.constexpr, QPB: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, D_PAD: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, RUNNING_MAX: tl.constexpr = False,
    # QUANT_Q: ``Q`` holds float query tokens and ``D`` e4m3 (or, DOC_FORMAT INT8, int8)
    # values; each program quantises its query rows as ``quantize_rows`` does (the query
    # side of the fp8 / int8 paths, fused: one launch instead of two, or instead of torch's
    # ~8) and uses their scales where RQ's would go.  Needs BLOCK_K == D_PAD.
    QUANT_Q: tl.constexpr = False, QUANT_LIMIT: tl.constexpr = 448.0,
    DOCS_PER_PROGRAM: tl.constexpr = 1,
    # TAIL_N: width of the tiles that cover a document's last ``Ld % BLOCK_N`` tokens (0:
    # the last BLOCK_N tile, masked).  Chosen by the host from Ld (``blocking.tail_tile``).
    TAIL_N: tl.constexpr = 0,
    DOC_FORMAT: tl.constexpr = 0, NBITS: tl.constexpr = 0, BLOCK_H: tl.constexpr = 16, HAS_BIAS: tl.constexpr = False,
    # VARLEN: Q and D are packed ``[sum L, d]``; query ``i`` is rows ``CU_Q[i] .. CU_Q[i+1]``,
    # document ``j`` rows ``CU_D[j] .. CU_D[j+1]`` (masks and inverse norms packed alike);
    # ``lq`` is the bound on query lengths, each document's own length bounds its loop.
    # PAIRS (with VARLEN): program ``j`` scores pair ``j``: query PAIR_Q[j] x document
    # PAIR_D[j]; the host passes n_q = 1, QPB = 1 (output ``[1, P]``).
    VARLEN: tl.constexpr = False, PAIRS: tl.constexpr = False,
    # DM_LENGTHS (padded layouts, HAS_DM off): DM holds each document's length (int32, at
    # its (s_dmi, s_dmj)); tokens past it are excluded and never loaded -- no [.., Ld] mask
    # in memory, no work on the padding.
    DM_LENGTHS: tl.constexpr = False,
    # N_HIDDEN (HIDDEN): the hidden size (= aux_n); EVEN_DIM (HIDDEN, RESIDUAL): dim == D_PAD
    N_HIDDEN: tl.constexpr = 0, EVEN_DIM: tl.constexpr = False,
):
    BLOCK_M: tl.constexpr = ROWS_PER_Q * QPB
    # the projection head's NORMALIZE acts on the documents only (late-interaction-kernels'
    # meaning of maxsim_from_hidden's ``normalize``): its queries are scored as given
    SCALE_Q: tl.constexpr = NORMALIZE and DOC_FORMAT != HIDDEN
    if DOC_FORMAT == HIDDEN:
        # The projection's sizes as compile-time constants (a model's are fixed): its K loop
        # gets a known trip count, and with the embedding dim known to fill the tile no load
        # of W is masked -- the loop then unrolls and pipelines as a dense GEMM's.  With W's
        # rows masked by the runtime dim (one predicate and select per load) it stayed a loop.
        aux_n = N_HIDDEN
    if EVEN_DIM:
        # (HIDDEN, RESIDUAL) the embedding dim fills the tile: no mask along it
        dim = D_PAD
    pid = tl.program_id(0)
    # Query blocks vary fastest: consecutive programs read the same documents (L2 reuse).
    # A program scores DOCS_PER_PROGRAM documents (the host makes it divide n_j) with its
    # query block loaded once: fewer query-block reloads from L2 per document.
    n_m = n_qblocks * n_chunks
    i_jb = pid // n_m
    i_m = pid % n_m
    i_chunk = i_m // n_qblocks
    i_qb = i_m % n_qblocks

    o_m = tl.arange(0, BLOCK_M)
    o_k = tl.arange(0, BLOCK_K)
    q_idx = i_qb * QPB + o_m // ROWS_PER_Q                   # [BM] query of each row
    t_idx = i_chunk * ROWS_PER_Q + o_m % ROWS_PER_Q          # [BM] token of each row
    m_row = (q_idx < n_q) & (t_idx < lq)
    m_store = m_row
    if VARLEN:
        if PAIRS:
            q_src = tl.load(PAIR_Q + i_jb) + o_m * 0           # the pair's query, on every row
        else:
            q_src = q_idx
        q_start = tl.load(CU_Q + q_src, mask=m_row, other=0)
        q_len = tl.load(CU_Q + q_src + 1, mask=m_row, other=0) - q_start
        m_row = m_row & (t_idx < q_len)                        # rows past the query: no data, winner -1
        q_tok = q_start.to(tl.int64) + t_idx                   # [BM] packed row of each row
        p_q = Q + q_tok * s_qs                                 # [BM] row pointers
        p_qm = QM + q_tok * s_qms
        p_rq = RQ + q_tok
    else:
        p_q = Q + q_idx.to(tl.int64) * s_qi + t_idx.to(tl.int64) * s_qs    # [BM] row pointers
        p_qm = QM + q_idx.to(tl.int64) * s_qmi + t_idx * s_qms
        p_rq = RQ + q_idx.to(tl.int64) * lq + t_idx
    m_keep = m_row
    if HAS_QM:
        b_qm = tl.load(p_qm, mask=m_row, other=0)
        m_keep = m_keep & (b_qm != 0)

    if DOC_FORMAT == HIDDEN:
        # Q^T [BK, BM]: the projected tokens are the left operand (_tile_similarities)
        b_q = tl.load(p_q[None, :] + o_k[:, None] * s_qh, mask=m_row[None, :] & (o_k[:, None] < dim), other=0.0)
        if UPCAST:
            b_q = b_q.to(tl.float32)
    elif BLOCK_K == D_PAD:
        # The whole embedding fits one tile: the query block stays on chip for the document.
        b_q = tl.load(p_q[:, None] + o_k[None, :] * s_qh, mask=m_row[:, None] & (o_k[None, :] < dim), other=0.0)
        if UPCAST:
            b_q = b_q.to(tl.float32)
        if QUANT_Q:
            b_qv, b_qscale = quantize_rows(b_q.to(tl.float32), QUANT_LIMIT, DOC_FORMAT == INT8)
            b_q = b_qv.to(D.dtype.element_ty)
    else:
        b_q = p_q   # unused: the document loop reloads query slices per K tile

    for jj in tl.static_range(DOCS_PER_PROGRAM):
        i_j = i_jb * DOCS_PER_PROGRAM + jj
        if VARLEN:
            if PAIRS:
                doc = tl.load(PAIR_D + i_j)
            else:
                doc = i_j
            d_start = tl.load(CU_D + doc)
            ld_j = tl.load(CU_D + doc + 1) - d_start           # this document's own loop bound
            d_first = d_start.to(tl.int64)
            p_d = D + d_first * s_dt
            p_dm = DM + d_first * s_dmt
            p_rd = RD + d_first
            p_a0 = A0 + d_first * s_a0t
        else:
            q_first = (i_qb * QPB).to(tl.int64)
            ld_j = ld
            if DM_LENGTHS:
                # the document's own length bounds its loop, as a packed one's does (a negative
                # one reads as empty, as in the reference's mask)
                ld_j = tl.maximum(tl.minimum(tl.load(DM + q_first * s_dmi + i_j.to(tl.int64) * s_dmj), ld), 0)
            p_d = D + q_first * s_di + i_j.to(tl.int64) * s_dj
            p_dm = DM + q_first * s_dmi + i_j.to(tl.int64) * s_dmj
            p_rd = RD + q_first * s_rdi + i_j.to(tl.int64) * s_rdj
            p_a0 = A0 + q_first * s_a0i + i_j.to(tl.int64) * s_a0j
        if DOC_FORMAT == HIDDEN:
            # W is every document's: its base stays A0, whose 16-byte alignment the compiler
            # knows.  Offset through the (unspecialised, here zero) a0 strides it was unknown,
            # and W loaded one element at a time.
            p_a0 = A0
        b_max, b_arg, b_floor = _document_row_max(
            b_q, p_q, m_row, p_d, p_dm, p_rd,
            ld_j, dim, s_qh, s_dt, s_dh, s_dmt,
            p_a0, A1, A2, s_a0t, aux_n,
            HAS_DM, ZERO_MODE, NORMALIZE, SAVE_ARG, BLOCK_M, BLOCK_N, BLOCK_K, D_PAD, UPCAST, PRECISION, RUNNING_MAX,
            TAIL_N, DOC_FORMAT, NBITS, BLOCK_H, HAS_BIAS,
        )
        if SCALE_Q:
            if QUANT_Q:
                b_rq = b_qscale
            else:
                b_rq = tl.load(p_rq, mask=m_row, other=1.0)
        else:
            b_rq = b_max   # unused
        _store_document(b_max, b_arg, b_floor, b_rq, m_keep, m_store, q_idx, t_idx, i_qb, i_chunk, i_j, OUT, ARG,
                        n_q, n_j, lq, SCALE_Q, SAVE_ARG, ROWS_PER_Q, QPB)
