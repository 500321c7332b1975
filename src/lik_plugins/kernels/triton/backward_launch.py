"""Backward launchers of the padded layouts (``backward=`` "lowmem" or "unified"): the
gather of grad_Q from the saved winners, grad_D destination-owned (lowmem: compact, dense
or winners route) or scattered with fp32 atomics (unified), and the normalisation
Jacobian applied in one fused pass.  What each strategy costs and when ``auto`` takes it:
docs/internals.md (Backward strategies) and docs/performance-notes.md (maxsim backward).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..common import COMPACT_MAX_ROWS, inverse_norms
from ..device import sm_count
from .backward import maxsim_bwd_gather_kernel, maxsim_bwd_winners_kernel, project_rows_kernel
from .blocking import MAX_ROWS_PER_Q, gather_blocking
from .direct import launch
from .operands import cached_plan, doc_view, norm_strides, placeholder, precision
from .tuning import cdiv, doc_kernel_and_meta, interpreting, next_pow2

# Largest fp32 grad_D buffer the unified backward allocates for the cross product; more
# documents are scattered slab by slab.  Slabs cost time (each is a launch with less
# parallelism), so the cap is generous.
UNIFIED_BUFFER_BYTES = 64 << 20
# lowmem for the cross product: each grad_D tile first lists the query rows whose winner
# lies in it (two scans of the document's winners, the list in an int16 scratch the size
# of the argmax), so its one-hot product walks Nq*Lq*BLOCK_T/Ld rows instead of all Nq*Lq.
# Row ids are 16-bit: up to COMPACT_MAX_ROWS query rows (common.py); the scans read
# COMPACT_SCAN winners a step.  Small shapes keep the dense walk (COMPACT_MIN_WORK): the
# gather then rides in its launch, one launch and one allocation less, which is what a
# launch-bound step is made of.
COMPACT_SCAN = 4096
COMPACT_MIN_WORK = 1 << 24   # Nq*Lq * Nd*Ld: the dense walk's one-hot size
# A gather of fewer programs than the device has SMs rides in the grad_D launch.
GATHER_ALONE_MIN_WAVES = 1


def _finish(g32, X, inv_norm, out, normalize):
    """``out`` = the fp32 gradient rows ``g32`` of ``X``, through the normalisation's Jacobian
    if any (one fused pass)."""
    if not normalize:
        return out.copy_(g32)
    dim = X.shape[-1]
    rows = g32.numel() // dim
    d_pad = max(16, next_pow2(dim))
    block_r = max(1, min(64, 8192 // d_pad))
    x_rows = X.reshape(rows, dim)
    launch(project_rows_kernel, (cdiv(rows, block_r),),
           (g32, x_rows, inv_norm.reshape(-1), out, rows, dim, x_rows.stride(0), x_rows.stride(1)),
           dict(BLOCK_R=block_r, D_PAD=d_pad))
    return out


def finish_rows(g32, X, inv_norm, normalize):
    """``X``'s gradient from an fp32 buffer of its rows, as :func:`_finish` but in a new
    tensor: cast without normalisation (the buffer itself for fp32)."""
    if normalize:
        return _finish(g32, X, inv_norm, torch.empty(X.shape, dtype=X.dtype, device=X.device), normalize)
    return g32 if X.dtype == torch.float32 else g32.to(X.dtype)


def _gather_pass(grad, Q, D, argmax, rq, rd, grad_q, gd32, *, cross, normalize):
    """One launch of the gather kernel: grad_Q (if ``grad_q``) and/or the atomic scatter
    into the fp32 ``gd32`` (if given) over the documents of ``D`` (a view: ``grad``,
    ``argmax`` and ``rd`` are sliced alike)."""
    nq, lq, dim = Q.shape
    nj, ld, (s_di, s_dj, s_dt, s_dh) = doc_view(D, cross)
    s_rdi, s_rdj = norm_strides(rd, cross, normalize)
    d_pad = max(16, next_pow2(dim))
    device = Q.device
    stand_in = placeholder(device, torch.float32)
    need_q = grad_q is not None
    block_s, block_j, base_programs, n_split, j_per_split = gather_blocking(nq, nj, lq, d_pad, sm_count(device))
    partial = need_q and n_split > 1
    gq_out = torch.empty((n_split, nq, lq, dim), dtype=torch.float32, device=device) if partial else grad_q
    launch(maxsim_bwd_gather_kernel, (base_programs * n_split,), (
        grad, Q, D, rq, rd, argmax, gq_out if gq_out is not None else stand_in,
        gd32 if gd32 is not None else stand_in,
        nq, nj, lq, ld, dim,
        grad.stride(0), grad.stride(1),
        Q.stride(0), Q.stride(1), Q.stride(2),
        s_di, s_dj, s_dt, s_dh,
        s_rdi, s_rdj,
        0 if cross else nj * ld * dim, ld * dim, argmax.stride(0),
        n_split, j_per_split,
    ), dict(
        NEED_Q=need_q, SCATTER_D=gd32 is not None, NORMALIZE=bool(normalize), PARTIAL=partial,
        BLOCK_J=block_j, BLOCK_S=block_s, D_PAD=d_pad, num_warps=4 if d_pad <= 128 else 8,
    ))
    if partial:
        _finish(gq_out.sum(0), Q, rq, grad_q, normalize)


def backward(grad, Q, D, argmax, *, cross, normalize, need_q, need_d, strategy, q_masked=True):
    """``strategy``: ``"lowmem"`` (destination-owned grad_D, deterministic, no fp32 buffer)
    or ``"unified"`` (gather + atomic scatter in one pass over the argmax).  ``q_masked``:
    the forward had a query mask, so rows without a winner may hold anything (NaN)."""
    if grad.dtype != torch.float32:
        grad = grad.float()
    if Q.numel() == 0 or D.numel() == 0 or grad.numel() == 0:
        return (torch.zeros_like(Q, memory_format=torch.contiguous_format) if need_q else None), \
            (D.new_zeros(D.shape) if need_d else None)
    stand_in = placeholder(Q.device, torch.float32)
    rq = inverse_norms(Q) if normalize else stand_in
    rd = inverse_norms(D) if normalize else stand_in
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
    # the winners kernel: writes winning rows only (the rest of grad_D must be 0), and takes
    # no row-list pointer (the document kernels do)
    winners: bool


# lowmem backward plans by the call's geometry, as the forward's (launch._FORWARD_PLANS): a
# repeated training step also skips the route choice, and its grad_D launch replays with a
# static key (no per-argument featurising).
_LOWMEM_PLANS: dict = {}


def clear_plans() -> None:
    """Forget the lowmem plans (``launch.clear_plans`` clears every plan)."""
    _LOWMEM_PLANS.clear()


def _lowmem_route(nq, lq, nj, ld, *, cross, need_q, n_gather, n_split, sms):
    """(grad_D kernel, how grad_Q is gathered) of a lowmem backward: kernel ``"compact"``,
    ``"winners"`` or ``"dense"``; grad_Q ``"ride"``, ``"alone"`` or None."""
    if cross and nq * lq <= COMPACT_MAX_ROWS and nq * lq * nj * ld >= COMPACT_MIN_WORK:
        # Each grad_D tile lists its rows first (the scratch is the argmax's size).  grad_Q
        # is gathered after the lists are freed, for the peak -- unless the gather has too few
        # programs to fill the GPU on its own, where a pass of its own is a slow step: then it
        # rides in the grad_D launch and its grad_Q lives beside the lists.
        ride = n_split == 1 and n_gather < GATHER_ALONE_MIN_WAVES * sms
        return "compact", ("ride" if ride else "alone") if need_q else None
    # candidates and pairs with Lq <= 128: zero-filled grad_D, winning rows written
    kernel = "winners" if not cross and lq <= MAX_ROWS_PER_Q else "dense"
    # without a split the gather rides in the grad_D launch
    return kernel, ("ride" if n_split == 1 else "alone") if need_q else None


def _plan_lowmem(grad, Q, D, argmax, rd, *, cross, normalize, need_q, q_masked):
    """(plan, after_launch), as :func:`_plan_forward`."""
    nq, lq, dim = Q.shape
    nj, ld, (s_di, s_dj, s_dt, s_dh) = doc_view(D, cross)
    s_rdi, s_rdj = norm_strides(rd, cross, normalize)
    d_pad = max(16, next_pow2(dim))
    sms = sm_count(Q.device)
    block_s, block_j, n_gather, n_split, _ = gather_blocking(nq, nj, lq, d_pad, sms)
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
        NORMALIZE=bool(normalize), F32_DOT=f32_dot, PRECISION=precision(Q.dtype),
        UPCAST=interpreting() and Q.dtype == torch.bfloat16, BLOCK_J=block_j, BLOCK_S=block_s, D_PAD=d_pad,
        WITH_GATHER=ride,
    )
    if kind == "winners":
        meta.update(BLOCK_SW=max(16, next_pow2(lq)),
                    **({} if interpreting() else {"num_warps": 4 if d_pad <= 128 else 8, "num_stages": 1}))
        return _LowmemPlan(maxsim_bwd_winners_kernel, (n_gather + nq * nj,), ints, meta, gather, None, True), None
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
                       (nj, nq * lq) if compact else None, False), after_launch


def _lowmem_backward(grad, Q, D, argmax, rq, rd, *, cross, normalize, need_q, q_masked):
    """grad_D destination-owned (each program writes its own tiles: deterministic, no fp32
    buffer), grad_Q gathered from the saved winners, in the grad_D launch or after it."""
    device = Q.device
    key = (Q.shape, Q.stride(), D.shape, D.stride(), grad.stride(), argmax.shape, argmax.stride(), Q.dtype,
           D.dtype, device, cross, bool(normalize), need_q, q_masked)
    plan, after_launch = cached_plan(_LOWMEM_PLANS, key, lambda: _plan_lowmem(
        grad, Q, D, argmax, rd, cross=cross, normalize=normalize, need_q=need_q, q_masked=q_masked))
    stand_in = placeholder(device, torch.float32)
    # Allocation order is the peak's: a riding grad_Q lives beside the row lists, a gather
    # of its own starts after they are freed.
    grad_q = torch.empty_like(Q, memory_format=torch.contiguous_format) if plan.gather == "ride" else None
    rows = torch.empty(plan.rows, dtype=torch.int16, device=device) if plan.rows is not None else None
    grad_d = (torch.zeros if plan.winners else torch.empty)(D.shape, dtype=D.dtype, device=device)
    args = (grad, Q, D, rq, rd, argmax, grad_d, stand_in if grad_q is None else grad_q, *plan.ints)
    if not plan.winners:
        args += (stand_in if rows is None else rows,)
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
    dim = Q.shape[-1]
    nj, ld, _ = doc_view(D, cross)
    device = Q.device
    grad_q = torch.empty_like(Q, memory_format=torch.contiguous_format) if need_q else None
    # fp32 inputs without normalisation scatter straight into grad_D; otherwise an fp32
    # buffer is needed, and for the cross product it is bounded: slab by slab from the host
    # above UNIFIED_BUFFER_BYTES (grad_Q then gets its own gather pass).
    straight = need_d and D.dtype == torch.float32 and not normalize
    slab = nj
    if need_d and not straight and cross:
        slab = max(1, min(nj, UNIFIED_BUFFER_BYTES // max(ld * dim * 4, 1)))
    one_pass = need_d and slab == nj
    # Allocations are counted: on a slow host each torch call is tens of microseconds.  The
    # one-pass grad_D is the fp32 buffer cast once (no separate empty + copy).
    grad_d = None
    if need_d and (straight or not one_pass):
        grad_d = (torch.zeros if straight else torch.empty)(D.shape, dtype=D.dtype, device=device)
    gd32 = None
    if one_pass:
        gd32 = grad_d if straight else torch.zeros(D.shape, dtype=torch.float32, device=device)
    if need_q or one_pass:
        _gather_pass(grad, Q, D, argmax, rq, rd, grad_q, gd32, cross=cross, normalize=normalize)
    if one_pass and not straight:
        grad_d = finish_rows(gd32, D, rd, normalize)
    if need_d and not one_pass:
        buffer = torch.empty((slab, ld, dim), dtype=torch.float32, device=device)
        for j0 in range(0, nj, slab):
            j1 = min(nj, j0 + slab)
            chunk = buffer[: j1 - j0].zero_()
            rd_slab = rd[j0:j1] if normalize else rd
            _gather_pass(grad[:, j0:j1], Q, D[j0:j1], argmax[:, j0:j1], rq, rd_slab,
                         None, chunk, cross=True, normalize=normalize)
            _finish(chunk, D[j0:j1], rd_slab, grad_d[j0:j1], normalize)
    return grad_q, grad_d
