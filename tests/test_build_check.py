"""The release check in ci/install_keeps_torch.py: the fresh environment it installs the sdist
and the wheel into sees torch and numpy (and what they need), nothing of the hosts or of
lik_plugins; the version it expects is pyproject.toml's."""
from __future__ import annotations

import re

from support import repo_scripts
from support.repo_scripts import ROOT

install_keeps_torch = repo_scripts.load("ci/install_keeps_torch.py")


def test_runtime_site_links_torch_and_numpy_and_nothing_of_the_hosts(tmp_path):
    site = install_keeps_torch.runtime_site(tmp_path / "site")
    names = {p.name for p in site.iterdir()}
    assert {"torch", "numpy"} <= names
    assert any(n.startswith("torch-") and n.endswith(".dist-info") for n in names)
    assert not any(n.startswith(("lik_plugins", "__editable__", "pylate", "colpali_engine", "transformers"))
                   for n in names), sorted(names)
    assert all(p.is_symlink() and p.exists() for p in site.iterdir())


def test_expected_version_is_pyprojects():
    text = (ROOT / "pyproject.toml").read_text()
    assert install_keeps_torch.pyproject_version() == re.search(r'^version = "(.+)"', text, re.M).group(1)
