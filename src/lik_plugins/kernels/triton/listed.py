"""MaxSim of packed queries against candidates scored where they lie: an address table.

The hosts' retrieval entry points (PyLate ``rank.rerank``, colpali-engine ``score_multi_vector``,
sentence-transformers ``util.maxsim`` on lists) hold their candidates as long Python lists of
separate ``[Ld, d]`` tensors.  Concatenating them costs more than scoring them, so each
candidate is instead one row of a table: the address of its first token (int64), its token
count, and whether the host's zero padding joins its max; either each row has its own query
(a rerank list) or every query meets every row (``CROSS``: colpali / ST lists, several
queries' rows stacked in one block).  The forward kernel's tile loop (:func:`forward._document_row_max`) reads the candidate from its
own address; only the program setup and the epilogue are this file's.

Every candidate must be a ``[Ld, d]`` tensor with token stride ``d`` and element stride 1,
of one dtype on the launch's device, at an address that is a multiple of 16 bytes
(:func:`candidate_table` checks; a wrong address reads wrong memory).
``PAD`` (zero padding): the host right-pads the candidate with zero tokens before its max,
so a zero similarity competes -- a row whose similarities are all negative scores 0 -- as
``mask_mode="zero"``'s masked token does in the reference.  Scores are fp32 sums of the
rows' maxima (:func:`score_listed`).
"""
from __future__ import annotations

import array
import gc
from contextlib import contextmanager
from operator import attrgetter, itemgetter
from typing import NamedTuple

import numpy
import torch
import triton
import triton.language as tl

from .forward import DENSE, _document_row_max
from .blocking import TARGET_BLOCK_M, row_blocking
from .direct import launch
from .operands import precision as _precision
from .tuning import interpreting, k_tile, next_pow2


@triton.jit(do_not_specialize=["n_table", "n_q", "n_qblocks", "n_chunks"])
def listed_fwd_kernel(
    Q, CU_Q, ADDR, LEN, QIDX, PAD, DOC, OUT,
    n_table, n_q, n_qblocks, n_chunks, dim, s_qs,
    ROWS_PER_Q: tl.constexpr, QPB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    D_PAD: tl.constexpr, TAIL_N: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    HAS_PAD: tl.constexpr, CROSS: tl.constexpr, ROUND_MAX: tl.constexpr,
):
    # Program = (table row, query-row chunk, query block); the programs of one table row are
    # neighbours, so they read the same candidate while it is in L2.
    # CROSS: every query against every candidate, QPB queries' rows stacked in one block (the
    # matrix units see full-height tiles; each candidate tile is loaded once per block);
    # otherwise table row p belongs to query QIDX[p] alone (QPB == 1).
    BLOCK_M: tl.constexpr = ROWS_PER_Q * QPB
    pid = tl.program_id(0)
    n_m = n_qblocks * n_chunks
    i_p = pid // n_m
    i_chunk = (pid % n_m) // n_qblocks
    i_qb = pid % n_qblocks
    o_m = tl.arange(0, BLOCK_M)
    o_k = tl.arange(0, BLOCK_K)

    if CROSS:
        q_idx = i_qb * QPB + o_m // ROWS_PER_Q                                         # [BM] query of each row
        m_q = q_idx < n_q
    else:
        q_idx = tl.load(QIDX + i_p) + o_m * 0
        m_q = o_m < BLOCK_M
    q_start = tl.load(CU_Q + q_idx, mask=m_q, other=0)
    q_len = tl.load(CU_Q + q_idx + 1, mask=m_q, other=0) - q_start
    t_idx = i_chunk * ROWS_PER_Q + o_m % ROWS_PER_Q
    m_row = m_q & (t_idx < q_len)
    p_q = Q + (q_start.to(tl.int64) + t_idx) * s_qs                                    # [BM] row pointers
    if BLOCK_K == D_PAD:
        b_q = tl.load(p_q[:, None] + o_k[None, :], mask=m_row[:, None] & (o_k[None, :] < dim), other=0.0)
        if UPCAST:
            b_q = b_q.to(tl.float32)
    else:
        b_q = p_q   # unused: the tile loop reloads query slices per K tile

    # every address in the table is a multiple of 16 bytes (candidate_table checks): vector loads
    address = tl.multiple_of(tl.load(ADDR + i_p), 16)
    p_d = address.to(tl.pointer_type(DOC.dtype.element_ty))
    ld = tl.load(LEN + i_p)
    b_max, b_arg, b_floor = _document_row_max(
        b_q, p_q, m_row, p_d, p_d, p_d, ld, dim, 1, dim, 1, 0, p_d, DOC, DOC, 0, 0,
        False, False, False, False, BLOCK_M, BLOCK_N, BLOCK_K, D_PAD, UPCAST, PRECISION, False,
        TAIL_N, DENSE, 0, 16, False,
    )
    if HAS_PAD:
        b_floor = tl.where(tl.load(PAD + i_p) != 0, 0.0, b_floor)
    # a row scores its max when a token beat the zero padding (a tie scores 0 either way);
    # NaN stays NaN; rows past the query, and rows of an empty candidate, add 0
    m_win = ((b_max > float("-inf")) & (b_max >= b_floor)) | (b_max != b_max)
    if ROUND_MAX:
        # the hosts' einsum rounds every similarity to the embeddings' dtype before its max;
        # rounding is monotone, so rounding the row's max gives the same value
        b_max = _round_to_input(b_max, Q.dtype.element_ty)
    b_val = tl.where(m_win & m_row, b_max, 0.0)
    b_score = tl.sum(tl.reshape(b_val, [QPB, ROWS_PER_Q]), axis=1)                     # [QPB]
    # OUT [n_chunks, n_out, n_table]: n_out = n_q (CROSS) or 1
    o_q = i_qb * QPB + tl.arange(0, QPB)
    n_out = n_q if CROSS else 1
    p_out = OUT + (i_chunk.to(tl.int64) * n_out + o_q) * n_table + i_p
    tl.store(p_out, b_score, mask=o_q < n_out)


@triton.jit
def _round_to_input(x, DTYPE: tl.constexpr):
    """fp32 ``x`` rounded to nearest-even in ``DTYPE`` (fp16 / bf16), back in fp32."""
    if DTYPE == tl.bfloat16:
        # by its bits (what the hardware's conversion computes): the interpreter's fp32 ->
        # bf16 cast truncates; NaN and inf keep their bits, the largest values round to inf
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    elif DTYPE == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


def _config(d_pad: int, elem: int) -> dict:
    # A fixed config (no tuning table for this kernel yet): 64-token tiles for 16-bit tokens,
    # as the forward kernel's default; the narrower tail tile spends little work on short
    # candidates.
    block_n = 64 if d_pad <= 256 and elem <= 2 else 32
    meta = {"BLOCK_N": block_n, "BLOCK_K": k_tile(d_pad), "TAIL_N": 16 if block_n > 16 else 0}
    if not interpreting():
        meta.update(num_warps=4, num_stages=3 if elem <= 2 else 2)
    return meta


def score_listed(Q: torch.Tensor, cu_q: torch.Tensor, max_q: int, doc: torch.Tensor, addresses: torch.Tensor,
                 lengths: torch.Tensor, query_index: torch.Tensor | None, pad: torch.Tensor | None,
                 round_maxima: bool = False) -> torch.Tensor:
    """fp32 MaxSim scores of packed queries (rows ``cu_q[i] .. cu_q[i+1]`` of the contiguous
    ``Q [sum Lq, d]``) against the table's candidates (``lengths[p]`` tokens at
    ``addresses[p]``).

    ``query_index`` ``[P]``: table row ``p`` belongs to that query alone -> ``[P]``; None:
    every query against every candidate -> ``[n_q, P]``.  ``doc``: any candidate (its dtype
    types the addresses; never read).  ``pad`` (bool or int8 ``[P]``, or None): rows whose
    max the host's zero padding joins.  ``round_maxima``: each row's max is rounded to
    ``Q``'s dtype (fp16 / bf16; nearest-even) before the fp32 sum, as a host whose einsum
    outputs that dtype computes it.  Every address must be a multiple of 16 bytes
    (:func:`candidate_table`'s).  Table tensors live on ``Q``'s device; ``addresses`` int64, ``lengths``,
    ``query_index`` and ``cu_q`` int32 or int64."""
    n_table, dim, n_q = addresses.shape[0], Q.shape[-1], cu_q.shape[0] - 1
    cross = query_index is None
    elem = Q.element_size()
    d_pad = max(16, next_pow2(dim))
    # 128-row blocks: a 256-row query block with its candidate tiles outgrew the fixed config
    rows, qpb, n_chunks = row_blocking(max_q, n_q if cross else 1, cross, TARGET_BLOCK_M)
    n_qblocks = -(-n_q // qpb) if cross else 1
    n_out = n_q if cross else 1
    out = torch.empty((n_chunks, n_out, n_table), dtype=torch.float32, device=Q.device)
    if n_table and n_q:
        pad_arg = pad.view(torch.int8) if pad is not None and pad.dtype == torch.bool else pad
        # through the shipped binaries (direct.launch): a process's first rerank compiles nothing
        launch(listed_fwd_kernel, (n_table * n_qblocks * n_chunks,),
               (Q, cu_q, addresses, lengths, lengths if cross else query_index, lengths if pad is None else pad_arg,
                doc, out, n_table, n_q, n_qblocks, n_chunks, dim, Q.stride(0)),
               dict(ROWS_PER_Q=rows, QPB=qpb, D_PAD=d_pad, UPCAST=interpreting() and Q.dtype == torch.bfloat16,
                    PRECISION=_precision(Q.dtype), HAS_PAD=pad is not None, CROSS=cross,
                    ROUND_MAX=round_maxima and Q.dtype != torch.float32, **_config(d_pad, elem)))
    else:
        out.zero_()
    scores = out[0] if n_chunks == 1 else out.sum(0)
    return scores if cross else scores[0]


def score_table(queries: list, q_lens: torch.Tensor, table: "Table", query_index: torch.Tensor | None,
                pad: torch.Tensor | None, round_maxima: bool = False) -> torch.Tensor:
    """:func:`score_listed` of a list of ``[Lq_i, d]`` queries against ``table``'s candidates:
    the queries packed on the table's device, ``q_lens`` their token counts already there
    (uploaded with the table as ``extra``)."""
    device = table.lengths.device
    Q = torch.cat([q.to(device) for q in queries])
    cu_q = torch.zeros(len(queries) + 1, dtype=torch.int64, device=device)
    torch.cumsum(q_lens, 0, out=cu_q[1:])
    max_q = max(q.shape[0] for q in queries)
    if table.addresses is None:
        return _score_staged(Q, cu_q, max_q, table, query_index, pad, round_maxima)
    return score_listed(Q, cu_q, max_q, table.doc, table.addresses, table.lengths, query_index, pad, round_maxima)


@contextmanager
def paused_gc():
    """Python's cyclic garbage collector off for the block (restored as found).  A walk over a
    list of thousands of candidates allocates an object or two per candidate (shapes, result
    dicts); every few hundred allocations trigger a collection, and the older generations'
    ones traverse every live tensor -- most of the walk's time.  Nothing the walk allocates
    forms a cycle."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


# C-level getters for the passes over a candidate list
_DTYPE, _SHAPE = attrgetter("dtype"), attrgetter("shape")
_FIRST, _SECOND = itemgetter(0), itemgetter(1)


class Table(NamedTuple):
    """A candidate list on the scoring device: what :func:`score_listed` reads."""
    addresses: torch.Tensor | None   # int64 [N]: each candidate's first token (None: staged by chunks)
    lengths: torch.Tensor     # int64 [N]: its token count
    extra: torch.Tensor       # int64: the caller's integers, uploaded with the table
    host_lengths: list        # the token counts, as read on the host
    doc: torch.Tensor         # a candidate on the device (types the addresses)
    hold: object              # a staged table's candidates and chunks


@paused_gc()
def candidate_table(candidates: list, dtype: torch.dtype, dim: int, device: torch.device,
                    extra: list[int] = ()) -> Table | str:
    """The address table of ``candidates`` (``[Ld_i, dim]`` tensors of ``dtype``) on ``device``,
    with ``extra`` integers in the same host-to-device copy; a reason string where they
    cannot be read in place.

    Candidates already on ``device`` are read where they lie: a few passes over the list read
    each one's address and length (no copy of any token; each pass maps one C-level getter
    over the list -- no Python frame per tensor, which a list of thousands would feel -- and
    the integers go to the device through one buffer).  Candidates on the CPU for a CUDA
    ``device`` are staged: :func:`score_table` copies them chunk by chunk through two pinned
    host buffers and two device buffers of :data:`STAGE_BYTES` each (bounded memory, the
    host's copying overlapped with the device's) and scores each chunk where it landed."""
    tensor = torch.Tensor
    if set(map(type, candidates)) != {tensor} or set(map(_DTYPE, candidates)) != {dtype}:
        return f"candidates must be [Ld, {dim}] tensors of {dtype}"
    shapes = list(map(_SHAPE, candidates))
    if set(map(len, shapes)) != {2} or set(map(_SECOND, shapes)) != {dim}:
        return f"candidates must be [Ld, {dim}] tensors of {dtype}"
    sources = set(map(tensor.get_device, candidates))     # an index, -1 on the CPU (no device objects)
    if len(sources) != 1:
        return "candidates must lie on one device"
    source = sources.pop()
    target = -1 if device.type == "cpu" else device.index if device.index is not None else torch.cuda.current_device()
    lengths = list(map(_FIRST, shapes))
    n = len(candidates)
    row_bytes = dim * torch.empty((), dtype=dtype).element_size()
    if source == target:
        # the kernel's addressing: rows dim elements apart, elements adjacent
        if not all(map(tensor.is_contiguous, candidates)):
            return "candidates must be contiguous"
        buffer = array.array("q", list(map(tensor.data_ptr, candidates)) + lengths + list(extra))
        # numpy reads the buffer in place (a torch op on the CPU pays its dispatch and thread pool)
        if bool((numpy.frombuffer(buffer, dtype=numpy.int64, count=n) & 15).any()):
            # the kernel's loads are 16-byte vectors; an odd offset would fault
            return "candidate addresses must be multiples of 16 bytes"
        table = torch.frombuffer(buffer, dtype=torch.int64).to(device, non_blocking=True)
        return Table(table[:n], table[n:2 * n], table[2 * n:], lengths, candidates[0], None)
    if not (source == -1 and device.type == "cuda"):
        return f"candidates on device {source} for scoring on {device}"
    if row_bytes % 16:
        return "candidate rows must be multiples of 16 bytes"
    return _staged_table(candidates, lengths, extra, dtype, dim, device)


#: Bytes of candidate tokens a staging buffer holds (two on the host, pinned, two on the device).
STAGE_BYTES = 256 << 20


def _staged_table(candidates: list, lengths: list, extra, dtype: torch.dtype, dim: int,
                  device: torch.device) -> Table:
    """A table of host-resident candidates, scored chunk by chunk as :func:`score_table` stages
    them: ``addresses`` None, ``hold`` the candidates and their chunks (row ranges of at most
    :data:`STAGE_BYTES` of tokens, or one longer candidate)."""
    n = len(candidates)
    row_bytes = dim * torch.empty((), dtype=dtype).element_size()
    rows_per_stage = max(1, STAGE_BYTES // row_bytes)
    chunks, r0, tokens = [], 0, 0
    for r, length in enumerate(lengths):
        if r > r0 and tokens + length > rows_per_stage:
            chunks.append((r0, r, tokens))
            r0, tokens = r, 0
        tokens += length
    if n:
        chunks.append((r0, n, tokens))
    table = torch.frombuffer(array.array("q", lengths + list(extra)), dtype=torch.int64).to(device, non_blocking=True)
    lens = table[:n]
    return Table(None, lens, table[n:], lengths, torch.empty(0, dtype=dtype, device=device),
                 (candidates, chunks, torch.cumsum(lens, 0) - lens, row_bytes))


def _score_staged(Q, cu_q, max_q, table: Table, query_index, pad, round_maxima) -> torch.Tensor:
    """:func:`score_listed` of a staged table: each chunk of candidates is concatenated into a
    host buffer (pinned for a CUDA device), copied to a device buffer and scored in place
    there; two buffers of each kind alternate, so the host fills one chunk while the device
    copies and scores the previous one.  Device memory: two buffers, whatever the list."""
    candidates, chunks, starts, row_bytes = table.hold
    if not chunks:        # no candidates: the empty table's scores
        return score_listed(Q, cu_q, max_q, table.doc, table.lengths, table.lengths, query_index, pad)
    device, dtype, dim = Q.device, table.doc.dtype, Q.shape[1]
    cuda = device.type == "cuda"
    size = max(tokens for _, _, tokens in chunks)
    host_buffers = [torch.empty((size, dim), dtype=dtype, pin_memory=cuda) for _ in range(min(2, len(chunks)))]
    device_buffers = [torch.empty((size, dim), dtype=dtype, device=device) for _ in host_buffers]
    copied = [None] * len(host_buffers)       # CUDA events: the copy out of each host buffer done
    parts = []
    for k, (r0, r1, tokens) in enumerate(chunks):
        slot = k % len(host_buffers)
        if copied[slot] is not None:
            copied[slot].synchronize()        # the host buffer's previous chunk has left it
        host = host_buffers[slot][:tokens]
        torch.cat(candidates[r0:r1], out=host)
        staged = device_buffers[slot][:tokens]
        # the device buffer's previous chunk was scored by a launch queued before this copy
        staged.copy_(host, non_blocking=True)
        if cuda:
            copied[slot] = torch.cuda.Event()
            copied[slot].record()
        # rows row_bytes apart from a base the allocator aligns: every address a multiple of 16
        addresses = staged.data_ptr() + (starts[r0:r1] - starts[r0]) * row_bytes
        parts.append(score_listed(Q, cu_q, max_q, staged, addresses, table.lengths[r0:r1],
                                  None if query_index is None else query_index[r0:r1],
                                  None if pad is None else pad[r0:r1], round_maxima))
    return torch.cat(parts, dim=-1)


__all__ = ["Table", "candidate_table", "paused_gc", "score_listed", "score_table"]
