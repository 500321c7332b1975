"""The layers of lik_plugins' ``kernels`` layer repository for sentence-transformers 6.3+.

ST 6.3 scores a model's similarity through two kernel-aware modules, ``STMaxSim`` and
``STMaxSimPairwise`` (``multi_vector_encoder.scoring.colbert``), whose forward ``(a, b, a_mask,
b_mask)`` scores one padded chunk exactly as ``util.similarity._maxsim_score_documents`` /
``_maxsim_score_pairs`` do.  With a ``transformers.KernelConfig`` mapping those targets to a
layer repository, ST's ``kernels`` integration replaces that forward by the layer's.  These
are our layers: the same chunk scorers the patch installs (:func:`._scores.score_chunk`),
so the results are ST's semantics (masked document tokens never win the max, masked query
tokens add 0, ST's sentinel for a document without a valid token, float32 output) through
the fused op: Triton on CUDA, Metal on MPS, the chunked-torch path on the CPU.  Each call is
counted under ``sentence_transformers.maxsim`` / ``sentence_transformers.maxsim_pairwise`` in
:func:`lik_plugins.routing_counts`; ``LIK_DISABLE=1`` sends it to ST's own scorer.

``kernels`` accepts a layer only if it is a stateless ``nn.Module``: no constructor and no
member besides ``forward`` (and the ``can_torch_compile`` / ``has_backward`` flags), with
the forward signature of the module it replaces.  Gradients flow through the fused op's
autograd (``has_backward`` keeps its default, True).  ``can_torch_compile`` is left unset:
ST itself never runs a kernel layer under ``torch.compile`` (it scores with its plain
chunk scorer there), so the flag would only matter to callers kernelizing in that mode.

The repository (``kernel_repository/``, see :func:`lik_plugins.sentence_transformers.kernel_config`)
imports this module as its ``layers``.
"""
from __future__ import annotations

import torch

from .._config import disabled
from . import _scores


class MaxSim(torch.nn.Module):
    """``STMaxSim``: ``(Na, Lq, H)`` queries x ``(Nb, Ld, H)`` documents -> ``(Na, Nb)`` float32."""

    def forward(self, a, b, a_mask, b_mask):
        return _scores.score_chunk(a, b, a_mask, b_mask, pairs=False, serve=not disabled())


class MaxSimPairwise(torch.nn.Module):
    """``STMaxSimPairwise``: ``(B, Lq, H)`` queries x ``(B, Ld, H)`` documents -> ``(B,)`` float32."""

    def forward(self, a, b, a_mask, b_mask):
        return _scores.score_chunk(a, b, a_mask, b_mask, pairs=True, serve=not disabled())
