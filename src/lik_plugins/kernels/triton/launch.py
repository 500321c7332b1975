"""The Triton path's launchers, as the dispatcher hands them out
(``dispatch.implementation("triton").maxsim``): same names and signatures as
:mod:`lik_plugins.kernels.chunked`.  The forward launcher is here; the backward
(:mod:`.backward_launch`) and packed (:mod:`.varlen_launch`) ones are imported so the path
is one module, with the document formats (:mod:`.operands`) the op layer builds.

No host synchronisation happens in any launcher (no ``.item()``, no data-dependent shapes),
so forward and backward can be captured in a CUDA graph once the autotuner has seen the
shape bucket.  How a launch is cut into programs, and why its binaries stay few while
lengths change: :mod:`.blocking`.  A repeated geometry reuses a cached plan.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..common import argmax_dtype, inverse_norms
from ..reference import FP8_MAX, INT8_MAX
from . import backward_launch, direct
from .backward_launch import backward
from .blocking import forward_blocking, tail_tile
from .direct import launch
from .operands import (
    DENSE, HIDDEN, INT8, RESIDUAL, DocFormat, built_key, cached_plan, doc_view, documents_only, format_meta,
    mask_bytes, norm_strides, placeholder, precision, stream_order_weights,
)
from .tuning import cdiv, forward_kernel_and_meta, interpreting, k_tile, next_pow2, size_class
from .varlen_launch import varlen_backward, varlen_forward

__all__ = ["forward", "backward", "varlen_forward", "varlen_backward", "clear_plans", "DocFormat", "DENSE", "INT8",
           "RESIDUAL", "HIDDEN", "stream_order_weights"]


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


# Forward plans by the call's geometry (shapes, strides, dtype, device, mask and option
# flags).  A repeated shape -- every training step of a fixed batch, every rerank of a
# fixed candidate count -- skips the blocking, the tuner lookup and building the argument
# list; with the direct launch that is what the launch-bound shapes cost on the host.
_FORWARD_PLANS: dict = {}


def clear_plans() -> None:
    """Forget the forward and backward plans and the compiled-launch plans: a plan holds the
    blocking and the config it was made with (for whoever changes the blocking constants or
    the tuner's remembered configs: tests, benchmarks)."""
    _FORWARD_PLANS.clear()
    backward_launch.clear_plans()
    direct.clear()


def _plan_forward(Q, D, rd, cross, scaled, zero_mode, save_argmax, s_qm, s_dm, fmt=None, lengths=False):
    """(plan, after_launch): ``after_launch`` is not None while the autotuner still has to
    run, and then the plan is for this call only.  ``s_qm``, ``s_dm``: the masks' strides (None
    without); ``lengths``: ``s_dm`` are the strides of per-document lengths (``DM_LENGTHS``)."""
    nq, lq, dim = Q.shape
    nj, ld, (s_di, s_dj, s_dt, s_dh) = doc_view(D, cross)
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
    # (query, document, token) strides; lengths have no token stride
    s_dmi, s_dmj, s_dmt = (0, 0, 0) if s_dm is None else ((0, *s_dm) if cross else s_dm) + ((0,) if lengths else ())
    s_rdi, s_rdj = norm_strides(rd, cross, scaled)
    s_qmi, s_qms = (0, 0) if s_qm is None else s_qm
    # 8-bit inference keeps an elementwise running max, reduced once at the end: its MMA is
    # fast enough that the per-tile reduction bounds it (16-bit: the registers cost more)
    running_max = not save_argmax and elem == 1
    n_programs = nj // dpp * n_qblocks * n_chunks
    # fused int8 query quantisation runs the int8 kernel's tiles: it shares their table entry
    tune_dtype = (D.dtype if kind == INT8 else (Q.dtype, D.dtype)) if quant_q else \
        built_key(Q, D, fmt) if built else Q.dtype
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
        HAS_QM=s_qm is not None, HAS_DM=s_dm is not None and not lengths, ZERO_MODE=bool(zero_mode), DM_LENGTHS=lengths,
        NORMALIZE=scaled, SAVE_ARG=bool(save_argmax),
        ROWS_PER_Q=rows, QPB=qpb, D_PAD=d_pad,
        UPCAST=interpreting() and Q.dtype == torch.bfloat16, PRECISION=precision(Q.dtype if built else D.dtype),
        RUNNING_MAX=running_max, QUANT_Q=quant_q, QUANT_LIMIT=float(INT8_MAX if quant_q and kind == INT8 else FP8_MAX),
        DOCS_PER_PROGRAM=dpp, TAIL_N=tail_tile(ld, rows * qpb),
        **meta,
    )
    aux_ints = (0, 0, 0, 0)
    if fmt is not None:
        meta.update(format_meta(fmt, Q.dtype, dim, d_pad))
        aux_ints = (*fmt.a0_strides, fmt.aux_n)
    grid = (n_programs,)
    return _ForwardPlan(kernel, grid, ints, meta, out_shape, n_chunks, arg_dtype, False, aux_ints), after_launch


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
    qm = mask_bytes(q_mask, device)
    assert d_lengths is None or (d_mask is None and not zero_mode and d_lengths.dtype == torch.int32)
    dm = mask_bytes(d_mask, device) if d_lengths is None else d_lengths
    stand_in = placeholder(device, torch.float32)
    built = doc_format is not None and doc_format.kind in (RESIDUAL, HIDDEN)
    if scales is not None:
        assert not normalize and not save_argmax, "scaled (fp8/int8) scores are inference-only and never normalised"
        rq, rd = scales
        rq = stand_in if rq is None else rq
    else:
        rq = inverse_norms(Q) if normalize and not documents_only(doc_format) else stand_in
        rd = inverse_norms(D) if normalize and not built else stand_in
    scaled = bool(normalize) or scales is not None
    s_qm = qm.stride() if q_mask is not None else None
    s_dm = dm.stride() if d_mask is not None or d_lengths is not None else None
    aux = (stand_in,) * 3 if doc_format is None else doc_format.tensors(stand_in)
    # the kernel reads RQ as [Nq, Lq] contiguous and RD through its strides
    key = (Q.shape, Q.stride(), D.shape, D.stride(), Q.dtype, D.dtype, device, cross, scaled, bool(zero_mode),
           bool(save_argmax), s_qm, s_dm, rd.stride() if scaled else None,
           None if doc_format is None else doc_format.key(), d_lengths is not None)
    plan, after_launch = cached_plan(_FORWARD_PLANS, key, lambda: _plan_forward(
        Q, D, rd, cross, scaled, zero_mode, save_argmax, s_qm, s_dm, doc_format, d_lengths is not None))
    argmax = (torch.empty((Q.shape[0], plan.out_shape[-1], Q.shape[1]), dtype=plan.arg_dtype, device=device)
              if save_argmax else None)
    if plan.empty:
        return torch.zeros(plan.out_shape[-2:], dtype=torch.float32, device=device), \
            (argmax.fill_(-1) if argmax is not None else None)
    scores = torch.empty(plan.out_shape, dtype=torch.float32, device=device)
    index = placeholder(device, torch.int32)   # the packed layouts' offsets and pair lists (never read)
    # Q, D and the masks are the caller's (views at any offset); the rest is ours
    launch(plan.kernel, plan.grid,
           (Q, D, qm, dm, rq, rd, scores, argmax if argmax is not None else stand_in, index, index, index, index,
            *plan.ints, *aux, *plan.aux_ints),
           plan.meta, static_key=key if after_launch is None else None, caller_tensors=(Q, D, qm, dm, rq, rd, *aux))
    if after_launch is not None:
        after_launch()
    return (scores if plan.n_chunks == 1 else scores.sum(0)), argmax
