"""Self-test of the Metal kernels on a Mac: ``python -m lik_plugins.kernels.metal.selftest``.

**This has never been run**: the package is developed without Apple hardware (off-Mac, CI
compiles the same shader source as C++ with the repository's ``tools/metal_emulator``).
The first Mac user who runs it confirms -- or reports -- that the real Metal compiler
accepts the source and that the GPU gives the reference's numbers.

What it does on an Apple GPU (MPS):

1. correctness: every case of :func:`.checks.default_cases` in fp32 / fp16 / bf16 through
   the Metal launchers on MPS, compared with the float64 reference on the CPU (the checks
   and tolerances CI's emulator applies);
2. timing: forward and forward+backward of a few realistic shapes, Metal vs the chunked
   PyTorch path (on MPS) vs eager PyTorch (the reference einsum formulation on MPS, with
   autograd), median of repeated runs, as a table of milliseconds and ratios.  The
   expectation -- not a claim -- is that Metal beats eager PyTorch.

Options: ``--quick`` (fewer cases and repeats), ``--out DIR`` (also write
``metal_selftest.json`` and ``metal_selftest.md`` there).  Exit status: 0 all correct,
1 a mismatch or a kernel failure, 2 no usable MPS device (nothing run).

The output starts with the machine (chip, macOS, torch) and ends by asking for a report:
a GitHub issue titled ``Metal self-test: <chip>`` with the whole output pasted (``--help``
shows a sample of it).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from . import checks, launch

# (name, layout, Nq, Lq, NJ, Ld, d)
TIMING_SHAPES = [
    ("colbert in-batch", "cross", 32, 32, 32, 180, 128),
    ("search 16 x 1024 docs", "cross", 16, 32, 1024, 180, 128),
    ("hard negatives 32 x 8", "candidates", 32, 32, 8, 180, 128),
    ("colpali in-batch", "cross", 16, 20, 16, 1030, 128),
]


def unavailable_reason() -> str | None:
    """Why the self-test cannot run here, or ``None``."""
    if not hasattr(torch.backends, "mps") or not torch.backends.mps.is_available():
        return "no Apple GPU: torch.backends.mps.is_available() is False on this machine"
    if not hasattr(torch.mps, "compile_shader"):
        return f"torch {torch.__version__} has no torch.mps.compile_shader (torch 2.6 or newer has it)"
    return None


def _median_ms(fn, repeats: int) -> float:
    fn()   # warm-up (and compile)
    torch.mps.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.mps.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _timing_row(name, layout, nq, lq, nj, ld, dim, dtype, repeats):
    from .. import chunked, reference

    cross = layout == "cross"
    dev = torch.device("mps")
    Q = torch.randn(nq, lq, dim, device=dev, dtype=dtype)
    D = torch.randn(*((nj, ld, dim) if cross else (nq, nj, ld, dim)), device=dev, dtype=dtype)
    grad = torch.randn(nq, nj, device=dev)
    kw = dict(cross=cross, normalize=False, zero_mode=False)

    def forward_of(path):     # path: the launch module or chunked (same signatures)
        return lambda: path.forward(Q, D, None, None, save_argmax=False, **kw)

    def train_of(path):
        def train():
            _, arg = path.forward(Q, D, None, None, save_argmax=True, **kw)
            path.backward(grad, Q, D, arg, cross=cross, normalize=False, need_q=True, need_d=True)
        return train

    def eager_fwd():
        with torch.no_grad():
            return reference.maxsim(Q, D)

    def eager_train():
        q, d = Q.detach().requires_grad_(), D.detach().requires_grad_()
        reference.maxsim(q, d).float().backward(grad)

    row = {"shape": name, "dtype": str(dtype).replace("torch.", "")}
    for label, fn in (("metal_fwd", forward_of(launch)), ("chunked_fwd", forward_of(chunked)), ("eager_fwd", eager_fwd),
                      ("metal_train", train_of(launch)), ("chunked_train", train_of(chunked)),
                      ("eager_train", eager_train)):
        try:
            row[label] = _median_ms(fn, repeats)
        except Exception as exc:  # e.g. eager runs out of memory: report, keep going
            row[label] = None
            row[f"{label}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return row


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def _ratio(a, b) -> str:
    return "-" if a is None or b is None or a == 0 else f"{b / a:.2f}x"


def timing_table(rows: list[dict]) -> str:
    head = ("| shape | dtype | metal fwd ms | chunked | eager | eager/metal | metal fwd+bwd ms | chunked | eager | eager/metal |\n"
            "|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['dtype']} | {_fmt(r['metal_fwd'])} | {_fmt(r['chunked_fwd'])} | {_fmt(r['eager_fwd'])} "
            f"| {_ratio(r['metal_fwd'], r['eager_fwd'])} | {_fmt(r['metal_train'])} | {_fmt(r['chunked_train'])} "
            f"| {_fmt(r['eager_train'])} | {_ratio(r['metal_train'], r['eager_train'])} |"
        )
    return "\n".join(lines)


def environment() -> dict:
    """The machine a report comes from."""
    from ... import __version__

    chip = platform.machine()
    if platform.system() == "Darwin":
        probe = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True)
        chip = probe.stdout.strip() or chip
    return {"chip": chip, "macos": platform.mac_ver()[0] or "-", "torch": torch.__version__,
            "python": platform.python_version(), "lik_plugins": __version__}


def heading(env: dict) -> str:
    return (f"lik_plugins Metal self-test: {env['chip']}, macOS {env['macos']}, torch {env['torch']}, "
            f"Python {env['python']}, lik_plugins {env['lik_plugins']}")


def correctness_section(results: list) -> str:
    return "correctness on MPS (errors relative to max(1, |reference|)):\n" + checks.report(results)


def timing_section(rows: list[dict]) -> str:
    return "\ntiming (median ms; ratio > 1 means Metal is faster):\n" + timing_table(rows)


def closing(env: dict, results: list) -> str:
    failed = sum(not r.ok for r in results)
    return (f"\n{len(results) - failed}/{len(results)} correctness cases passed\n\n"
            f"Please report this run, passed or failed: open an issue in the lik_plugins GitHub repository titled\n"
            f'"Metal self-test: {env["chip"]}" and paste this whole output, from its first line to this one,\n'
            f"in a code block (with --out DIR, attach metal_selftest.md and metal_selftest.json too).")


def sample_output() -> str:
    """A run's output as the sections above print it, with placeholder numbers (no Mac has
    run this yet): what ``--help`` shows."""
    env = {"chip": "Apple M2", "macos": "14.5", "torch": "2.6.0", "python": "3.12.4", "lik_plugins": "0.1.0"}
    cases = checks.default_cases(quick=True)[:2]
    results = [checks.Result(case, torch.float32, {"scores": 1e-7, "grad_q": 2e-7, "grad_d": 2e-7, "argmax": 0}, [])
               for case in cases]
    row = {"shape": TIMING_SHAPES[0][0], "dtype": "float16", "metal_fwd": 0.5, "chunked_fwd": 1.5, "eager_fwd": 1.0,
           "metal_train": 1.0, "chunked_train": 3.0, "eager_train": 2.0}
    correctness = correctness_section(results).replace("\n\nkernel", "\n[... every case in fp32, fp16 and bf16 ...]"
                                                                     "\n\nkernel")
    return "\n".join([heading(env), correctness,
                      timing_section([row]) + "\n[... one row per shape and dtype ...]", closing(env, results)])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lik_plugins.kernels.metal.selftest", description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="sample output (the layout only: the numbers are placeholders, not measurements):\n\n"
               + sample_output())
    parser.add_argument("--quick", action="store_true", help="fewer cases and repeats")
    parser.add_argument("--out", help="also write metal_selftest.json / .md into this folder")
    args = parser.parse_args(argv)

    reason = unavailable_reason()
    if reason is not None:
        print(f"lik_plugins Metal self-test: {reason}; nothing was run (it needs a Mac with an Apple GPU; "
              f"--help shows what a run prints and how to report it).")
        return 2

    env = environment()
    print(heading(env), flush=True)
    results = []
    for dtype in checks.DTYPES.values():
        for case in checks.default_cases(args.quick):
            try:
                errors = checks.check(case, dtype, "mps")
                failure = checks.judge(errors, dtype)
            except Exception as exc:  # compile error, device fault: report per case
                errors, failure = {}, f"{type(exc).__name__}: {str(exc)[:2000]}"
            results.append(checks.Result(case, dtype, errors, [], failure))
    print(correctness_section(results), flush=True)

    repeats = 3 if args.quick else 10
    rows = [_timing_row(*shape, dtype, repeats)
            for dtype in (torch.float16, torch.float32) for shape in TIMING_SHAPES[: 2 if args.quick else None]]
    print(timing_section(rows))
    print(closing(env, results))

    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        correctness = [{"case": r.case.name, "dtype": checks.dtype_name(r.dtype), "errors": r.errors,
                        "failure": r.failure} for r in results]
        payload = {**env, "correctness": correctness, "timing": rows}
        (out / "metal_selftest.json").write_text(json.dumps(payload, indent=2))
        markdown = "\n\n".join([heading(env), checks.report(results), timing_table(rows)])
        (out / "metal_selftest.md").write_text(markdown + "\n")
    return 1 if any(not r.ok for r in results) else 0

if __name__ == "__main__":
    sys.exit(main())
