"""Which host releases CI tests, and which newer ones PyPI has: the release matrix at a glance.

    python ci/host_releases.py            # the matrix, then any release newer than its newest
    python ci/host_releases.py --check    # the same; exit status 1 if a host has a newer release

The matrix is read from the files that pin it, not kept twice:

=======================  =================================================================
PyLate                   ``ci/requirements-nodeps.txt`` (newest) and
                         ``tests/support/pylate_releases.py`` (older releases, side by side)
colpali-engine           ``ci/requirements-nodeps.txt`` and ``tests/support/colpali_releases.py``
sentence-transformers    ``ci/st6-requirements-<release>.txt`` (one environment each)
fast-plaid               ``ci/fastplaid-requirements.txt`` and ``ci/fastplaid-146.txt``
=======================  =================================================================

``--index DIR`` reads ``DIR/<project>.json`` (PyPI's JSON API format) instead of asking PyPI:
for a machine without a network, and the tests.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PIN = re.compile(r"^\s*([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?==([0-9][0-9A-Za-z.]*)", re.MULTILINE)
QUOTED_PIN = re.compile(r'"([A-Za-z0-9_.\-]+)==([0-9][0-9A-Za-z.]*)"')
QUOTED_RELEASE = re.compile(r'"(\d+\.\d+\.\d+)"')

# host -> (PyPI project, files whose pins name its tested releases)
SOURCES = {
    "PyLate": ("pylate", ["ci/requirements-nodeps.txt", "tests/support/pylate_releases.py"]),
    "colpali-engine": ("colpali-engine", ["ci/requirements-nodeps.txt", "tests/support/colpali_releases.py"]),
    "sentence-transformers": ("sentence-transformers", ["ci/st6-requirements-*.txt"]),
    "fast-plaid": ("fast-plaid", ["ci/fastplaid-requirements.txt", "ci/fastplaid-146.txt"]),
}


def _key(version: str) -> tuple:
    """A release's order: its numeric parts (``1.7.0.2110`` after ``1.4.6.2110``); a
    pre-release or dev tag (``6.3.0rc1``) is not a release and gets None."""
    if not re.fullmatch(r"\d+(\.\d+)*", version):
        return None
    return tuple(int(p) for p in version.split("."))


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def tested(project: str, patterns: list[str], root: Path = ROOT) -> list[str]:
    """The releases of ``project`` the matrix pins, oldest first."""
    found = set()
    for pattern in patterns:
        for path in sorted(root.glob(pattern)):
            text = path.read_text()
            pins = PIN.findall(text) + QUOTED_PIN.findall(text)
            found.update(v for name, v in pins if _normalise(name) == _normalise(project))
            if path.name == "colpali_releases.py" and project == "colpali-engine":
                found.update(QUOTED_RELEASE.findall(text))
    return sorted(found, key=_key)


def published(project: str, index: Path | None) -> list[str]:
    """Every final release of ``project`` on PyPI (or in ``index``), oldest first."""
    if index is not None:
        data = json.loads((index / f"{project}.json").read_text())
    else:
        with urllib.request.urlopen(f"https://pypi.org/pypi/{project}/json", timeout=30) as reply:
            data = json.load(reply)
    releases = [v for v, files in data["releases"].items() if files and _key(v) is not None
                and not all(f.get("yanked") for f in files)]
    return sorted(releases, key=_key)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit status 1 if any host has a release newer than the matrix")
    parser.add_argument("--index", type=Path, help="a folder of <project>.json files in PyPI's JSON format")
    args = parser.parse_args(argv)
    newer_anywhere = False
    print(f"{'host':<23} {'tested in CI':<60} newer on PyPI")
    for host, (project, patterns) in SOURCES.items():
        matrix = tested(project, patterns)
        if not matrix:
            print(f"{host:<23} {'(no pin found: ' + ', '.join(patterns) + ')':<60} -")
            newer_anywhere = True
            continue
        try:
            newer = [v for v in published(project, args.index) if _key(v) > _key(matrix[-1])]
        except (OSError, ValueError, KeyError) as exc:
            print(f"{host:<23} {', '.join(matrix):<60} (PyPI not read: {exc})")
            continue
        newer_anywhere |= bool(newer)
        print(f"{host:<23} {', '.join(matrix):<60} {', '.join(newer) if newer else 'none'}")
    return 1 if args.check and newer_anywhere else 0


if __name__ == "__main__":
    sys.exit(main())
