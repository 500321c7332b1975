"""The registered op layer: every computation of the public ops as a ``torch.library`` custom
op (``torch.ops.lik.*``) with a fake kernel for shapes, and the autograd Functions over them.

One module per op family, named as in :mod:`lik_plugins.ops`:

================  ==========================================================================
``registry``      how an op is registered (eager calls skip the dispatcher; compiled graphs
                  hold the op), fake-kernel helpers, the layout ids
``dense``         ``lik::maxsim_forward`` / ``_backward``; ``choose_backward``
``packed``        ``lik::maxsim_varlen_forward`` / ``_backward``
``smooth``        ``lik::smooth_maxsim_forward`` / ``_backward``
``quantized``     ``lik::maxsim_fp8``, ``lik::maxsim_int8`` (inference only)
``residual``      ``lik::maxsim_residual_forward`` / ``_backward``, ``lik::maxsim_residual_varlen``,
                  ``lik::plaid_approx_score``
``hidden``        ``lik::maxsim_hidden_forward`` / ``_backward``
================  ==========================================================================

No op branches on the device: each asks :func:`lik_plugins.kernels.dispatch.serve` for the
launchers of the path that serves its tensors, at run time inside the op, and that call
counts it in :func:`lik_plugins.routing_counts` -- so a ``torch.compile``d function routes
and counts exactly as eager code does.  ``torch.compile(fullgraph=True)``, ``torch.export``
and CUDA graphs (``mode="reduce-overhead"``) trace through the public ops without a graph
break.  The autograd Functions save only the winners (hard max) or the log-sum-exp (smooth
max).

Importing this package registers every op (the families import nothing heavier than torch),
so a graph that names any ``torch.ops.lik.*`` op loads once ``lik_plugins.autograd`` is imported.
"""
from __future__ import annotations

from . import dense, hidden, packed, quantized, residual, smooth  # noqa: F401  (registers every op)
from .registry import CANDIDATES, CROSS, PAIRS  # noqa: F401
