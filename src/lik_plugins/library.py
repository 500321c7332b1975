"""The registered op layer: every computation of the public ops as a ``torch.library``
custom op with a fake (meta) kernel, and the one autograd path over them.

=============================  ================================================================
``lik::maxsim_forward``        scores and (for a gradient) the winning document token per query row
``lik::maxsim_backward``       grad_Q / grad_D through the saved winners
``lik::smooth_maxsim_forward`` smooth-max scores and the per-row log-sum-exp
``lik::smooth_maxsim_backward`` its gradients, recomputed from the log-sum-exp
``lik::maxsim_fp8``            fp8 (e4m3) scores, inference only
``lik::maxsim_int8``           int8 scores (int32 products, per-token scales), inference only
``lik::maxsim_residual_forward`` scores against PLAID residual documents (and the winners)
``lik::maxsim_residual_backward`` grad_Q through the winners' decompressed tokens
``lik::maxsim_residual_varlen``  scores against a packed residual index, read in place (no gradient)
``lik::maxsim_hidden_forward`` scores against ``normalize(H @ W.T + b)`` built in the kernel
``lik::maxsim_hidden_backward`` grads of Q, H, W, b through the winning hidden states
``lik::plaid_approx_score``    PLAID's centroid-only candidate score
``lik::maxsim_varlen_forward`` packed (``cu_seqlens``) scores, every pair or a pair list, + winners
``lik::maxsim_varlen_backward`` grad of the packed tokens through those winners
=============================  ================================================================

Each op picks its device path at run time, inside the op (``kernels.dispatch``), and counts
the call in :func:`lik_plugins.routing_counts` -- so a ``torch.compile``d function routes
and counts exactly as eager code does, and the compiler sees one opaque node per op with a
fake kernel for shapes.  ``torch.compile(fullgraph=True)``, ``torch.export`` and CUDA graphs
(``mode="reduce-overhead"``) trace through the public ops without a graph break.

The autograd formulas are ``torch.autograd.Function`` s whose forward and backward call the
ops above; they save only the winners (hard max) or the log-sum-exp (smooth max).  In eager
mode a Function calls the op's Python implementation directly instead of going through
the dispatcher: the hop costs ~14 us per call of the hard-max forward on CI's CPU (34 us
through ``torch.library.custom_op``'s layers, see ``_registered``), much of a launch-bound
call.  While compiling or
exporting (``torch.compiler.is_compiling()``) the registered op is called, so the graph holds
it.  Either way the same function computes.
"""
from __future__ import annotations

import functools
import importlib
from typing import Optional

import torch

from ._config import chunk_elements
from ._routing import record
from .kernels import chunked, reference
from .kernels.common import COMPACT_MAX_ROWS, argmax_dtype
from .kernels.device import sm_count
from .kernels.dispatch import implementation, served_by, serves_width

# Layouts, passed to the ops as ints (a custom op's schema takes int, not an enum).
CROSS, CANDIDATES, PAIRS = 0, 1, 2
BACKWARD_STRATEGIES = ("auto", "unified", "lowmem")

# Short documents (ColBERT): lowmem up to this length, where its tiles list their rows.
LOWMEM_MAX_LD = 256


# One library object owns every registration below (dropping it would unregister them).
_LIBRARY = torch.library.Library("lik", "FRAGMENT")


def _registered(name: str, fake):
    """Register ``impl`` as ``lik::name`` with ``fake`` as its meta kernel; return a caller
    that runs ``impl`` directly in eager mode and the registered op while compiling.

    The schema comes from ``impl``'s annotations (``torch.library.infer_schema``, as
    ``torch.library.custom_op`` would); ``impl`` is registered as the op's one
    ``CompositeExplicitAutograd`` kernel, with no per-device wrapper.  A compiled graph calls
    the op on every step, and ``custom_op``'s layers (an autograd kernel that re-dispatches, a
    per-device wrapper that checks aliasing and toggles Dynamo) cost 27-54 us of host time a
    call on the GPU machines over the implementation itself, this registration 7-16 us
    (docs/performance-notes.md); on CI's CPU, with a no-op kernel, 13.8 us a call against
    5.8 and the bare function's 3.1.  The autograd formulas are the Functions below, so the
    op needs no autograd kernel: compiled graphs call it with gradients off (AOTAutograd's
    Function holds the backward).  A direct
    ``torch.ops.lik.*`` call on inputs that need a gradient gets PyTorch's autograd fallback,
    which warns at ``backward`` that no autograd kernel is registered: these ops are internal,
    the public functions are the interface.  The schema's aliasing promise (fresh outputs) is
    checked by ``torch.library.opcheck`` in the tests."""

    def wrap(impl):
        _LIBRARY.define(name + torch.library.infer_schema(impl, mutates_args=()))
        _LIBRARY.impl(name, impl, "CompositeExplicitAutograd")
        torch.library.register_fake(f"lik::{name}", fake, lib=_LIBRARY)
        op = getattr(torch.ops.lik, name).default

        def call(*args):
            if torch.compiler.is_compiling():
                return op(*args)
            return impl(*args)

        call.op = op
        call.__doc__ = impl.__doc__
        call.__name__ = name
        return call

    return wrap


@functools.lru_cache(maxsize=None)
def _module(name: str):
    """``lik_plugins.<name>``, imported at its first call and looked up once: the Triton
    modules outside ``dispatch.implementation`` (quantisation, the approximate score; never
    imported where no kernel launches) and ``fp8`` (which imports this module).  An
    ``import`` statement inside an op cost ~1-2 us a call on CI's CPU."""
    return importlib.import_module(f"lik_plugins.{name}")


CHUNKED = "torch-chunked"      # the path that serves what the others cannot (yet)


def _no_tensor(like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    # A custom op returns tensors, never None: an absent result is an empty tensor.
    return like.new_empty((0,), dtype=dtype)


def _path(t: torch.Tensor, op: str, entry: str, dim: int = 0) -> str:
    path = serves_width(served_by(t, op), op, dim)
    if path == "reference":
        # The public ops run the reference themselves; a compiled graph that was traced
        # before LIK_DISABLE / LIK_BACKEND=reference was set lands here: same semantics.
        path = CHUNKED
    if entry:
        record(entry, path)
    return path


def _serve(call, path: str, entry: str = ""):
    """``call(path)``, the op's work on the path that serves it, counted for the public op
    ``entry`` (none: not counted).  A CUDA call whose Triton binary is not built waits for it
    (Triton's JIT, or its disk cache: ``python -m lik_plugins.precompile`` fills that ahead)."""
    result = call(path)
    if entry:
        record(entry, path)
    return result


def _shape_of_scores(Q, D, layout):
    """(score shape, documents per query, Ld) of a MaxSim call."""
    if layout == CROSS:
        return (Q.shape[0], D.shape[0]), D.shape[0], D.shape[1]
    if layout == CANDIDATES:
        return (Q.shape[0], D.shape[1]), D.shape[1], D.shape[2]
    return (Q.shape[0],), 1, D.shape[1]


def _score_dtype(Q: torch.Tensor) -> torch.dtype:
    return torch.float64 if Q.dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------- hard max
def _maxsim_forward_fake(Q, D, q_mask, d_mask, layout, normalize, zero_mode, save_argmax, entry, strategy, need_q,
                         need_d):
    shape, nj, ld = _shape_of_scores(Q, D, layout)
    scores = Q.new_empty(shape, dtype=_score_dtype(Q))
    if not save_argmax:
        return scores, _no_tensor(Q, torch.int16)
    return scores, Q.new_empty((Q.shape[0], nj, Q.shape[1]), dtype=argmax_dtype(ld))


@_registered("maxsim_forward", _maxsim_forward_fake)
def maxsim_forward(
    Q: torch.Tensor, D: torch.Tensor, q_mask: Optional[torch.Tensor], d_mask: Optional[torch.Tensor],
    layout: int, normalize: bool, zero_mode: bool, save_argmax: bool, entry: str,
    strategy: str, need_q: bool, need_d: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MaxSim scores and, when ``save_argmax``, the winners ``[Nq, NJ, Lq]`` (-1: none).
    Pairs (``layout == PAIRS``) score ``D [B, Ld, d]`` as one candidate per query.

    ``save_argmax``: a training forward, whose backward (``maxsim_backward`` with ``strategy``,
    ``need_q``, ``need_d``) will follow."""
    path = _path(Q, "maxsim", "")
    if layout == PAIRS:
        D = D.unsqueeze(1)
        d_mask = None if d_mask is None else d_mask.unsqueeze(1)
    options = dict(cross=layout == CROSS, normalize=normalize, zero_mode=zero_mode, save_argmax=save_argmax)

    def forward(on):
        return implementation(on).maxsim.forward(Q, D, q_mask, d_mask, **options)

    scores, argmax = _serve(forward, path, entry)
    if layout == PAIRS:
        scores = scores.squeeze(1)
    return scores, (argmax if argmax is not None else _no_tensor(Q, torch.int16))


def choose_backward(strategy: str, *, cross: bool, shape: tuple[int, int, int, int, int] | None = None,
                    sms: int | None = None) -> str:
    """Resolve ``backward="auto"``; ``shape = (Nq, Lq, Nd, Ld, d)`` of a cross product,
    ``sms`` the GPU's streaming multiprocessors (default: an H100's 132).

    * per-query candidates and pairs: ``lowmem`` — each document is owned by one query,
      so destination-owned gradients have no contention, need no fp32 buffer and are
      deterministic; atomics would buy nothing.
    * in-batch cross product: ``lowmem`` where it measured best on an H100 (each grad_D
      tile lists the query rows that picked one of its tokens, then multiplies only those;
      docs/performance-notes.md), else ``unified`` -- one pass over the argmax that gathers
      for grad_Q and scatters ``g * q`` into fp32 with relaxed atomics (slab by slab above
      64 MiB of buffer):
      - short documents (Ld <= ``LOWMEM_MAX_LD``) with at most ``COMPACT_MAX_ROWS`` query
        rows: ColBERT 256 lowmem 0.75 ms at 24 MiB against unified 0.87 at 54 MiB,
        ColBERT 1024 9.6 ms at 196 MiB against 12.7 at 204;
      - fewer query programs (one per 32 query tokens) than the GPU has SMs, where unified
        cannot fill it (ColPali 64: lowmem 0.35-0.47 ms at 17 MiB against unified 0.55-0.74 at 49);
      - otherwise unified (ColPali 256: 1.94 ms at 134 MiB against lowmem 2.09 at 73).
      ``unified`` rounds grad_D differently from run to run; pass ``backward="lowmem"``
      for bitwise determinism.
    """
    if strategy not in BACKWARD_STRATEGIES:
        raise ValueError(f"backward must be one of {', '.join(map(repr, BACKWARD_STRATEGIES))}; got {strategy!r}")
    if strategy != "auto":
        return strategy
    if not cross:
        return "lowmem"
    if shape is not None:
        nq, lq, nd, ld, dim = shape
        if nq * -(-max(lq, 1) // 32) < (sms if sms is not None else sm_count(None)):
            return "lowmem"
        if ld <= LOWMEM_MAX_LD and nq * lq <= COMPACT_MAX_ROWS:
            return "lowmem"
    return "unified"


def _maxsim_backward_fake(grad, Q, D, argmax, layout, normalize, strategy, need_q, need_d, q_masked):
    return (Q.new_empty(Q.shape) if need_q else _no_tensor(Q)), (D.new_empty(D.shape) if need_d else _no_tensor(D))


@_registered("maxsim_backward", _maxsim_backward_fake)
def maxsim_backward(
    grad: torch.Tensor, Q: torch.Tensor, D: torch.Tensor, argmax: torch.Tensor, layout: int, normalize: bool,
    strategy: str, need_q: bool, need_d: bool, q_masked: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_Q, grad_D)`` through the winners (empty where not needed), in the inputs'
    dtypes and shapes, contiguous."""
    path = _path(Q, "maxsim", "")
    cross = layout == CROSS
    shape = (Q.shape[0], Q.shape[1], D.shape[0], D.shape[1], Q.shape[2]) if cross else None
    strategy = choose_backward(strategy, cross=cross, shape=shape, sms=sm_count(Q.device))
    D_view = D.unsqueeze(1) if layout == PAIRS else D
    if layout == PAIRS:
        grad = grad.unsqueeze(1)
    options = dict(cross=cross, normalize=normalize, need_q=need_q, need_d=need_d, strategy=strategy,
                   q_masked=q_masked)
    def backward(on):
        return implementation(on).maxsim.backward(grad, Q, D_view, argmax, **options)

    gq, gd = _serve(backward, path)
    if gd is not None and layout == PAIRS:
        gd = gd.squeeze(1)
    return (gq if gq is not None else _no_tensor(Q)), (gd if gd is not None else _no_tensor(D))


class _MaxSim(torch.autograd.Function):
    """``options = (layout, normalize, zero_mode, strategy, entry)``: one argument, not five,
    since ``apply`` walks every argument on every call."""

    @staticmethod
    def forward(ctx, Q, D, q_mask, d_mask, options):
        layout, normalize, zero_mode, strategy, entry = options
        scores, argmax = maxsim_forward(Q, D, q_mask, d_mask, layout, normalize, zero_mode, True, entry, strategy,
                                        ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        ctx.save_for_backward(Q, D, argmax)
        ctx.options = (layout, normalize, strategy, q_mask is not None)
        return scores

    @staticmethod
    def backward(ctx, grad):
        Q, D, argmax = ctx.saved_tensors
        layout, normalize, strategy, q_masked = ctx.options
        need_q, need_d = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gq, gd = maxsim_backward(grad, Q, D, argmax, layout, normalize, strategy, need_q, need_d, q_masked)
        return (gq if need_q else None), (gd if need_d else None), None, None, None


def maxsim(Q, D, q_mask, d_mask, *, layout: int, normalize: bool, zero_mode: bool, strategy: str,
           entry: str) -> torch.Tensor:
    """Validated inputs in, scores out: through autograd when a gradient is needed, else
    the forward alone (nothing saved)."""
    if torch.is_grad_enabled() and (Q.requires_grad or D.requires_grad):
        return _MaxSim.apply(Q, D, q_mask, d_mask, (layout, normalize, zero_mode, strategy, entry))
    return maxsim_forward(Q, D, q_mask, d_mask, layout, normalize, zero_mode, False, entry, strategy, False, False)[0]


# ----------------------------------------------------------------------------- packed layouts
# Tokens packed as ``[sum L, d]`` with int32 offsets (``cu_seqlens``), validated by the public
# ops (``lik_plugins.packed``).  ``pair_q`` / ``pair_d`` given: only those pairs are scored
# (``[P]``); absent (empty tensors): every query against every document (``[Nq, Nd]``).
# ``max_q`` / ``max_d``: bounds on the lengths, fixed on the host (the fake kernel's shapes).

def _pairs_of(pair_q, pair_d):
    return None if pair_q is None else (pair_q, pair_d)


def _varlen_path(t: torch.Tensor) -> str:
    """The path that serves a packed op: every path with a packed forward (Triton, chunked);
    others (Metal) are served by the chunked path, and counted so."""
    path = served_by(t, "maxsim")
    if path == "reference" or not hasattr(implementation(path).maxsim, "varlen_forward"):
        path = CHUNKED
    return path


def _varlen_forward_fake(Q, D, cu_q, cu_d, pair_q, pair_d, q_mask, d_mask, max_q, max_d, normalize, zero_mode,
                         save_argmax, entry, need_q, need_d):
    dtype = _score_dtype(Q)
    if pair_q is not None:
        shape, arg_shape = (pair_q.shape[0],), (pair_q.shape[0], max_q)
    else:
        shape = (cu_q.shape[0] - 1, cu_d.shape[0] - 1)
        arg_shape = (*shape, max_q)
    scores = Q.new_empty(shape, dtype=dtype)
    if not save_argmax:
        return scores, _no_tensor(Q, torch.int16)
    return scores, Q.new_empty(arg_shape, dtype=argmax_dtype(max_d))


@_registered("maxsim_varlen_forward", _varlen_forward_fake)
def maxsim_varlen_forward(
    Q: torch.Tensor, D: torch.Tensor, cu_q: torch.Tensor, cu_d: torch.Tensor,
    pair_q: Optional[torch.Tensor], pair_d: Optional[torch.Tensor],
    q_mask: Optional[torch.Tensor], d_mask: Optional[torch.Tensor], max_q: int, max_d: int,
    normalize: bool, zero_mode: bool, save_argmax: bool, entry: str, need_q: bool, need_d: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed scores (``[Nq, Nd]``, or ``[P]`` for a pair list) and, when ``save_argmax``,
    the winners (``[Nq, Nd, max_q]`` / ``[P, max_q]``; -1: none).  ``save_argmax``: the
    backward (``need_q``, ``need_d``) follows."""
    path = _varlen_path(Q)

    def forward(on):
        return implementation(on).maxsim.varlen_forward(
            Q, D, cu_q, cu_d, _pairs_of(pair_q, pair_d), q_mask, d_mask, max_q=max_q, max_d=max_d,
            normalize=normalize, zero_mode=zero_mode, save_argmax=save_argmax)

    scores, argmax = _serve(forward, path, entry)
    return scores, (argmax if argmax is not None else _no_tensor(Q, torch.int16))


def _varlen_backward_fake(grad, Q, D, cu_q, cu_d, pair_q, pair_d, argmax, normalize, need_q, need_d):
    return (Q.new_empty(Q.shape) if need_q else _no_tensor(Q)), (D.new_empty(D.shape) if need_d else _no_tensor(D))


@_registered("maxsim_varlen_backward", _varlen_backward_fake)
def maxsim_varlen_backward(
    grad: torch.Tensor, Q: torch.Tensor, D: torch.Tensor, cu_q: torch.Tensor, cu_d: torch.Tensor,
    pair_q: Optional[torch.Tensor], pair_d: Optional[torch.Tensor], argmax: torch.Tensor,
    normalize: bool, need_q: bool, need_d: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_Q, grad_D)`` of the packed tokens through the saved winners (empty where not
    needed); duplicate pairs accumulate."""
    def backward(on):
        return implementation(on).maxsim.varlen_backward(grad, Q, D, cu_q, cu_d, _pairs_of(pair_q, pair_d), argmax,
                                                         normalize=normalize, need_q=need_q, need_d=need_d)

    gq, gd = _serve(backward, _varlen_path(Q))
    return (gq if gq is not None else _no_tensor(Q)), (gd if gd is not None else _no_tensor(D))


class _MaxSimVarlen(torch.autograd.Function):
    """``options = (max_q, max_d, normalize, zero_mode, entry)``; saves the packed tokens,
    the offsets, the pair list and the winners."""

    @staticmethod
    def forward(ctx, Q, D, cu_q, cu_d, pair_q, pair_d, q_mask, d_mask, options):
        max_q, max_d, normalize, zero_mode, entry = options
        scores, argmax = maxsim_varlen_forward(Q, D, cu_q, cu_d, pair_q, pair_d, q_mask, d_mask, max_q, max_d,
                                               normalize, zero_mode, True, entry, ctx.needs_input_grad[0],
                                               ctx.needs_input_grad[1])
        if pair_q is None:
            ctx.save_for_backward(Q, D, cu_q, cu_d, argmax)
        else:
            ctx.save_for_backward(Q, D, cu_q, cu_d, argmax, pair_q, pair_d)
        ctx.normalize = normalize
        return scores

    @staticmethod
    def backward(ctx, grad):
        Q, D, cu_q, cu_d, argmax, *pairs = ctx.saved_tensors
        pair_q, pair_d = pairs if pairs else (None, None)
        need_q, need_d = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gq, gd = maxsim_varlen_backward(grad.contiguous(), Q, D, cu_q, cu_d, pair_q, pair_d, argmax, ctx.normalize,
                                        need_q, need_d)
        return (gq if need_q else None), (gd if need_d else None), None, None, None, None, None, None, None


def maxsim_varlen(Q, D, cu_q, cu_d, pair_q, pair_d, q_mask, d_mask, *, max_q: int, max_d: int, normalize: bool,
                  zero_mode: bool, entry: str) -> torch.Tensor:
    """Validated packed inputs in, scores out (through autograd when a gradient is needed)."""
    if torch.is_grad_enabled() and (Q.requires_grad or D.requires_grad):
        return _MaxSimVarlen.apply(Q, D, cu_q, cu_d, pair_q, pair_d, q_mask, d_mask,
                                   (max_q, max_d, normalize, zero_mode, entry))
    return maxsim_varlen_forward(Q, D, cu_q, cu_d, pair_q, pair_d, q_mask, d_mask, max_q, max_d, normalize,
                                 zero_mode, False, entry, False, False)[0]


# ----------------------------------------------------------------------------- smooth max
def _smooth_forward_fake(Q, D, tau, layout, entry, need_q, need_d):
    shape, nj, _ = _shape_of_scores(Q, D, layout)
    dtype = _score_dtype(Q)
    return Q.new_empty(shape, dtype=dtype), Q.new_empty((Q.shape[0], nj, Q.shape[1]), dtype=dtype)


@_registered("smooth_maxsim_forward", _smooth_forward_fake)
def smooth_maxsim_forward(Q: torch.Tensor, D: torch.Tensor, tau: float, layout: int, entry: str, need_q: bool,
                          need_d: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Smooth-max scores and the per-row log-sum-exp ``[Nq, NJ, Lq]`` (fp32; fp64 inputs: fp64).
    ``need_q`` / ``need_d``: the backward that follows (neither: none)."""
    path = _path(Q, "smooth", "")
    D_view = D.unsqueeze(1) if layout == PAIRS else D
    scores, lse = _serve(lambda on: implementation(on).smooth.smooth_forward(Q, D_view, tau, layout == CROSS), path,
                         entry)
    return (scores.squeeze(1) if layout == PAIRS else scores), lse


def _smooth_backward_fake(grad, Q, D, lse, tau, layout, need_q, need_d):
    return (Q.new_empty(Q.shape) if need_q else _no_tensor(Q)), (D.new_empty(D.shape) if need_d else _no_tensor(D))


@_registered("smooth_maxsim_backward", _smooth_backward_fake)
def smooth_maxsim_backward(grad: torch.Tensor, Q: torch.Tensor, D: torch.Tensor, lse: torch.Tensor, tau: float,
                           layout: int, need_q: bool, need_d: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients from the recomputed softmax weights ``exp(S / tau - lse)``."""
    path = _path(Q, "smooth", "")
    pairs = layout == PAIRS
    args = (Q, D.unsqueeze(1) if pairs else D, lse, grad.unsqueeze(1) if pairs else grad, tau, layout == CROSS, need_q,
            need_d)
    gq, gd = _serve(lambda on: implementation(on).smooth.smooth_backward(*args), path)
    gq = _no_tensor(Q) if gq is None else gq.to(Q.dtype)
    gd = _no_tensor(D) if gd is None else (gd.squeeze(1) if pairs else gd).to(D.dtype)
    return gq, gd


class _SmoothMaxSim(torch.autograd.Function):
    """Saves ``Q``, ``D`` and the per-row log-sum-exp; never its output (callers such as
    colpali's negative filtering edit the scores in place)."""

    @staticmethod
    def forward(ctx, Q, D, options):
        tau, layout, entry = options
        scores, lse = smooth_maxsim_forward(Q, D, tau, layout, entry, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        ctx.save_for_backward(Q, D, lse)
        ctx.options = (tau, layout)
        return scores

    @staticmethod
    def backward(ctx, grad):
        Q, D, lse = ctx.saved_tensors
        tau, layout = ctx.options
        need_q, need_d = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_q or need_d):
            return None, None, None
        gq, gd = smooth_maxsim_backward(grad.contiguous(), Q, D, lse, tau, layout, need_q, need_d)
        return (gq if need_q else None), (gd if need_d else None), None


def smooth_maxsim(Q, D, *, tau: float, layout: int, entry: str) -> torch.Tensor:
    if torch.is_grad_enabled() and (Q.requires_grad or D.requires_grad):
        return _SmoothMaxSim.apply(Q, D, (tau, layout, entry))
    return smooth_maxsim_forward(Q, D, tau, layout, entry, False, False)[0]


# ----------------------------------------------------------------------------- fp8
def _fp8_fake(Q, q_scales, d_values, d_scales, q_mask, d_mask, zero_mode, entry):
    cross = d_values.dim() == 3
    nj = d_values.shape[0] if cross else d_values.shape[1]
    return Q.new_empty((Q.shape[0], nj), dtype=torch.float32)


@_registered("maxsim_fp8", _fp8_fake)
def maxsim_fp8(
    Q: torch.Tensor, q_scales: Optional[torch.Tensor], d_values: torch.Tensor, d_scales: torch.Tensor,
    q_mask: Optional[torch.Tensor], d_mask: Optional[torch.Tensor], zero_mode: bool, entry: str,
) -> torch.Tensor:
    """fp8 MaxSim: ``Q`` is e4m3 values with ``q_scales``, or float tokens (``q_scales``
    None) quantised here -- inside the scoring kernel where that is cheaper (see
    :func:`lik_plugins.fp8.fuse_query_quantisation`)."""
    fp8 = _module("fp8")
    path = _path(d_values, "fp8", entry)
    cross = d_values.dim() == 3
    if q_scales is None:
        if path == "triton" and fp8.fuse_query_quantisation(Q, d_values):
            launch = implementation("triton").maxsim
            return launch.forward(Q, d_values, q_mask, d_mask, cross=cross, normalize=False, zero_mode=zero_mode,
                                  save_argmax=False, scales=(None, d_scales))[0]
        Q, q_scales = fp8.quantize_tokens(Q, path)
    if path == "triton":
        launch = implementation("triton").maxsim
        return launch.forward(Q, d_values, q_mask, d_mask, cross=cross, normalize=False, zero_mode=zero_mode,
                              save_argmax=False, scales=(q_scales, d_scales))[0]
    # No fp8 matrix units here: the same numbers from the dequantised tokens, with the
    # bounded-memory path (it materialises fp32 tokens, 4x the fp8 bytes).
    return chunked.forward(reference.dequantize_fp8(Q, q_scales), reference.dequantize_fp8(d_values, d_scales),
                           q_mask, d_mask, cross=cross, normalize=False, zero_mode=zero_mode, save_argmax=False)[0]


# ----------------------------------------------------------------------------- int8
@_registered("maxsim_int8", _fp8_fake)
def maxsim_int8(
    Q: torch.Tensor, q_scales: Optional[torch.Tensor], d_values: torch.Tensor, d_scales: torch.Tensor,
    q_mask: Optional[torch.Tensor], d_mask: Optional[torch.Tensor], zero_mode: bool, entry: str,
) -> torch.Tensor:
    """int8 MaxSim: ``Q`` is int8 values with ``q_scales``, or float tokens (``q_scales``
    None) quantised here.  The Triton kernel multiplies int8 x int8 into int32 and scales
    each similarity by its two tokens' scales before the max (where fp8's scales go)."""
    path = _path(d_values, "int8", entry, d_values.shape[-1])
    cross = d_values.dim() == 3
    if path == "triton":
        fused_quantisation_fits = _module("fp8").fused_quantisation_fits
        launch, quantize = implementation("triton").maxsim, _module("kernels.triton.quantize")
        # A float query is quantised inside the scoring kernel where that is cheap (q_scales
        # stays None: ``QUANT_Q``; unlike fp8 also under the interpreter, whose int8 casts are
        # exact), else by one quantisation launch -- never torch's ~8 ops per call.
        if q_scales is None and not fused_quantisation_fits(Q, d_values):
            Q, q_scales = quantize.quantize_int8(Q)
        return launch.forward(Q, d_values, q_mask, d_mask, cross=cross, normalize=False, zero_mode=zero_mode,
                              save_argmax=False, scales=(None if q_scales is None else q_scales.contiguous(), d_scales),
                              doc_format=launch.DocFormat(launch.INT8))[0]
    if q_scales is None:
        Q, q_scales = reference.quantize_int8(Q)
    # No int8 kernel here: the same numbers from the dequantised tokens (fp32, 4x the bytes).
    return chunked.forward(reference.dequantize_int8(Q, q_scales), reference.dequantize_int8(d_values, d_scales),
                           q_mask, d_mask, cross=cross, normalize=False, zero_mode=zero_mode, save_argmax=False)[0]


# ----------------------------------------------------------------------------- built documents
def _built_forward_fake(Q, D, d_mask, normalize, save_argmax):
    scores = Q.new_empty((Q.shape[0], D.shape[0]), dtype=_score_dtype(Q))
    if not save_argmax:
        return scores, _no_tensor(Q, torch.int16)
    return scores, Q.new_empty((Q.shape[0], D.shape[0], Q.shape[1]), dtype=argmax_dtype(D.shape[1]))


def _residual_forward_fake(Q, codes, residuals, doc_lengths, centroids, bucket_weights, nbits, normalize, save_argmax,
                           entry):
    return _built_forward_fake(Q, codes, None, normalize, save_argmax)


@_registered("maxsim_residual_forward", _residual_forward_fake)
def maxsim_residual_forward(
    Q: torch.Tensor, codes: torch.Tensor, residuals: torch.Tensor, doc_lengths: torch.Tensor,
    centroids: torch.Tensor, bucket_weights: torch.Tensor, nbits: int, normalize: bool, save_argmax: bool,
    entry: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of ``Q [Nq, Lq, d]`` against documents stored as PLAID residuals (codes
    ``[Nd, Ld]`` int32, residuals ``[Nd, Ld, d*nbits/8]`` uint8, ``doc_lengths [Nd]`` int32),
    and the winners when ``save_argmax``.  The Triton kernel decompresses (and normalises)
    each document tile on chip, each document's loop bounded by its length (no token mask in
    memory, no work on the padding); the chunked path decompresses a bounded chunk of
    documents at a time."""
    path = _path(Q, "residual", entry, Q.shape[-1])
    nd, ld = codes.shape
    if path == "triton":
        launch = implementation("triton").maxsim
        weights = launch.stream_order_weights(bucket_weights, nbits)
        fmt = launch.DocFormat(launch.RESIDUAL, codes, centroids, weights, (0, *codes.stride()), centroids.shape[0],
                               nbits)
        scores, argmax = launch.forward(Q, residuals, None, None, cross=True, normalize=normalize,
                                        zero_mode=False, save_argmax=save_argmax, doc_format=fmt,
                                        d_lengths=doc_lengths)
    else:
        def build(start, stop):
            # padding may hold any code (as in the kernel): clamp its (ignored) lookup in bounds
            chunk_codes = codes[start:stop].clamp(0, centroids.shape[0] - 1)
            return reference.decompress_residual(chunk_codes, residuals[start:stop], centroids, bucket_weights,
                                                 nbits).float()

        scores, argmax = chunked.forward_built(Q, build, nd, ld, reference.lengths_mask(doc_lengths, ld),
                                               normalize_docs=normalize, normalize_queries=normalize,
                                               save_argmax=save_argmax)
    return scores, (argmax if argmax is not None else _no_tensor(Q, torch.int16))


def _residual_backward_fake(grad, Q, codes, residuals, centroids, bucket_weights, argmax, nbits, normalize):
    return Q.new_empty(Q.shape)


@_registered("maxsim_residual_backward", _residual_backward_fake)
def maxsim_residual_backward(
    grad: torch.Tensor, Q: torch.Tensor, codes: torch.Tensor, residuals: torch.Tensor, centroids: torch.Tensor,
    bucket_weights: torch.Tensor, argmax: torch.Tensor, nbits: int, normalize: bool,
) -> torch.Tensor:
    """grad_Q: each winning token is decompressed once (only those), on every path."""
    ld, rbytes = residuals.shape[1], residuals.shape[2]
    positions, inverse, ok = chunked.winner_positions(argmax, ld)
    rows = reference.decompress_residual(codes.reshape(-1)[positions], residuals.reshape(-1, rbytes)[positions],
                                         centroids, bucket_weights, nbits).float()
    if normalize:
        rows = rows * chunked.inverse_norms(rows).unsqueeze(-1)
    gq, _ = chunked.backward_built(grad, Q, inverse, ok, rows, normalize_queries=normalize, need_q=True,
                                   need_rows=False)
    return gq


class _ResidualMaxSim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, Q, codes, residuals, doc_lengths, centroids, bucket_weights, options):
        nbits, normalize, entry = options
        scores, argmax = maxsim_residual_forward(Q, codes, residuals, doc_lengths, centroids, bucket_weights, nbits,
                                                 normalize, True, entry)
        ctx.save_for_backward(Q, codes, residuals, centroids, bucket_weights, argmax)
        ctx.options = (nbits, normalize)
        return scores

    @staticmethod
    def backward(ctx, grad):
        Q, codes, residuals, centroids, bucket_weights, argmax = ctx.saved_tensors
        nbits, normalize = ctx.options
        gq = maxsim_residual_backward(grad.contiguous(), Q, codes, residuals, centroids, bucket_weights, argmax,
                                      nbits, normalize)
        return gq, None, None, None, None, None, None


def maxsim_residual(Q, codes, residuals, doc_lengths, centroids, bucket_weights, *, nbits: int, normalize: bool,
                    entry: str) -> torch.Tensor:
    """Validated inputs in, scores out (autograd into ``Q`` when it requires grad)."""
    if torch.is_grad_enabled() and Q.requires_grad:
        return _ResidualMaxSim.apply(Q, codes, residuals, doc_lengths, centroids, bucket_weights,
                                     (nbits, normalize, entry))
    return maxsim_residual_forward(Q, codes, residuals, doc_lengths, centroids, bucket_weights, nbits, normalize,
                                   False, entry)[0]


def _residual_varlen_fake(Q, codes_flat, residuals_flat, cu_d, centroids, bucket_weights, nbits, max_d, normalize,
                          entry):
    return Q.new_empty((Q.shape[0], cu_d.shape[0] - 1), dtype=_score_dtype(Q))


@_registered("maxsim_residual_varlen", _residual_varlen_fake)
def maxsim_residual_varlen(
    Q: torch.Tensor, codes_flat: torch.Tensor, residuals_flat: torch.Tensor, cu_d: torch.Tensor,
    centroids: torch.Tensor, bucket_weights: torch.Tensor, nbits: int, max_d: int, normalize: bool, entry: str,
) -> torch.Tensor:
    """Scores (no gradient) of ``Q [Nq, Lq, d]`` against a packed residual index (int32
    offsets ``cu_d``, checked by the caller; ``max_d`` bounds the documents).  The Triton
    kernel reads each document's packed tokens in place (the forward's ``VARLEN`` layout);
    elsewhere the compressed tokens are padded first and scored as :func:`maxsim_residual_forward`."""
    if _path(Q, "residual", "", Q.shape[-1]) == "triton":
        launch = implementation("triton").maxsim
        record(entry, "triton")
        nq, lq, dim = Q.shape
        Qp = Q.contiguous().reshape(nq * lq, dim)
        cu_q = torch.arange(0, (nq + 1) * lq, max(lq, 1), dtype=torch.int32, device=Q.device)[:nq + 1]
        weights = launch.stream_order_weights(bucket_weights, nbits)
        fmt = launch.DocFormat(launch.RESIDUAL, codes_flat, centroids, weights, (0, 0, codes_flat.stride(0)),
                               centroids.shape[0], nbits)
        return launch.varlen_forward(Qp, residuals_flat, cu_q, cu_d, None, None, None, max_q=lq, max_d=max_d,
                                     normalize=normalize, zero_mode=False, save_argmax=False, doc_format=fmt)[0]
    codes, residuals, lengths = reference.pad_packed_index(codes_flat, residuals_flat, cu_d, max_d)
    return maxsim_residual_forward(Q, codes, residuals, lengths.to(torch.int32), centroids, bucket_weights, nbits,
                                   normalize, False, entry)[0]


def _hidden_forward_fake(Q, H, W, b, d_mask, normalize, save_argmax, entry):
    return _built_forward_fake(Q, H, d_mask, normalize, save_argmax)


def _project_hidden(H, W, b):
    """``H @ W.T + b`` in fp32 (fp64 for fp64 inputs): the tokens the kernel builds."""
    if H.is_cuda and H.dtype in (torch.bfloat16, torch.float16) and W.dtype == H.dtype:
        # 16-bit products on the matrix units summed into fp32, as the kernel's tiles are
        # (each product exact, fp32 sums): no fp32 copy of H and no fp32 GEMM, which took a
        # third of a 32 x 32 training step's GPU time on an H100 (docs/performance-notes.md)
        rows = torch.mm(H.reshape(-1, H.shape[-1]), W.t(), out_dtype=torch.float32)
        rows = rows.view(*H.shape[:-1], W.shape[0])
        return rows if b is None else rows + b.float()
    cdt = torch.float64 if H.dtype == torch.float64 else torch.float32
    return torch.nn.functional.linear(H.to(cdt), W.to(cdt), None if b is None else b.to(cdt))


@_registered("maxsim_hidden_forward", _hidden_forward_fake)
def maxsim_hidden_forward(
    Q: torch.Tensor, H: torch.Tensor, W: torch.Tensor, b: Optional[torch.Tensor], d_mask: Optional[torch.Tensor],
    normalize: bool, save_argmax: bool, entry: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of ``Q [Nq, Lq, d]`` (as given: ``normalize`` acts on the documents only)
    against ``normalize(H @ W.T + b)`` (``H [Nd, Ld, h]``, ``W [d, h]``), and the winners
    when ``save_argmax``.  The Triton kernel projects each
    document tile on chip; the chunked path projects a bounded chunk of documents at a time."""
    path = _path(Q, "hidden", entry, Q.shape[-1])
    nd, ld = H.shape[0], H.shape[1]
    if path == "triton":
        launch = implementation("triton").maxsim
        fmt = launch.DocFormat(launch.HIDDEN, W.contiguous(), b, None, (0, 0, 0), H.shape[-1], 0, b is not None)
        scores, argmax = launch.forward(Q, H, None, d_mask, cross=True, normalize=normalize, zero_mode=False,
                                        save_argmax=save_argmax, doc_format=fmt)
    else:
        scores, argmax = chunked.forward_built(Q, lambda i, j: _project_hidden(H[i:j], W, b), nd, ld, d_mask,
                                               normalize_docs=normalize, normalize_queries=False,
                                               save_argmax=save_argmax)
    return scores, (argmax if argmax is not None else _no_tensor(Q, torch.int16))


def _hidden_backward_fake(grad, Q, H, W, b, argmax, normalize, need_q, need_h, need_w, need_b):
    return tuple(x.new_empty(x.shape) if need and x is not None else _no_tensor(Q)
                 for x, need in ((Q, need_q), (H, need_h), (W, need_w), (b, need_b)))


@_registered("maxsim_hidden_backward", _hidden_backward_fake)
def maxsim_hidden_backward(
    grad: torch.Tensor, Q: torch.Tensor, H: torch.Tensor, W: torch.Tensor, b: Optional[torch.Tensor],
    argmax: torch.Tensor, normalize: bool, need_q: bool, need_h: bool, need_w: bool, need_b: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(grad_Q, grad_H, grad_W, grad_b)`` (empty where not needed).

    Chunked path: the hidden states at the winning positions are gathered (each distinct
    one once), projected and normalised again, and the gradient flows back through that
    small product only.  Triton path: every token is projected again (one GEMM, microseconds
    on a GPU; the ``[Nd, Ld, d]`` tokens live only during the backward, ``d/h`` of the
    hidden states autograd already keeps) so the dense kernels' own backward runs on them:
    finding the distinct winners needs a sort and a host sync, which cost more there
    (``benchmarks/bench_compressed.py``).  Both are exact: a token that won nowhere has a
    zero gradient either way."""
    nd, ld, hidden = H.shape
    need_rows = need_h or need_w or need_b
    dense = _path(Q, "hidden", "", Q.shape[-1]) == "triton"      # every token's row, in order
    if dense:
        launch = implementation("triton").maxsim
        h_rows = H.reshape(-1, hidden)
        rows = _project_hidden(h_rows, W, b)                                    # [Nd*Ld, d] fp32
        # the documents as scored (normalised in fp32, then Q's dtype) through the dense
        # kernels' backward without normalisation: the queries were not normalised; the
        # documents' Jacobian follows in fp32 below
        inv = chunked.inverse_norms(rows) if normalize else None
        rows_hat = rows * inv.unsqueeze(-1) if normalize else rows
        gq, g_hat = launch.backward(grad, Q, rows_hat.to(Q.dtype).view(nd, ld, -1), argmax, cross=True,
                                    normalize=False, need_q=need_q, need_d=need_rows, strategy="lowmem",
                                    q_masked=False)
        g_hat = g_hat.reshape(rows.shape).to(rows.dtype) if need_rows else None
    else:
        positions, inverse, ok = chunked.winner_positions(argmax, ld)
        h_rows = H.reshape(-1, hidden)[positions]
        rows = _project_hidden(h_rows, W, b)                                    # [U, d] fp32
        inv = chunked.inverse_norms(rows) if normalize else None
        rows_hat = rows * inv.unsqueeze(-1) if normalize else rows
        gq, g_hat = chunked.backward_built(grad, Q, inverse, ok, rows_hat, normalize_queries=False, need_q=need_q,
                                           need_rows=need_rows)
    grads = [gq if need_q else _no_tensor(Q), _no_tensor(Q), _no_tensor(Q), _no_tensor(Q)]
    if need_rows:
        # through the normalisation, then the affine map: d rows = g_rows, dW = g^T h, db = sum g
        g_rows = chunked.project_out_norm(g_hat, rows, inv) if normalize else g_hat
        split = _split_gradient(g_rows, H, W)
        if need_h:
            # with the split, straight into bf16 (fp32 sums inside the GEMM, one rounding): no
            # [rows, h] fp32 intermediate, 4x the hidden states' gradient in bytes
            g_h = (g_rows @ W.to(g_rows.dtype)) if split is None else torch.mm(split, torch.cat([W, W]))
            if dense:
                grads[1] = g_h.to(H.dtype).view(H.shape)
            else:
                full = torch.zeros((nd * ld, hidden), dtype=H.dtype, device=H.device)
                full[positions] = g_h.to(H.dtype)
                grads[1] = full.view(H.shape)
        if need_w:
            if split is None:
                grads[2] = (g_rows.t() @ h_rows.to(g_rows.dtype)).to(W.dtype)
            else:
                # [hi | lo]^T h stacks the two terms' products; their sum is g^T h
                grads[2] = torch.mm(split.t(), h_rows, out_dtype=torch.float32).view(2, *W.shape).sum(0).to(W.dtype)
        if need_b:
            grads[3] = g_rows.sum(0).to(b.dtype)
    return tuple(grads)


def _split_gradient(g_rows: torch.Tensor, H: torch.Tensor, W: torch.Tensor) -> Optional[torch.Tensor]:
    """``[hi | lo]`` (bf16, ``[rows, 2d]``) with ``hi + lo`` the fp32 row gradients to 16 bits of
    mantissa, for bf16 hidden states on CUDA (None elsewhere): the backward's two products then
    run on the matrix units into fp32 -- its gradients, rounded to bf16 at the end, differ from
    fp32 products' by about 2**-17 of their size against bf16's 2**-9 -- instead of fp32 GEMMs
    and an fp32 copy of the hidden states (H100, a 32 x 32 training step's GPU time: 281 -> 184
    us, its peak 38 -> 24 MiB; its gradients' error against a float64 oracle unchanged in four
    digits).  Not for fp16: its range would flush small gradients."""
    if not (g_rows.is_cuda and H.dtype == torch.bfloat16 and W.dtype == torch.bfloat16
            and g_rows.dtype == torch.float32):
        return None
    hi = g_rows.to(torch.bfloat16)
    lo = (g_rows - hi.float()).to(torch.bfloat16)
    return torch.cat([hi, lo], dim=1)


class _HiddenMaxSim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, Q, H, W, b, d_mask, options):
        normalize, entry = options
        scores, argmax = maxsim_hidden_forward(Q, H, W, b, d_mask, normalize, True, entry)
        ctx.save_for_backward(Q, H, W, b, argmax)
        ctx.normalize = normalize
        return scores

    @staticmethod
    def backward(ctx, grad):
        Q, H, W, b, argmax = ctx.saved_tensors
        need = ctx.needs_input_grad
        gq, gh, gw, gb = maxsim_hidden_backward(grad.contiguous(), Q, H, W, b, argmax, ctx.normalize, need[0],
                                                need[1], need[2], b is not None and need[3])
        return (gq if need[0] else None), (gh if need[1] else None), (gw if need[2] else None), \
            (gb if b is not None and need[3] else None), None, None


def maxsim_hidden(Q, H, W, b, d_mask, *, normalize: bool, entry: str) -> torch.Tensor:
    """Validated inputs in, scores out (autograd into whichever of Q, H, W, b require grad)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (Q, H, W, b)):
        return _HiddenMaxSim.apply(Q, H, W, b, d_mask, (normalize, entry))
    return maxsim_hidden_forward(Q, H, W, b, d_mask, normalize, False, entry)[0]


# ----------------------------------------------------------------------------- PLAID pruning
def _approx_fake(query_centroid_scores, codes, doc_lengths):
    return query_centroid_scores.new_empty((codes.shape[0],), dtype=torch.float32)


@_registered("plaid_approx_score", _approx_fake)
def plaid_approx_score(query_centroid_scores: torch.Tensor, codes: torch.Tensor,
                       doc_lengths: torch.Tensor) -> torch.Tensor:
    """``[B]`` fp32: ``sum_s max_{t < len} S[codes[b, t], s]`` (0 for an empty document) from
    ``S [C, Lq]``: one program per document on the Triton path (``kernels/triton/approx.py``),
    elsewhere a bounded chunk of documents at a time (a gather and a max in torch)."""
    scores = query_centroid_scores.float().contiguous()                        # [C, Lq]: one row per code
    if _path(query_centroid_scores, "residual", "") == "triton":
        approx = _module("kernels.triton.approx")
        record("plaid_approx_score", "triton")
        return approx.plaid_approx_score(scores, codes, doc_lengths)
    d_mask = reference.lengths_mask(doc_lengths, codes.shape[1])
    record("plaid_approx_score", CHUNKED)
    n, ld = codes.shape
    out = torch.empty((n,), dtype=torch.float32, device=codes.device)
    step = max(1, min(max(n, 1), chunk_elements() // max(ld * scores.shape[1], 1)))
    for start in range(0, n, step):
        m = d_mask[start:start + step]
        # padding may hold any code (as maxsim_residual allows): look up centroid 0 there
        c = torch.where(m, codes[start:start + step], 0).long()
        sim = scores[c]                                                        # [b, Ld, Lq]
        best = sim.masked_fill(~m.unsqueeze(-1), float("-inf")).amax(1)
        best = torch.where(m.any(1, keepdim=True), best, torch.zeros_like(best))
        out[start:start + step] = best.sum(-1)
    return out
