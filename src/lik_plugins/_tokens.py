"""What the fp8 and int8 paths share: the quantised-token container (``values`` ``[..., L, d]``
and one fp32 ``scale`` per token ``[..., L]``; token ``t`` is ``values[..., t, :] * scales[..., t]``),
quantising an index, and checking the tokens an op receives."""
from __future__ import annotations

from collections import namedtuple
from typing import Callable, NamedTuple

import torch

from ._validate import FLOAT_DTYPES
from .kernels import reference


def scaled_tokens_type(name: str, module: str, element: str):
    """A named tuple ``(values, scales)`` called ``name`` (defined for ``module``, so it pickles
    by its public name) whose ``values`` hold ``element`` numbers."""

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
    ScaledTokens.__module__ = module
    ScaledTokens.__doc__ = (
        f"Quantised token embeddings: ``values`` {element} ``[..., L, d]``, ``scales`` fp32 ``[..., L]``.\n\n"
        "``values[..., t, :] * scales[..., t]`` is token ``t``.  Slice both alike\n"
        "(:meth:`select`) to take a part of an index.")
    return ScaledTokens


class TokenFormat(NamedTuple):
    """One quantised format: ``kind`` (``"fp8"`` / ``"int8"``), its token container, the
    dtype of its values, and ``quantize(x) -> tokens`` for checked float tokens."""
    kind: str
    tokens: type
    value_dtype: torch.dtype
    quantize: Callable


def check_source(name: str, x) -> None:
    """``x`` is float tokens ``[..., L, d]`` that can be quantised."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64 tokens, got {x.dtype}")
    if x.dim() < 2 or x.shape[-1] == 0:
        raise ValueError(f"{name} must be tokens [..., L, d] with d >= 1, got shape {tuple(x.shape)}")


def quantize_index(fmt: TokenFormat, x: torch.Tensor, normalize: bool):
    """``quantize_<kind>``: checked, optionally L2-normalised, refused on NaN/inf (one
    reduction and a host sync: an index with a poisoned token would rank wrong for as long
    as it is served)."""
    check_source(f"quantize_{fmt.kind}'s input", x)
    with torch.no_grad():
        if normalize:
            x = torch.nn.functional.normalize(x.float(), p=2, dim=-1, eps=reference.NORM_EPS)
        if x.numel() and not bool(torch.isfinite(x.abs().amax(dim=-1)).all()):
            raise ValueError(f"quantize_{fmt.kind}: the tokens contain NaN or inf")
        return fmt.quantize(x)


def as_tokens(fmt: TokenFormat, name: str, x, rank: tuple[int, ...], quantize: bool = True):
    """``x`` checked, as ``fmt``'s tokens -- or, for a float tensor with ``quantize=False``,
    the checked tensor itself (the op quantises it)."""
    ranks = " or ".join(f"{r}-D" for r in rank)
    if isinstance(x, torch.Tensor):
        check_source(name, x)
        if x.dim() not in rank:
            raise ValueError(f"{name} must be {ranks}, got shape {tuple(x.shape)}")
        if torch.is_grad_enabled() and x.requires_grad:
            raise RuntimeError(
                f"maxsim_{fmt.kind} is inference-only and {name} requires grad; train with lik_plugins.maxsim, "
                f"or call maxsim_{fmt.kind} under torch.no_grad()"
            )
        if not quantize:
            return x
        with torch.no_grad():
            # unchecked: a non-finite query gives NaN scores, as in lik_plugins.maxsim
            return fmt.quantize(x)
    if not isinstance(x, fmt.tokens):
        raise TypeError(f"{name} must be a float tensor or {fmt.tokens.__name__} (from quantize_{fmt.kind}), "
                        f"got {type(x).__name__}")
    values, scales = x
    if values.dtype != fmt.value_dtype:
        raise TypeError(f"{name}.values must be {fmt.value_dtype}, got {values.dtype}")
    if values.dim() not in rank:
        raise ValueError(f"{name} must be {ranks}, got shape {tuple(values.shape)}")
    if scales.dtype != torch.float32 or tuple(scales.shape) != tuple(values.shape[:-1]):
        raise ValueError(
            f"{name}.scales must be float32 of shape {tuple(values.shape[:-1])}, "
            f"got {scales.dtype} {tuple(scales.shape)}"
        )
    if scales.device != values.device:
        raise ValueError(f"{name}.scales is on {scales.device} but {name}.values on {values.device}")
    return fmt.tokens(values, scales.contiguous())
