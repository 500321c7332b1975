"""MaxSim of packed queries against candidates scored where they lie: an address table.

The hosts' retrieval entry points (PyLate ``rank.rerank``, colpali-engine ``score_multi_vector``,
sentence-transformers ``util.maxsim`` on lists) hold their candidates as long Python lists of
separate ``[Ld, d]`` tensors.  Concatenating them costs more than scoring them, so each
candidate is instead one row of a table: the address of its first token (int64), its token
count, the query it is scored against, and whether the host's zero padding joins its max.
The forward kernel's tile loop (:func:`forward._document_row_max`) reads the candidate from its
own address; only the program setup and the epilogue are this file's.

Every candidate must be a ``[Ld, d]`` tensor with token stride ``d`` and element stride 1,
of one dtype on the launch's device (the caller checks; a wrong address reads wrong memory).
``PAD`` (zero padding): the host right-pads the candidate with zero tokens before its max,
so a zero similarity competes -- a row whose similarities are all negative scores 0 -- as
``mask_mode="zero"``'s masked token does in the reference.  Scores are fp32 sums of the
rows' maxima, one per table row (:func:`score_listed`).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .forward import DENSE, _document_row_max
from .launch import WIDE_BLOCK_M, TARGET_BLOCK_M, _precision, row_blocking
from .tuning import interpreting, k_tile, next_pow2


@triton.jit(do_not_specialize=["n_pairs", "n_chunks"])
def listed_fwd_kernel(
    Q, CU_Q, ADDR, LEN, QIDX, PAD, DOC, OUT,
    n_pairs, n_chunks, dim, s_qs,
    ROWS_PER_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, D_PAD: tl.constexpr,
    TAIL_N: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    HAS_PAD: tl.constexpr, ALIGNED: tl.constexpr,
):
    # Program = (table row, query-row chunk); the chunks of one row are neighbours, so they
    # read the same candidate while it is in L2.
    pid = tl.program_id(0)
    i_p = pid // n_chunks
    i_chunk = pid % n_chunks
    o_m = tl.arange(0, ROWS_PER_Q)
    o_k = tl.arange(0, BLOCK_K)

    q = tl.load(QIDX + i_p)
    q_start = tl.load(CU_Q + q)
    q_len = tl.load(CU_Q + q + 1) - q_start
    t_idx = i_chunk * ROWS_PER_Q + o_m
    m_row = t_idx < q_len
    p_q = Q + (q_start.to(tl.int64) + t_idx) * s_qs                                    # [BM] row pointers
    if BLOCK_K == D_PAD:
        b_q = tl.load(p_q[:, None] + o_k[None, :], mask=m_row[:, None] & (o_k[None, :] < dim), other=0.0)
        if UPCAST:
            b_q = b_q.to(tl.float32)
    else:
        b_q = p_q   # unused: the tile loop reloads query slices per K tile

    address = tl.load(ADDR + i_p)
    if ALIGNED:
        # every address in the table is a multiple of 16 (the launcher checked): vector loads
        address = tl.multiple_of(address, 16)
    p_d = address.to(tl.pointer_type(DOC.dtype.element_ty))
    ld = tl.load(LEN + i_p)
    b_max, b_arg, b_floor = _document_row_max(
        b_q, p_q, m_row, p_d, p_d, p_d, ld, dim, 1, dim, 1, 0, p_d, DOC, DOC, 0, 0,
        False, False, False, False, ROWS_PER_Q, BLOCK_N, BLOCK_K, D_PAD, UPCAST, PRECISION, False,
        TAIL_N, DENSE, 0, 16, False,
    )
    if HAS_PAD:
        b_floor = tl.where(tl.load(PAD + i_p) != 0, 0.0, b_floor)
    # a row scores its max when a token beat the zero padding (a tie scores 0 either way);
    # NaN stays NaN; rows past the query, and rows of an empty candidate, add 0
    m_win = ((b_max > float("-inf")) & (b_max >= b_floor)) | (b_max != b_max)
    b_val = tl.where(m_win & m_row, b_max, 0.0)
    tl.store(OUT + i_chunk.to(tl.int64) * n_pairs + i_p, tl.sum(b_val, axis=0))


def _config(d_pad: int, elem: int, rows: int) -> dict:
    # Memory-bound (one query's rows per candidate): 64-token tiles for 16-bit tokens keep
    # enough loads in flight; the narrower tail tile spends little work on short candidates.
    block_n = 64 if d_pad <= 256 and elem <= 2 else 32
    meta = {"BLOCK_N": block_n, "BLOCK_K": k_tile(d_pad), "TAIL_N": 16 if block_n > 16 else 0}
    if not interpreting():
        meta.update(num_warps=8 if rows >= 256 else 4, num_stages=3 if elem <= 2 else 2)
    return meta


def score_listed(Q: torch.Tensor, cu_q: torch.Tensor, max_q: int, doc: torch.Tensor, addresses: torch.Tensor,
                 lengths: torch.Tensor, query_index: torch.Tensor, pad: torch.Tensor | None,
                 aligned: bool) -> torch.Tensor:
    """``[P]`` fp32 MaxSim scores: table row ``p`` is query ``query_index[p]`` (rows
    ``cu_q[i] .. cu_q[i+1]`` of the packed, contiguous ``Q [sum Lq, d]``) against the
    ``lengths[p]`` tokens at ``addresses[p]``.

    ``doc``: any candidate (its dtype types the addresses; never read).  ``pad`` (bool or
    int8, ``[P]``, or None): rows whose max the host's zero padding joins.  ``aligned``: every
    address is a multiple of 16 bytes.  Table tensors live on ``Q``'s device; ``addresses``
    int64, ``lengths``, ``query_index`` and ``cu_q`` int32 or int64."""
    n_pairs, dim = addresses.shape[0], Q.shape[-1]
    out_dtype = torch.float32
    if n_pairs == 0:
        return torch.zeros(0, dtype=out_dtype, device=Q.device)
    elem = Q.element_size()
    d_pad = max(16, next_pow2(dim))
    block_m = WIDE_BLOCK_M if elem <= 2 and d_pad <= 128 else TARGET_BLOCK_M
    rows, _, n_chunks = row_blocking(max_q, 1, False, block_m)
    meta = _config(d_pad, elem, rows)
    out = torch.empty((n_chunks, n_pairs), dtype=out_dtype, device=Q.device)
    pad_arg = pad.view(torch.int8) if pad is not None and pad.dtype == torch.bool else pad
    listed_fwd_kernel[(n_pairs * n_chunks,)](
        Q, cu_q, addresses, lengths, query_index, pad_arg if pad_arg is not None else lengths, doc, out,
        n_pairs, n_chunks, dim, Q.stride(0),
        ROWS_PER_Q=rows, D_PAD=d_pad, UPCAST=interpreting() and Q.dtype == torch.bfloat16,
        PRECISION=_precision(Q.dtype), HAS_PAD=pad is not None, ALIGNED=bool(aligned), **meta,
    )
    return out[0] if n_chunks == 1 else out.sum(0)



class Table(NamedTuple):
    """A candidate list on the scoring device: what :func:`score_listed` reads."""
    addresses: torch.Tensor   # int64 [N]: each candidate's first token
    lengths: torch.Tensor     # int64 [N]: its token count
    extra: torch.Tensor       # int64: the caller's integers, uploaded with the table
    doc: torch.Tensor         # a candidate on the device (types the addresses)
    aligned: bool             # every address a multiple of 16 bytes
    hold: object              # storage the addresses point into (a staged copy), kept alive


def candidate_table(candidates: list, dtype: torch.dtype, dim: int, device: torch.device,
                    extra: list[int] = ()) -> Table | str:
    """The address table of ``candidates`` (``[Ld_i, dim]`` tensors of ``dtype``) on ``device``,
    with ``extra`` integers in the same host-to-device copy; a reason string where they
    cannot be read in place.

    Candidates already on ``device`` are read where they lie: one pass over the list reads
    each one's address and length (no copy of any token).  Candidates on the CPU for a CUDA
    ``device`` are copied once into one pinned staging buffer and moved in one transfer;
    their addresses are then offsets into that buffer, computed on the device."""
    tensor = torch.Tensor
    if not all(type(t) is tensor for t in candidates):
        return "candidates must be tensors"
    if not all(t.dtype is dtype for t in candidates):
        return f"candidates must all be {dtype}"
    if not all(t.dim() == 2 for t in candidates) or not all(t.shape[1] == dim for t in candidates):
        return f"candidates must be [Ld, {dim}] tensors"
    lengths = [t.shape[0] for t in candidates]
    devices = {t.device for t in candidates}
    if len(devices) != 1:
        return "candidates must lie on one device"
    source = devices.pop()
    row_bytes = dim * torch.empty((), dtype=dtype).element_size()
    if source == device:
        # the kernel's addressing: rows dim elements apart, elements adjacent
        if not all(t.is_contiguous() for t in candidates):
            return "candidates must be contiguous"
        addresses = [t.data_ptr() for t in candidates]
        table = torch.tensor(addresses + lengths + list(extra), dtype=torch.int64).to(device, non_blocking=True)
        n = len(candidates)
        aligned = all(a % 16 == 0 for a in addresses)
        return Table(table[:n], table[n:2 * n], table[2 * n:], candidates[0], aligned, None)
    if not (source.type == "cpu" and device.type == "cuda"):
        return f"candidates on {source} for scoring on {device}"
    total = sum(lengths)
    staged = torch.empty((total, dim), dtype=dtype, pin_memory=True)
    torch.cat(candidates, out=staged)
    tokens = staged.to(device, non_blocking=True)
    table = torch.tensor(lengths + list(extra), dtype=torch.int64).to(device, non_blocking=True)
    n = len(candidates)
    lens = table[:n]
    starts = torch.cumsum(lens, 0) - lens
    # rows are row_bytes apart from a base the allocator aligns: aligned when row_bytes is
    addresses = tokens.data_ptr() + starts * row_bytes
    return Table(addresses, lens, table[n:], tokens, row_bytes % 16 == 0, (tokens, staged))


__all__ = ["Table", "candidate_table", "score_listed"]
