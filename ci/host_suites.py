"""Run the hosts' own test suites with and without lik_plugins and compare test for test.

For each host (PyLate 1.6.0, colpali-engine 0.3.18, sentence-transformers 6.x) the tests shipped in
its sdist (fetched with ``pip download --no-deps --no-binary :all:`` into a cache directory, never
committed) and its installed-package doctests run offline in four modes:

===================  ===========================================================================
``unpatched``        the host alone
``zero-code``        ``LIK_PATCH=<host>`` (the start-up hook patches on the host's import), plus
                     ``<HOST>_SCORES_BACKEND=auto`` where the host has that variable (its default)
``explicit``         ``patch_<host>()`` called before collection (``ci/host_suite_plugin.py``)
``disabled``         ``LIK_PATCH=<host>`` and ``LIK_DISABLE=1``
===================  ===========================================================================

Per-test outcomes come from JUnit reports.  CI fails when ``disabled`` differs from ``unpatched`` in
any test, or a patched mode differs in a test not listed (with its reason) in
``ci/host_suite_expected_failures.txt``.  A listed test that no longer differs is reported as stale.

    python ci/host_suites.py                                   # all hosts, cache in .host-suites/
    python ci/host_suites.py --hosts pylate --out /tmp/hs      # one host, report elsewhere

The PyLate and colpali suites run in this interpreter (the main CI venv); sentence-transformers 6
needs its own environment (``ci/st6_env.sh --build-only`` builds ``.venv-st6``).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXPECTED = ROOT / "ci" / "host_suite_expected_failures.txt"
MODES = ("unpatched", "zero-code", "explicit", "disabled")


@dataclass(frozen=True)
class Host:
    name: str            # LIK_PATCH name and the suite's label
    spec: str            # what pip downloads
    sdist_dir: str       # top folder inside the sdist
    patch: str           # lik_plugins patch function (explicit mode)
    tests: tuple         # paths inside the sdist to copy and run
    doctests: tuple      # installed modules (dotted) whose doctests run
    python: str = "main"  # "main" (this interpreter) or "st6"
    extra_args: tuple = ()
    backend_variable: str | None = None  # the host's own selector, set to its default ``auto``


HOSTS = {
    "pylate": Host(
        "pylate", "pylate==1.6.0", "pylate-1.6.0", "patch_pylate", ("tests", "conftest.py"),
        ("pylate",),
        extra_args=("-m", "not web and not slow", "-o", "doctest_optionflags=NORMALIZE_WHITESPACE NUMBER"),
        backend_variable="PYLATE_SCORES_BACKEND",
    ),
    "colpali": Host(
        "colpali", "colpali-engine==0.3.18", "colpali_engine-0.3.18", "patch_colpali_engine", ("tests",), (),
        extra_args=("-m", "not slow", "-W", "ignore::Warning"),
        backend_variable="COLPALI_SCORES_BACKEND",
    ),
    "sentence_transformers": Host(
        "sentence_transformers", "sentence-transformers==6.2.0", "sentence_transformers-6.2.0",
        "patch_sentence_transformers", ("tests",),
        ("sentence_transformers.util.similarity", "sentence_transformers.multi_vector_encoder.scoring.colbert"),
        python="st6",
    ),
}


def fetch(host: Host, cache: Path, python: str) -> Path:
    """The host's sdist unpacked under ``cache`` (downloaded once)."""
    target = cache / host.sdist_dir
    if target.is_dir():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    subprocess.run([python, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", host.spec, "-d", str(cache)],
                   check=True)
    archive = next(p for p in cache.iterdir() if p.name.startswith(host.sdist_dir) and p.name.endswith(".tar.gz"))
    with tarfile.open(archive) as tar:
        tar.extractall(cache, filter="data") if sys.version_info >= (3, 12) else tar.extractall(cache)  # noqa: S202
    return target


def workdir(host: Host, sdist: Path, cache: Path) -> Path:
    """The sdist's tests (and root conftest) copied without the package itself, so every import
    reaches the *installed* host (the one the patch serves)."""
    work = cache / f"{host.name}-work"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir()
    for item in host.tests:
        src = sdist / item
        if src.is_dir():
            shutil.copytree(src, work / item)
        elif src.exists():
            shutil.copy2(src, work / item)
    (work / "pytest.ini").write_text("[pytest]\n")  # the host's addopts want plugins CI lacks (cov, xdist)
    return work


def module_paths(python: str, modules: tuple) -> list[str]:
    if not modules:
        return []
    code = "import importlib, os, sys\nfor m in sys.argv[1:]:\n    f = importlib.import_module(m).__file__\n" \
           "    print(os.path.dirname(f) if f.endswith('__init__.py') else f)"
    out = subprocess.run([python, "-c", code, *modules], capture_output=True, text=True, check=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    return out.stdout.split()


def run_mode(host: Host, python: str, work: Path, doctest_paths: list[str], mode: str, out_dir: Path) -> dict[str, str]:
    report = out_dir / f"{host.name}-{mode}.xml"
    env = {k: v for k, v in os.environ.items()
           if not k.endswith("_SCORES_BACKEND") and k not in ("LIK_DISABLE", "LIK_PATCH", "LIK_BACKEND", "LIK_HOST_SUITE_PATCH")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "ci"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    if mode in ("zero-code", "disabled"):
        env["LIK_PATCH"] = host.name
        if host.backend_variable:
            env[host.backend_variable] = "auto"
    if mode == "disabled":
        env["LIK_DISABLE"] = "1"
    if mode == "explicit":
        env["LIK_HOST_SUITE_PATCH"] = host.patch
    targets = [str(work / t) for t in host.tests if (work / t).is_dir()] + doctest_paths
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "host_suite_plugin", "--junitxml", str(report),
           "--continue-on-collection-errors",
           "-o", "junit_family=xunit1", "--rootdir", str(work), "-c", str(work / "pytest.ini"), *host.extra_args]
    if doctest_paths:
        cmd.append("--doctest-modules")
    # the exit status is not read: the hosts' suites fail some tests in every mode here (the
    # baseline), and what counts is each test's outcome against that baseline
    proc = subprocess.run([*cmd, *targets], cwd=work, env=env, capture_output=True, text=True, timeout=1500)
    (out_dir / f"{host.name}-{mode}.log").write_text(proc.stdout[-200_000:] + proc.stderr[-50_000:])
    return outcomes(report) if report.exists() else {}


def mode_row(host: str, mode: str, runs: dict[str, dict[str, str]], seconds: float) -> str:
    """One line per mode as it finishes: the baseline's outcomes, then each mode against it."""
    got = runs[mode]
    if mode == "unpatched":
        counts = {o: sum(v == o for v in got.values()) for o in ("passed", "skipped", "failed", "error")}
        return (f"  {host:22s} {mode:10s} {len(got)} tests: {counts['passed']} pass, {counts['skipped']} skipped, "
                f"{counts['failed'] + counts['error']} set aside (they need the Hugging Face Hub, offline here, or a "
                f"package CI leaves out, patched or not; every mode is compared with this run)  {seconds:6.1f} s")
    base = runs["unpatched"]
    ids = set(base) | set(got)
    same = sum(base.get(t, "absent") == got.get(t, "absent") for t in ids)
    return f"  {host:22s} {mode:10s} {same} of {len(ids)} tests as unpatched  {seconds:6.1f} s"


def outcomes(report: Path) -> dict[str, str]:
    result = {}
    for case in ET.parse(report).iter("testcase"):
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        tags = {child.tag for child in case}
        result[test_id] = ("failed" if "failure" in tags else "error" if "error" in tags
                           else "skipped" if "skipped" in tags else "passed")
    return result


def expected_differences() -> dict[tuple[str, str], str]:
    listed = {}
    for line in EXPECTED.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            suite, test_id, reason = (part.strip() for part in line.split("|", 2))
            listed[(suite, test_id)] = reason
    return listed


def compare(host: str, runs: dict[str, dict[str, str]], listed: dict) -> dict:
    """Each test against the unpatched run in every other mode: ``equal`` (same outcome in
    all modes), ``deliberate`` (listed tests that differ in a patched mode: id -> modes),
    ``problems`` (unlisted differences, or any under ``disabled``) and ``stale`` (listed,
    no longer different)."""
    base = runs["unpatched"]
    ids = sorted(set().union(*runs.values()))
    problems, deliberate, equal = [], {}, 0
    for test_id in ids:
        differs = False
        for mode, got in runs.items():
            a, b = base.get(test_id, "absent"), got.get(test_id, "absent")
            if mode == "unpatched" or a == b:
                continue
            differs = True
            if mode != "disabled" and (host, test_id) in listed:
                deliberate.setdefault(test_id, []).append(mode)
            else:
                problems.append(f"{host} [{mode}] {test_id}: {a} unpatched, {b} {mode}")
        equal += not differs
    stale = [f"{host} {test_id}: listed but no longer differs" for (suite, test_id) in listed
             if suite == host and test_id not in deliberate]
    return {"tests": len(ids), "equal": equal, "deliberate": deliberate, "problems": problems, "stale": stale}


def summary_lines(report: dict, seconds: float) -> list[str]:
    """The closing lines (``make test`` repeats them in its summary)."""
    lines = []
    for name, entry in report.items():
        if "equal" not in entry:
            lines.append(f"host suites: {name}: {entry['problems'][0]}")
            continue
        k = len(entry["deliberate"])
        lines.append(f"host suites: {name}: {entry['equal']} tests equal to unpatched in every mode, {k} deliberate "
                     f"difference{'s' if k != 1 else ''} (listed), {len(entry['problems'])} unexpected")
        for test_id, modes in entry["deliberate"].items():
            lines.append(f"host suites:   deliberate: {test_id} ({', '.join(modes)})")
    problems = [p for entry in report.values() for p in entry["problems"]]
    stale = [p for entry in report.values() for p in entry.get("stale", [])]
    lines += [f"host suites: STALE {line}" for line in stale]
    lines += [f"host suites: DIFF {line}" for line in problems]
    lines.append(f"host suites: {len(problems)} unexpected difference(s) in {len(report)} host(s), {seconds:.0f} s "
                 f"(deliberate differences and their reasons: ci/host_suite_expected_failures.txt)")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", default=",".join(HOSTS), help="comma list of " + ", ".join(HOSTS))
    p.add_argument("--cache", default=str(ROOT / ".host-suites"), help="sdists and work folders (not committed)")
    p.add_argument("--out", default=None, help="reports (default: <cache>/reports)")
    p.add_argument("--st6-python", default=str(ROOT / ".venv-st6" / "bin" / "python"))
    args = p.parse_args(argv)
    cache = Path(args.cache).resolve()
    out_dir = Path(args.out).resolve() if args.out else cache / "reports"
    out_dir.mkdir(parents=True, exist_ok=True)
    listed = expected_differences()
    report = {}
    started = time.perf_counter()
    for name in [h.strip() for h in args.hosts.split(",") if h.strip()]:
        host = HOSTS[name]
        python = sys.executable if host.python == "main" else args.st6_python
        if not Path(python).exists():
            report[name] = {"problems": [f"no interpreter at {python} (run ci/st6_env.sh --build-only)"]}
            continue
        sdist = fetch(host, cache, python)
        work = workdir(host, sdist, cache)
        doctest_paths = module_paths(python, host.doctests)
        runs = {}
        for mode in MODES:
            mode_started = time.perf_counter()
            runs[mode] = run_mode(host, python, work, doctest_paths, mode, out_dir)
            if not runs["unpatched"]:
                break
            print(mode_row(name, mode, runs, time.perf_counter() - mode_started), flush=True)
        if not runs["unpatched"]:
            report[name] = {"problems": [f"no test outcomes (see {out_dir}/{name}-unpatched.log)"]}
            continue
        report[name] = compare(name, runs, listed)
    seconds = time.perf_counter() - started
    (out_dir / "host_suites.json").write_text(json.dumps({"seconds": seconds, "hosts": report}, indent=1))
    for line in summary_lines(report, seconds):
        print(line)
    return 1 if any(entry["problems"] for entry in report.values()) else 0

if __name__ == "__main__":
    sys.exit(main())
