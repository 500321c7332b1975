"""Host launchers for the Triton kernels: allocate, pick tiles and grid, launch.

Same signatures as :mod:`lik_plugins.kernels.chunked`.  No host synchronisation happens
here (no ``.item()``, no data-dependent shapes), so forward and backward can be captured
in a CUDA graph once the autotuner has seen the shape bucket.

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
(``tests/kernels/test_shape_stability.py``).  Host-side plans are cached per exact
geometry (the fast path of a repeated shape); a new length builds its plan (tens of
microseconds) and replays the binary its bucket already has (``direct.py``).  The binaries
compiled ahead for guessed lengths (``ahead.py``) are these buckets' too: compiling ahead
changes when a binary is built, not how many there can be.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..common import COMPACT_MAX_ROWS, argmax_dtype, inverse_norms
from ..device import sm_count
from ..reference import FP8_MAX, INT8_MAX
from . import direct
from .backward import (
    maxsim_bwd_gather_kernel, maxsim_bwd_varlen_kernel, maxsim_bwd_winners_kernel, project_rows_kernel,
)
from . import forward as forward_formats
from .direct import launch
from .tuning import cdiv, doc_kernel_and_meta, forward_kernel_and_meta, interpreting, k_tile, next_pow2, size_class

# Counts above this do not fit the kernels' 32-bit integer arguments (Triton would specialise them as 64-bit).
_INT32_MAX = 2**31 - 1
# Upper bound on the binaries one kernel needs for one dtype / width / option set (above).
MAX_VARIANTS_PER_KERNEL = 40
# Lq above this is split into row chunks of this many tokens (exact: partial sums).
MAX_ROWS_PER_Q = 128
# Rows per program the forward aims for: 128 rows fill a Hopper warpgroup MMA twice over.
TARGET_BLOCK_M = 128
# With 16-bit (or fp8) inputs and d <= 128 a program owns up to 256 rows -- several
# queries, or 256 tokens of one long query -- so each document tile is read half as often.
# Measured on an H100: the inference forward 5-15 % faster at Lq 32-1024, the training
# forward with its argmax 2-7 % faster on the in-batch training shapes
# (docs/performance-notes.md).  fp32 or wider embeddings
# keep 128 so the query block and document tiles still fit in shared memory.
WIDE_BLOCK_M = 256
# The gather backward splits each query's documents until about this many programs run
# (two waves of an H100's 132 SMs), but only when fewer than GATHER_SPLIT_BELOW programs
# would run otherwise (rerank, search): a split costs three more host-side ops (fp32
# partials, their sum, a copy), ~0.1 ms on a slow host, which is more than the kernel time
# it saves once every SM has half a program (measured: docs/performance-notes.md).
# It also needs enough steps per program to be worth those ops: a step (BLOCK_J documents)
# takes ~1-2 us of dependent loads, the split ~50 us of host time on the H100 machine, so
# below GATHER_SPLIT_MIN_STEPS the unsplit gather finishes first (the 8x8 training shape:
# 4 steps; rerank 1x1000: 500).
GATHER_TARGET_WAVES = 2      # programs per SM of the device (an H100: 264)
GATHER_SPLIT_BELOW = 64
GATHER_SPLIT_MIN_STEPS = 32
# Gather blocking: up to GATHER_MAX_BLOCK_S query tokens per program, and about
# GATHER_STEP_ELEMS gathered elements (BLOCK_J documents x BLOCK_S rows x d) per step.
# On an H100 (docs/performance-notes.md) 16 tokens x 4 documents a step
# made the gather 1.6-2.2x faster than 32 x 2 (ColBERT 256 0.17 -> 0.078 ms, ColBERT 1024
# 1.94 -> 1.12, ColPali 256 0.27 -> 0.16): twice the programs, so twice the row loads in
# flight, for a kernel that waits on dependent random loads.
GATHER_MAX_BLOCK_S = 16
GATHER_STEP_ELEMS = 8192
# Largest fp32 grad_D buffer the unified backward allocates for the cross product; more
# documents are scattered slab by slab.  Slabs cost time (each is a launch with less
# parallelism: 4 MiB measured 1.3-3x slower on an H100), so the cap is generous.
UNIFIED_BUFFER_BYTES = 64 << 20
# lowmem for the cross product: each grad_D tile first lists the query rows whose winner
# lies in it (two scans of the document's winners, the list in an int16 scratch the size
# of the argmax), so its one-hot product walks Nq*Lq*BLOCK_T/Ld rows instead of all Nq*Lq.
# Row ids are 16-bit: up to COMPACT_MAX_ROWS query rows (common.py); the scans read
# COMPACT_SCAN winners a step.  On an H100 (docs/performance-notes.md)
# a ColBERT 256 step went 1.05 -> 0.75 ms, ColBERT 1024 17.5 -> 9.6 ms, ColPali 256 4.1 -> 2.1.
# Small shapes keep the dense walk (COMPACT_MIN_WORK): the gather then rides in its launch,
# one launch and one allocation less, which is what a launch-bound step is made of.
COMPACT_LOWMEM = True
COMPACT_SCAN = 4096
COMPACT_MIN_WORK = 1 << 24   # Nq*Lq * Nd*Ld: the dense walk's one-hot size
# A gather of fewer programs than the device has SMs rides in the grad_D launch.
GATHER_ALONE_MIN_WAVES = 1
# fp8 inference forward: an elementwise running max over the document tiles, reduced
# across columns once at the end instead of a cross-thread reduction per tile.  The fp8
# MMA is twice as fast, so the CUDA-core epilogue is its bottleneck; on an H100 this made
# fp8 11-17 % faster on every shape of an epilogue sweep, and bf16 9-18 % slower
# (its 64 more registers per thread cost more than the shuffles they save there).
RUNNING_MAX = True
# The training forward (argmax saved) can do the same: an elementwise running max plus the
# offset of the tile each element's max came from, so the per-tile work is a compare, a
# select and a max instead of two cross-column reductions (max, then the lowest winning
# column).  Same scores and winners bit for bit; OFF because on an H100 (each variant tuned
# on its own, docs/performance-notes.md) its two extra register
# tiles cost more than the reductions they save where documents are short: ColBERT 256
# 0.330 -> 0.362 ms, ColBERT 1024 5.08 -> 5.67; ColPali 64 0.083 -> 0.078, ColPali 256
# 1.169 -> 1.160 (Ld 1030: more tiles per program).
RUNNING_ARGMAX = False
# Documents per forward program: the query block is loaded once for all of them, so less
# is read from L2 per document.  On an H100 (docs/performance-notes.md)
# 4 documents made the 16-bit inference forward 5-13 % faster on big launches (search Lq 128
# 4.36 -> 3.80 ms, long query 16x1000 Lq 512 4.30 -> 3.72, in-batch 256 0.296 -> 0.271) but
# slower on launches of 2000-8000 programs over long documents (ColPali 16x1000 0.25 ->
# 0.28, long query 1x2000 0.88 -> 0.92), and the training forward (argmax) 28 % slower.
FORWARD_DOCS_PER_PROGRAM = 4
FORWARD_MULTI_DOC_MIN_PROGRAMS = 8192   # programs at one document each; twice that for Ld > 256


# fp8 inference with queries up to this long: 128-row programs (TARGET_BLOCK_M) with
# FORWARD_DOCS_PER_PROGRAM documents each, wherever the 16-bit multi-document rule would take
# such a launch; otherwise fp8 keeps the 256 x 1 blocking.  On an H100 (fp8 forward alone,
# each variant autotuned; docs/performance-notes.md), 256 x 1 ->
# 128 x 4: search 64x4096 Lq 32 0.958 -> 0.819 ms, in-batch 256 0.212 -> 0.214 (within
# noise); not taken: ColPali 16x1000 (4000 programs; 0.197 -> 0.223) and Lq 128 (3.14 ->
# 3.24-3.29).  0 turns the rule off (the sweep does, to time 256 x 1).
FP8_SHORT_QUERY_MAX_LQ = 32

# A document's last Ld % BLOCK_N tokens go through narrower tiles (``tail_tile``) instead of a
# whole BLOCK_N tile with the rest masked: masked columns cost the MMA and the epilogue as
# much as real ones, and ColPali's 1030-token pages padded 1030 -> 1088 columns at
# BLOCK_N 64 (1152 at 128).  On an H100 (docs/performance-notes.md) 2-8 %
# faster on the compute-bound forwards of Ld 1030 (query blocks of 128+ rows); where a
# program holds one short query (32 rows: rerank, per-query candidates) the forward reads
# the same bytes either way and a rerank of 4096 pages measured 1.6 % slower, so those
# keep the masked tile (TAIL_MIN_BLOCK_ROWS).  False: always the masked tile.
TAIL_TILES = True
TAIL_MIN_BLOCK_ROWS = 128
# ... and only for documents of TAIL_MIN_LD tokens or more: every tail width is one more
# binary per query-row bucket, and a loop whose document lengths change every step (ColBERT
# lengths, 60-300) met each new width as a 1.3-1.4 s compile in its first hundred steps on
# the H100 (benchmarks/real_loop.py, docs/performance-notes.md) for a gain that was only
# ever measured on 1030-token pages.
TAIL_MIN_LD = 512


def _multi_doc(nj: int, ld: int, n_programs: int) -> bool:
    """A launch big enough for several documents per program (see FORWARD_DOCS_PER_PROGRAM)."""
    if FORWARD_DOCS_PER_PROGRAM <= 1 or nj % FORWARD_DOCS_PER_PROGRAM:
        return False
    return n_programs >= FORWARD_MULTI_DOC_MIN_PROGRAMS * (2 if ld > 256 else 1)


def docs_per_program(nj: int, ld: int, n_programs: int, save_argmax: bool, elem: int,
                     block_rows: int = TARGET_BLOCK_M) -> int:
    """Documents each 16-bit forward program scores (see FORWARD_DOCS_PER_PROGRAM): only where
    it was measured faster -- inference, query blocks of at least TARGET_BLOCK_M rows, big
    launches, short documents or very many programs -- and only when it divides the document
    count.  (fp8: :func:`forward_blocking`.)  A smaller query block (one short query: rerank)
    costs little to reload per document, and one document per program reads HBM faster:
    rerank 1x100k on an H100 2.437 ms with 4 documents, 2.398-2.405 with 1
    (docs/performance-notes.md)."""
    if save_argmax or elem != 2 or block_rows < TARGET_BLOCK_M or not _multi_doc(nj, ld, n_programs):
        return 1
    return FORWARD_DOCS_PER_PROGRAM


def tail_tile(ld: int, block_rows: int = TAIL_MIN_BLOCK_ROWS) -> int:
    """Width of the forward's tail tiles for documents of ``ld`` tokens scored by programs
    of ``block_rows`` query rows, 0 for none (see TAIL_TILES).  The
    autotuner picks BLOCK_N (32, 64 or 128) after this is fixed, so the width suits all of
    them: the next power of two >= 16 above ``ld % 64`` (one tile covers the tail at
    BLOCK_N <= 64 and one or two at 128), or 64 when only BLOCK_N 128 leaves a tail.  The
    kernel splits only where the tail tile is narrower than BLOCK_N."""
    if not TAIL_TILES or block_rows < TAIL_MIN_BLOCK_ROWS or ld < TAIL_MIN_LD or ld % 128 == 0:
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


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs must not be silently computed at reduced precision: three TF32 passes
    # give ~fp32 accuracy on the tensor cores.  (fp16/bf16 ignore the setting.)
    return "tf32x3" if dtype == torch.float32 else "tf32"


_PLACEHOLDERS: dict = {}


def _placeholder(device, dtype) -> torch.Tensor:
    """A stand-in for an absent optional tensor (never read: its flag is off).  Empty, so it
    owns no memory (a null pointer): a cached allocation made while CUDA graph trees warm up
    would live in their pool untracked, which they reject.  Cached per device so the hot
    path builds nothing for it."""
    key = (device, dtype)
    found = _PLACEHOLDERS.get(key)
    if found is None:
        found = _PLACEHOLDERS[key] = torch.empty(0, dtype=dtype, device=device)
    return found


def _no_offsets(device) -> tuple:
    """The packed layouts' offset and pair-list pointers, for a dense launch (never read)."""
    index = _placeholder(device, torch.int32)
    return index, index, index, index


def _mask_bytes(mask: torch.Tensor | None, device) -> torch.Tensor:
    if mask is None:
        return _placeholder(device, torch.uint8)
    return mask.view(torch.uint8) if mask.dtype == torch.bool else (mask != 0).view(torch.uint8)


def _doc_view(D, cross):
    """(documents per query, Ld, strides (query, document, token, dim)) of ``D``: in the
    cross product every query sees the same documents (query stride 0)."""
    if cross:
        return D.shape[0], D.shape[1], (0, *D.stride())
    return D.shape[1], D.shape[2], tuple(D.stride())


def _norm_strides(rd, cross, normalize):
    """(query, document) strides of the document inverse norms (zeros when unused)."""
    if not normalize:
        return 0, 0
    return (0, rd.stride(0)) if cross else (rd.stride(0), rd.stride(1))


def row_blocking(lq: int, nq: int, cross: bool, block_m: int = TARGET_BLOCK_M) -> tuple[int, int, int]:
    """(ROWS_PER_Q, QPB, n_chunks): query tokens per query slot, query slots per program,
    row chunks per query, for programs of about ``block_m`` rows.  Powers of two;
    BLOCK_M = ROWS_PER_Q * QPB >= 16 (MMA minimum)."""
    rows = min(next_pow2(max(lq, 1)), max(MAX_ROWS_PER_Q, block_m))
    if cross:
        qpb = max(1, min(block_m // rows, next_pow2(max(nq, 1))))
    else:
        qpb = 1  # each query has its own candidates: nothing to share
    rows = max(rows, 16 // qpb)
    return rows, qpb, cdiv(max(lq, 1), rows)


class _ForwardPlan(NamedTuple):
    """Everything a forward launch needs but the tensors: see :func:`forward`."""
    kernel: object
    grid: tuple
    ints: tuple            # the kernel's integer arguments, in order
    meta: dict
    out_shape: tuple       # scores, or per-row-chunk partial scores
    n_chunks: int
    arg_dtype: torch.dtype | None
    empty: bool            # nothing to compute: zeros (and an argmax of -1)
    aux_ints: tuple = (0, 0, 0, 0)   # the document operand's strides and size (DocFormat)


# Document operands other than float tokens (forward.py ``DOC_FORMAT``).
# the kernel's document formats (forward.py), as plain ints for the host
DENSE, INT8, RESIDUAL, HIDDEN = (f.value for f in (forward_formats.DENSE, forward_formats.INT8, forward_formats.RESIDUAL,
                                                  forward_formats.HIDDEN))


class DocFormat(NamedTuple):
    """How the forward builds its document operand when ``D`` is not float tokens:

    * ``INT8``: ``D`` int8 tokens (``Q`` int8 too); the scales come in ``scales``.
    * ``RESIDUAL``: ``D`` the packed residuals ``[.., Ld, d*nbits/8]`` uint8, ``a0`` the codes
      ``[.., Ld]`` int32, ``a1`` the centroids ``[C, d]`` contiguous, ``a2`` the bucket
      weights ``[2**nbits]`` fp32 in stream order (:func:`stream_order_weights`); ``aux_n = C``.
    * ``HIDDEN``: ``D`` the hidden states ``[.., Ld, h]``, ``a0`` the projection ``W [d, h]``
      contiguous, ``a1`` its bias ``[d]`` (``has_bias``); ``aux_n = h``.

    ``a0_strides``: (query, document, token) strides of ``a0`` as ``D``'s (0 where ``a0``
    is shared by every document)."""
    kind: int
    a0: torch.Tensor | None = None
    a1: torch.Tensor | None = None
    a2: torch.Tensor | None = None
    a0_strides: tuple = (0, 0, 0)
    aux_n: int = 0
    nbits: int = 0
    has_bias: bool = False

    def key(self) -> tuple:
        dtypes = tuple(None if t is None else t.dtype for t in (self.a0, self.a1, self.a2))
        return (self.kind, dtypes, self.a0_strides, self.aux_n, self.nbits, self.has_bias)


_STREAM_ORDER: dict = {}


def stream_order_weights(bucket_weights: torch.Tensor, nbits: int) -> torch.Tensor:
    """``bucket_weights`` re-indexed by the residual field as stored in a byte (the bucket's
    ``nbits`` bits reversed): the RESIDUAL operand's ``a2``.  The permutation is cached per
    device; applying it is one small gather."""
    key = (nbits, bucket_weights.device)
    perm = _STREAM_ORDER.get(key)
    if perm is None:
        perm = torch.tensor([int(f"{field:0{nbits}b}"[::-1], 2) for field in range(1 << nbits)],
                            device=bucket_weights.device)
        _STREAM_ORDER[key] = perm
    return bucket_weights[perm].contiguous()


def _hidden_block(dtype: torch.dtype) -> int:
    # slices of the hidden state per projection step: [d, BLOCK_H] of W and [BLOCK_H, BLOCK_N] of H
    return 32 if dtype == torch.float32 else 64


def _format_meta(fmt: DocFormat, dtype: torch.dtype, dim: int, d_pad: int) -> dict:
    """The forward kernel's compile-time arguments for a document format (the projection
    head's sizes among them: forward.maxsim_fwd_kernel says why)."""
    hidden = fmt.kind == HIDDEN
    return dict(DOC_FORMAT=fmt.kind, NBITS=fmt.nbits, HAS_BIAS=fmt.has_bias, BLOCK_H=_hidden_block(dtype),
                N_HIDDEN=fmt.aux_n if hidden else 0, EVEN_DIM=fmt.kind in (HIDDEN, RESIDUAL) and dim == d_pad)


def _built_key(Q: torch.Tensor, D: torch.Tensor, fmt: DocFormat, packed: bool = False) -> tuple:
    """The config table's dtype field for documents built in the kernel.  Residuals are tuned
    per bit width and apart when packed: on an H100 (one query x 10k documents of 300 tokens)
    padded documents ran best on 64-token tiles (2 bits: 0.42 ms against 0.46 on 32), packed
    ones on 32 (2 bits: 0.54 against 0.59; 4 bits: 0.59 against 0.65)."""
    if fmt.kind != RESIDUAL:
        return (Q.dtype, D.dtype, fmt.kind)
    return (Q.dtype, D.dtype, fmt.kind, fmt.nbits) + (("packed",) if packed else ())


# Forward plans by the call's geometry (shapes, strides, dtype, device, mask and option
# flags).  A repeated shape -- every training step of a fixed batch, every rerank of a
# fixed candidate count -- skips the blocking, the tuner lookup and building the argument
# list; with the direct launch that is what the launch-bound shapes cost on the host
# (docs/performance-notes.md).  Cleared with :func:`clear_plans` by whoever changes the
# module's blocking constants.
_FORWARD_PLANS: dict = {}


def clear_plans() -> None:
    """Forget the forward and backward plans and the compiled-launch plans (after changing
    the blocking constants above or the tuner's remembered configs)."""
    _FORWARD_PLANS.clear()
    _LOWMEM_PLANS.clear()
    direct.clear()


def _plan_forward(Q, D, rd, cross, scaled, zero_mode, save_argmax, has_qm, has_dm, s_qm, s_dm, fmt=None,
                  lengths=False):
    """(plan, after_launch): ``after_launch`` is not None while the autotuner still has to
    run, and then the plan is for this call only.  ``lengths``: ``s_dm`` are the strides of
    per-document lengths (``DM_LENGTHS``), not of a mask."""
    nq, lq, dim = Q.shape
    nj, ld, (s_di, s_dj, s_dt, s_dh) = _doc_view(D, cross)
    kind = DENSE if fmt is None else fmt.kind
    built = kind in (RESIDUAL, HIDDEN)   # the operand is built in Q's dtype inside the kernel
    # float queries against e4m3 documents: the kernel quantises the query rows itself
    quant_q = Q.dtype != D.dtype and not built
    elem = Q.element_size() if built else D.element_size()  # of the MMA's operands
    # the MMA's K is at least 16 (16-bit) or 32 (fp8, int8) elements
    d_pad = max(32 if elem == 1 else 16, next_pow2(dim))
    assert not quant_q or (elem == 1 and k_tile(d_pad) == d_pad), "fused query quantisation: fp8 D, d <= 256"
    assert kind == DENSE or k_tile(d_pad) == d_pad, "int8 / residual / hidden documents: d <= 256"
    rows, qpb, n_chunks, dpp = forward_blocking(nq, lq, nj, ld, cross=cross, elem=elem, d_pad=d_pad,
                                                save_argmax=save_argmax)
    n_qblocks = cdiv(nq, qpb)
    # one row chunk (Lq <= 128, the common case) writes the final scores directly
    out_shape = (nq, nj) if n_chunks == 1 else (n_chunks, nq, nj)
    arg_dtype = argmax_dtype(ld) if save_argmax else None
    if nq * nj == 0 or lq == 0:
        return _ForwardPlan(None, (0,), (), {}, out_shape, n_chunks, arg_dtype, True), None
    if lengths:
        s_dmi, s_dmj, s_dmt = ((0, *s_dm) if cross else s_dm) + (0,)
    else:
        s_dmi, s_dmj, s_dmt = (0, 0, 0) if not has_dm else ((0, *s_dm) if cross else s_dm)
    s_rdi, s_rdj = _norm_strides(rd, cross, scaled)
    s_qmi, s_qms = s_qm if has_qm else (0, 0)
    running_max = RUNNING_ARGMAX if save_argmax else (RUNNING_MAX and elem == 1)
    n_programs = nj // dpp * n_qblocks * n_chunks
    # fused int8 query quantisation runs the int8 kernel's tiles: it shares their table entry
    tune_dtype = (D.dtype if kind == INT8 else (Q.dtype, D.dtype)) if quant_q else \
        _built_key(Q, D, fmt) if built else Q.dtype
    kernel, meta, after_launch = forward_kernel_and_meta(
        rows_per_q=rows, qpb=qpb, d_pad=d_pad, dtype=tune_dtype,
        n_programs=n_programs, save_arg=save_argmax, running_max=running_max, docs_per_program=dpp,
    )
    ints = (
        nq, nj, lq, ld, dim,
        Q.stride(0), Q.stride(1), Q.stride(2),
        s_di, s_dj, s_dt, s_dh,
        s_qmi, s_qms,
        s_dmi, s_dmj, s_dmt,
        s_rdi, s_rdj,
        n_qblocks, n_chunks, size_class(n_programs),
    )
    meta = dict(
        HAS_QM=has_qm, HAS_DM=has_dm, ZERO_MODE=bool(zero_mode), DM_LENGTHS=lengths,
        NORMALIZE=scaled, SAVE_ARG=bool(save_argmax),
        ROWS_PER_Q=rows, QPB=qpb, D_PAD=d_pad,
        UPCAST=interpreting() and Q.dtype == torch.bfloat16, PRECISION=_precision(Q.dtype if built else D.dtype),
        RUNNING_MAX=running_max, QUANT_Q=quant_q, QUANT_LIMIT=float(INT8_MAX if quant_q and kind == INT8 else FP8_MAX),
        DOCS_PER_PROGRAM=dpp, TAIL_N=tail_tile(ld, rows * qpb),
        **meta,
    )
    aux_ints = (0, 0, 0, 0)
    if fmt is not None:
        meta.update(_format_meta(fmt, Q.dtype, dim, d_pad))
        aux_ints = (*fmt.a0_strides, fmt.aux_n)
    grid = (n_programs,)
    return _ForwardPlan(kernel, grid, ints, meta, out_shape, n_chunks, arg_dtype, False, aux_ints), after_launch


def _documents_only(doc_format: DocFormat | None) -> bool:
    # the projection head's ``normalize`` leaves the queries as given (the kernel's SCALE_Q)
    return doc_format is not None and doc_format.kind == HIDDEN


def forward(Q, D, q_mask, d_mask, *, cross, normalize, zero_mode, save_argmax, scales=None,
            doc_format: DocFormat | None = None, d_lengths: torch.Tensor | None = None):
    """Scores (and the argmax when ``save_argmax``).  ``scales = (q_scales [Nq, Lq],
    d_scales [.., Ld])`` (fp32, contiguous) multiply every similarity by its two tokens'
    scales -- the fp8 and int8 paths' dequantisation; the kernel applies them exactly where
    it applies inverse norms, so ``normalize`` must be off.  ``q_scales = None`` with float
    ``Q`` and e4m3 ``D``: the kernel quantises the query rows itself (``QUANT_Q``; the
    embedding dim must be at most 256), with the numbers of a separate quantisation.
    ``doc_format``: documents that are not float tokens (:class:`DocFormat`); residual and
    hidden documents are normalised inside the kernel when ``normalize`` (hidden: the
    documents only, the queries scored as given).  ``d_lengths``
    (instead of ``d_mask``; padded documents, ``zero_mode`` off): int32 tokens per document
    (``[Nd]`` in the cross product, ``[Nq, K]`` per query), the tokens past it excluded."""
    device = Q.device
    qm = _mask_bytes(q_mask, device)
    assert d_lengths is None or (d_mask is None and not zero_mode and d_lengths.dtype == torch.int32)
    dm = _mask_bytes(d_mask, device) if d_lengths is None else d_lengths
    placeholder = _placeholder(device, torch.float32)
    built = doc_format is not None and doc_format.kind in (RESIDUAL, HIDDEN)
    if scales is not None:
        assert not normalize and not save_argmax, "scaled (fp8/int8) scores are inference-only and never normalised"
        rq, rd = scales
        rq = placeholder if rq is None else rq
    else:
        rq = inverse_norms(Q) if normalize and not _documents_only(doc_format) else placeholder
        rd = inverse_norms(D) if normalize and not built else placeholder
    scaled = bool(normalize) or scales is not None
    has_qm, has_dm = q_mask is not None, d_mask is not None
    s_qm = qm.stride() if has_qm else None
    s_dm = dm.stride() if has_dm or d_lengths is not None else None
    aux = (placeholder,) * 3 if doc_format is None else \
        tuple(placeholder if t is None else t for t in (doc_format.a0, doc_format.a1, doc_format.a2))
    # the kernel reads RQ as [Nq, Lq] contiguous and RD through its strides
    key = (Q.shape, Q.stride(), D.shape, D.stride(), Q.dtype, D.dtype, device, cross, scaled, bool(zero_mode),
           bool(save_argmax), s_qm, s_dm, rd.stride() if scaled else None,
           None if doc_format is None else doc_format.key(), d_lengths is not None)
    plan = _FORWARD_PLANS.get(key)
    after_launch = None
    if plan is None:
        plan, after_launch = _plan_forward(Q, D, rd, cross, scaled, zero_mode, save_argmax, has_qm, has_dm, s_qm,
                                           s_dm, doc_format, d_lengths is not None)
        if after_launch is None:
            if len(_FORWARD_PLANS) >= direct.MAX_PLANS:  # shapes that never repeat: start over
                _FORWARD_PLANS.clear()
            _FORWARD_PLANS[key] = plan
    argmax = None
    if save_argmax:
        argmax = torch.empty((Q.shape[0], plan.out_shape[-1], Q.shape[1]), dtype=plan.arg_dtype, device=device)
    if plan.empty:
        return torch.zeros(plan.out_shape[-2:], dtype=torch.float32, device=device), \
            (argmax.fill_(-1) if argmax is not None else None)
    scores = torch.empty(plan.out_shape, dtype=torch.float32, device=device)
    # Q, D and the masks are the caller's (views at any offset); the rest is ours
    launch(plan.kernel, plan.grid,
           (Q, D, qm, dm, rq, rd, scores, argmax if argmax is not None else placeholder, *_no_offsets(device),
            *plan.ints, *aux, *plan.aux_ints),
           plan.meta, static_key=key if after_launch is None else None, caller_tensors=(Q, D, qm, dm, rq, rd, *aux))
    if after_launch is not None:
        after_launch()
    return (scores if plan.n_chunks == 1 else scores.sum(0)), argmax


def _project_into(g32, X, inv_norm, out):
    """out = normalisation Jacobian of X applied to the fp32 rows g32 (one fused pass)."""
    dim = X.shape[-1]
    rows = g32.numel() // dim
    d_pad = max(16, next_pow2(dim))
    block_r = max(1, min(64, 8192 // d_pad))
    x_rows = X.reshape(rows, dim)
    launch(project_rows_kernel, (cdiv(rows, block_r),),
           (g32, x_rows, inv_norm.reshape(-1), out, rows, dim, x_rows.stride(0), x_rows.stride(1)),
           dict(BLOCK_R=block_r, D_PAD=d_pad))


def _finish_grad_d(g32, D, rd, out, normalize):
    if normalize:
        _project_into(g32, D, rd, out)
    else:
        out.copy_(g32)


def _gather_blocking(nq, nj, lq, d_pad, sms):
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


def _gather_pass(grad, Q, D, argmax, rq, rd, grad_q, gd32, *, cross, normalize):
    """One launch of the gather kernel: grad_Q (if ``grad_q``) and/or the atomic scatter
    into the fp32 ``gd32`` (if given) over the documents of ``D`` (a view: ``grad``,
    ``argmax`` and ``rd`` are sliced alike)."""
    nq, lq, dim = Q.shape
    nj, ld, (s_di, s_dj, s_dt, s_dh) = _doc_view(D, cross)
    s_rdi, s_rdj = _norm_strides(rd, cross, normalize)
    d_pad = max(16, next_pow2(dim))
    device = Q.device
    placeholder = _placeholder(device, torch.float32)
    need_q = grad_q is not None
    scatter = gd32 is not None
    block_s, block_j, base_programs, n_split, j_per_split = _gather_blocking(nq, nj, lq, d_pad, sm_count(device))
    partial = need_q and n_split > 1
    gq_out = grad_q
    if partial:
        gq_out = torch.empty((n_split, nq, lq, dim), dtype=torch.float32, device=device)
    launch(maxsim_bwd_gather_kernel, (base_programs * n_split,), (
        grad, Q, D, rq, rd, argmax, gq_out if gq_out is not None else placeholder,
        gd32 if gd32 is not None else placeholder,
        nq, nj, lq, ld, dim,
        grad.stride(0), grad.stride(1),
        Q.stride(0), Q.stride(1), Q.stride(2),
        s_di, s_dj, s_dt, s_dh,
        s_rdi, s_rdj,
        0 if cross else nj * ld * dim, ld * dim, argmax.stride(0),
        n_split, j_per_split,
    ), dict(
        NEED_Q=need_q, SCATTER_D=scatter, NORMALIZE=bool(normalize), PARTIAL=partial,
        BLOCK_J=block_j, BLOCK_S=block_s, D_PAD=d_pad, num_warps=4 if d_pad <= 128 else 8,
    ))
    if partial:
        summed = gq_out.sum(0)
        if normalize:
            _project_into(summed, Q, rq, grad_q)
        else:
            grad_q.copy_(summed)


def backward(grad, Q, D, argmax, *, cross, normalize, need_q, need_d, strategy, q_masked=True):
    """``strategy``: ``"lowmem"`` (destination-owned grad_D, deterministic, no fp32 buffer)
    or ``"unified"`` (gather + atomic scatter in one pass over the argmax).  ``q_masked``:
    the forward had a query mask, so rows without a winner may hold anything (NaN)."""
    device = Q.device
    if grad.dtype != torch.float32:
        grad = grad.float()
    if Q.numel() == 0 or D.numel() == 0 or grad.numel() == 0:
        return (torch.zeros_like(Q, memory_format=torch.contiguous_format) if need_q else None), \
            (D.new_zeros(D.shape) if need_d else None)
    placeholder = _placeholder(device, torch.float32)
    rq = inverse_norms(Q) if normalize else placeholder
    rd = inverse_norms(D) if normalize else placeholder
    if need_d and strategy != "unified":
        return _lowmem_backward(grad, Q, D, argmax, rq, rd, cross=cross, normalize=normalize, need_q=need_q,
                                q_masked=q_masked)
    return _unified_backward(grad, Q, D, argmax, rq, rd, cross=cross, normalize=normalize, need_q=need_q,
                             need_d=need_d)


class _LowmemPlan(NamedTuple):
    """Everything a lowmem backward needs but the tensors: see :func:`_lowmem_backward`."""
    kernel: object
    grid: object           # a tuple, or a function of the meta-parameters while the tuner runs
    ints: tuple            # the grad_D kernel's integer arguments, in order
    meta: dict
    gather: str | None     # grad_Q: "ride" (in the grad_D launch), "alone" (a pass of its own) or None
    rows: tuple | None     # shape of the compact walk's int16 row lists, or None
    zero_grad_d: bool      # the winners kernel writes winning rows only: the rest must be 0
    with_rows_arg: bool    # the document kernels take the row-list pointer, the winners kernel not


# lowmem backward plans by the call's geometry, as the forward's: a repeated training step
# skips the route choice, the blocking, the tuner lookup and the argument list, and its
# grad_D launch replays with a static key (no per-argument featurising).  These are the
# launch-bound steps (pairs, KD, ColPali 64, the small shapes), where host time is the step.
_LOWMEM_PLANS: dict = {}


def _lowmem_knobs() -> tuple:
    # module constants a plan depends on: part of the key, so a test or sweep that changes
    # one never replays a plan made under the old value
    return (COMPACT_LOWMEM, COMPACT_MIN_WORK, COMPACT_SCAN, GATHER_ALONE_MIN_WAVES, GATHER_MAX_BLOCK_S,
            GATHER_STEP_ELEMS, GATHER_SPLIT_BELOW, GATHER_SPLIT_MIN_STEPS, GATHER_TARGET_WAVES, MAX_ROWS_PER_Q)


def _lowmem_route(nq, lq, nj, ld, *, cross, need_q, n_gather, n_split, sms):
    """(grad_D kernel, how grad_Q is gathered) of a lowmem backward: kernel ``"compact"``,
    ``"winners"`` or ``"dense"``; grad_Q ``"ride"``, ``"alone"`` or None."""
    if cross and COMPACT_LOWMEM and nq * lq <= COMPACT_MAX_ROWS and nq * lq * nj * ld >= COMPACT_MIN_WORK:
        # Each grad_D tile lists its rows first (the scratch is the argmax's size).  grad_Q
        # is gathered after the lists are freed, for the peak -- unless the gather has too few
        # programs to fill the GPU on its own (ColPali 64: 64 programs; alone it made the step
        # 0.81 ms against 0.4-0.7 with it riding along, docs/performance-notes.md): then it rides in the
        # grad_D launch and its grad_Q lives beside the lists.
        ride = n_split == 1 and n_gather < GATHER_ALONE_MIN_WAVES * sms
        return "compact", ("ride" if ride else "alone") if need_q else None
    # candidates and pairs with Lq <= 128: zero-filled grad_D, winning rows written
    kernel = "winners" if not cross and lq <= MAX_ROWS_PER_Q else "dense"
    # without a split the gather rides in the grad_D launch
    return kernel, ("ride" if n_split == 1 else "alone") if need_q else None


def _plan_lowmem(grad, Q, D, argmax, rd, *, cross, normalize, need_q, q_masked):
    """(plan, after_launch), as :func:`_plan_forward`."""
    nq, lq, dim = Q.shape
    nj, ld, (s_di, s_dj, s_dt, s_dh) = _doc_view(D, cross)
    s_rdi, s_rdj = _norm_strides(rd, cross, normalize)
    d_pad = max(16, next_pow2(dim))
    sms = sm_count(Q.device)
    block_s, block_j, n_gather, n_split, _ = _gather_blocking(nq, nj, lq, d_pad, sms)
    kind, gather = _lowmem_route(nq, lq, nj, ld, cross=cross, need_q=need_q, n_gather=n_gather, n_split=n_split,
                                 sms=sms)
    ride = gather == "ride"
    n_gather = n_gather if ride else 0
    f32_dot = Q.dtype != torch.bfloat16
    ints = (
        nq, nj, lq, ld, dim,
        grad.stride(0), grad.stride(1),
        Q.stride(0), Q.stride(1), Q.stride(2),
        s_di, s_dj, s_dt, s_dh,
        s_rdi, s_rdj, argmax.stride(0),
        n_gather,
    )
    meta = dict(
        NORMALIZE=bool(normalize), F32_DOT=f32_dot, PRECISION=_precision(Q.dtype),
        UPCAST=interpreting() and Q.dtype == torch.bfloat16, BLOCK_J=block_j, BLOCK_S=block_s, D_PAD=d_pad,
        WITH_GATHER=ride,
    )
    if kind == "winners":
        meta.update(BLOCK_SW=max(16, next_pow2(lq)),
                    **({} if interpreting() else {"num_warps": 4 if d_pad <= 128 else 8, "num_stages": 1}))
        return _LowmemPlan(maxsim_bwd_winners_kernel, (n_gather + nq * nj,), ints, meta, gather, None, True,
                           False), None
    compact = kind == "compact"
    n_docs = nj if cross else nq * nj
    # a listed row always has a winner: nothing to guard
    guard_rows = q_masked and not compact
    kernel, tuned, after_launch = doc_kernel_and_meta(
        d_pad=d_pad, n_programs_at_64=n_docs * cdiv(ld, 64), cross=cross, f32_dot=f32_dot, normalize=normalize,
        with_gather=ride, dtype=Q.dtype, guard_rows=guard_rows, compact=compact,
    )
    meta.update(CROSS=cross, GUARD_ROWS=guard_rows, **tuned)
    if compact:
        meta.update(COMPACT=True, SCAN=min(COMPACT_SCAN, next_pow2(nq * lq)))

    def grid(m):
        return (n_gather + n_docs * cdiv(ld, m["BLOCK_T"]),)

    return _LowmemPlan(kernel, grid if after_launch is not None else grid(meta), ints, meta, gather,
                       (nj, nq * lq) if compact else None, False, True), after_launch


def _lowmem_backward(grad, Q, D, argmax, rq, rd, *, cross, normalize, need_q, q_masked):
    """grad_D destination-owned (each program writes its own tiles: deterministic, no fp32
    buffer), grad_Q gathered from the saved winners, in the grad_D launch or after it."""
    device = Q.device
    key = (Q.shape, Q.stride(), D.shape, D.stride(), grad.stride(), argmax.shape, argmax.stride(), Q.dtype,
           D.dtype, device, cross, bool(normalize), need_q, q_masked, _lowmem_knobs())
    plan = _LOWMEM_PLANS.get(key)
    after_launch = None
    if plan is None:
        plan, after_launch = _plan_lowmem(grad, Q, D, argmax, rd, cross=cross, normalize=normalize, need_q=need_q,
                                          q_masked=q_masked)
        if after_launch is None:
            if len(_LOWMEM_PLANS) >= direct.MAX_PLANS:
                _LOWMEM_PLANS.clear()
            _LOWMEM_PLANS[key] = plan
    placeholder = _placeholder(device, torch.float32)
    # Allocation order is the peak's: a riding grad_Q lives beside the row lists, a gather
    # of its own starts after they are freed.
    grad_q = torch.empty_like(Q, memory_format=torch.contiguous_format) if plan.gather == "ride" else None
    rows = torch.empty(plan.rows, dtype=torch.int16, device=device) if plan.rows is not None else None
    grad_d = (torch.zeros if plan.zero_grad_d else torch.empty)(D.shape, dtype=D.dtype, device=device)
    args = (grad, Q, D, rq, rd, argmax, grad_d, placeholder if grad_q is None else grad_q, *plan.ints)
    if plan.with_rows_arg:
        args += (placeholder if rows is None else rows,)
    # the caller's: grad (autograd's, any view), Q, D, the argmax (a view for pairs); the rest is ours
    launch(plan.kernel, plan.grid, args, plan.meta, static_key=key if after_launch is None else None,
           caller_tensors=(grad, Q, D, argmax))
    if after_launch is not None:
        after_launch()
    del rows, args  # the argument tuple holds the row lists too: both go before grad_Q is allocated
    if plan.gather == "alone":
        grad_q = torch.empty_like(Q, memory_format=torch.contiguous_format)
        _gather_pass(grad, Q, D, argmax, rq, rd, grad_q, None, cross=cross, normalize=normalize)
    return grad_q, grad_d


def _unified_backward(grad, Q, D, argmax, rq, rd, *, cross, normalize, need_q, need_d):
    """grad_Q gathered from the saved winners and, if ``need_d``, grad_D scattered into
    fp32 with atomics in the same pass (one pass over the argmax)."""
    nq, lq, dim = Q.shape
    nj = D.shape[0] if cross else D.shape[1]
    ld = D.shape[-2]
    device = Q.device
    grad_q = torch.empty_like(Q, memory_format=torch.contiguous_format) if need_q else None
    # fp32 inputs without normalisation scatter straight into grad_D; otherwise an fp32
    # buffer is needed, and for the cross product it is bounded: slab by slab from the host
    # above UNIFIED_BUFFER_BYTES (grad_Q then gets its own gather pass).
    direct = need_d and D.dtype == torch.float32 and not normalize
    slab = nj
    if need_d and not direct and cross:
        slab = max(1, min(nj, UNIFIED_BUFFER_BYTES // max(ld * dim * 4, 1)))
    one_pass = need_d and slab == nj
    # Allocations are counted: on a slow host each torch call is tens of microseconds.  The
    # one-pass grad_D is the fp32 buffer cast once (no separate empty + copy).
    grad_d = None
    if need_d and (direct or normalize or not one_pass):
        grad_d = torch.zeros(D.shape, dtype=D.dtype, device=device) if direct else \
            torch.empty(D.shape, dtype=D.dtype, device=device)
    gd32 = None
    if one_pass:
        gd32 = grad_d if direct else torch.zeros(D.shape, dtype=torch.float32, device=device)
    if need_q or one_pass:
        _gather_pass(grad, Q, D, argmax, rq, rd, grad_q, gd32, cross=cross, normalize=normalize)
    if one_pass and not direct:
        if normalize:
            _project_into(gd32, D, rd, grad_d)
        else:
            grad_d = gd32.to(D.dtype)
    if need_d and not one_pass:
        buffer = torch.empty((slab, ld, dim), dtype=torch.float32, device=device)
        for j0 in range(0, nj, slab):
            j1 = min(nj, j0 + slab)
            chunk = buffer[: j1 - j0].zero_()
            rd_slab = rd[j0:j1] if normalize else rd
            _gather_pass(grad[:, j0:j1], Q, D[j0:j1], argmax[:, j0:j1], rq, rd_slab,
                         None, chunk, cross=True, normalize=normalize)
            _finish_grad_d(chunk, D[j0:j1], rd_slab, grad_d[j0:j1], normalize)
    return grad_q, grad_d


# --------------------------------------------------------------------------- packed layouts
def varlen_forward(Q, D, cu_q, cu_d, pairs, q_mask, d_mask, *, max_q, max_d, normalize, zero_mode, save_argmax,
                   doc_format: DocFormat | None = None, q_scale: torch.Tensor | None = None):
    """Packed MaxSim on the forward kernel (``VARLEN``; ``PAIRS`` for a pair list), same
    signature and outputs as :func:`lik_plugins.kernels.chunked.varlen_forward`.  The query
    blocking comes from ``max_q`` (a bound: shorter queries leave rows idle); each
    document's tile loop runs to its own length, so ``max_d`` only sizes the winners.
    ``doc_format``: packed documents that are not float tokens (:class:`DocFormat`, its
    ``a0`` packed like ``D``: token stride ``a0_strides[2]``), built in the tile load.
    ``q_scale``: fp32 ``[query rows]`` factors that replace the queries' inverse norms under
    ``normalize`` (ones: documents normalised, queries as given -- fast-plaid's PLAID score)."""
    device = Q.device
    dim = Q.shape[-1]
    nq, nd = cu_q.numel() - 1, cu_d.numel() - 1
    n_pairs = pairs[0].shape[0] if pairs is not None else 0
    elem = Q.element_size()
    d_pad = max(16, next_pow2(dim))
    block_m = WIDE_BLOCK_M if elem <= 2 and d_pad <= 128 else TARGET_BLOCK_M
    built = doc_format is not None
    assert not built or doc_format.kind in (RESIDUAL, HIDDEN), "packed documents: float, residual or hidden"
    if pairs is not None:
        rows, qpb, n_chunks = row_blocking(max_q, 1, False, block_m)
        n_rows, n_j, n_qblocks = 1, n_pairs, 1
    else:
        rows, qpb, n_chunks = row_blocking(max_q, nq, True, block_m)
        n_rows, n_j, n_qblocks = nq, nd, cdiv(nq, qpb)
    arg_dtype = argmax_dtype(max_d)
    argmax = None
    if save_argmax:
        argmax = torch.full((n_rows, n_j, max_q), -1, dtype=arg_dtype, device=device) if max_q * n_j * n_rows \
            else torch.empty((n_rows, n_j, max_q), dtype=arg_dtype, device=device)
    if n_rows * n_j == 0 or max_q == 0:
        scores = torch.zeros((n_rows, n_j), dtype=torch.float32, device=device)
    else:
        placeholder = _placeholder(device, torch.float32)
        qm, dm = _mask_bytes(q_mask, device), _mask_bytes(d_mask, device)
        rq = (inverse_norms(Q) if q_scale is None else q_scale) if normalize and not _documents_only(doc_format) \
            else placeholder
        rd = inverse_norms(D) if normalize and not built else placeholder
        index = _placeholder(device, torch.int32)
        pair_q, pair_d = pairs if pairs is not None else (index, index)
        n_programs = n_j * n_qblocks * n_chunks
        # packed float documents have their own table rows: a pair list's short documents
        # (50-300 tokens, a program each) ran best on other tiles than a padded 1 x 100k rerank
        kernel, meta, after_launch = forward_kernel_and_meta(
            rows_per_q=rows, qpb=qpb, d_pad=d_pad, dtype=_built_key(Q, D, doc_format, packed=True) if built else
            (Q.dtype, D.dtype, DENSE, "packed"), n_programs=n_programs, save_arg=save_argmax)
        if built:
            meta.update(_format_meta(doc_format, Q.dtype, dim, d_pad))
            aux = (*(placeholder if t is None else t for t in (doc_format.a0, doc_format.a1, doc_format.a2)),
                   *doc_format.a0_strides, doc_format.aux_n)
        else:
            aux = (placeholder, placeholder, placeholder, 0, 0, 0, 0)
        out = torch.empty((n_chunks, n_rows, n_j) if n_chunks > 1 else (n_rows, n_j), dtype=torch.float32,
                          device=device)
        ints = (
            n_rows, n_j, max_q, max_d, dim,
            0, Q.stride(0), Q.stride(1),
            0, 0, D.stride(0), D.stride(1),
            0, qm.stride(0) if q_mask is not None else 0,
            0, 0, dm.stride(0) if d_mask is not None else 0,
            0, 0,
            n_qblocks, n_chunks, size_class(n_programs),
        )
        meta = dict(
            HAS_QM=q_mask is not None, HAS_DM=d_mask is not None, ZERO_MODE=bool(zero_mode),
            NORMALIZE=bool(normalize), SAVE_ARG=bool(save_argmax), ROWS_PER_Q=rows, QPB=qpb, D_PAD=d_pad,
            UPCAST=interpreting() and Q.dtype == torch.bfloat16, PRECISION=_precision(Q.dtype),
            VARLEN=True, PAIRS=pairs is not None, **meta,
        )
        static_key = None
        if after_launch is None:
            # what Triton specialises on beyond the meta-parameters (direct.launch): the
            # specialised strides and sizes, the dtypes; the lengths and counts are not
            # specialised (only their 32-bit fit, which the packed ops' offsets rule keeps)
            static_key = ("varlen", tuple(meta.items()), dim, Q.dtype, D.dtype, cu_q.dtype, pair_q.dtype, arg_dtype,
                          Q.stride(), D.stride(), ints[13], ints[16], aux[5:],
                          None if doc_format is None else doc_format.key(),
                          max(n_rows, n_j, max_q, max_d) <= _INT32_MAX)
        launch(kernel, (n_programs,),
               (Q, D, qm, dm, rq, rd, out, argmax if argmax is not None else placeholder, cu_q, cu_d, pair_q, pair_d,
                *ints, *aux), meta, static_key=static_key,
               caller_tensors=(Q, D, qm, dm, rq, rd, cu_q, cu_d, pair_q, pair_d, *aux[:3]))
        if after_launch is not None:
            after_launch()
        scores = out if n_chunks == 1 else out.sum(0)
    if pairs is not None:
        return scores[0], (argmax[0] if argmax is not None else None)
    return scores, argmax


def varlen_backward(grad, Q, D, cu_q, cu_d, pairs, argmax, *, normalize, need_q, need_d):
    """Gradients of :func:`varlen_forward` through its winners, same signature and outputs as
    :func:`lik_plugins.kernels.chunked.varlen_backward`: one launch of the packed gather
    (``maxsim_bwd_varlen_kernel``) -- grad_Q gathered per query block, grad_D scattered into
    an fp32 buffer with atomics (the ``unified`` strategy: the packed documents have no
    fixed tile grid for the destination-owned lowmem kernels), then one pass that applies
    the normalisation Jacobian or casts.  fp32 atomics add in no fixed order, so packed
    gradients can differ in the last bits between runs."""
    device = Q.device
    dim = Q.shape[-1]
    if grad.dtype != torch.float32:
        grad = grad.float()
    max_q = argmax.shape[-1]
    n_rows = grad.shape[0]
    n_j = 1 if pairs is not None else grad.shape[1]
    if not (Q.shape[0] and D.shape[0] and n_rows * n_j * max_q):
        return (torch.zeros_like(Q) if need_q else None), (torch.zeros_like(D) if need_d else None)
    placeholder = _placeholder(device, torch.float32)
    rq = inverse_norms(Q) if normalize else placeholder
    rd = inverse_norms(D) if normalize else placeholder
    d_pad = max(16, next_pow2(dim))
    block_s, block_j, base_programs, n_split, j_per_split = _gather_blocking(n_rows, n_j, max_q, d_pad,
                                                                             sm_count(device))
    # a pair list repeats queries, and a split walks a query's documents in several programs:
    # then several programs add into one grad_Q row
    atomic_q = pairs is not None or n_split > 1
    gq = None
    if need_q:
        # zeros: rows no offset covers (before cu_q[0]) get no program
        gq = torch.zeros(Q.shape, dtype=torch.float32 if atomic_q else Q.dtype, device=device)
    gd32 = torch.zeros(D.shape, dtype=torch.float32, device=device) if need_d else None
    index = _placeholder(device, torch.int32)
    pair_q, pair_d = pairs if pairs is not None else (index, index)
    s_gj = grad.stride(1) if pairs is None else 0
    meta = dict(
        NEED_Q=bool(need_q), SCATTER_D=bool(need_d), NORMALIZE=bool(normalize), ATOMIC_Q=atomic_q,
        PAIRS=pairs is not None, BLOCK_J=block_j, BLOCK_S=block_s, D_PAD=d_pad, num_warps=4 if d_pad <= 128 else 8,
    )
    # specialised: the meta-parameters, dim, the strides but grad's and the argmax's first, the
    # dtypes (direct.launch); the counts are not, and fit 32 bits (the offsets rule)
    static_key = ("varlen_bwd", tuple(meta.items()), dim, s_gj, Q.stride(), D.stride(), Q.dtype, D.dtype,
                  argmax.dtype, cu_q.dtype, pair_q.dtype, None if gq is None else gq.dtype,
                  max(n_rows, n_j, j_per_split) <= _INT32_MAX)
    launch(maxsim_bwd_varlen_kernel, (base_programs * n_split,), (
        grad, Q, D, rq, rd, argmax, gq if gq is not None else placeholder, gd32 if gd32 is not None else placeholder,
        cu_q, cu_d, pair_q, pair_d,
        n_rows, n_j, max_q, dim,
        grad.stride(0), s_gj,
        Q.stride(0), Q.stride(1), D.stride(0), D.stride(1),
        argmax.stride(0), n_split, j_per_split,
    ), meta, static_key=static_key, caller_tensors=(grad, Q, D, argmax, cu_q, cu_d, pair_q, pair_d))
    grad_q = grad_d = None
    if need_q:
        grad_q = _finish_rows(gq, Q, rq, normalize) if atomic_q else gq
    if need_d:
        grad_d = _finish_rows(gd32, D, rd, normalize)
    return grad_q, grad_d


def _finish_rows(g32, X, inv_norm, normalize):
    """An fp32 gradient buffer of ``X``'s rows as ``X``'s gradient: through the
    normalisation Jacobian, or cast (the buffer itself for fp32)."""
    if normalize:
        out = torch.empty(X.shape, dtype=X.dtype, device=X.device)
        _project_into(g32, X, inv_norm, out)
        return out
    return g32 if X.dtype == torch.float32 else g32.to(X.dtype)
