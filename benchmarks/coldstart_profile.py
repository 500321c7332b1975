"""Where a fresh process's first kernel calls spend their time, even on a filled cache.

    python benchmarks/coldstart_profile.py OUT_DIR [--step ops|pylate] [--modes jit-precompiled,shipped,jit-cold]

The step is PyLate ``Contrastive`` at batch 128 (one hard negative: Q ``[128, 32, 128]``
against D ``[256, 300, 128]``, PyLate's multiplicative document mask), forward and backward:
``--step pylate`` runs PyLate itself on a random ColBERT (``pylate_e2e``, autocast bf16, as
``real_loop.py``); ``--step ops`` (default) the op call PyLate's adapter makes, in fp32 (the
dtype PyLate's normalised embeddings have under autocast) and then bf16.

First, in its own processes, ``python -m lik_plugins.precompile --hosts pylate --dtypes bf16
fp32 --dims 128`` fills a cache.  Then each mode is a fresh process that runs the step three
times:

* ``jit-precompiled``   a copy of that cache: Triton's JIT finds every binary on disk;
* ``jit-again``         the cache ``jit-precompiled`` left (what a second job on the node sees);
* ``shipped``           ``LIK_SHIPPED_BINARIES=1`` on an empty cache (the package's binaries);
* ``jit-cold``          an empty cache.

Per process: import times; each kernel launch of the first step (kernel, thread, host wall,
whether it was the variant's first launch) with the time spent inside it in each phase of
a first call -- Triton's source hashing (``JITFunction.cache_key``), binder creation, the
compile call (a disk-cache lookup and load, or a build), ``ptxas --version``, the driver's
utility module, the C launcher module (built with the C compiler or loaded from the cache),
the cubin load (``_init_handles``), our driver-launch self-check, the shipped-binary lookup and
load; the cache's files before and after (a file added on a filled cache is something the
precompile did not build); cProfile's top entries by cumulative time over the first step;
the second and third steps' walls.  Writes ``coldstart_profile.json`` (and one JSON per
mode) and prints one summary line per mode.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BATCH, NEGATIVES, LQ, LD, DIM = 128, 1, 32, 300, 128
MODES = ("jit-precompiled", "jit-again", "shipped", "jit-cold")


# ----------------------------------------------------------------------------- timers
class Phases:
    """Wall time per (launch, phase): wrappers around the functions a first call runs."""

    def __init__(self):
        self.local = threading.local()
        self.launches: list = []
        self.outside: dict = {}             # phase -> seconds spent outside any launch
        self.t0 = time.perf_counter()

    def wrap(self, owner, attr: str, label: str) -> None:
        original = getattr(owner, attr, None) if owner is not None else None
        if original is None:
            return
        is_property = isinstance(original, property)
        inner = original.fget if is_property else original
        phases = self

        @functools.wraps(inner)
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                phases.add(label, time.perf_counter() - t)

        setattr(owner, attr, property(timed) if is_property else timed)

    def add(self, label: str, seconds: float) -> None:
        current = getattr(self.local, "launch", None)
        target = current["phases"] if current is not None else self.outside
        target[label] = target.get(label, 0.0) + seconds

    def wrap_launch(self, direct) -> None:
        from lik_plugins.kernels.triton import variants

        original = direct.launch
        seen: set = set()
        phases = self

        def launch(kernel, grid, args, meta, *rest, **kwargs):
            key = variants.variant(kernel, args, meta)
            record = {"kernel": variants.kernel_name(kernel), "thread": threading.current_thread().name,
                      "first_of_variant": key not in seen, "phases": {},
                      "at_s": round(time.perf_counter() - phases.t0, 4)}
            seen.add(key)
            outer, phases.local.launch = getattr(phases.local, "launch", None), record
            t = time.perf_counter()
            try:
                return original(kernel, grid, args, meta, *rest, **kwargs)
            finally:
                record["wall_ms"] = (time.perf_counter() - t) * 1e3
                record["phases"] = {k: round(v * 1e3, 3) for k, v in record["phases"].items()}
                phases.local.launch = outer
                phases.launches.append(record)

        # the launchers imported ``launch`` by name: rebind it where they hold it
        holders = [module for module in list(sys.modules.values())
                   if getattr(module, "__name__", "").startswith("lik_plugins.")
                   and getattr(module, "launch", None) is original]
        for module in holders:
            module.launch = launch

        def unwrap():
            for module in holders:
                module.launch = original

        self.unwrap_launch = unwrap


def _instrument(phases: Phases) -> None:
    import importlib

    def mod(name):
        try:
            return importlib.import_module(name)
        except Exception:
            return None

    jit, compiler_pkg, build = mod("triton.runtime.jit"), mod("triton.compiler"), mod("triton.runtime.build")
    nv_compiler, nv_driver = mod("triton.backends.nvidia.compiler"), mod("triton.backends.nvidia.driver")
    compiled_cls = getattr(mod("triton.compiler.compiler"), "CompiledKernel", None)
    phases.wrap(getattr(jit, "JITFunction", None), "cache_key", "triton: source hash (cache_key)")
    phases.wrap(getattr(jit, "JITFunction", None), "create_binder", "triton: create_binder")
    phases.wrap(compiler_pkg, "compile", "triton: compile() (disk-cache lookup + load, or a build)")
    phases.wrap(nv_compiler, "get_ptxas_version", "triton: ptxas --version")
    phases.wrap(getattr(nv_driver, "CudaUtils", None), "__init__", "triton: driver utils module (cuda_utils)")
    for owner in (build, nv_driver):
        phases.wrap(owner, "compile_module_from_src", "triton: C module (launcher/utils) build or load")
    phases.wrap(build, "_build", "triton: C compiler run")
    phases.wrap(compiled_cls, "_init_handles", "triton: _init_handles (cubin load + launcher)")
    import pkgutil

    import lik_plugins.kernels.triton as package
    from lik_plugins.kernels.triton import binaries_cuda, binaries_loader, direct, variants

    for info in pkgutil.iter_modules(package.__path__):     # every launcher holds ``launch`` by name
        importlib.import_module(f"{package.__name__}.{info.name}")

    phases.wrap(binaries_loader, "find", "lik: shipped lookup (+ load)")
    phases.wrap(binaries_loader, "_self_check", "lik: driver-launch self-check")
    phases.wrap(binaries_loader, "file_key", "lik: shipped source key")
    phases.wrap(binaries_cuda.Driver, "load", "lik: cuModuleLoadData + function setup")
    phases.wrap_launch(direct)


# ----------------------------------------------------------------------------- the step
def _ops_step(dtype):
    import torch

    import lik_plugins

    g = torch.Generator().manual_seed(0)
    nd = BATCH * (1 + NEGATIVES)
    Q0 = torch.nn.functional.normalize(torch.randn(BATCH, LQ, DIM, generator=g), dim=-1).to("cuda", dtype)
    D0 = torch.nn.functional.normalize(torch.randn(nd, LD, DIM, generator=g), dim=-1).to("cuda", dtype)
    dm = (torch.arange(LD)[None, :] < torch.randint(LD // 2, LD + 1, (nd, 1), generator=g)).to("cuda")
    target = torch.arange(BATCH, device="cuda")

    def step():
        Q, D = Q0.detach().requires_grad_(), D0.detach().requires_grad_()
        s = lik_plugins.maxsim(Q, D, None, dm, mask_mode="zero")
        torch.nn.functional.cross_entropy(s.float() / 0.05, target).backward()

    return step


def _pylate_step():
    import tempfile

    import torch

    sys.path.insert(0, HERE)
    import pylate_e2e

    import lik_plugins

    lik_plugins.patch_pylate()
    from pylate import losses

    with tempfile.TemporaryDirectory() as tmp:
        model = pylate_e2e.build_model(tmp)
    loss = losses.Contrastive(model=model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    feats = pylate_e2e.features(model, BATCH, seed=0)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pylate_e2e.train_step(loss, opt, feats)

    return step


def _cache_files(path: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)


def child(mode: str, step_kind: str, out: str) -> dict:
    import cProfile
    import io
    import pstats

    t = time.perf_counter()
    import torch
    t_torch = time.perf_counter() - t
    t = time.perf_counter()
    import triton  # noqa: F401  (its import is part of any Triton user's start)
    t_triton = time.perf_counter() - t
    t = time.perf_counter()
    import lik_plugins
    from lik_plugins.kernels.triton import binaries_loader
    t_lik = time.perf_counter() - t
    cache = os.environ["TRITON_CACHE_DIR"]
    before = _cache_files(cache)
    torch.cuda.init()
    torch.empty(1, device="cuda")             # the CUDA context: not a kernel's first-call cost
    phases = Phases()
    _instrument(phases)
    steps = [_pylate_step()] if step_kind == "pylate" else [_ops_step(torch.float32), _ops_step(torch.bfloat16)]

    def run():
        for s in steps:
            s()
        torch.cuda.synchronize()

    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.runcall(run)
    first = time.perf_counter() - t
    first_launches = list(phases.launches)
    again = []
    for _ in range(2):
        t = time.perf_counter()
        run()
        again.append(time.perf_counter() - t)
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("cumulative").print_stats(45)
    top = [[f"{os.path.basename(f)}:{line}({fn})", nc, round(tt, 4), round(ct, 4)]
           for (f, line, fn), (cc, nc, tt, ct, _) in stats.stats.items()]
    top.sort(key=lambda r: -r[3])
    after = _cache_files(cache)
    totals: dict = {}
    for launch in first_launches:
        for k, v in launch["phases"].items():
            totals[k] = round(totals.get(k, 0.0) + v, 3)
    row = {
        "mode": mode, "step": step_kind, "torch": torch.__version__, "triton": triton.__version__,
        "device": torch.cuda.get_device_name(),
        "import_s": {"torch": t_torch, "triton": t_triton, "lik_plugins": t_lik},
        "first_step_s": first, "next_steps_s": again,
        "first_step_launch_wall_ms": round(sum(r["wall_ms"] for r in first_launches), 3),
        "first_of_variant_wall_ms": round(sum(r["wall_ms"] for r in first_launches if r["first_of_variant"]), 3),
        "phase_totals_ms": dict(sorted(totals.items(), key=lambda kv: -kv[1])),
        "phases_outside_launches_ms": {k: round(v * 1e3, 3) for k, v in phases.outside.items()},
        "launches": [r for r in first_launches if r["first_of_variant"]],
        "launch_count_first_step": len(first_launches),
        "cache_files_before": len(before), "cache_files_added": sorted(set(after) - set(before)),
        "routing": lik_plugins.routing_counts(),
        "shipped": binaries_loader.diagnostics(),
        "cprofile_top_cumulative": top[:40],
    }
    write_json(os.path.join(out, f"coldstart_profile_{mode}.json"), row)
    with open(os.path.join(out, f"coldstart_profile_{mode}.txt"), "w") as f:
        f.write(text.getvalue())
    return row


def write_json(path: str, data: dict) -> None:
    """A result file as this script and ``shipped_binaries_check`` write theirs: indented, values
    JSON has no type for (dtypes, paths) as their strings."""
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=str)


# ----------------------------------------------------------------------------- the parent
def run_child(mode: str, argv: list, env: dict, path: str) -> dict:
    """One measuring process in a fresh interpreter (``python *argv``): the JSON it wrote at
    ``path`` with ``process_s`` (its wall time) added, or ``{"error": its stderr, "process_s"}``
    (the error also printed under ``mode``)."""
    t = time.perf_counter()
    run = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t
    if run.returncode != 0 or not os.path.exists(path):
        print(f"{mode}: FAILED\n{run.stderr[-2000:]}")
        return {"error": run.stderr[-3000:], "process_s": wall}
    with open(path) as f:
        row = json.load(f)
    row["process_s"] = wall
    return row


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--step", choices=("ops", "pylate"), default="ops")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.child:
        child(args.child, args.step, args.out)
        return 0
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH", "")]))
    env.pop("LIK_SHIPPED_BINARIES", None)
    caches = os.path.join(args.out, "caches")
    shutil.rmtree(caches, ignore_errors=True)
    filled = os.path.join(caches, "precompiled")
    t = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "lik_plugins.precompile", "--hosts", "pylate", "--dtypes", "bf16",
                           "fp32", "--dims", "128"], env=dict(env, TRITON_CACHE_DIR=filled), capture_output=True,
                          text=True)
    result = {"precompile_s": time.perf_counter() - t, "precompile_rc": done.returncode,
              "precompile_out": done.stdout[-500:] + done.stderr[-1500:], "modes": {}}
    for mode in args.modes.split(","):
        cache = os.path.join(caches, mode)
        if mode == "jit-precompiled":
            shutil.copytree(filled, cache)
        elif mode == "jit-again":
            cache = os.path.join(caches, "jit-precompiled")     # what the first process left there
        else:
            os.makedirs(cache, exist_ok=True)
        child_env = dict(env, TRITON_CACHE_DIR=cache)
        if mode == "shipped":
            child_env["LIK_SHIPPED_BINARIES"] = "1"
        row = result["modes"][mode] = run_child(
            mode, [os.path.abspath(__file__), args.out, "--step", args.step, "--child", mode], child_env,
            os.path.join(args.out, f"coldstart_profile_{mode}.json"))
        if "error" in row:
            continue
        top = ", ".join(f"{k} {v:.0f}" for k, v in list(row["phase_totals_ms"].items())[:4])
        print(f"{mode}: first step {row['first_step_s']:.3f} s, next {row['next_steps_s'][0]:.3f} s; "
              f"first launches {row['first_of_variant_wall_ms']:.0f} ms ({top}); "
              f"cache files added {len(row['cache_files_added'])}; process {row['process_s']:.1f} s")
    write_json(os.path.join(args.out, "coldstart_profile.json"), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
