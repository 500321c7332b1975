"""fast-plaid integration: ``FastPlaid.search`` served by lik_plugins' batched PLAID search.

    >>> import lik_plugins.fast_plaid
    >>> lik_plugins.fast_plaid.patch_fast_plaid()        # doctest: +SKIP

``patch_pylate()`` and ``patch_colpali_engine()`` apply it themselves where fast-plaid is
installed.  See :func:`patch_fast_plaid` for what is served and :mod:`._files` for the index
layouts read.
"""
from ._files import UnknownIndexLayout
from ._patch import FastPlaidPatch, is_patched, patch_fast_plaid, unpatch_fast_plaid

__all__ = ["patch_fast_plaid", "unpatch_fast_plaid", "is_patched", "FastPlaidPatch", "UnknownIndexLayout"]
