"""``LIK_PATCH``: which hosts the start-up hook patches (parsing only; no host imported)."""
from __future__ import annotations

import pytest

from lik_plugins import _autoactivate as aa


def _hosts(**environ):
    return [row[0] for row in aa.wanted(environ)]


def test_names_lists_and_all():
    assert _hosts() == []
    assert _hosts(LIK_PATCH="sentence_transformers") == ["sentence_transformers"]
    assert _hosts(LIK_PATCH=" PyLate , sentence-transformers,") == ["pylate", "sentence_transformers"]
    assert _hosts(LIK_PATCH="colpali_engine,colpali") == ["colpali_engine"]
    assert sorted(_hosts(LIK_PATCH="all")) == ["colpali_engine", "pylate", "sentence_transformers"]


def test_backend_variables_and_lik_patch_do_not_double_a_host():
    assert _hosts(PYLATE_SCORES_BACKEND="lik", LIK_PATCH="pylate,sentence_transformers") == ["pylate", "sentence_transformers"]
    assert _hosts(PYLATE_SCORES_BACKEND="torch", LIK_PATCH="colpali") == ["colpali_engine"]


def test_unknown_names_warn_and_are_skipped():
    with pytest.warns(RuntimeWarning, match="unknown host 'bogus'"):
        assert _hosts(LIK_PATCH="bogus,pylate") == ["pylate"]


def test_pth_line_reads_lik_patch():
    from pathlib import Path

    line = (Path(aa.__file__).resolve().parents[2] / "lik_plugins_autoactivate.pth").read_text()
    assert "LIK_PATCH" in line and "_SCORES_BACKEND" in line
