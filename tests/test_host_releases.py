"""``ci/host_releases.py``: the release matrix read from the pins, and what PyPI has beyond it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "ci" / "host_releases.py"


def _index(tmp_path, extra: dict[str, list[str]]) -> Path:
    """A PyPI-format folder holding exactly the releases the matrix tests, plus ``extra``."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import host_releases
    finally:
        sys.path.pop(0)
    for project, patterns in host_releases.SOURCES.values():
        versions = host_releases.tested(project, patterns) + extra.get(project, [])
        files = {v: [{"filename": f"{project}-{v}.tar.gz", "yanked": False}] for v in versions}
        (tmp_path / f"{project}.json").write_text(json.dumps({"releases": files}))
    return tmp_path


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_the_matrix_names_each_hosts_oldest_and_newest_release(tmp_path):
    out = _run("--check", "--index", str(_index(tmp_path, {})))
    assert out.returncode == 0, out.stdout + out.stderr
    rows = {line.split()[0]: line for line in out.stdout.splitlines()[1:]}
    assert set(rows) == {"PyLate", "colpali-engine", "sentence-transformers", "fast-plaid"}
    for host, oldest, newest in [("PyLate", "1.3.3", "1.6.0"), ("colpali-engine", "0.3.10", "0.3.18"),
                                 ("sentence-transformers", "6.0.1", "6.3.0"), ("fast-plaid", "1.4.6.2110", "1.7.0.2110")]:
        assert oldest in rows[host] and newest in rows[host] and rows[host].rstrip().endswith("none"), rows[host]


def test_a_newer_release_is_listed_and_fails_check(tmp_path):
    index = _index(tmp_path, {"fast-plaid": ["1.7.1.2110", "1.8.0rc1"], "pylate": ["1.5.9"]})
    out = _run("--check", "--index", str(index))
    assert out.returncode == 1
    row = next(line for line in out.stdout.splitlines() if line.startswith("fast-plaid"))
    assert row.rstrip().endswith("1.7.1.2110")           # a pre-release is not a release
    assert next(line for line in out.stdout.splitlines() if line.startswith("PyLate")).rstrip().endswith("none")
    assert _run("--index", str(index)).returncode == 0   # without --check it only reports
