"""Every patcher says how to install its host when the host is missing.

The host is made unimportable for the test (``None`` in ``sys.modules`` for it and every
submodule already loaded), so these run whether or not PyLate / colpali-engine are installed.
"""
from __future__ import annotations

import sys

import pytest

import lik_plugins


def _hide(monkeypatch, package: str) -> None:
    """Make ``import package`` (and its submodules) fail as if it were not installed."""
    for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, package, None)


def test_patch_pylate_without_pylate_names_the_extra(monkeypatch):
    lik_plugins.unpatch_pylate()
    _hide(monkeypatch, "pylate")
    with pytest.raises(ImportError, match=r"pip install 'lik_plugins\[pylate\]'"):
        lik_plugins.patch_pylate()


def test_patch_colpali_without_colpali_names_the_extra(monkeypatch):
    lik_plugins.unpatch_colpali_engine()
    _hide(monkeypatch, "colpali_engine")
    with pytest.raises(ImportError, match=r"pip install 'lik_plugins\[colpali\]'") as info:
        lik_plugins.patch_colpali_engine()
    assert isinstance(info.value.__cause__, ImportError)  # the original error stays attached
    from lik_plugins.colpali import patch

    assert not patch.is_patched()


def test_patch_colpali_that_does_not_import_points_at_torchvision(monkeypatch, tmp_path):
    """An installed colpali-engine whose import fails (here: its package raises on import,
    as a torchvision built for another torch makes transformers do) is not told to install
    itself again: the message keeps the real error and names the likely cause."""
    lik_plugins.unpatch_colpali_engine()
    for name in [m for m in sys.modules if m == "colpali_engine" or m.startswith("colpali_engine.")]:
        monkeypatch.delitem(sys.modules, name)
    fake = tmp_path / "colpali_engine"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ModuleNotFoundError(\"Could not import module 'Gemma3Model'\")\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError) as info:
        lik_plugins.patch_colpali_engine()
    message = str(info.value)
    assert "Gemma3Model" in message and "torchvision" in message
    assert "pip install 'lik_plugins[colpali]'" not in message
