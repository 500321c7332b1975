"""How a launch is cut into programs: query rows and documents per forward program, the
forward's tail tiles, the gather backward's blocking and split.

Lengths that change every call: batch sizes and lengths are runtime arguments that Triton
does not specialise on (``do_not_specialize``), as are the strides that follow them; the
constexprs that depend on a length are buckets.  For one dtype, embedding width, mask
presence and option set, the binaries a kernel needs are bounded by its buckets:

* forward: query rows per program (powers of two, 16-256: 5) x documents per program
  (1 or 4) x tail widths (0, 16, 32, 64) -- at most 40, in practice a handful;
* lowmem grad_D: row-list scan width (powers of two up to 4096) x gather blocking
  (``BLOCK_S`` powers of two up to 16) x route (compact / dense / winners);
* gather: ``BLOCK_S`` x ``BLOCK_J`` (powers of two) x split.

:data:`MAX_VARIANTS_PER_KERNEL` is the bound the tests hold a sweep of lengths to
(``tests/kernels/test_shape_stability.py``).  A new length builds its host-side plan and
replays the binary its bucket already has (``direct.py``).

Each rule below was measured on the shapes it names; the figures are in
docs/performance-notes.md (sections Forward and Backward).
"""
from __future__ import annotations

from .tuning import cdiv, next_pow2

# Upper bound on the binaries one kernel needs for one dtype / width / option set (above).
MAX_VARIANTS_PER_KERNEL = 40
# Lq above this is split into row chunks of this many tokens (exact: partial sums).
MAX_ROWS_PER_Q = 128
# Rows per program the forward aims for: 128 rows fill a warpgroup MMA twice over.
TARGET_BLOCK_M = 128
# With 16-bit (or fp8) inputs and d <= 128 a program owns up to 256 rows -- several
# queries, or 256 tokens of one long query -- so each document tile is read half as often.
# fp32 or wider embeddings keep 128 so the query block and document tiles still fit in
# shared memory.
WIDE_BLOCK_M = 256
# Documents per forward program: the query block is loaded once for all of them, so less
# is read from L2 per document.  Only 16-bit inference launches of many programs gain
# (long documents need twice as many); the training forward (argmax) and smaller launches
# lose.
FORWARD_DOCS_PER_PROGRAM = 4
FORWARD_MULTI_DOC_MIN_PROGRAMS = 8192   # programs at one document each; twice that for Ld > 256
# fp8 inference with queries up to this long: 128-row programs (TARGET_BLOCK_M) with
# FORWARD_DOCS_PER_PROGRAM documents each, wherever the 16-bit multi-document rule would take
# such a launch; otherwise fp8 keeps the 256 x 1 blocking (longer queries and smaller
# launches measured slower at 128 x 4).
FP8_SHORT_QUERY_MAX_LQ = 32
# A document's last Ld % BLOCK_N tokens go through narrower tiles (``tail_tile``) instead of a
# whole BLOCK_N tile with the rest masked: masked columns cost the MMA and the epilogue as
# much as real ones.  That pays where the forward is compute-bound (query blocks of 128+
# rows); a program of one short query (rerank, per-query candidates) reads the same bytes
# either way and keeps the masked tile.
TAIL_MIN_BLOCK_ROWS = 128
# ... and only for documents of TAIL_MIN_LD tokens or more: every tail width is one more
# binary per query-row bucket, and a loop whose document lengths change every step (ColBERT
# lengths) met each new width as a compile in its first steps, for a gain measured only on
# long pages.
TAIL_MIN_LD = 512

# The gather backward splits each query's documents until about GATHER_TARGET_WAVES programs
# per SM run, but only when fewer than GATHER_SPLIT_BELOW programs would run otherwise
# (rerank, search): a split costs three more host-side ops (fp32 partials, their sum, a
# copy), more than the kernel time it saves once every SM has half a program.  It also
# needs GATHER_SPLIT_MIN_STEPS steps (BLOCK_J documents each) per program: below that the
# unsplit gather finishes before the split's host work.
GATHER_TARGET_WAVES = 2
GATHER_SPLIT_BELOW = 64
GATHER_SPLIT_MIN_STEPS = 32
# Gather blocking: up to GATHER_MAX_BLOCK_S query tokens per program, and about
# GATHER_STEP_ELEMS gathered elements (BLOCK_J documents x BLOCK_S rows x d) per step.  A
# kernel that waits on dependent random loads wants many programs, hence many row loads in
# flight: 16 tokens x 4 documents a step beat 32 x 2.
GATHER_MAX_BLOCK_S = 16
GATHER_STEP_ELEMS = 8192


def row_blocking(lq: int, nq: int, cross: bool, block_m: int = TARGET_BLOCK_M) -> tuple[int, int, int]:
    """(ROWS_PER_Q, QPB, n_chunks): query tokens per query slot, query slots per program,
    row chunks per query, for programs of about ``block_m`` rows.  Powers of two;
    BLOCK_M = ROWS_PER_Q * QPB >= 16 (MMA minimum)."""
    rows = min(next_pow2(max(lq, 1)), max(MAX_ROWS_PER_Q, block_m))
    # without the cross product each query has its own candidates: nothing to share
    qpb = max(1, min(block_m // rows, next_pow2(max(nq, 1)))) if cross else 1
    rows = max(rows, 16 // qpb)
    return rows, qpb, cdiv(max(lq, 1), rows)


def _multi_doc(nj: int, ld: int, n_programs: int) -> bool:
    """A launch big enough for several documents per program (see FORWARD_DOCS_PER_PROGRAM)."""
    return nj % FORWARD_DOCS_PER_PROGRAM == 0 and n_programs >= FORWARD_MULTI_DOC_MIN_PROGRAMS * (2 if ld > 256 else 1)


def docs_per_program(nj: int, ld: int, n_programs: int, save_argmax: bool, elem: int,
                     block_rows: int = TARGET_BLOCK_M) -> int:
    """Documents each 16-bit forward program scores (see FORWARD_DOCS_PER_PROGRAM): only where
    it was measured faster -- inference, query blocks of at least TARGET_BLOCK_M rows, big
    launches, short documents or very many programs -- and only when it divides the document
    count.  (fp8: :func:`forward_blocking`.)  A smaller query block (one short query: rerank)
    costs little to reload per document, and one document per program reads HBM faster."""
    if save_argmax or elem != 2 or block_rows < TARGET_BLOCK_M or not _multi_doc(nj, ld, n_programs):
        return 1
    return FORWARD_DOCS_PER_PROGRAM


def tail_tile(ld: int, block_rows: int = TAIL_MIN_BLOCK_ROWS) -> int:
    """Width of the forward's tail tiles for documents of ``ld`` tokens scored by programs
    of ``block_rows`` query rows, 0 for none (see TAIL_MIN_BLOCK_ROWS).  The autotuner picks
    BLOCK_N (32, 64 or 128) after this is fixed, so the width suits all of them: the next
    power of two >= 16 above ``ld % 64`` (one tile covers the tail at BLOCK_N <= 64 and one
    or two at 128), or 64 when only BLOCK_N 128 leaves a tail.  The kernel splits only where
    the tail tile is narrower than BLOCK_N."""
    if block_rows < TAIL_MIN_BLOCK_ROWS or ld < TAIL_MIN_LD or ld % 128 == 0:
        return 0
    rem = ld % 64
    return 64 if rem == 0 else max(16, next_pow2(rem))


def forward_blocking(nq: int, lq: int, nj: int, ld: int, *, cross: bool, elem: int, d_pad: int,
                     save_argmax: bool) -> tuple[int, int, int, int]:
    """(ROWS_PER_Q, QPB, n_chunks, documents per program) of a forward launch: 256-row
    programs for 16-bit or fp8 operands up to 128 wide (WIDE_BLOCK_M), else 128; fp8 with
    short queries as FP8_SHORT_QUERY_MAX_LQ says."""
    wide = elem <= 2 and d_pad <= 128
    rows, qpb, n_chunks = row_blocking(lq, nq, cross, WIDE_BLOCK_M if wide else TARGET_BLOCK_M)
    if elem == 1 and not save_argmax and lq <= FP8_SHORT_QUERY_MAX_LQ and rows * qpb > TARGET_BLOCK_M:
        rows_s, qpb_s, chunks_s = row_blocking(lq, nq, cross, TARGET_BLOCK_M)
        if _multi_doc(nj, ld, nj * cdiv(nq, qpb_s) * chunks_s):
            return rows_s, qpb_s, chunks_s, FORWARD_DOCS_PER_PROGRAM
    return rows, qpb, n_chunks, docs_per_program(nj, ld, nj * cdiv(nq, qpb) * n_chunks, save_argmax, elem,
                                                  rows * qpb)


def gather_blocking(nq, nj, lq, d_pad, sms):
    """(BLOCK_S, BLOCK_J, programs per split, n_split, documents per split) of the gather on
    a device of ``sms`` streaming multiprocessors."""
    block_s = max(1, min(next_pow2(lq), 4096 // d_pad, GATHER_MAX_BLOCK_S))
    # ~64 gathered rows per step (fewer for wide embeddings: registers)
    block_j = max(1, min(next_pow2(nj), max(1, GATHER_STEP_ELEMS // (block_s * d_pad))))
    base_programs = nq * cdiv(lq, block_s)
    j_steps = cdiv(nj, block_j)
    n_split = 1
    if base_programs < GATHER_SPLIT_BELOW and j_steps >= GATHER_SPLIT_MIN_STEPS:
        n_split = max(1, min(j_steps, GATHER_TARGET_WAVES * sms // base_programs))
    j_per_split = cdiv(j_steps, n_split) * block_j
    return block_s, block_j, base_programs, cdiv(nj, j_per_split), j_per_split
