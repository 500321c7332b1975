"""Zero-code activation: ``PYLATE_SCORES_BACKEND=lik python train.py`` (or
``LIK_PATCH=sentence_transformers python train.py``) trains on our kernels.

The installed ``lik_plugins_autoactivate.pth`` runs one line at interpreter start.  That
line imports nothing unless ``LIK_PATCH`` is set or an environment variable ending in
``_SCORES_BACKEND`` is ``lik`` or ``auto``; only then does it import this module and call
:func:`install`.  ``LIK_PATCH`` names hosts (comma-separated): ``pylate``, ``colpali``,
``sentence_transformers``, or ``all``; it is the only switch for sentence-transformers,
which has no backend variable of its own.

:func:`install` does not import the host either: it puts a finder on ``sys.meta_path``
that waits for the host's top-level module and runs the patch function right after
that module finishes importing (or at once, if the host is already imported).
"""
from __future__ import annotations

import importlib
import os
import sys
import threading

#: One row per host: ``{env var: (host top-level module, adapter module, patch function)}``.
HOSTS: dict[str, tuple[str, str, str]] = {
    "PYLATE_SCORES_BACKEND": ("pylate", "lik_plugins.pylate", "patch_pylate"),
    "COLPALI_SCORES_BACKEND": ("colpali_engine", "lik_plugins.colpali", "patch_colpali_engine"),
}

#: ``LIK_PATCH`` names -> rows (sentence-transformers has no backend variable: only this name reaches it).
NAMES: dict[str, tuple[str, str, str]] = {
    "pylate": HOSTS["PYLATE_SCORES_BACKEND"],
    "colpali": HOSTS["COLPALI_SCORES_BACKEND"],
    "colpali_engine": HOSTS["COLPALI_SCORES_BACKEND"],
    "sentence_transformers": ("sentence_transformers", "lik_plugins.sentence_transformers",
                              "patch_sentence_transformers"),
}

#: Values of a host's variable that turn the patch on at interpreter start.
ACTIVATING = ("lik", "auto")


def wanted(environ=os.environ) -> list[tuple[str, str, str]]:
    """The table rows asked for: by a host's ``*_SCORES_BACKEND`` variable or by ``LIK_PATCH``."""
    from ._config import patch_hosts

    rows = [row for var, row in HOSTS.items() if environ.get(var, "").strip().lower() in ACTIVATING]
    for name in patch_hosts(environ):
        chosen = list(dict.fromkeys(NAMES.values())) if name == "all" else [NAMES.get(name)]
        if chosen == [None]:
            import warnings

            known = ", ".join(sorted({*NAMES, "all"}))
            warnings.warn(f"lik_plugins: LIK_PATCH names an unknown host {name!r} (known: {known})",
                          RuntimeWarning, stacklevel=2)
            continue
        rows += [row for row in chosen if row not in rows]
    return rows


def _patch(adapter: str, function: str) -> None:
    try:
        getattr(importlib.import_module(adapter), function)()
    except Exception as exc:  # never break the user's import of the host
        import warnings

        warnings.warn(f"lik_plugins: automatic {function}() failed: {exc!r}", RuntimeWarning, stacklevel=2)


class _PatchAfterImport:
    """A ``sys.meta_path`` finder: when a watched top-level module is imported, let the
    other finders find it, then run its patch function right after it executes."""

    def __init__(self, rows: dict[str, tuple[str, str]]) -> None:
        self.rows = dict(rows)  # host module -> (adapter module, patch function)
        self._busy = threading.local()

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.rows or getattr(self._busy, "active", False):
            return None
        self._busy.active = True
        try:
            spec = None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._busy.active = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        adapter, function = self.rows.pop(fullname)
        if not self.rows:  # every watched host seen: off the import path
            try:
                sys.meta_path.remove(self)
            except ValueError:
                pass
        spec.loader = _LoaderThenPatch(spec.loader, adapter, function)
        return spec


class _LoaderThenPatch:
    """Wraps the host's loader for one import; puts the real loader back before the
    host's code runs, so nothing of ours stays visible on the module."""

    def __init__(self, loader, adapter: str, function: str) -> None:
        self._loader, self._adapter, self._function = loader, adapter, function

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        _patch(self._adapter, self._function)

    def __getattr__(self, name):
        return getattr(self._loader, name)


def install(environ=os.environ) -> None:
    """Arrange for every host whose variable is ``lik``/``auto`` to be patched on import."""
    pending: dict[str, tuple[str, str]] = {}
    for host, adapter, function in wanted(environ):
        if host in sys.modules:
            _patch(adapter, function)
        else:
            pending[host] = (adapter, function)
    if pending:
        sys.meta_path.insert(0, _PatchAfterImport(pending))
