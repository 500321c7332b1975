"""fp8 (e4m3) inference: quantise token embeddings once, score them at twice the bf16 rate.

Opt-in and inference-only.  Each token keeps one fp32 scale (its largest component maps
to e4m3's largest finite value, 448), so a token's direction survives quantisation to
about 3 significant bits per component; what that does to rankings is measured in
``recipes/fp8_fidelity.py`` and ``docs/performance-notes.md``, not assumed.

    >>> index = quantize_fp8(D)                 # once, when the corpus is encoded
    >>> scores = maxsim_fp8(Q, index)           # Q quantised on the fly

Where it runs: the Triton kernel with fp8 tensor-core products on GPUs with fp8 matrix
units (compute capability 8.9+: Ada, Hopper) and under ``TRITON_INTERPRET=1``; elsewhere
(older GPUs, CPU, ``LIK_BACKEND=torch-chunked``) the same scores are computed from the
dequantised fp32 tokens, so results never depend on the hardware beyond fp32 rounding.
``LIK_DISABLE=1`` routes to the reference.
"""
from __future__ import annotations

import functools

import torch

from . import _routing, library
from ._config import disabled, forced_backend, triton_interpret
from ._tokens import TokenFormat, quantize_index, scaled_tokens_type
from ._tokens import as_tokens as as_tokens_of
from ._validate import check_geometry, check_options
from .kernels import reference
from .kernels.dispatch import served_by
from .kernels.reference import FP8_DTYPE

__all__ = ["Fp8Tokens", "quantize_fp8", "maxsim_fp8"]


Fp8Tokens = scaled_tokens_type("Fp8Tokens", __name__, "e4m3")


def quantize_tokens(x: torch.Tensor, path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, scales)`` of ``x`` on ``path``, unchecked: a NaN/inf token quantises to NaN
    values, so its scores are NaN.  One fused kernel on the Triton path, torch elsewhere; the
    same bits either way."""
    if path == "triton":
        from .kernels.triton import quantize

        return quantize.quantize_fp8(x)
    values, scales = reference.quantize_fp8(x)
    return values.contiguous(), scales.contiguous()


def _quantize(x: torch.Tensor) -> Fp8Tokens:
    path = served_by(x, "fp8")
    return Fp8Tokens(*quantize_tokens(x, "triton" if path == "triton" else "torch-chunked"))


def quantize_fp8(x: torch.Tensor, *, normalize: bool = False) -> Fp8Tokens:
    """Per-token e4m3 quantisation of ``x [..., L, d]`` (float16/bfloat16/float32/float64).

    ``normalize=True`` L2-normalises each token first (as ``maxsim(..., normalize=True)``
    would), so cosine-similarity models quantise their unit vectors.  Raises on NaN/inf
    (one reduction and a host sync): an index with a poisoned token would rank wrong for
    as long as it is served.  One fused kernel where the fp8 kernels run, torch elsewhere;
    the same bits either way.
    """
    return quantize_index(FP8, x, normalize)


FP8 = TokenFormat("fp8", Fp8Tokens, FP8_DTYPE, _quantize)
as_tokens = functools.partial(as_tokens_of, FP8)


# Largest re-quantisation the fused path may do: every program quantises its own query
# rows, i.e. about (documents per query) x (query elements) in all.  Fusing saves a launch,
# which decides a small rerank; the round-to-nearest divisions, repeated per document, cost
# more than that launch on search-sized calls (docs/performance-notes.md, fp8).
FUSED_QUANTISATION_ELEMENTS = 1 << 24


def fused_quantisation_fits(Q, d_values: torch.Tensor) -> bool:
    """A float query ``[Nq, Lq, d]`` the scoring kernel can quantise itself (``QUANT_Q``, fp8
    or int8 documents): embeddings up to 256 wide, and a small repeated quantisation (above)."""
    if not isinstance(Q, torch.Tensor) or Q.dim() != 3 or not 0 < Q.shape[-1] <= 256:
        return False
    docs_per_query = d_values.shape[-3] if d_values.dim() >= 3 else 1
    return docs_per_query * Q.numel() <= FUSED_QUANTISATION_ELEMENTS


def fuse_query_quantisation(Q, d_values: torch.Tensor) -> bool:
    """Quantise a float query inside the scoring kernel (kernels/triton/forward.py
    ``QUANT_Q``: one launch instead of two, the same quantised values) -- on a GPU, where
    :func:`fused_quantisation_fits`.  The interpreter keeps the separate quantisation: it
    casts fp32 to e4m3 wrongly (see kernels/triton/quantize.py)."""
    return not triton_interpret() and fused_quantisation_fits(Q, d_values)


def maxsim_fp8(
    Q,
    D,
    q_mask: torch.Tensor | None = None,
    d_mask: torch.Tensor | None = None,
    *,
    mask_mode: str = "exclude",
) -> torch.Tensor:
    """MaxSim scores from fp8 tokens, like :func:`lik_plugins.maxsim` (no gradient).

    Args:
        Q: ``[Nq, Lq, d]`` float tensor (quantised here) or :class:`Fp8Tokens`.
        D: ``[Nd, Ld, d]`` (cross product -> ``[Nq, Nd]``) or ``[Nq, K, Ld, d]`` (per-query
            candidates -> ``[Nq, K]``), float tensor or :class:`Fp8Tokens` -- quantise an
            index once with :func:`quantize_fp8` and reuse it.
        q_mask, d_mask, mask_mode: as in :func:`lik_plugins.maxsim`.

    Returns:
        float32 scores of the dequantised tokens (``reference.maxsim_fp8``).
    """
    check_options("auto", mask_mode)
    d = as_tokens("D", D, (3, 4))
    # a float query is quantised inside the op (in the scoring kernel where that pays)
    q = as_tokens("Q", Q, (3,), quantize=False)
    q_values, q_scales = (q, None) if isinstance(q, torch.Tensor) else q
    q_mask, d_mask, _ = check_geometry(q_values, d.values, q_mask, d_mask)
    with torch.no_grad():
        if disabled() or forced_backend() == "reference":
            _routing.record("maxsim_fp8", "reference")
            q = q if q_scales is not None else Fp8Tokens(*reference.quantize_fp8(q_values))
            return reference.maxsim_fp8(q, d, q_mask, d_mask, mask_mode=mask_mode)
        return library.maxsim_fp8(q_values, q_scales, d.values, d.scales, q_mask, d_mask, mask_mode == "zero",
                                  "maxsim_fp8")
