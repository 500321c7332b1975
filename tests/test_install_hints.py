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


def _error_without(monkeypatch, package: str, unpatch, patch) -> ImportError:
    """The ImportError ``patch()`` raises where ``package`` is not installed."""
    unpatch()
    _hide(monkeypatch, package)
    with pytest.raises(ImportError) as info:
        patch()
    return info.value


def test_patch_pylate_without_pylate_gives_a_command_that_keeps_torch(monkeypatch):
    message = str(_error_without(monkeypatch, "pylate", lik_plugins.unpatch_pylate, lik_plugins.patch_pylate))
    # PyLate's own metadata pulls fast-plaid, which pins one torch: the hint installs the
    # other dependencies, then PyLate alone
    assert "pip install --no-deps pylate==1.6.0" in message and "fast-plaid" not in message.split("docs/install.md")[0]
    assert "lik_plugins[" not in message and "torch==" not in message


def test_patch_colpali_without_colpali_gives_a_command_that_keeps_torch(monkeypatch):
    error = _error_without(monkeypatch, "colpali_engine", lik_plugins.unpatch_colpali_engine,
                           lik_plugins.patch_colpali_engine)
    message = str(error)
    # no torchvision: PyPI's is built for a CUDA torch and breaks a CPU torch's transformers
    assert "pip install --no-deps colpali-engine==0.3.18" in message and "torchvision" not in message
    assert "lik_plugins[" not in message
    assert isinstance(error.__cause__, ImportError)  # the original error stays attached
    from lik_plugins.colpali import patch

    assert not patch.is_patched()


def test_install_guide_shows_the_hints_commands_after_saying_what_they_keep():
    """docs/install.md (which README "Install" points to, and the errors name) quotes the
    commands the errors give, verbatim, and says what the plain install would do to torch
    before it shows them."""
    from pathlib import Path

    from lik_plugins import _install

    root = Path(__file__).resolve().parent.parent
    guide = (root / "docs" / "install.md").read_text()
    heading = "## PyLate and colpali-engine beside your torch"
    section = guide[guide.index(heading):guide.index("\n## ", guide.index(heading) + 1)]
    for command in (_install.PYLATE, _install.COLPALI):
        assert command in section
    readme = (root / "README.md").read_text()
    assert "docs/install.md" in readme[readme.index("## Install"):]
    assert "lik_plugins[pylate]" not in readme + guide and "lik_plugins[colpali]" not in readme + guide
    first_command = section.index("```bash")
    assert section.index("torch", 0, first_command) < first_command


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
    assert "Gemma3Model" in message and "install torchvision from the index your torch came from" in message
    assert "pip install torch " not in message     # never a command that swaps the torch
    assert "pip install --no-deps colpali-engine" not in message
