"""int8 inference: quantise token embeddings once, score them on the integer matrix units.

The fp8 path's twin for GPUs without fp8 matrix units (Ampere, compute capability 8.0+)
and for halving an index's storage against bf16.  Each token keeps one fp32 scale (its
largest component maps to 127); the kernel multiplies int8 x int8 into exact int32 sums
and scales each similarity by its query and document token's scales *before* the row
max -- the document scale varies along the reduced axis, so it cannot wait until after.
What that does to rankings is measured in ``recipes/fp8_fidelity.py``.

    >>> index = quantize_int8(D)                # once, when the corpus is encoded
    >>> scores = maxsim_int8(Q, index)          # Q quantised on the fly

Where it runs: the Triton kernel on CUDA GPUs of compute capability 8.0+ (and under
``TRITON_INTERPRET=1`` with ``LIK_BACKEND=triton``); elsewhere the same scores from the
dequantised fp32 tokens (chunked path).  ``LIK_DISABLE=1`` routes to the reference.
"""
from __future__ import annotations

import functools

import torch

from . import _routing, library
from ._config import disabled, forced_backend
from ._tokens import TokenFormat, quantize_index, scaled_tokens_type
from ._tokens import as_tokens as as_tokens_of
from ._validate import check_geometry, check_options
from .kernels import reference

__all__ = ["Int8Tokens", "quantize_int8", "maxsim_int8"]


Int8Tokens = scaled_tokens_type("Int8Tokens", __name__, "int8")


def _quantize(x: torch.Tensor) -> Int8Tokens:
    values, scales = reference.quantize_int8(x)
    return Int8Tokens(values.contiguous(), scales.contiguous())


def quantize_int8(x: torch.Tensor, *, normalize: bool = False) -> Int8Tokens:
    """Per-token symmetric int8 quantisation of ``x [..., L, d]`` (float16/bfloat16/float32/float64):
    ``scale = max|x| / 127``, ``values = round(x / scale)`` (see ``reference.quantize_int8``).

    ``normalize=True`` L2-normalises each token first (cosine-similarity models quantise
    their unit vectors).  Raises on NaN/inf (one reduction and a host sync).

    Example::

        >>> index = quantize_int8(torch.randn(100, 180, 128), normalize=True)
        >>> index.values.dtype, index.scales.shape
        (torch.int8, torch.Size([100, 180]))
    """
    return quantize_index(INT8, x, normalize)


INT8 = TokenFormat("int8", Int8Tokens, torch.int8, _quantize)
as_tokens = functools.partial(as_tokens_of, INT8)


def maxsim_int8(
    Q,
    D,
    q_mask: torch.Tensor | None = None,
    d_mask: torch.Tensor | None = None,
    *,
    mask_mode: str = "exclude",
) -> torch.Tensor:
    """MaxSim scores from int8 tokens, like :func:`lik_plugins.maxsim` (no gradient).

    Args:
        Q: ``[Nq, Lq, d]`` float tensor (quantised here, per token) or :class:`Int8Tokens`.
        D: ``[Nd, Ld, d]`` (cross product -> ``[Nq, Nd]``) or ``[Nq, K, Ld, d]`` (per-query
            candidates -> ``[Nq, K]``), float tensor or :class:`Int8Tokens` -- quantise an
            index once with :func:`quantize_int8` and reuse it.
        q_mask, d_mask, mask_mode: as in :func:`lik_plugins.maxsim`.

    Returns:
        float32 scores of the dequantised tokens (``reference.maxsim_int8``).

    Example::

        >>> index = quantize_int8(torch.randn(8, 30, 64))
        >>> maxsim_int8(torch.randn(2, 5, 64), index).shape
        torch.Size([2, 8])
    """
    check_options("auto", mask_mode)
    d = as_tokens("D", D, (3, 4))
    q = as_tokens("Q", Q, (3,), quantize=False)
    q_values, q_scales = (q, None) if isinstance(q, torch.Tensor) else q
    q_mask, d_mask, _ = check_geometry(q_values, d.values, q_mask, d_mask)
    with torch.no_grad():
        if disabled() or forced_backend() == "reference":
            _routing.record("maxsim_int8", "reference")
            q = q if q_scales is not None else Int8Tokens(*reference.quantize_int8(q_values))
            return reference.maxsim_int8(q, d, q_mask, d_mask, mask_mode=mask_mode)
        return library.maxsim_int8(q_values, q_scales, d.values, d.scales, q_mask, d_mask, mask_mode == "zero",
                                   "maxsim_int8")
