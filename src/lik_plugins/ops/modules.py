"""``nn.Module`` wrappers around the ops."""
from __future__ import annotations

import torch
from torch import nn

from .dense import maxsim


class MaxSimScorer(nn.Module):
    """MaxSim as a module: ``scorer(Q, D, q_mask=None, d_mask=None) -> scores``.

    Holds the op's options; adds no parameters.  Gradients follow the caller's autograd
    mode: under ``torch.no_grad()`` no argmax is saved and nothing is differentiable.

    Args:
        normalize: L2-normalise tokens inside the kernel.
        backward: ``"auto"`` | ``"unified"`` | ``"lowmem"`` (see :func:`lik_plugins.maxsim`).
        mask_mode: ``"exclude"`` | ``"zero"``.
    """

    def __init__(self, *, normalize: bool = False, backward: str = "auto", mask_mode: str = "exclude"):
        super().__init__()
        self.normalize = normalize
        self.backward_strategy = backward
        self.mask_mode = mask_mode

    def forward(self, Q: torch.Tensor, D: torch.Tensor, q_mask=None, d_mask=None) -> torch.Tensor:
        return maxsim(Q, D, q_mask, d_mask, normalize=self.normalize, backward=self.backward_strategy,
                      mask_mode=self.mask_mode)

    def extra_repr(self) -> str:
        return f"normalize={self.normalize}, backward={self.backward_strategy!r}, mask_mode={self.mask_mode!r}"
