"""Input checks of the packed ops in one launch, for CUDA tensors.

The packed ops check their offsets and pair indices on the device when the caller gives
``max_seqlen_*`` (no host synchronisation).  Written as torch ops that is ~100 small
operations (two offset arrays, each: differences, extremes, comparisons, reductions), whose
host time together exceeds a whole rerank of a thousand candidates on the GPU.
:func:`packed_inputs_ok` does all of them in one kernel: the result is a
one-element int32 tensor, 1 when every check holds, for ``torch._assert_async``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .direct import launch

CHECK_BLOCK = 1024
PAIRS_PER_PROGRAM = 4096


@triton.jit
def _offsets_ok(CU, n_off, rows, max_len, BLOCK: tl.constexpr):
    """``CU[0] == 0``, ``CU[-1] == rows``, and every ``CU[i+1] - CU[i]`` in ``[0, max_len]``."""
    ok = (tl.load(CU) == 0) & (tl.load(CU + n_off - 1) == rows)
    for i0 in range(0, n_off - 1, BLOCK):
        o = i0 + tl.arange(0, BLOCK)
        m = o < n_off - 1
        length = tl.load(CU + o + 1, mask=m, other=0) - tl.load(CU + o, mask=m, other=0)
        n_bad = tl.sum((m & ((length < 0) | (length > max_len))).to(tl.int32), axis=0)
        ok = ok & (n_bad == 0)
    return ok


@triton.jit(do_not_specialize=["n_cu_q", "rows_q", "max_q", "n_cu_d", "rows_d", "max_d", "n_pairs"])
def packed_inputs_ok_kernel(CU_Q, n_cu_q, rows_q, max_q, CU_D, n_cu_d, rows_d, max_d, PAIR_Q, PAIR_D, n_pairs,
                            OK, BLOCK: tl.constexpr, PAIR_BLOCK: tl.constexpr):
    # program 0: the query offsets, 1: the document offsets, 2..: blocks of the pair list.
    # A failing program stores 0; every writer writes the same value, so no atomics.
    pid = tl.program_id(0)
    if pid == 0:
        ok = _offsets_ok(CU_Q, n_cu_q, rows_q, max_q, BLOCK)
    elif pid == 1:
        ok = _offsets_ok(CU_D, n_cu_d, rows_d, max_d, BLOCK)
    else:
        n_q, n_d = n_cu_q - 1, n_cu_d - 1
        n_bad = 0
        for i0 in range(0, PAIR_BLOCK, BLOCK):
            o = (pid - 2) * PAIR_BLOCK + i0 + tl.arange(0, BLOCK)
            m = o < n_pairs
            pq = tl.load(PAIR_Q + o, mask=m, other=0)
            pd = tl.load(PAIR_D + o, mask=m, other=0)
            bad = m & ((pq < 0) | (pq >= n_q) | (pd < 0) | (pd >= n_d))
            n_bad += tl.sum(bad.to(tl.int32), axis=0)
        ok = n_bad == 0
    if not ok:
        tl.store(OK, 0)


def packed_inputs_ok(cu_q, rows_q, max_q, cu_d, rows_d, max_d, pair_q=None, pair_d=None) -> torch.Tensor:
    """1 (int32, one element, on the offsets' device) when both offset arrays start at 0, end
    at their packed lengths ``rows_*``, never decrease and hold no sequence longer than
    ``max_*``, and every pair index is in range; else 0.  No host synchronisation."""
    ok = torch.ones(1, dtype=torch.int32, device=cu_q.device)
    n_pairs = 0 if pair_q is None else pair_q.shape[0]
    pair_q = cu_q if pair_q is None else pair_q
    pair_d = cu_d if pair_d is None else pair_d
    grid = (2 + -(-n_pairs // PAIRS_PER_PROGRAM),)    # not triton.cdiv: a JIT function, slow from the host
    ints = (cu_q.numel(), rows_q, max_q, cu_d.numel(), rows_d, max_d, n_pairs)
    # every integer argument is unspecialised: the binary depends on the dtypes and the
    # integers' 32-bit fit only (direct.launch), so the launch skips featurising them
    static_key = ("packed_inputs_ok", cu_q.dtype, cu_d.dtype, pair_q.dtype, pair_d.dtype,
                  max(ints) <= 0x7FFFFFFF and min(ints) >= -0x80000000)
    launch(packed_inputs_ok_kernel, grid,
           (cu_q, ints[0], rows_q, max_q, cu_d, ints[3], rows_d, max_d, pair_q, pair_d, n_pairs, ok),
           dict(BLOCK=CHECK_BLOCK, PAIR_BLOCK=PAIRS_PER_PROGRAM), static_key=static_key,
           caller_tensors=(cu_q, cu_d, pair_q, pair_d))
    return ok
