"""Small host-side helpers shared by every path (no kernels here)."""
from __future__ import annotations

import torch

NORM_EPS = 1e-12
# The Triton lowmem backward lists each grad_D tile's query rows by 16-bit row id, so it
# serves cross products of up to this many query rows (Nq * Lq); the backward choice
# (autograd.choose_backward) reads it too.
COMPACT_MAX_ROWS = 1 << 15


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32, fp64 for fp64 inputs: what every path computes and returns scores in."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def inverse_norms(x: torch.Tensor) -> torch.Tensor:
    """``1 / max(||x||, eps)`` over the last dim, in fp32 (fp64 for fp64 input).

    The reduction upcasts on the fly, so no full-size fp32 copy of ``x`` is made.
    """
    norms = torch.linalg.vector_norm(x, dim=-1, dtype=accumulation_dtype(x.dtype))
    return norms.clamp_min(NORM_EPS).reciprocal()


def project_out_norm(g_hat: torch.Tensor, x: torch.Tensor, inv_norm: torch.Tensor) -> torch.Tensor:
    """Jacobian of ``x / ||x||`` applied to ``g_hat = dL/dx_hat``:
    ``dL/dx = (g_hat - <g_hat, x_hat> x_hat) / ||x||``."""
    x_hat = x * inv_norm.unsqueeze(-1)
    radial = (g_hat * x_hat).sum(-1, keepdim=True)
    return (g_hat - radial * x_hat) * inv_norm.unsqueeze(-1)


# The fused smooth-max kernel keeps a [rows, d] query tile and its gradient on chip: wider
# embeddings are served by the chunked path (unless LIK_BACKEND=triton asks for the kernel).
SMOOTH_FUSED_MAX_DIM = 256


def argmax_dtype(ld: int) -> torch.dtype:
    """Dtype of the saved winners for documents of ``ld`` tokens, the same on every path
    (the registered op's fake kernel promises it): 16 bits where they suffice."""
    return torch.int16 if ld < 2**15 else torch.int32
