"""fp8 (e4m3) and int8 inference: quantise token embeddings once, score them on the matrix units.

Opt-in and inference-only.  Each token keeps one fp32 scale: its largest component maps to
the format's largest value (448 for e4m3, 127 for int8, symmetric), so a token's direction
survives quantisation to a few significant bits per component; what that does to rankings
is measured in ``recipes/fp8_fidelity.py`` and ``docs/performance-notes.md``, not assumed.

    >>> index = quantize_fp8(D)                 # once, when the corpus is encoded
    >>> scores = maxsim_fp8(Q, index)           # Q quantised on the fly
    >>> index = quantize_int8(D)                # the same for the integer matrix units
    >>> scores = maxsim_int8(Q, index)

The two formats share everything but their numbers, so one module holds both: the token
container (``values [..., L, d]`` and one fp32 ``scale`` per token ``[..., L]``; token ``t``
is ``values[..., t, :] * scales[..., t]``), the checks, and one scoring function, each
format a :class:`TokenFormat`.

Where it runs (:mod:`lik_plugins.kernels.dispatch` decides, inside the registered op):
fp8 on the Triton kernel with fp8 tensor-core products (compute capability 8.9+, and under
``TRITON_INTERPRET=1``); int8 on the Triton kernel with int8 x int8 -> int32 products,
each similarity scaled by its two tokens' scales *before* the row max (the document scale
varies along the reduced axis), on capability 8.0+ (and under ``TRITON_INTERPRET=1`` with
``LIK_BACKEND=triton``).  Elsewhere the same scores from the dequantised fp32 tokens, so
results never depend on the hardware beyond fp32 rounding.  ``LIK_DISABLE=1`` routes to
the reference.
"""
from __future__ import annotations

from collections import namedtuple
from typing import Callable, NamedTuple

import torch

from .. import autograd
from ..kernels import reference
from ..kernels.dispatch import reference_requested
from .validate import FLOAT_DTYPES, check_geometry, check_options

__all__ = ["Fp8Tokens", "Int8Tokens", "quantize_fp8", "quantize_int8", "maxsim_fp8", "maxsim_int8"]


def _scaled_tokens_type(name: str, element: str):
    """A named tuple ``(values, scales)`` called ``name`` (defined for this module, so it
    pickles by its public name) whose ``values`` hold ``element`` numbers."""

    class ScaledTokens(namedtuple(name, ["values", "scales"])):
        __slots__ = ()

        @property
        def shape(self) -> torch.Size:
            return self.values.shape

        @property
        def device(self) -> torch.device:
            return self.values.device

        def select(self, index):
            """The same leading-dimension ``index`` (int, slice, tensor) of values and scales."""
            return type(self)(self.values[index], self.scales[index])

        def to(self, device):
            return type(self)(self.values.to(device), self.scales.to(device))

        def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return reference.dequantize(self.values, self.scales, dtype)

    ScaledTokens.__name__ = ScaledTokens.__qualname__ = name
    ScaledTokens.__module__ = __name__
    ScaledTokens.__doc__ = (
        f"Quantised token embeddings: ``values`` {element} ``[..., L, d]``, ``scales`` fp32 ``[..., L]``.\n\n"
        "``values[..., t, :] * scales[..., t]`` is token ``t``.  Slice both alike\n"
        "(:meth:`select`) to take a part of an index.")
    return ScaledTokens


Fp8Tokens = _scaled_tokens_type("Fp8Tokens", "e4m3")
Int8Tokens = _scaled_tokens_type("Int8Tokens", "int8")


class TokenFormat(NamedTuple):
    """One quantised format: ``kind`` (``"fp8"`` / ``"int8"``), its token container, the
    dtype of its values, ``quantize(x) -> (values, scales)`` on the path that serves ``x``
    (unchecked), the specification's quantiser and scores, and the registered scoring op."""
    kind: str
    tokens: type
    value_dtype: torch.dtype
    quantize: Callable
    reference_quantize: Callable
    reference_maxsim: Callable
    scores: Callable


def _quantize_int8_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, scales)``: int8 tokens of ``x``, unchecked, by the specification's quantiser
    on every path (an index is quantised once; a float query is quantised inside the op)."""
    values, scales = reference.quantize_int8(x)
    return values.contiguous(), scales.contiguous()


FP8 = TokenFormat("fp8", Fp8Tokens, reference.FP8_DTYPE, autograd.quantized.quantize_fp8_tokens,
                  reference.quantize_fp8, reference.maxsim_fp8, autograd.quantized.maxsim_fp8)
INT8 = TokenFormat("int8", Int8Tokens, torch.int8, _quantize_int8_tokens, reference.quantize_int8,
                   reference.maxsim_int8, autograd.quantized.maxsim_int8)


def format_of(tokens) -> TokenFormat | None:
    """The format of a quantised index (None for anything else)."""
    return FP8 if isinstance(tokens, Fp8Tokens) else INT8 if isinstance(tokens, Int8Tokens) else None


def _check_source(name: str, x) -> None:
    """``x`` is float tokens ``[..., L, d]`` that can be quantised."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64 tokens, got {x.dtype}")
    if x.dim() < 2 or x.shape[-1] == 0:
        raise ValueError(f"{name} must be tokens [..., L, d] with d >= 1, got shape {tuple(x.shape)}")


def _quantize_index(fmt: TokenFormat, x: torch.Tensor, normalize: bool):
    """:func:`quantize_fp8` / :func:`quantize_int8` for ``fmt``."""
    _check_source(f"quantize_{fmt.kind}'s input", x)
    with torch.no_grad():
        if normalize:
            x = torch.nn.functional.normalize(x.float(), p=2, dim=-1, eps=reference.NORM_EPS)
        if x.numel() and not bool(torch.isfinite(x.abs().amax(dim=-1)).all()):
            raise ValueError(f"quantize_{fmt.kind}: the tokens contain NaN or inf")
        return fmt.tokens(*fmt.quantize(x))


def quantize_fp8(x: torch.Tensor, *, normalize: bool = False) -> Fp8Tokens:
    """Per-token e4m3 quantisation of ``x [..., L, d]`` (float16/bfloat16/float32/float64):
    ``scale = max|x| / 448`` (see ``reference.quantize_fp8``).

    ``normalize=True`` L2-normalises each token first (as ``maxsim(..., normalize=True)``
    would), so cosine-similarity models quantise their unit vectors.  Raises on NaN/inf
    (one reduction and a host sync): an index with a poisoned token would rank wrong for
    as long as it is served.  One fused kernel where the fp8 kernels run, torch elsewhere;
    the same bits either way.
    """
    return _quantize_index(FP8, x, normalize)


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
    return _quantize_index(INT8, x, normalize)


def as_tokens(fmt: TokenFormat, name: str, x, rank: tuple[int, ...], quantize: bool = True):
    """``x`` checked, as ``fmt``'s tokens -- or, for a float tensor with ``quantize=False``,
    the checked tensor itself (the op quantises it)."""
    ranks = " or ".join(f"{r}-D" for r in rank)
    if isinstance(x, torch.Tensor):
        _check_source(name, x)
        if x.dim() not in rank:
            raise ValueError(f"{name} must be {ranks}, got shape {tuple(x.shape)}")
        if torch.is_grad_enabled() and x.requires_grad:
            raise RuntimeError(f"maxsim_{fmt.kind} is inference-only and {name} requires grad; train with "
                               f"lik_plugins.maxsim, or call maxsim_{fmt.kind} under torch.no_grad()")
        if not quantize:
            return x
        with torch.no_grad():
            # unchecked: a non-finite query gives NaN scores, as in lik_plugins.maxsim
            return fmt.tokens(*fmt.quantize(x))
    if not isinstance(x, fmt.tokens):
        raise TypeError(f"{name} must be a float tensor or {fmt.tokens.__name__} (from quantize_{fmt.kind}), "
                        f"got {type(x).__name__}")
    values, scales = x
    if values.dtype != fmt.value_dtype:
        raise TypeError(f"{name}.values must be {fmt.value_dtype}, got {values.dtype}")
    if values.dim() not in rank:
        raise ValueError(f"{name} must be {ranks}, got shape {tuple(values.shape)}")
    if scales.dtype != torch.float32 or tuple(scales.shape) != tuple(values.shape[:-1]):
        raise ValueError(f"{name}.scales must be float32 of shape {tuple(values.shape[:-1])}, got {scales.dtype} "
                         f"{tuple(scales.shape)}")
    if scales.device != values.device:
        raise ValueError(f"{name}.scales is on {scales.device} but {name}.values on {values.device}")
    return fmt.tokens(values, scales.contiguous())


def maxsim_quantized(fmt: TokenFormat, Q, D, q_mask, d_mask, mask_mode: str) -> torch.Tensor:
    """:func:`maxsim_fp8` / :func:`maxsim_int8` for ``fmt``."""
    check_options("auto", mask_mode)
    d = as_tokens(fmt, "D", D, (3, 4))
    # a float query is quantised inside the op (in the scoring kernel where that pays)
    q = as_tokens(fmt, "Q", Q, (3,), quantize=False)
    q_values, q_scales = (q, None) if isinstance(q, torch.Tensor) else q
    q_mask, d_mask, _ = check_geometry(q_values, d.values, q_mask, d_mask)
    entry = f"maxsim_{fmt.kind}"
    with torch.no_grad():
        if reference_requested(entry):
            q = q if q_scales is not None else fmt.tokens(*fmt.reference_quantize(q_values))
            return fmt.reference_maxsim(q, d, q_mask, d_mask, mask_mode=mask_mode)
        return fmt.scores(q_values, q_scales, d.values, d.scales, q_mask, d_mask, mask_mode == "zero", entry)


def maxsim_fp8(Q, D, q_mask: torch.Tensor | None = None, d_mask: torch.Tensor | None = None, *,
               mask_mode: str = "exclude") -> torch.Tensor:
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
    return maxsim_quantized(FP8, Q, D, q_mask, d_mask, mask_mode)


def maxsim_int8(Q, D, q_mask: torch.Tensor | None = None, d_mask: torch.Tensor | None = None, *,
                mask_mode: str = "exclude") -> torch.Tensor:
    """MaxSim scores from int8 tokens, like :func:`lik_plugins.maxsim` (no gradient): the
    twin of :func:`maxsim_fp8` for GPUs without fp8 matrix units (Ampere).

    Args:
        Q: ``[Nq, Lq, d]`` float tensor (quantised here, per token) or :class:`Int8Tokens`.
        D: ``[Nd, Ld, d]`` or ``[Nq, K, Ld, d]``, float tensor or :class:`Int8Tokens` --
            quantise an index once with :func:`quantize_int8` and reuse it.
        q_mask, d_mask, mask_mode: as in :func:`lik_plugins.maxsim`.

    Returns:
        float32 scores of the dequantised tokens (``reference.maxsim_int8``).

    Example::

        >>> index = quantize_int8(torch.randn(8, 30, 64))
        >>> maxsim_int8(torch.randn(2, 5, 64), index).shape
        torch.Size([2, 8])
    """
    return maxsim_quantized(INT8, Q, D, q_mask, d_mask, mask_mode)
