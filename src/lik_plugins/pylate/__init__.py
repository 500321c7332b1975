"""PyLate integration: ``patch_pylate()`` / ``unpatch_pylate()`` and the ``lik`` backend.

Importing this package does not import PyLate; :func:`patch_pylate` does.  See
:func:`patch_pylate` for what is served, and ``lik_plugins.pylate._layout`` for the
capture points per PyLate release.
"""
from __future__ import annotations

from ._layout import PyLateLayout
from ._patch import is_patched, patch_pylate, unpatch_pylate

__all__ = ["patch_pylate", "unpatch_pylate", "is_patched", "PyLateLayout"]
