"""Load any colpali-engine release's loss and scoring modules side by side, without
installing it and without running ``colpali_engine/__init__.py`` (the model zoo).

The release's small wheel is fetched once (``pip download --no-deps``) into a cache
directory and unzipped; stub packages ``colpali_engine``, ``colpali_engine.utils`` and
``colpali_engine.loss`` with ``__path__`` into the unzipped tree let
``importlib.import_module`` load ``loss/late_interaction_losses.py`` and
``utils/processing_utils.py`` (they import only torch, PIL and transformers).

:func:`activate` swaps the release's modules into ``sys.modules`` for the duration of a
block — the patcher and colpali's call-time imports (``_lik_backend``) see that release —
and puts back whatever was there (e.g. the installed 0.3.18) afterwards.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import subprocess
import sys
import tempfile
import time
import types
import zipfile
from pathlib import Path

RELEASES = ("0.3.10", "0.3.11", "0.3.12", "0.3.13", "0.3.14", "0.3.15", "0.3.16", "0.3.17", "0.3.18")
PACKAGES = ("colpali_engine", "colpali_engine.utils", "colpali_engine.loss")
MODULES = ("colpali_engine.loss.late_interaction_losses", "colpali_engine.utils.processing_utils")

_REPO = Path(__file__).resolve().parents[2]


def cache_dir() -> Path:
    root = os.environ.get("LIK_COLPALI_WHEELS") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "lik_plugins", "colpali-wheels"
    )
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _wheel(version: str) -> Path:
    name = f"colpali_engine-{version}-py3-none-any.whl"
    for candidate in (cache_dir() / name, _REPO / ".whl" / name):
        if candidate.is_file():
            return candidate
    last = None
    for attempt in range(3):
        with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
            proc = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", tmp,
                 f"colpali-engine=={version}"],
                capture_output=True, text=True, timeout=300,
            )
            got = Path(tmp) / name
            if proc.returncode == 0 and got.is_file():
                os.replace(got, cache_dir() / name)  # atomic: parallel workers never see half a wheel
                return cache_dir() / name
            last = proc.stderr[-2000:]
        time.sleep(2 * (attempt + 1))
    raise RuntimeError(f"could not download colpali-engine=={version}: {last}")


def _unpacked(version: str) -> Path:
    root = cache_dir() / f"colpali_engine-{version}"
    marker = root / ".complete"
    if not marker.is_file():
        tmp = Path(tempfile.mkdtemp(dir=cache_dir()))
        with zipfile.ZipFile(_wheel(version)) as zf:
            zf.extractall(tmp)
        (tmp / ".complete").write_text(version)
        try:
            os.replace(tmp, root)
        except OSError:  # another worker won the race
            pass
    return root


class Release:
    """One release's modules, loaded once, swapped into ``sys.modules`` on demand."""

    def __init__(self, version: str):
        self.version = version
        self.root = _unpacked(version)
        self._modules: dict[str, types.ModuleType] = {}
        with self._swapped({}):
            for pkg in PACKAGES:
                stub = types.ModuleType(pkg)
                stub.__path__ = [str(self.root.joinpath(*pkg.split(".")))]
                sys.modules[pkg] = stub
            for name in MODULES:
                importlib.import_module(name)
            if (self.root / "colpali_engine" / "utils" / "_lik_backend.py").is_file():
                importlib.import_module("colpali_engine.utils._lik_backend")
            self._modules = {k: v for k, v in sys.modules.items() if k == "colpali_engine" or k.startswith("colpali_engine.")}
        self.losses = self._modules[MODULES[0]]
        self.processing = self._modules[MODULES[1]]

    @staticmethod
    @contextlib.contextmanager
    def _swapped(modules: dict):
        saved = {k: v for k, v in sys.modules.items() if k == "colpali_engine" or k.startswith("colpali_engine.")}
        for k in saved:
            del sys.modules[k]
        sys.modules.update(modules)
        try:
            yield
        finally:
            for k in [k for k in sys.modules if k == "colpali_engine" or k.startswith("colpali_engine.")]:
                del sys.modules[k]
            sys.modules.update(saved)

    @contextlib.contextmanager
    def activate(self):
        with self._swapped(self._modules):
            try:
                yield self
            finally:  # keep anything colpali imported lazily meanwhile, for the next activation
                self._modules.update(
                    {k: v for k, v in sys.modules.items() if k == "colpali_engine" or k.startswith("colpali_engine.")}
                )

    def __repr__(self) -> str:
        return f"Release({self.version})"


_loaded: dict[str, Release] = {}


def release(version: str) -> Release:
    if version not in _loaded:
        _loaded[version] = Release(version)
    return _loaded[version]
