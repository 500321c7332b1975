"""``pip install`` of lik_plugins into an environment that already has torch and the hosts
leaves torch (and every other installed package) as it is.

The user's environment is simulated cheaply: a fresh venv (no pip of its own) whose
``site-packages`` holds a ``.pth`` line pointing at a folder of links to the main CI venv's
packages -- torch 2.13.0+cpu, PyLate 1.6.0, colpali-engine 0.3.18 and their dependencies --
minus lik_plugins itself.  In that venv, plainly (no ``--no-deps``):

1. ``pip install <a copy of this checkout>`` (a wheel build, as a user's ``pip install .``);
2. the two commands README "Install" and the patchers' ImportErrors give to install PyLate and
   colpali-engine beside an existing torch (``lik_plugins._install``).

``pip list`` is taken before and after each step; the step fails if any package present
before is gone or has another version or location afterwards.  The lists are written to
``--out`` and the differences printed.  Needs PyPI for the wheel build's setuptools (and
ninja, PyLate's one dependency CI's venv lacks); nothing else is downloaded.

    python ci/install_keeps_torch.py [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OWN = ("lik_plugins", "__editable__.lik_plugins", "__editable___lik_plugins", "lik_plugins_autoactivate.pth")
# what a source copy leaves out: environments, build leftovers (a stale build/ would put
# deleted modules into the wheel), caches
NOT_COPIED = shutil.ignore_patterns(".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                                    ".hypothesis", ".host-suites", ".whl")


def host_site(target: Path) -> Path:
    """A folder of links to this interpreter's site-packages entries, lik_plugins excluded."""
    site = Path(sysconfig.get_paths()["purelib"])
    target.mkdir(parents=True)
    for entry in site.iterdir():
        if not entry.name.startswith(OWN):
            (target / entry.name).symlink_to(entry)
    return target


def make_env(work: Path) -> Path:
    """A venv that sees the host packages; returns its python."""
    env = work / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    python = env / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    # a plain path line: the host's own .pth files (the editable lik_plugins) stay unread
    (Path(purelib) / "_user_environment.pth").write_text(str(host_site(work / "host-site")) + "\n")
    return python


def pip_list(python: Path) -> dict[str, tuple[str, str]]:
    """name -> (version, location) of every distribution the environment sees."""
    out = subprocess.run([str(python), "-m", "pip", "list", "-v", "--format=json", "--disable-pip-version-check"],
                         check=True, capture_output=True, text=True).stdout
    return {row["name"].lower(): (row["version"], os.path.realpath(row.get("location", ""))) for row in json.loads(out)}


def changes(before: dict, after: dict) -> tuple[list[str], list[str]]:
    """(added, broken): packages new in ``after``; packages of ``before`` gone or changed."""
    added = [f"{name} {after[name][0]}" for name in sorted(set(after) - set(before))]
    broken = []
    for name, (version, location) in sorted(before.items()):
        if name not in after:
            broken.append(f"{name} {version}: removed")
        elif after[name] != (version, location):
            broken.append(f"{name} {version} ({location}) -> {after[name][0]} ({after[name][1]})")
    return added, broken


def write_list(path: Path, listing: dict) -> None:
    path.write_text("".join(f"{name}=={version}  {location}\n" for name, (version, location) in sorted(listing.items())))


def run_step(python: Path, label: str, command: list[str], out: Path, index: int) -> list[str]:
    before = pip_list(python)
    proc = subprocess.run([str(python), "-m", *command], capture_output=True, text=True, cwd=out)
    (out / f"{index}-pip.log").write_text(proc.stdout + proc.stderr)
    after = pip_list(python)
    write_list(out / f"{index}-before.txt", before)
    write_list(out / f"{index}-after.txt", after)
    added, broken = changes(before, after)
    torch_before, torch_after = before.get("torch", ("absent",))[0], after.get("torch", ("absent",))[0]
    print(f"install check {index}: {label}")
    print(f"  $ python -m {' '.join(shlex.quote(c) for c in command)}")
    print(f"  pip list: {len(before)} packages before, {len(after)} after; torch {torch_before} -> {torch_after}; "
          f"added: {', '.join(added) or 'nothing'}; changed or removed: {', '.join(broken) or 'nothing'}")
    problems = [f"{label}: {line}" for line in broken]
    if proc.returncode != 0:
        problems.append(f"{label}: pip exited {proc.returncode} (log: {out / f'{index}-pip.log'})")
    return problems


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="pip lists and logs (default: a new temporary folder)")
    args = p.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="install-check-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT / "src"))
    from lik_plugins import _install

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        python = make_env(work)
        source = work / "lik_plugins-source"
        shutil.copytree(ROOT, source, ignore=NOT_COPIED, symlinks=True)
        steps = [("pip install <this checkout> beside torch, PyLate and colpali-engine",
                  ["pip", "install", "--disable-pip-version-check", str(source)])]
        for host, command in (("PyLate", _install.PYLATE), ("colpali-engine", _install.COLPALI)):
            for n, part in enumerate(command.split("&&")):
                words = shlex.split(part)
                assert words[:2] == ["pip", "install"], part
                steps.append((f"README's {host} command, part {n + 1}", ["pip", "install", "--disable-pip-version-check",
                                                                        *words[2:]]))
        problems = []
        for index, (label, command) in enumerate(steps, 1):
            problems += run_step(python, label, command, out, index)
        imported = subprocess.run([str(python), "-c", "import lik_plugins, torch; print(lik_plugins.__file__); "
                                   "print(torch.__version__)"], capture_output=True, text=True, cwd=work)
        where, _, version = imported.stdout.strip().partition("\n")
        if imported.returncode != 0 or not where.startswith(str(work / "env")):
            problems.append(f"lik_plugins does not import from the new environment: {imported.stdout}{imported.stderr}")
        else:
            print(f"install check: lik_plugins imports from the new environment beside torch {version}")
    print(f"install check: pip lists and logs in {out}")
    for line in problems:
        print(f"CHANGED  {line}")
    verdict = (f"{len(steps)} pip installs left torch {version} and every other installed package untouched "
               f"(pip list before/after each)" if not problems else f"{len(problems)} problem(s)")
    print(f"install check: {verdict}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
