"""Smooth MaxSim: ``score(q, d) = sum_s tau * logsumexp_t(<Q[q, s], D[d, t]> / tau)``.

colpali-engine's ``use_smooth_max=True`` replaces the hard max over document tokens by
this log-sum-exp.  No masks (colpali zero-pads: a zero token's similarity is 0 and
takes part in the log-sum-exp, a zero query row adds ``tau * log(Ld)``), no
normalisation inside.

Three pieces live here, with the fused Triton kernel beside them in
:mod:`lik_plugins.kernels.triton.smoothmax`:

* :func:`smooth_maxsim_reference` — the specification, plain autograd, float64-capable;
* a bounded-memory chunked torch path (CPU and the fallback): the forward keeps only the
  per-row log-sum-exp ``lse[q, j, s]`` (``[Nq, NJ, Lq]`` fp32); the backward recomputes
  each chunk's similarities and softmax weights ``exp(S / tau - lse)`` from it;
* :func:`smooth_maxsim` — the public entry: one ``autograd.Function``, device dispatch
  (CUDA -> Triton, else chunked; ``LIK_BACKEND`` forces a path, ``LIK_DISABLE=1`` runs
  the reference).

Layouts (``D.dim()`` and ``layout`` pick one):

=============  ==============  ===================  ==========
layout         Q               D                    out
=============  ==============  ===================  ==========
``cross``      ``[Nq, Lq, d]``  ``[Nd, Ld, d]``      ``[Nq, Nd]``
``candidates`` ``[Nq, Lq, d]``  ``[Nq, K, Ld, d]``   ``[Nq, K]``
``pairs``      ``[B, Lq, d]``   ``[B, Ld, d]``       ``[B]``
=============  ==============  ===================  ==========
"""
from __future__ import annotations

import math

import torch

from .._config import chunk_elements, forced_backend, triton_interpret

# The fused kernel keeps a [rows, d] query tile and its gradient on chip: wider embeddings
# are served by the chunked path (unless LIK_BACKEND=triton asks for the kernel explicitly).
FUSED_MAX_DIM = 256

LAYOUTS = ("cross", "candidates", "pairs")


# --------------------------------------------------------------------------- reference
def smooth_maxsim_reference(Q: torch.Tensor, D: torch.Tensor, *, tau: float, layout: str = "auto") -> torch.Tensor:
    """The specification (materialises every similarity): computed in the promoted input
    dtype, so float64 inputs give an oracle."""
    layout = _resolve_layout(Q, D, layout)
    if layout == "pairs":
        return smooth_maxsim_reference(Q, D.unsqueeze(1), tau=tau, layout="candidates").squeeze(1)
    if layout == "cross":
        sim = torch.einsum("ash,bth->abst", Q, D)
    else:
        sim = torch.einsum("ash,akth->akst", Q, D)
    return (tau * torch.logsumexp(sim / tau, dim=-1)).sum(dim=-1)


def _resolve_layout(Q: torch.Tensor, D: torch.Tensor, layout: str) -> str:
    if layout == "auto":
        layout = "candidates" if D.dim() == 4 else "cross"
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS} or 'auto', got {layout!r}")
    want = 4 if layout == "candidates" else 3
    if Q.dim() != 3 or D.dim() != want:
        raise ValueError(f"smooth_maxsim[{layout}]: expected Q 3-D and D {want}-D, got {tuple(Q.shape)} and {tuple(D.shape)}")
    if Q.shape[-1] != D.shape[-1]:
        raise ValueError(f"smooth_maxsim: embedding dims differ ({Q.shape[-1]} vs {D.shape[-1]})")
    if layout != "cross" and D.shape[0] != Q.shape[0]:
        raise ValueError(f"smooth_maxsim[{layout}]: D must have one entry per query ({D.shape[0]} vs {Q.shape[0]})")
    return layout


# --------------------------------------------------------------------------- chunked torch
def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunks(n_outer: int, per_outer: int):
    step = max(1, min(n_outer, chunk_elements() // max(per_outer, 1)))
    return [slice(i, i + step) for i in range(0, n_outer, step)]


def _chunked_forward(Q, D, tau: float, cross: bool):
    """``(scores [Nq, NJ], lse [Nq, NJ, Lq])`` in fp32 (fp64 for fp64 inputs); ``lse`` is
    the log-sum-exp of ``S / tau`` per query row."""
    cdt = _compute_dtype(Q.dtype)
    nq, lq, _ = Q.shape
    nj, ld = (D.shape[0], D.shape[1]) if cross else (D.shape[1], D.shape[2])
    lse = torch.empty((nq, nj, lq), dtype=cdt, device=Q.device)
    inv_tau = 1.0 / tau
    if cross:
        for ds in _chunks(nj, lq * ld):
            dc = D[ds].to(cdt)
            for qs in _chunks(nq, (ds.stop - ds.start) * lq * ld):
                sim = torch.einsum("ash,bth->abst", Q[qs].to(cdt), dc)
                lse[qs, ds] = torch.logsumexp(sim.mul_(inv_tau), dim=-1)
    else:
        for qs in _chunks(nq, nj * lq * ld):
            sim = torch.einsum("ash,akth->akst", Q[qs].to(cdt), D[qs].to(cdt))
            lse[qs] = torch.logsumexp(sim.mul_(inv_tau), dim=-1)
    scores = lse.sum(dim=-1) * tau
    return scores, lse


def _chunked_backward(Q, D, lse, grad, tau: float, cross: bool, need_q: bool, need_d: bool):
    """Gradients from recomputed softmax weights ``P = exp(S / tau - lse)``:
    ``dQ[q, s] = sum_j g[q, j] sum_t P D[j, t]``, ``dD[j, t] = sum_q g[q, j] sum_s P Q[q, s]``."""
    cdt = lse.dtype
    nq, lq, _ = Q.shape
    nj, ld = (D.shape[0], D.shape[1]) if cross else (D.shape[1], D.shape[2])
    gq = torch.zeros(Q.shape, dtype=cdt, device=Q.device) if need_q else None
    gd = torch.zeros(D.shape, dtype=cdt, device=D.device) if need_d else None
    grad = grad.to(cdt)
    inv_tau = 1.0 / tau
    if cross:
        for ds in _chunks(nj, lq * ld):
            dc = D[ds].to(cdt)
            for qs in _chunks(nq, (ds.stop - ds.start) * lq * ld):
                qc = Q[qs].to(cdt)
                sim = torch.einsum("ash,bth->abst", qc, dc).mul_(inv_tau)
                w = sim.sub_(lse[qs, ds].unsqueeze(-1)).exp_().mul_(grad[qs, ds, None, None])
                if need_q:
                    gq[qs] += torch.einsum("abst,bth->ash", w, dc)
                if need_d:
                    gd[ds] += torch.einsum("abst,ash->bth", w, qc)
    else:
        for qs in _chunks(nq, nj * lq * ld):
            qc, dc = Q[qs].to(cdt), D[qs].to(cdt)
            sim = torch.einsum("ash,akth->akst", qc, dc).mul_(inv_tau)
            w = sim.sub_(lse[qs].unsqueeze(-1)).exp_().mul_(grad[qs, :, None, None])
            if need_q:
                gq[qs] = torch.einsum("akst,akth->ash", w, dc)
            if need_d:
                gd[qs] = torch.einsum("akst,ash->akth", w, qc)
    return gq, gd


# --------------------------------------------------------------------------- dispatch
def served_by(t: torch.Tensor) -> str:
    """The path that serves a smooth-max call on tensors like ``t`` right now:
    ``"triton"``, ``"torch-chunked"`` or ``"reference"`` (the core ops' dispatch rules,
    plus: embeddings wider than ``FUSED_MAX_DIM`` go to the chunked path under ``auto``)."""
    from .dispatch import served_by as core_served_by

    path = core_served_by(t)
    if path == "triton" and t.shape[-1] > FUSED_MAX_DIM and forced_backend() != "triton":
        return "torch-chunked"
    return path


def _triton_module():
    from .triton import smoothmax as tsm

    return tsm


def _check_triton_device(Q: torch.Tensor) -> None:
    if not Q.is_cuda and not triton_interpret():
        raise RuntimeError(
            "smooth_maxsim: the Triton path needs CUDA tensors, or TRITON_INTERPRET=1 for CPU tensors"
        )


class _SmoothMaxSim(torch.autograd.Function):
    """Saves ``Q``, ``D`` and the per-row log-sum-exp; never saves its output (callers such
    as colpali's negative filtering edit the scores in place)."""

    @staticmethod
    def forward(ctx, Q, D, tau: float, cross: bool, path: str):
        if path == "triton":
            _check_triton_device(Q)
            scores, lse = _triton_module().forward(Q, D, tau, cross)
        else:
            scores, lse = _chunked_forward(Q, D, tau, cross)
        ctx.save_for_backward(Q, D, lse)
        ctx.tau, ctx.cross, ctx.path = tau, cross, path
        return scores

    @staticmethod
    def backward(ctx, grad):
        Q, D, lse = ctx.saved_tensors
        need_q, need_d = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_q or need_d):
            return None, None, None, None, None
        if ctx.path == "triton":
            gq, gd = _triton_module().backward(Q, D, lse, grad.contiguous(), ctx.tau, ctx.cross, need_q, need_d)
        else:
            gq, gd = _chunked_backward(Q, D, lse, grad, ctx.tau, ctx.cross, need_q, need_d)
        gq = None if gq is None else gq.to(Q.dtype)
        gd = None if gd is None else gd.to(D.dtype)
        return gq, gd, None, None, None


def smooth_maxsim(Q: torch.Tensor, D: torch.Tensor, *, tau: float, layout: str = "auto") -> torch.Tensor:
    """Smooth MaxSim ``sum_s tau * logsumexp_t(S[s, t] / tau)`` without materialising ``S``.

    Args:
        Q: ``[Nq, Lq, d]`` query tokens (fp16 / bf16 / fp32 / fp64), zero rows allowed.
        D: ``[Nd, Ld, d]`` (``cross``, ``pairs``) or ``[Nq, K, Ld, d]`` (``candidates``).
        tau: the temperature of the log-sum-exp (> 0); ``tau -> 0`` tends to the hard max.
        layout: ``"auto"`` (4-D ``D`` -> ``candidates``, else ``cross``), ``"cross"``,
            ``"candidates"`` or ``"pairs"``.

    Returns:
        float32 scores (float64 for float64 inputs): ``[Nq, Nd]``, ``[Nq, K]`` or ``[B]``.
        Gradients flow to whichever of ``Q``, ``D`` require them.

    Example::

        >>> Q, D = torch.randn(4, 8, 16), torch.randn(5, 12, 16)
        >>> smooth_maxsim(Q, D, tau=0.1).shape
        torch.Size([4, 5])
    """
    layout = _resolve_layout(Q, D, layout)
    tau = float(tau)
    if not tau > 0 or math.isinf(tau):
        raise ValueError(f"tau must be a positive finite number, got {tau}")
    if Q.device != D.device:
        raise ValueError(f"Q and D are on different devices ({Q.device} vs {D.device})")
    if not (Q.is_floating_point() and D.is_floating_point()):
        raise TypeError("smooth_maxsim: Q and D must be floating point")
    path = served_by(Q)
    out_dtype = torch.float64 if torch.float64 in (Q.dtype, D.dtype) else torch.float32
    if path == "reference":
        return smooth_maxsim_reference(Q.to(out_dtype), D.to(out_dtype), tau=tau, layout=layout)
    if Q.dtype != D.dtype:
        common = torch.promote_types(Q.dtype, D.dtype)
        Q, D = Q.to(common), D.to(common)
    if layout == "pairs":
        return _SmoothMaxSim.apply(Q, D.unsqueeze(1), tau, False, path).squeeze(1)
    return _SmoothMaxSim.apply(Q, D, tau, layout == "cross", path)
