"""Host time of the launch-bound calls, piece by piece (and for the peers).

For each shape: wall-clock microseconds per call of back-to-back calls without a sync
(the GPU keeps up, so this is the host's cost), for the whole public call, our launcher,
the bare Triton launch with prepared arguments, one ``torch.empty``, and each peer; then a
cProfile of our call (top entries by own time) so the next change is aimed, not guessed.

Usage: python benchmarks/probe_host.py OUT_DIR
"""
from __future__ import annotations

import cProfile
import io
import json
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
import lik_plugins as lik  # noqa: E402
from lik_plugins.kernels.triton import launch  # noqa: E402
from lik_plugins import fp8  # noqa: E402

SHAPES = [("small 8x8 Lq32 Ld256", 8, 8, 32, 256), ("rerank 1x1000 Lq32 Ld300", 1, 1000, 32, 300)]


def host_us(fn, calls=300, repeats=7):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


def bare_launch(Q, D):
    """The Triton launch alone, with the arguments our launcher prepared: through the JIT
    (``kernel[grid](...)``) and straight into the compiled kernel's launcher."""
    from lik_plugins.kernels.triton import tuning

    seen = {}
    real = tuning.forward_kernel_and_meta

    def recording(**kw):
        kernel, meta, after = real(**kw)

        class Rec:
            def __getitem__(self, grid):
                def go(*args, **kwargs):
                    seen.update(kernel=kernel, grid=grid, args=args, kwargs=kwargs)
                    return kernel[grid](*args, **kwargs)
                return go
        return Rec(), meta, after

    launch.clear_plans()  # a cached forward plan would skip the tuner lookup recorded here
    tuning_fn, launch.forward_kernel_and_meta = launch.forward_kernel_and_meta, recording
    try:
        launch.forward(Q, D, None, None, cross=True, normalize=False, zero_mode=False, save_argmax=False)
    finally:
        launch.forward_kernel_and_meta = tuning_fn
        launch.clear_plans()  # the plan just made holds the recording stand-in, not the kernel
    kernel, grid, args, kwargs = seen["kernel"], seen["grid"], seen["args"], seen["kwargs"]
    out = {"jit launch": host_us(lambda: kernel[grid](*args, **kwargs))}
    try:
        compiled = kernel[grid](*args, **kwargs)
        stream = torch.cuda.current_stream().cuda_stream
        names = list(kernel.arg_names)
        full = dict(zip(names, args))
        full.update({k: v for k, v in kwargs.items() if k in names})
        values = [full[n] for n in names]
        out["compiled.run"] = host_us(lambda: compiled.run(grid[0], 1, 1, stream, compiled.function,
                                                           compiled.packed_metadata, None, None, None, *values))
    except Exception as exc:  # noqa: BLE001 - the launcher's calling convention differs by Triton release
        out["compiled.run"] = f"{type(exc).__name__}: {exc}"[:200]
    return out


def peers():
    out = {}
    try:
        import late_interaction_kernels as m

        out["late-interaction-kernels"] = m.maxsim
    except ImportError:
        pass
    try:
        import flash_maxsim as f

        out["flash-maxsim"] = lambda Q, D: f.flash_maxsim_batched(Q, D, shared_docs=True)
    except ImportError:
        pass
    return out


def profile(fn, calls: int, sort: str, lines: int) -> str:
    """cProfile of ``calls`` calls of ``fn``, the top ``lines`` entries by ``sort``."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats(sort).print_stats(lines)
    return out.getvalue()


def train_step(fn, Q, D, g):
    Q.grad = D.grad = None
    fn(Q, D).backward(g)


def main(out_dir):
    rows, profiles = [], []
    for name, nq, nd, lq, ld in SHAPES:
        Q = torch.randn(nq, lq, 128, device="cuda", dtype=torch.bfloat16)
        D = torch.randn(nd, ld, 128, device="cuda", dtype=torch.bfloat16)
        row = {"shape": name}
        with torch.no_grad():
            row["lik_plugins maxsim"] = host_us(lambda: lik.maxsim(Q, D))
            row["launch.forward"] = host_us(lambda: launch.forward(Q, D, None, None, cross=True, normalize=False,
                                                                   zero_mode=False, save_argmax=False))
            row.update(bare_launch(Q, D))
            index = lik.quantize_fp8(D)   # the fp8 path as the benchmark runs it: index once, query per call
            row["lik_plugins maxsim_fp8"] = host_us(lambda: lik.maxsim_fp8(Q, index))
            row["quantize_fp8 (query)"] = host_us(lambda: lik.quantize_fp8(Q))
            row["torch.empty"] = host_us(lambda: torch.empty((nq, nd), device="cuda"))
            for peer, fn in peers().items():
                row[peer] = host_us(lambda: fn(Q, D))  # noqa: B023
            profiles.append(f"## {name}: lik.maxsim x500, by own time\n"
                            + profile(lambda: lik.maxsim(Q, D), 500, "tottime", 25))
            row["fp8 query quantisation alone"] = host_us(lambda: fp8._quantize(Q))
            profiles.append(f"## {name}: lik.maxsim_fp8 x500, by cumulative time\n"
                            + profile(lambda: lik.maxsim_fp8(Q, index), 500, "cumulative", 30))
        if nq * nd <= 64:
            Qg, Dg = Q.clone().requires_grad_(), D.clone().requires_grad_()
            g = torch.randn(nq, nd, device="cuda")
            row["train lik_plugins"] = host_us(lambda: train_step(lik.maxsim, Qg, Dg, g), calls=100)
            for peer, fn in peers().items():
                if peer == "flash-maxsim":
                    import flash_maxsim as f

                    fn = lambda Q, D: f.flash_maxsim_batched_train(Q, D, shared_docs=True)  # noqa: E731
                row[f"train {peer}"] = host_us(lambda: train_step(fn, Qg, Dg, g), calls=100)  # noqa: B023
            profiles.append(f"## {name}: train step x200, by own time\n"
                            + profile(lambda: train_step(lik.maxsim, Qg, Dg, g), 200, "tottime", 25))
        rows.append(row)
        print(json.dumps(row), flush=True)
    import triton

    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "command": " ".join(sys.argv)}
    with open(f"{out_dir}/probe_host.json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(f"{out_dir}/probe_host_profile.txt", "w") as f:
        f.write("\n".join(profiles))


if __name__ == "__main__":
    main(sys.argv[1])
