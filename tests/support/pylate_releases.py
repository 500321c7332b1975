"""Older PyLate releases, installed side by side and checked in a subprocess.

``python tests/support/pylate_releases.py 1.4.0 OUT.json`` installs that release (and the
dependencies it needs that differ from the CI environment) into a cache folder with
``pip install --target --no-deps``, puts the folder first on ``PYTHONPATH`` and runs
``pylate_tiny.py`` there (vanilla / patched / ``LIK_DISABLE=1`` training for the three
losses, plus rerank, similarity and the evaluators).

Cache folder: ``$LIK_PYLATE_RELEASES`` or ``~/.cache/lik_plugins/pylate-releases``.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# PyLate <= 1.4.x pins sentence-transformers 5.1.1 and transformers <= 4.56.2, which need a
# huggingface-hub below 1.0, which needs a datasets below 4.1.
_OLD_STACK = [
    "sentence-transformers==5.1.1",
    "transformers==4.56.2",
    "huggingface-hub==0.36.2",
    "datasets==4.0.0",
    "sqlitedict>=2.1",
]
REQUIREMENTS = {
    "1.3.3": ["pylate==1.3.3", *_OLD_STACK],
    "1.4.0": ["pylate==1.4.0", *_OLD_STACK],
    "1.5.0": ["pylate==1.5.0"],  # same sentence-transformers / transformers as 1.6.0
}


class InstallError(RuntimeError):
    pass


def cache_root() -> Path:
    return Path(os.environ.get("LIK_PYLATE_RELEASES", Path.home() / ".cache" / "lik_plugins" / "pylate-releases"))


def install(version: str) -> Path:
    target = cache_root() / version
    stamp = target / ".complete"
    if stamp.exists():
        return target
    target.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--upgrade", "--target", str(target)]
    out = subprocess.run([*cmd, *REQUIREMENTS[version]], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise InstallError(f"pip could not install PyLate {version}: {out.stderr.strip()[-1500:]}")
    stamp.write_text("\n".join(REQUIREMENTS[version]))
    return target


def run(version: str, out_json: str, timeout: int = 600) -> subprocess.CompletedProcess:
    target = install(version)
    env = dict(os.environ)
    env.pop("PYLATE_SCORES_BACKEND", None)
    env.pop("LIK_DISABLE", None)
    env["PYTHONPATH"] = os.pathsep.join([str(target), str(HERE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    return subprocess.run(
        [sys.executable, str(HERE / "pylate_tiny.py"), out_json], env=env, capture_output=True, text=True, timeout=timeout
    )


if __name__ == "__main__":
    result = run(sys.argv[1], sys.argv[2])
    sys.stdout.write(result.stdout[-5000:])
    sys.stderr.write(result.stderr[-5000:])
    sys.exit(result.returncode)
