"""Score adapters: colpali-engine's scoring expressions on our ops, with colpali's semantics.

colpali passes no masks (zero-padded tokens score 0 and take part in the max), so none
are passed here.  Our ops return float32; colpali's own path returns the input dtype,
so every adapter casts back to it.
"""
from __future__ import annotations

import torch

from .._config import disabled, scores_backend

# COLPALI_SCORES_BACKEND, as colpali-engine >= 0.3.17 parses it (read on every call).
BACKEND_VAR = "COLPALI_SCORES_BACKEND"
VALID_BACKENDS = ("auto", "torch", "lik")


def backend_mode() -> str:
    """``auto`` (default) | ``torch`` | ``lik``; any other value raises colpali's ValueError."""
    value = scores_backend(BACKEND_VAR)
    if value not in VALID_BACKENDS:
        raise ValueError(f"{BACKEND_VAR} must be one of {VALID_BACKENDS}, got {value!r}.")
    return value


def use_original() -> bool:
    """True when a patched entry must run colpali's own code: ``LIK_DISABLE=1`` or
    ``COLPALI_SCORES_BACKEND=torch``."""
    if disabled():
        return True
    return backend_mode() == "torch"


def eligible(*tensors: torch.Tensor) -> bool:
    """Our ops serve these inputs exactly as colpali's einsum would: floating tensors of one
    dtype on one device, non-empty, same embedding dim.  Anything else runs the original
    code (which raises colpali's own error where it has one)."""
    first = tensors[0]
    for t in tensors:
        if not torch.is_tensor(t) or not t.is_floating_point():
            return False
        if t.device != first.device or t.dtype != first.dtype or t.numel() == 0:
            return False
        if t.shape[-1] != first.shape[-1]:
            return False
    return True


def _ops():
    from .. import ops

    return ops


def inbatch(Q: torch.Tensor, D: torch.Tensor, smooth: bool = False, tau: float = 0.1):
    """``[B, Lq, d] x [C, Ld, d] -> [B, C]`` in ``Q.dtype``; returns ``(scores, path)``."""
    if smooth:
        ops = _ops()
        return ops.smooth_maxsim(Q, D, tau=tau, layout="cross").to(Q.dtype), ops.served_by(Q, "smooth")
    ops = _ops()
    return ops.maxsim(Q, D).to(Q.dtype), ops.served_by(Q)


def pairs(Q: torch.Tensor, D: torch.Tensor, smooth: bool = False, tau: float = 0.1):
    """``[B, Lq, d] x [B, Ld, d] -> [B]`` in ``Q.dtype``; returns ``(scores, path)``."""
    if smooth:
        ops = _ops()
        return ops.smooth_maxsim(Q, D, tau=tau, layout="pairs").to(Q.dtype), ops.served_by(Q, "smooth")
    ops = _ops()
    return ops.maxsim_pairs(Q, D).to(Q.dtype), ops.served_by(Q)


def candidates(Q: torch.Tensor, N: torch.Tensor, smooth: bool = False, tau: float = 0.1):
    """``[B, Lq, d] x [B, K, Ld, d] -> [B, K]`` in ``Q.dtype`` (one launch); returns ``(scores, path)``."""
    if smooth:
        ops = _ops()
        return ops.smooth_maxsim(Q, N, tau=tau, layout="candidates").to(Q.dtype), ops.served_by(Q, "smooth")
    ops = _ops()
    return ops.maxsim(Q, N).to(Q.dtype), ops.served_by(Q)


def query_lengths(Q: torch.Tensor) -> torch.Tensor:
    """colpali's query length: rows whose first feature is non-zero."""
    return (Q[:, :, 0] != 0).sum(dim=1)
