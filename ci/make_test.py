"""``make test``: every part CI runs, each with its output streamed as it comes, then one
summary a reader takes in at a glance -- the skipped tests with their reasons, one line per
part (passed / failed, with its counts), and the verdict.

Parts (each fails ``make test`` on its own; every part runs even after one fails, so the
summary covers them all):

1. the suite in .venv (the kernels under Triton's CPU interpreter, PyLate 1.6, colpali-engine 0.3.18);
2. the Metal kernels' shader source under the C++ emulator, every kernel;
3. sentence-transformers 6.0, 6.2 and 6.3, each in its own environment (they cannot sit beside PyLate's pinned 5.3);
4. the hosts' own test suites, unpatched / patched / kill switch, compared test for test;
5. ``pip install`` of this checkout into an environment with torch and the hosts leaves them untouched,
   and ``python -m build``'s sdist and wheel each install in a fresh environment and pass a CPU smoke test;
6. the real fast-plaid (1.7.0 installed, 1.4.6 beside it) in an environment with the torch its wheels pin:
   indexes it creates, searched by itself and then patched.

A pytest part that collects no tests (exit code 5) fails.

    python ci/make_test.py                 # all parts (what make test runs)
    python ci/make_test.py --parts 1,5     # some of them
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTEST_TOTALS = re.compile(r"^=*\s*((?:\d+ [a-z]+(?:, )?)+) in [0-9.]+s")
PYTEST_COUNT = re.compile(r"(\d+) ([a-z]+)")


@dataclass
class Part:
    label: str
    command: list[str]
    kind: str                       # "pytest", "metal", "hosts", "install": how its output is summarised
    env: dict = field(default_factory=dict)


@dataclass
class Outcome:
    part: Part
    returncode: int
    seconds: float
    lines: list[str]


def parts(python: str) -> list[Part]:
    return [
        Part("test suite (.venv)", [python, "-m", "pytest", "-q", "-rs", "tests"], "pytest", {"TRITON_INTERPRET": "1"}),
        Part("Metal kernels, C++ emulator", [python, "tools/metal_emulator/emulate.py"], "metal"),
        Part("sentence-transformers 6.x", ["bash", "ci/st6_env.sh"], "pytest"),
        Part("hosts' own test suites", [python, "ci/host_suites.py"], "hosts"),
        Part("install beside torch", [python, "ci/install_keeps_torch.py"], "install"),
        Part("fast-plaid 1.4.6 and 1.7.0", ["bash", "ci/fastplaid_env.sh"], "pytest"),
    ]


def run(part: Part) -> Outcome:
    """Run one part, its output streamed through and kept."""
    started = time.perf_counter()
    proc = subprocess.Popen(part.command, cwd=ROOT, env={**os.environ, **part.env}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)
    lines = []
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        lines.append(line.rstrip("\n"))
    return Outcome(part, proc.wait(), time.perf_counter() - started, lines)


def pytest_counts(lines: list[str]) -> dict[str, int]:
    """pytest's closing totals (``12 passed, 3 skipped, 1 warning in 4.2s``) as a dict."""
    for line in reversed(lines):
        m = PYTEST_TOTALS.match(line.strip())
        if m:
            counts = {}
            for n, what in PYTEST_COUNT.findall(m.group(1)):
                what = {"error": "errors", "warning": "warnings"}.get(what, what)
                counts[what] = counts.get(what, 0) + int(n)
            return counts
    return {}


SKIP_LINE = re.compile(r"^SKIPPED \[(\d+)\] ([^:]+):\d+: (.*)$")


def skips_by_reason(lines: list[str]) -> dict[str, tuple[int, list[str]]]:
    """The ``-rs`` report (``SKIPPED [n] file:line: reason``) grouped: reason -> (tests, files)."""
    grouped: dict[str, tuple[int, list[str]]] = {}
    for line in lines:
        m = SKIP_LINE.match(line.strip())
        if m:
            n, files = grouped.get(m.group(3), (0, []))
            grouped[m.group(3)] = (n + int(m.group(1)), files + [m.group(2)] * (m.group(2) not in files))
    return grouped


def passed(outcome: Outcome) -> bool:
    if outcome.returncode != 0:
        return False
    return outcome.part.kind != "pytest" or pytest_counts(outcome.lines).get("passed", 0) > 0


def detail(outcome: Outcome) -> list[str]:
    """What a part's summary line says after passed / FAILED, and any lines under it."""
    kind, lines = outcome.part.kind, outcome.lines
    if kind == "pytest":
        counts = pytest_counts(lines)
        if outcome.returncode == 5 or not counts:
            return ["pytest collected no tests (exit code 5)" if outcome.returncode == 5
                    else f"no pytest totals (exit code {outcome.returncode})"]
        shown = [f"{counts.pop(k)} {k}" for k in ("passed", "failed", "errors", "skipped") if k in counts]
        counts.pop("warnings", None)
        return [", ".join(shown + [f"{n} {k}" for k, n in counts.items()])]
    if kind == "metal":
        done = [line for line in lines if re.fullmatch(r"\d+/\d+ cases passed", line.strip())]
        never = [line.strip() for line in lines if line.startswith("kernels never launched")]
        return [(done[-1].strip() if done else f"no result (exit code {outcome.returncode})")
                + " against the float64 reference"] + never
    if kind == "hosts":
        picked = [line[len("host suites: "):] for line in lines if line.startswith("host suites: ")]
        return picked or [f"no result (exit code {outcome.returncode})"]
    if kind == "install":
        picked = [line[len("install check: "):] for line in lines if line.startswith("install check: ")]
        changed = [line for line in lines if line.startswith("CHANGED")]
        return (picked[-1:] or [f"no result (exit code {outcome.returncode})"]) + changed
    raise ValueError(kind)


def summary(outcomes: list[Outcome], seconds: float, numbers=None) -> list[str]:
    """``numbers``: each outcome's part number (default 1, 2, ...)."""
    out = ["", "=" * 30 + " make test: summary " + "=" * 30]
    for o in outcomes:
        grouped = skips_by_reason(o.lines) if o.part.kind == "pytest" else {}
        if grouped:
            out.append(f"skipped in {o.part.label}, by reason (tests, reason, files):")
            for reason, (n, files) in sorted(grouped.items(), key=lambda item: -item[1][0]):
                shown = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
                out.append(f"  {n:5d}  {reason}  ({shown})")
            out.append("")
    for n, o in zip(numbers or range(1, len(outcomes) + 1), outcomes):
        first, *rest = detail(o)
        verdict = "passed" if passed(o) else f"FAILED (exit code {o.returncode})"
        out.append(f"{n}. {o.part.label:<28} {verdict}: {first}  [{o.seconds:.0f} s]")
        out += [f"   {' ' * 28} {line}" for line in rest]
    failed = [o.part.label for o in outcomes if not passed(o)]
    out.append(f"make test: {'all ' + str(len(outcomes)) + ' parts passed' if not failed else 'FAILED: ' + ', '.join(failed)}"
               f" in {seconds:.0f} s")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default=None, help="comma list of part numbers (default: all)")
    p.add_argument("--python", default=sys.executable)
    args = p.parse_args(argv)
    every = parts(args.python)
    numbers = [int(n) for n in args.parts.split(",")] if args.parts else range(1, len(every) + 1)
    started = time.perf_counter()
    outcomes = []
    for n in numbers:
        part = every[n - 1]
        print(f"\n----- make test, part {n} of {len(every)}: {part.label}: {' '.join(part.command)}", flush=True)
        outcomes.append(run(part))
    print("\n".join(summary(outcomes, time.perf_counter() - started, numbers)))
    return 0 if all(passed(o) for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
