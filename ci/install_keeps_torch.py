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
``--out`` and the differences printed.

Then the release artefacts: ``python -m build`` (``build`` from PyPI, in a venv of its own)
makes the sdist, and the wheel from that sdist; each goes with ``--no-deps`` into a fresh venv
that sees only torch, numpy and their dependencies (links again, nothing downloaded), where a
CPU smoke test imports the installed package, checks its version, its package data and the
start-up ``.pth``, and compares ``maxsim`` / ``retrieve`` with the reference.

Needs PyPI for ``build``, the builds' setuptools (and ninja, PyLate's one dependency CI's venv
lacks); nothing else is downloaded.

    python ci/install_keeps_torch.py [--out DIR] [--build-only]
"""
from __future__ import annotations

import argparse
import json
import os
import re
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


def runtime_site(target: Path, roots=("torch", "numpy")) -> Path:
    """A folder of links to the site-packages entries of ``roots`` and their dependencies (the
    markers evaluated here, extras left out): what ``pip install torch`` leaves a user."""
    from importlib import metadata

    from packaging.requirements import Requirement

    site = Path(sysconfig.get_paths()["purelib"])
    entries, seen, todo = set(), set(), list(roots)
    while todo:
        name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
        entries |= {f.parts[0] for f in dist.files or [] if f.parts and f.parts[0] != ".."}
    target.mkdir(parents=True)
    for entry in sorted(entries):
        if (site / entry).exists() and not entry.startswith(OWN):
            (target / entry).symlink_to(site / entry)
    return target


SMOKE = """
import importlib.resources, sys, sysconfig
from pathlib import Path
import torch
import lik_plugins
from lik_plugins.kernels import reference

want_version, env_root = sys.argv[1], Path(sys.argv[2]).resolve()
assert Path(lik_plugins.__file__).resolve().is_relative_to(env_root), lik_plugins.__file__
assert lik_plugins.__version__ == want_version, (lik_plugins.__version__, want_version)
data = importlib.resources.files("lik_plugins.kernels")
assert any(p.name.endswith(".metal") for p in (data / "metal" / "shaders").iterdir()), "no Metal shader source"
assert any(p.name.endswith(".json") for p in (data / "triton" / "configs").iterdir()), "no Triton config tables"
assert (Path(sysconfig.get_paths()["purelib"]) / "lik_plugins_autoactivate.pth").is_file(), "no start-up .pth"
torch.manual_seed(0)
Q, D = torch.randn(3, 5, 16), torch.randn(6, 7, 16)
mask = torch.rand(6, 7) > 0.3
mask[:, 0] = True
torch.testing.assert_close(lik_plugins.maxsim(Q, D, d_mask=mask), reference.maxsim(Q, D, None, mask))
scores, index = lik_plugins.retrieve(Q, D, top_k=2, d_mask=mask, chunk=4)
want_scores, want_index = reference.maxsim(Q, D, None, mask).topk(2, dim=1)
torch.testing.assert_close(scores, want_scores)
assert torch.equal(index, want_index)
routed = lik_plugins.routing_counts()
assert routed.get("maxsim") and routed.get("retrieve"), routed
print(f"smoke test passed: lik_plugins {lik_plugins.__version__} beside torch {torch.__version__}, {routed}")
"""


def pyproject_version() -> str:
    return re.search(r'^version\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)


def build_check(work: Path, source: Path, out: Path) -> list[str]:
    """``python -m build`` of ``source``: the sdist and the wheel built from it, each installed
    with ``--no-deps`` into a fresh venv beside torch and passing the CPU smoke test."""
    version, problems = pyproject_version(), []
    tools = work / "build-tools"
    dist = work / "dist"
    subprocess.run([sys.executable, "-m", "venv", str(tools)], check=True)
    steps = [([str(tools / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check", "build"],
              "pip install build"),
             ([str(tools / "bin" / "python"), "-m", "build", "--outdir", str(dist), str(source)], "python -m build")]
    for command, label in steps:
        proc = subprocess.run(command, capture_output=True, text=True, cwd=work)
        (out / f"build-{label.split()[-1]}.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            return [f"{label} exited {proc.returncode} (log: {out / f'build-{label.split()[-1]}.log'})"]
    artefacts = sorted(dist.iterdir())
    names = [a.name for a in artefacts]
    print(f"install check: python -m build made {', '.join(names)}")
    wanted = (f"lik_plugins-{version}.tar.gz", f"lik_plugins-{version}-py3-none-any.whl")
    problems += [f"python -m build made no {name}" for name in wanted if name not in names]
    site = runtime_site(work / "runtime-site")
    for artefact in (a for a in artefacts if a.name in wanted):
        env = work / f"fresh-{artefact.suffix.lstrip('.')}"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
        python = env / "bin" / "python"
        purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 check=True, capture_output=True, text=True).stdout.strip()
        (Path(purelib) / "_torch_only.pth").write_text(str(site) + "\n")
        install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                                  "--disable-pip-version-check", str(artefact)], capture_output=True, text=True, cwd=work)
        smoke = subprocess.run([str(python), "-c", SMOKE, version, str(env)], capture_output=True, text=True, cwd=work,
                               env={k: v for k, v in os.environ.items() if not k.startswith(("LIK_", "PYTHON"))})
        (out / f"smoke-{artefact.name}.log").write_text(install.stdout + install.stderr + smoke.stdout + smoke.stderr)
        if install.returncode != 0 or smoke.returncode != 0:
            problems.append(f"{artefact.name}: {'pip install' if install.returncode else 'the smoke test'} failed "
                            f"(log: {out / f'smoke-{artefact.name}.log'})")
        else:
            print(f"install check: {artefact.name} in a fresh environment: {smoke.stdout.strip()}")
    return problems


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
    p.add_argument("--build-only", action="store_true", help="only the python -m build check")
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
        if args.build_only:
            built = build_check(work, source, out)
            for line in built:
                print(f"CHANGED  {line}")
            print(f"install check: {f'{len(built)} problem(s)' if built else 'the sdist and the wheel pass'}")
            return 1 if built else 0
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
        problems += build_check(work, source, out)   # after the pip steps: the build writes into the source copy
    print(f"install check: pip lists and logs in {out}")
    for line in problems:
        print(f"CHANGED  {line}")
    verdict = (f"{len(steps)} pip installs left torch {version} and every other installed package untouched "
               f"(pip list before/after each); python -m build's sdist and wheel each install in a fresh "
               f"environment and pass the CPU smoke test" if not problems else f"{len(problems)} problem(s)")
    print(f"install check: {verdict}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
