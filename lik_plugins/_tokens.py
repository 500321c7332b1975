"""The quantised-token container shared by the fp8 and int8 paths: ``values`` ``[..., L, d]``
and one fp32 ``scale`` per token ``[..., L]``; token ``t`` is ``values[..., t, :] * scales[..., t]``."""
from __future__ import annotations

from collections import namedtuple

import torch

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
