"""Launchers of the packed layouts (cu_seqlens offsets, pair lists): the forward kernel
under ``VARLEN`` / ``PAIRS`` and the packed gather backward, same signatures as
:func:`lik_plugins.kernels.chunked.varlen_forward` / ``varlen_backward``.  Packed launches
keep no host-side plan: they replay the binary under a static key of what Triton
specialises on (``direct.launch``), so a new length compiles and plans nothing.
"""
from __future__ import annotations

import torch

from ..common import argmax_dtype, inverse_norms
from ..device import sm_count
from .backward import maxsim_bwd_varlen_kernel
from .backward_launch import finish_rows
from .blocking import TARGET_BLOCK_M, WIDE_BLOCK_M, gather_blocking, row_blocking
from .direct import launch
from .operands import (
    DENSE, HIDDEN, INT32_MAX, RESIDUAL, DocFormat, built_key, documents_only, format_meta, mask_bytes, placeholder,
    precision,
)
from .tuning import cdiv, forward_kernel_and_meta, interpreting, next_pow2, size_class


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
    elem = Q.element_size()
    d_pad = max(16, next_pow2(dim))
    block_m = WIDE_BLOCK_M if elem <= 2 and d_pad <= 128 else TARGET_BLOCK_M
    built = doc_format is not None
    assert not built or doc_format.kind in (RESIDUAL, HIDDEN), "packed documents: float, residual or hidden"
    if pairs is not None:
        rows, qpb, n_chunks = row_blocking(max_q, 1, False, block_m)
        n_rows, n_j, n_qblocks = 1, pairs[0].shape[0], 1
    else:
        rows, qpb, n_chunks = row_blocking(max_q, nq, True, block_m)
        n_rows, n_j, n_qblocks = nq, nd, cdiv(nq, qpb)
    arg_dtype = argmax_dtype(max_d)
    argmax = torch.full((n_rows, n_j, max_q), -1, dtype=arg_dtype, device=device) if save_argmax else None
    if n_rows * n_j == 0 or max_q == 0:
        scores = torch.zeros((n_rows, n_j), dtype=torch.float32, device=device)
    else:
        stand_in = placeholder(device, torch.float32)
        qm, dm = mask_bytes(q_mask, device), mask_bytes(d_mask, device)
        rq = (inverse_norms(Q) if q_scale is None else q_scale) if normalize and not documents_only(doc_format) \
            else stand_in
        rd = inverse_norms(D) if normalize and not built else stand_in
        index = placeholder(device, torch.int32)
        pair_q, pair_d = pairs if pairs is not None else (index, index)
        n_programs = n_j * n_qblocks * n_chunks
        # packed float documents have their own table rows: a pair list's short documents
        # (50-300 tokens, a program each) ran best on other tiles than a padded 1 x 100k rerank
        kernel, meta, after_launch = forward_kernel_and_meta(
            rows_per_q=rows, qpb=qpb, d_pad=d_pad, dtype=built_key(Q, D, doc_format, packed=True) if built else
            (Q.dtype, D.dtype, DENSE, "packed"), n_programs=n_programs, save_arg=save_argmax)
        if built:
            meta.update(format_meta(doc_format, Q.dtype, dim, d_pad))
            aux = (*doc_format.tensors(stand_in), *doc_format.a0_strides, doc_format.aux_n)
        else:
            aux = (stand_in, stand_in, stand_in, 0, 0, 0, 0)
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
            UPCAST=interpreting() and Q.dtype == torch.bfloat16, PRECISION=precision(Q.dtype),
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
                          max(n_rows, n_j, max_q, max_d) <= INT32_MAX)
        launch(kernel, (n_programs,),
               (Q, D, qm, dm, rq, rd, out, argmax if argmax is not None else stand_in, cu_q, cu_d, pair_q, pair_d,
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
    stand_in = placeholder(device, torch.float32)
    rq = inverse_norms(Q) if normalize else stand_in
    rd = inverse_norms(D) if normalize else stand_in
    d_pad = max(16, next_pow2(dim))
    block_s, block_j, base_programs, n_split, j_per_split = gather_blocking(n_rows, n_j, max_q, d_pad,
                                                                             sm_count(device))
    # a pair list repeats queries, and a split walks a query's documents in several programs:
    # then several programs add into one grad_Q row
    atomic_q = pairs is not None or n_split > 1
    # zeros: rows no offset covers (before cu_q[0]) get no program
    gq = torch.zeros(Q.shape, dtype=torch.float32 if atomic_q else Q.dtype, device=device) if need_q else None
    gd32 = torch.zeros(D.shape, dtype=torch.float32, device=device) if need_d else None
    index = placeholder(device, torch.int32)
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
                  max(n_rows, n_j, j_per_split) <= INT32_MAX)
    launch(maxsim_bwd_varlen_kernel, (base_programs * n_split,), (
        grad, Q, D, rq, rd, argmax, gq if gq is not None else stand_in, gd32 if gd32 is not None else stand_in,
        cu_q, cu_d, pair_q, pair_d,
        n_rows, n_j, max_q, dim,
        grad.stride(0), s_gj,
        Q.stride(0), Q.stride(1), D.stride(0), D.stride(1),
        argmax.stride(0), n_split, j_per_split,
    ), meta, static_key=static_key, caller_tensors=(grad, Q, D, argmax, cu_q, cu_d, pair_q, pair_d))
    grad_q = finish_rows(gq, Q, rq, normalize) if need_q and atomic_q else gq
    grad_d = finish_rows(gd32, D, rd, normalize) if need_d else None
    return grad_q, grad_d
