"""How every op of :mod:`lik_plugins.autograd` is registered with ``torch.library``, and the
helpers their fake kernels share.

:func:`registered` defines ``lik::<name>`` from the implementation's annotations
(``torch.library.infer_schema``, as ``torch.library.custom_op`` would), registers the
implementation as the op's one ``CompositeExplicitAutograd`` kernel and the fake kernel for
shapes, and returns a caller that runs the implementation directly in eager mode and the
registered op while compiling or exporting (``torch.compiler.is_compiling()``), so the graph
holds one opaque node per op.  Either way the same function computes.

Why not ``torch.library.custom_op``: a compiled graph calls the op on every step, and
``custom_op``'s layers (an autograd kernel that re-dispatches, a per-device wrapper that
checks aliasing and toggles Dynamo) cost several times this registration's host time per
call, itself several times the bare function's (docs/performance-notes.md).  The autograd
formulas are the families' ``torch.autograd.Function`` s, so an op needs no autograd kernel:
compiled graphs call it with gradients off (AOTAutograd's Function holds the backward).  A
direct ``torch.ops.lik.*`` call on inputs that need a gradient gets PyTorch's autograd
fallback, which warns at ``backward`` that no autograd kernel is registered: these ops are
internal, the public functions are the interface.  The schema's aliasing promise (fresh
outputs) is checked by ``torch.library.opcheck`` in the tests.

The op names (``torch.ops.lik.*``) are a compatibility promise: compiled and exported graphs
refer to them.
"""
from __future__ import annotations

import torch

from ..kernels.common import accumulation_dtype, argmax_dtype

# Layouts, passed to the ops as ints (a custom op's schema takes int, not an enum).
CROSS, CANDIDATES, PAIRS = 0, 1, 2

# One library object owns every registration (dropping it would unregister them).
_LIBRARY = torch.library.Library("lik", "FRAGMENT")


def registered(name: str, fake):
    """Decorator: register the implementation as ``lik::name`` with ``fake`` as its meta
    kernel; return the eager/compiled caller described in the module docstring (its ``.op``
    is the registered op)."""

    def wrap(impl):
        _LIBRARY.define(name + torch.library.infer_schema(impl, mutates_args=()))
        _LIBRARY.impl(name, impl, "CompositeExplicitAutograd")
        # the fake kernel as the op's Meta kernel, which fake tensors run for an op with no
        # fake registration: ``torch.library.register_fake`` records its caller's source
        # line, and finding that file's module scans every module loaded (in a host process,
        # thousands: tens of milliseconds of a user's first step)
        _LIBRARY.impl(name, fake, "Meta")
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


def no_tensor(like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A custom op returns tensors, never None: an absent result is an empty tensor."""
    return like.new_empty((0,), dtype=dtype)


def or_empty(result, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``result``, or :func:`no_tensor` where a launcher returned None."""
    return result if result is not None else no_tensor(like, dtype)


def shape_of_scores(Q, D, layout):
    """(score shape, documents per query, Ld) of a MaxSim call."""
    if layout == CROSS:
        return (Q.shape[0], D.shape[0]), D.shape[0], D.shape[1]
    if layout == CANDIDATES:
        return (Q.shape[0], D.shape[1]), D.shape[1], D.shape[2]
    return (Q.shape[0],), 1, D.shape[1]


def scores_fake(Q, shape, n_docs: int, ld: int, save_argmax: bool):
    """``(scores, winners)`` as a scoring forward returns them: ``[Nq, n_docs, Lq]`` winners
    of the dtype every path writes (empty without ``save_argmax``)."""
    scores = Q.new_empty(shape, dtype=accumulation_dtype(Q.dtype))
    if not save_argmax:
        return scores, no_tensor(Q, torch.int16)
    return scores, Q.new_empty((Q.shape[0], n_docs, Q.shape[1]), dtype=argmax_dtype(ld))


def grads_fake(*pairs):
    """Fake gradients: ``x``'s shape where ``need``, else empty, for each ``(x, need)``."""
    first = pairs[0][0]
    return tuple(x.new_empty(x.shape) if need and x is not None else no_tensor(first if x is None else x)
                 for x, need in pairs)
