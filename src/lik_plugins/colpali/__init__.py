"""colpali-engine integration: every loss head and the scorer on lik_plugins' kernels.

    >>> import lik_plugins
    >>> lik_plugins.patch_colpali_engine()        # doctest: +SKIP
    '0.3.17+'

Zero-code: ``COLPALI_SCORES_BACKEND=lik python train.py`` with lik_plugins installed.
See :func:`patch_colpali_engine` for the capture points and the switches.
"""
from .patch import is_patched, patch_colpali_engine, patched_generation, unpatch_colpali_engine

__all__ = ["patch_colpali_engine", "unpatch_colpali_engine", "is_patched", "patched_generation"]
