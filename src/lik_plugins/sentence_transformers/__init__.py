"""sentence-transformers 6.x integration: ``patch_sentence_transformers()`` /
``unpatch_sentence_transformers()`` serve ``MultiVectorEncoder`` scoring, losses and
evaluators with the fused MaxSim kernels.

Importing this package does not import sentence-transformers; the patch function does.
See :func:`patch_sentence_transformers` for what is served and
``lik_plugins.sentence_transformers._patch`` for the capture points.
"""
from __future__ import annotations

from ._patch import STLayout, is_patched, patch_sentence_transformers, unpatch_sentence_transformers

__all__ = ["patch_sentence_transformers", "unpatch_sentence_transformers", "is_patched", "STLayout"]
