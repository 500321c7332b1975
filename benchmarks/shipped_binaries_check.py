"""The shipped kernel binaries on a GPU: first-call time, per-call host cost, correctness.

    python benchmarks/shipped_binaries_check.py OUT_DIR [--repeat 2000]

Three kinds of fresh process run the same host calls (the cases of
the CUDA cases of ``tests/kernels/test_shipped_binaries.py``: PyLate in-batch and KD, sentence-transformers,
the plain op, colpali in-batch / hard negatives / smooth max; bf16 and fp32; forward and
backward):

* ``shipped``    ``LIK_SHIPPED_BINARIES=1`` on an empty Triton cache;
* ``jit-cold``   the JIT on an empty cache (it compiles every variant);
* ``jit-warm``   the JIT on the cache ``jit-cold`` filled (disk-cache loads).

Per process: the wall of each variant's first launch (host time inside
``direct.launch``, with the time in each first-call phase: ``coldstart_profile.Phases``), the
whole first pass over the cases, a second pass; then the host cost of one launch, measured
on a launch-bound call repeated ``--repeat`` times (a small forward without autograd: the
time inside ``direct.launch`` per launch, and the call's own host time); the outputs, saved
and compared in the parent (shipped against each JIT process, all against fp64).  The
shipped binaries' manifest says which Triton built them; the JIT processes use the
installed one.  Writes ``shipped_binaries_check.json`` and prints one line per process and
the comparison.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODES = ("shipped", "jit-cold", "jit-warm")


def _cases():
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    sys.path.insert(0, os.path.join(ROOT, "tests", "kernels"))
    import test_shipped_binaries as cases

    return cases


def child(mode: str, out: str, repeat: int) -> None:
    import torch

    import lik_plugins as lik
    from lik_plugins.kernels.triton import binaries_loader, direct

    sys.path.insert(0, HERE)
    from coldstart_profile import Phases, _instrument, write_json

    torch.empty(1, device="cuda")
    phases = Phases()
    _instrument(phases)
    cases = _cases()
    os.environ["LIK_BACKEND"] = "triton"
    results, passes = {}, []
    for attempt in range(2):
        t = time.perf_counter()
        for name, fn, q_shape, d_shape in cases._cases():
            for dtype in (torch.bfloat16, torch.float32):
                g = torch.Generator(device="cuda").manual_seed(0)
                Q0 = torch.nn.functional.normalize(torch.randn(*q_shape, 128, device="cuda", generator=g),
                                                   dim=-1).to(dtype)
                D0 = torch.nn.functional.normalize(torch.randn(*d_shape, 128, device="cuda", generator=g),
                                                   dim=-1).to(dtype)
                dm = torch.rand(d_shape, device="cuda", generator=g) > 0.2
                qm = torch.rand(q_shape, device="cuda", generator=g) > 0.1
                out_, gq, gd, grad = cases._run(fn, Q0, D0, dm, qm)
                if attempt == 0:
                    results[f"{name}/{str(dtype)[6:]}"] = {"out": out_.cpu(), "gq": gq.cpu(), "gd": gd.cpu(),
                                                           "inputs": (Q0.cpu(), D0.cpu(), dm.cpu(), qm.cpu()),
                                                           "grad": grad.cpu()}
        torch.cuda.synchronize()
        passes.append(time.perf_counter() - t)
    first_launches = [r for r in phases.launches if r["first_of_variant"]]
    # per-call host cost: a launch-bound forward, its launches timed inside direct.launch
    Q = torch.randn(2, 8, 128, device="cuda", dtype=torch.bfloat16)
    D = torch.randn(4, 16, 128, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for _ in range(50):
            lik.maxsim(Q, D)
        torch.cuda.synchronize()
        n_before = len(phases.launches)
        for _ in range(repeat):
            lik.maxsim(Q, D)
        torch.cuda.synchronize()
        timed = phases.launches[n_before:]
        phases.unwrap_launch()                  # the call's own cost, without the timing wrapper
        t = time.perf_counter()
        for _ in range(repeat):
            lik.maxsim(Q, D)
        call_s = (time.perf_counter() - t) / repeat
        torch.cuda.synchronize()
    per_launch_us = sorted(r["wall_ms"] * 1e3 for r in timed)
    row = {
        "mode": mode, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "first_pass_s": passes[0], "second_pass_s": passes[1],
        "first_launches": first_launches,
        "first_launch_total_ms": round(sum(r["wall_ms"] for r in first_launches), 2),
        # time inside Triton's JIT, compiler and driver during first launches (shipped: none expected)
        "first_launch_triton_ms": round(sum(v for r in first_launches for k, v in r["phases"].items()
                                            if k.startswith("triton:")), 2),
        "jit_launches_first_pass": sum(1 for r in first_launches if any(k.startswith("triton:") for k in r["phases"])),
        "launch_host_us_median": per_launch_us[len(per_launch_us) // 2] if per_launch_us else None,
        "launches_per_call": len(timed) / repeat,
        "call_host_us": call_s * 1e6,
        "shipped": binaries_loader.diagnostics(),
        "variants_launched": len(direct._VARIANTS),
    }
    torch.save(results, os.path.join(out, f"outputs_{mode}.pt"))
    write_json(os.path.join(out, f"shipped_check_{mode}.json"), row)


def _compare(out: str, modes) -> dict:
    import torch

    cases = _cases()
    loaded = {m: torch.load(os.path.join(out, f"outputs_{m}.pt")) for m in modes
              if os.path.exists(os.path.join(out, f"outputs_{m}.pt"))}
    if "shipped" not in loaded:
        return {}
    report = {}
    for key, got in loaded["shipped"].items():
        name = key.split("/")[0]
        Q0, D0, dm, qm = got["inputs"]
        Qr, Dr = Q0.double().requires_grad_(), D0.double().requires_grad_()
        ref = cases._reference(name, Qr, Dr, dm, qm)
        ref.backward(got["grad"].double())
        row = {"vs_fp64": max(cases._rel(got[k], r) for k, r in (("out", ref.detach()), ("gq", Qr.grad),
                                                                   ("gd", Dr.grad)))}
        for mode, other in loaded.items():
            if mode != "shipped":
                row[f"vs_{mode}"] = max(cases._rel(got[k], other[key][k]) for k in ("out", "gq", "gd"))
                row[f"bitwise_{mode}"] = all(torch.equal(got[k], other[key][k]) for k in ("out", "gq", "gd"))
        report[key] = row
    return report


def stub_host_cost(repeat: int) -> dict:
    """Per-launch host cost of every shipped variant's ``ShippedKernel`` call, on the CPU:
    the driver is ``tests/kernels/fake_libcuda.c`` built with the C compiler (its
    ``cuLaunchKernel`` returns at once), so what is timed is the Python side -- packing the
    arguments and the foreign call -- with each variant's real parameter layout."""
    import ctypes
    import statistics
    import tempfile

    import torch

    from lik_plugins.kernels.triton import binaries_cuda as cuda
    from lik_plugins.kernels.triton import binaries_loader

    with tempfile.TemporaryDirectory() as tmp:
        so = os.path.join(tmp, "libcuda_stub.so")
        subprocess.run(["cc", "-shared", "-fPIC", "-O2", os.path.join(ROOT, "tests", "kernels", "fake_libcuda.c"),
                        "-o", so], check=True)
        driver = cuda.Driver(ctypes.CDLL(so))
    tensor = torch.zeros(16)
    per_kernel: dict = {}
    for manifest in binaries_loader.shipped_manifests().values():
        for entry in manifest["variants"].values():
            codes = entry["params"]
            args = tuple(tensor if c == cuda.POINTER else 1.5 if c == cuda.FLOAT32 else 1 if c == cuda.DROPPED else 7
                         for c in codes)
            kernel = cuda.ShippedKernel(entry["function"], driver, 0x3000, entry["num_warps"], entry["shared"],
                                        cuda.LaunchLayout(codes), 0)
            for _ in range(100):
                kernel((8, 1, 1), 0, args)
            t = time.perf_counter()
            for _ in range(repeat):
                kernel((8, 1, 1), 0, args)
            per_kernel.setdefault(entry["kernel"], []).append((time.perf_counter() - t) / repeat * 1e6)
    t = time.perf_counter()
    for _ in range(repeat):
        tensor.data_ptr()
    data_ptr_us = (time.perf_counter() - t) / repeat * 1e6
    return {"launch_us_median_per_kernel": {k: round(statistics.median(v), 2) for k, v in per_kernel.items()},
            "tensor_data_ptr_us": round(data_ptr_us, 3)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out", nargs="?")
    p.add_argument("--repeat", type=int, default=2000)
    p.add_argument("--stub-host-cost", action="store_true",
                   help="no GPU: time each shipped variant's launch call against a stand-in libcuda, print JSON")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.stub_host_cost:
        print(json.dumps(stub_host_cost(args.repeat), indent=1))
        return 0
    os.makedirs(args.out, exist_ok=True)
    if args.child:
        child(args.child, args.out, args.repeat)
        return 0
    from coldstart_profile import run_child, write_json

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH", "")]))
    caches = os.path.join(args.out, "caches")
    shutil.rmtree(caches, ignore_errors=True)
    summary = {"modes": {}}
    for mode in MODES:
        cache = os.path.join(caches, "shipped" if mode == "shipped" else "jit")
        os.makedirs(cache, exist_ok=True)
        child_env = dict(env, TRITON_CACHE_DIR=cache, LIK_SHIPPED_BINARIES="1" if mode == "shipped" else "0")
        row = summary["modes"][mode] = run_child(
            mode, [os.path.abspath(__file__), args.out, "--repeat", str(args.repeat), "--child", mode], child_env,
            os.path.join(args.out, f"shipped_check_{mode}.json"))
        if "error" in row:
            continue
        print(f"{mode}: first pass {row['first_pass_s']:.2f} s (first launches {row['first_launch_total_ms']:.0f} ms "
              f"over {len(row['first_launches'])} variants, {row['first_launch_triton_ms']:.0f} ms in Triton, "
              f"{row['jit_launches_first_pass']} through it), second pass {row['second_pass_s']:.3f} s; "
              f"launch {row['launch_host_us_median']:.1f} us host, call {row['call_host_us']:.1f} us; "
              f"shipped: {json.dumps(row['shipped']['devices'])}; process {row['process_s']:.1f} s")
    summary["correctness"] = _compare(args.out, MODES)
    worst = {k: max(r.get(k, 0) for r in summary["correctness"].values())
             for k in ("vs_fp64", "vs_jit-cold", "vs_jit-warm")} if summary["correctness"] else {}
    print(f"correctness (max relative error over the cases): {worst}; bitwise equal to jit-warm: "
          f"{sum(r.get('bitwise_jit-warm', False) for r in summary['correctness'].values())}"
          f"/{len(summary['correctness'])}")
    write_json(os.path.join(args.out, "shipped_binaries_check.json"), summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
