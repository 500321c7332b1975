"""Zero-code activation for sentence-transformers 6.x: ``LIK_PATCH=sentence_transformers``.

Runs in a subprocess of this environment, which must have lik_plugins installed (the
``.pth`` start-up hook); ``ci/st6_env.sh`` installs the checkout editable."""
from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from support import st_tiny
from support.autoactivation import training_script

st_tiny.require_st6()

TESTS = Path(__file__).resolve().parents[2]  # on the subprocess's PYTHONPATH: the package support
ROOT = TESTS.parent


def _pth_installed() -> bool:
    dirs = [*site.getsitepackages(), site.getusersitepackages()]
    return any((Path(d) / "lik_plugins_autoactivate.pth").exists() for d in dirs)


pytestmark = pytest.mark.skipif(not _pth_installed(), reason="lik_plugins is not installed here (pip install -e .)")


def _run(code: str, **env) -> dict:
    environ = {k: v for k, v in os.environ.items()
               if not k.endswith("_SCORES_BACKEND") and k not in ("LIK_DISABLE", "LIK_PATCH", "LIK_BACKEND")}
    environ.update(env, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=f"{TESTS}{os.pathsep}{ROOT / 'src'}")
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=environ, capture_output=True, text=True,
                         timeout=300, cwd=str(ROOT))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


STARTUP = """
import json, sys
print(json.dumps({m: m in sys.modules for m in ("lik_plugins", "torch", "sentence_transformers")}))
"""


def test_nothing_imported_unless_asked_and_then_only_the_hook():
    assert _run(STARTUP) == {"lik_plugins": False, "torch": False, "sentence_transformers": False}
    assert _run(STARTUP, LIK_PATCH="sentence_transformers") == {
        "lik_plugins": True, "torch": False, "sentence_transformers": False}


TRAIN = training_script("st_tiny", "load_encoder", "mnrl")


@pytest.fixture(scope="module")
def vanilla():
    return _run(TRAIN)


@pytest.mark.parametrize("value", ["sentence_transformers", "pylate,sentence-transformers"])
def test_zero_code_training_is_routed_and_matches(vanilla, value):
    patched = _run(TRAIN, LIK_PATCH=value)
    assert vanilla["counts"] == {}
    assert patched["counts"]["sentence_transformers.maxsim"] == {"torch-chunked": 2}  # one launch a step
    assert patched["losses"] == pytest.approx(vanilla["losses"], abs=1e-5)
