"""Zero-code activation through the installed ``lik_plugins_autoactivate.pth``."""
from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from lik_plugins import _autoactivate
from support.autoactivation import training_script

TESTS = Path(__file__).resolve().parents[2]  # on the subprocess's PYTHONPATH: the package support


def _site_dirs():
    dirs = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    user = site.getusersitepackages() if hasattr(site, "getusersitepackages") else None
    return [Path(d) for d in (*dirs, user) if d]


def _run(code: str, **env) -> dict:
    environ = {k: v for k, v in os.environ.items() if not k.endswith("_SCORES_BACKEND") and k != "LIK_DISABLE"}
    environ.update(env, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(TESTS))
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=environ, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_pth_is_installed():
    found = [d / "lik_plugins_autoactivate.pth" for d in _site_dirs() if (d / "lik_plugins_autoactivate.pth").exists()]
    assert found, "lik_plugins_autoactivate.pth is not in site-packages: reinstall the package (pip install -e .)"


STARTUP = """
import json, sys
print(json.dumps({m: m in sys.modules for m in ("lik_plugins", "lik_plugins._autoactivate", "torch", "pylate")}))
"""


@pytest.mark.parametrize("value", [None, "torch", "flash", "bogus"])
def test_nothing_imported_at_startup_unless_asked(value):
    env = {} if value is None else {"PYLATE_SCORES_BACKEND": value}
    assert _run(STARTUP, **env) == {"lik_plugins": False, "lik_plugins._autoactivate": False, "torch": False, "pylate": False}


def test_activation_waits_for_the_host_import():
    got = _run(STARTUP, PYLATE_SCORES_BACKEND="lik")
    assert got == {"lik_plugins": True, "lik_plugins._autoactivate": True, "torch": False, "pylate": False}


TRAIN = training_script("pylate_tiny", "load_colbert", "contrastive")


def test_zero_code_training_is_routed_and_matches():
    pytest.importorskip("pylate.scores", reason="PyLate is not installed (docs/install.md: PyLate beside your torch)")
    patched = _run(TRAIN, PYLATE_SCORES_BACKEND="lik")
    vanilla = _run(TRAIN)
    assert vanilla["counts"] == {}
    assert patched["counts"]["pylate.ColBERTScores"] == {"torch-chunked": 2}
    assert patched["losses"] == pytest.approx(vanilla["losses"], abs=1e-5)


RERANK_ON_CPU = """
import json, torch
from pylate import rank
from lik_plugins import routing_counts
g = torch.Generator().manual_seed(0)
unit = torch.nn.functional.normalize
queries = [unit(torch.randn(n, 16, generator=g), dim=-1) for n in (5, 8)]
docs = [[unit(torch.randn(n, 16, generator=g), dim=-1) - 0.2 for n in lengths] for lengths in ((3, 9, 1, 6), (7, 2, 4))]
ids = [[f"q{i}d{j}" for j in range(len(group))] for i, group in enumerate(docs)]
print(json.dumps({"ranked": rank.rerank(ids, queries, docs), "counts": routing_counts()}))
"""


def test_zero_code_rerank_on_a_plain_cpu_runs_pylates_torch_path():
    # PYLATE_SCORES_BACKEND=lik without patch_pylate(): on a plain CPU PyLate's own loop serves the
    # call, and the variable must not send that loop's scoring to PyLate's own LIK backend (which
    # raises on CPU tensors)
    pytest.importorskip("pylate.scores", reason="PyLate is not installed (docs/install.md: PyLate beside your torch)")
    plain_cpu = {"TRITON_INTERPRET": "0", "LIK_BACKEND": "auto"}
    patched = _run(RERANK_ON_CPU, PYLATE_SCORES_BACKEND="lik", **plain_cpu)
    torch_path = _run(RERANK_ON_CPU, PYLATE_SCORES_BACKEND="torch", **plain_cpu)
    assert torch_path["counts"] == {}
    assert patched["ranked"] == torch_path["ranked"]
    assert patched["counts"]["pylate.rerank"] == {"original": 1}
    assert patched["counts"]["pylate.colbert_scores"] == {"original": 2}
    # the kill switch keeps PyLate's own meaning of "lik": its LIK backend, and its own error on a CPU
    environ = {k: v for k, v in os.environ.items() if not k.endswith("_SCORES_BACKEND")}
    environ.update(plain_cpu, PYLATE_SCORES_BACKEND="lik", LIK_DISABLE="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(TESTS))
    disabled = subprocess.run([sys.executable, "-c", RERANK_ON_CPU], env=environ, capture_output=True, text=True,
                              timeout=300)
    assert disabled.returncode != 0 and "lik" in disabled.stderr.splitlines()[-1].lower()


# ------------------------------------------------------- the post-import hook, in process


def test_post_import_hook_patches_once_after_the_host_executed(tmp_path, monkeypatch):
    host = tmp_path / "lik_fake_host_mod.py"
    host.write_text("EXECUTED = True\n")
    adapter = types.ModuleType("lik_fake_adapter")
    calls = []

    def patch_fake():
        calls.append(sys.modules["lik_fake_host_mod"].EXECUTED)

    adapter.patch_fake = patch_fake
    monkeypatch.setitem(sys.modules, "lik_fake_adapter", adapter)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(_autoactivate.HOSTS, "LIK_FAKE_SCORES_BACKEND", ("lik_fake_host_mod", "lik_fake_adapter", "patch_fake"))
    before = list(sys.meta_path)
    _autoactivate.install({"LIK_FAKE_SCORES_BACKEND": "LIK"})
    try:
        assert calls == []
        import lik_fake_host_mod

        assert calls == [True]
        assert "_LoaderThenPatch" not in type(lik_fake_host_mod.__loader__).__name__
        assert sys.meta_path == before  # the finder removed itself
        # already imported: patched at once
        _autoactivate.install({"LIK_FAKE_SCORES_BACKEND": "auto"})
        assert calls == [True, True]
        _autoactivate.install({"LIK_FAKE_SCORES_BACKEND": "torch"})
        assert calls == [True, True]
    finally:
        sys.meta_path[:] = before
        sys.modules.pop("lik_fake_host_mod", None)


EXPLICIT_PATCH_BEFORE_IMPORT = """
import json, lik_plugins
from lik_plugins.colpali import patch as colpali_patch
from lik_plugins.pylate import _patch as pylate_patch
layout = lik_plugins.patch_pylate()  # imports pylate, whose import runs the start-up hook's patch_pylate()
generation = lik_plugins.patch_colpali_engine()
print(json.dumps({"pylate": pylate_patch.is_patched(), "layout": type(layout).__name__,
                  "colpali": colpali_patch.is_patched(), "generation": generation}))
"""


@pytest.mark.parametrize("env", [{"PYLATE_SCORES_BACKEND": "auto", "COLPALI_SCORES_BACKEND": "auto"},
                                 {"LIK_PATCH": "all"}])
def test_explicit_patch_with_the_startup_hook_armed_does_not_deadlock(env):
    # the explicit call imports the host, the import re-enters the patcher on the same thread:
    # it used to wait forever on the patcher's own lock
    pytest.importorskip("colpali_engine")
    got = _run(EXPLICIT_PATCH_BEFORE_IMPORT, **env)
    assert got["pylate"] and got["colpali"] and got["layout"] == "PyLateLayout" and isinstance(got["generation"], str)
