"""sentence-transformers 6.x integration: ``patch_sentence_transformers()`` /
``unpatch_sentence_transformers()`` serve ``MultiVectorEncoder`` scoring, losses and
evaluators with the fused MaxSim kernels.

Importing this package does not import sentence-transformers; the patch function does.
See :func:`patch_sentence_transformers` for what is served and
``lik_plugins.sentence_transformers._patch`` for the capture points.

From 6.3, ST's own ``kernels`` mechanism can pick our MaxSim layers without the patch:
``MultiVectorEncoder(..., kernel_config=kernel_config())`` (the layer repository ships in
this package, :data:`KERNEL_REPOSITORY`).  With both on, ``_model_scorer`` states which
path serves a call.
"""
from __future__ import annotations

from ._kernel_config import REPOSITORY as KERNEL_REPOSITORY
from ._kernel_config import kernel_config
from ._patch import STLayout, is_patched, patch_sentence_transformers, unpatch_sentence_transformers

__all__ = ["patch_sentence_transformers", "unpatch_sentence_transformers", "is_patched", "STLayout",
           "kernel_config", "KERNEL_REPOSITORY"]
