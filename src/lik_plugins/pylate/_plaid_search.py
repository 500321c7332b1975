"""PyLate's PLAID index: its id mappings cached between searches.

PyLate 1.6's ``indexes.PLAID`` (``use_fast=True``, its default) answers
``retrieve.ColBERT(index).retrieve(...)`` through ``FastPlaid.__call__``, which maps
document ids and calls ``fast_plaid.search.FastPlaid.search``: that search is served by
fast-plaid's own patch (:mod:`lik_plugins.fast_plaid`), which ``patch_pylate()`` holds.

PyLate's own wrapper (``pylate.indexes.fast_plaid.FastPlaid.__call__``) unpickles its two
id mappings from disk on every search, which takes longer than our search of a 100k-document
index for one query: while that call runs, :func:`make_call` has the two loaders return the
mapping cached per file (path, modification time, size).  Only ``__call__`` (which reads them)
sees the cached objects; ``add_documents`` / ``remove_documents``, which modify the mappings
they load, get fresh ones from PyLate's loaders as before.
"""
from __future__ import annotations

import os
import threading

from .._config import disabled

_reading = threading.local()
_mappings: dict = {}   # path -> ((mtime, size), mapping); one dict get or set at a time needs no lock


def make_call(original):
    """PyLate's ``FastPlaid.__call__``, with its id mappings read through the cache."""

    def __call__(self, *args, **kwargs):
        _reading.active = not disabled()          # under LIK_DISABLE=1, PyLate's own loaders
        try:
            return original(self, *args, **kwargs)
        finally:
            _reading.active = False

    return __call__


def make_loader(original, name: str):
    """PyLate's mapping loader ``name`` (``_load_<mapping>``, reading ``self.<mapping>_path``):
    inside ``__call__`` the object cached for that file while it is unchanged."""
    attribute = name[len("_load_"):] + "_path"

    def load(self):
        path = getattr(self, attribute, None)
        if not getattr(_reading, "active", False) or not isinstance(path, str) or not os.path.exists(path):
            return original(self)
        stat = os.stat(path)
        key = (stat.st_mtime_ns, stat.st_size)
        hit = _mappings.get(path)
        if hit is not None and hit[0] == key:
            return hit[1]
        value = original(self)
        _mappings[path] = (key, value)
        return value

    return load
