"""fp8 and int8 scores (``maxsim_fp8``, ``maxsim_int8``, ``retrieve`` over a quantised index):
the registered ops, inference only (no autograd Function), and the quantisation of the
public ``quantize_fp8``.

``lik::maxsim_fp8``   fp8 (e4m3) scores
``lik::maxsim_int8``  int8 scores (int32 products, per-token scales)

A float query (``q_scales`` None) is quantised inside the op: inside the scoring kernel where
that is cheaper, else by the path's quantiser (:mod:`lik_plugins.kernels.triton_ops`,
:mod:`lik_plugins.kernels.torch_ops`).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..kernels.dispatch import serve
from .registry import registered

__all__ = ["maxsim_fp8", "maxsim_int8", "quantize_fp8_tokens"]


def quantize_fp8_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, scales)``: e4m3 tokens of ``x`` on the path that serves it (unchecked: a
    NaN/inf token quantises to NaN values).  The same bits on every path."""
    return serve(x, "fp8").quantized.quantize_fp8(x)


def _scores_fake(Q, q_scales, d_values, d_scales, q_mask, d_mask, zero_mode, entry):
    n_docs = d_values.shape[0] if d_values.dim() == 3 else d_values.shape[1]
    return Q.new_empty((Q.shape[0], n_docs), dtype=torch.float32)


def _register_scores(kind: str):
    """Register ``lik::maxsim_<kind>``: the two formats' ops differ only in their name, the
    dispatcher's op and the launcher they call."""
    launcher = f"maxsim_{kind}"

    def scores(
        Q: torch.Tensor, q_scales: Optional[torch.Tensor], d_values: torch.Tensor, d_scales: torch.Tensor,
        q_mask: Optional[torch.Tensor], d_mask: Optional[torch.Tensor], zero_mode: bool, entry: str,
    ) -> torch.Tensor:
        return getattr(serve(d_values, kind, entry).quantized, launcher)(Q, q_scales, d_values, d_scales, q_mask,
                                                                         d_mask, zero_mode=zero_mode)

    scores.__doc__ = f"{kind} MaxSim: ``Q`` is {kind} values with ``q_scales``, or float tokens (``q_scales`` None)."
    return registered(launcher, _scores_fake)(scores)


maxsim_fp8 = _register_scores("fp8")
maxsim_int8 = _register_scores("int8")
