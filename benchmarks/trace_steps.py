"""Where a training step's time goes on the small shapes: GPU kernels versus host.

For each shape and implementation: the event-timed step (as bench_kernels.py measures it),
the host's wall time per step when the GPU never waits (host throughput), and the sum of
the step's kernel times from the profiler, with the kernels listed.  A cProfile of our
own step shows which Python lines the host time is spent in.

Every variant is timed in ``--rounds`` interleaved rounds (the device machine's host
drifts between and within calls; interleaving puts the drift on every variant alike).
``lik_plugins (replan)`` is ours with the lowmem backward plans cleared before each step
(the backward's host path before they existed), and ``--cpu-ops`` adds the profiler's
CPU-side op table of one step (ours and each peer): what the host time is made of.

Usage: python benchmarks/trace_steps.py OUT_JSON [--only kd,pairs] [--rounds 3] [--cpu-ops]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")
from bench_kernels import SHAPES, implementations, make_inputs  # noqa: E402
from profile_parts import timed as event_ms  # noqa: E402  (CUDA-event median of back-to-back calls)


def step_fn(impl, layout, Q, D, g):
    def step():
        Q.grad = D.grad = None
        out = impl(Q, D, layout)
        out.backward(g)
    return step


def replanning(impl):
    from lik_plugins.kernels.triton import launch

    def run(Q, D, layout):
        launch._LOWMEM_PLANS.clear()
        return impl(Q, D, layout)
    return run


def _nothing_kernel():
    # module-level names: Triton resolves a kernel's globals in its module
    global triton, tl
    import triton
    import triton.language as tl

    @triton.jit
    def nothing(x_ptr, n, FLAG: tl.constexpr):
        pass
    return nothing


def floor_impl():
    """The host floor of a step like ours: an autograd Function that allocates what ours
    allocates (scores and argmax; grad_Q, the row lists, grad_D) and makes one direct
    launch each way, of a kernel that does nothing -- no validation, routing or planning.
    What ours takes above it is our Python."""
    from lik_plugins.kernels.triton.direct import launch

    nothing = _nothing_kernel()
    class Floor(torch.autograd.Function):
        @staticmethod
        def forward(ctx, Q, D):
            scores = torch.empty((Q.shape[0], D.shape[-3]), dtype=torch.float32, device=Q.device)
            argmax = torch.empty((Q.shape[0], D.shape[-3], Q.shape[1]), dtype=torch.int16, device=Q.device)
            launch(nothing, (1,), (scores, 1), {"FLAG": True}, static_key=("floor", 0), caller_tensors=())
            ctx.save_for_backward(Q, D, argmax)
            return scores

        @staticmethod
        def backward(ctx, grad):
            Q, D, argmax = ctx.saved_tensors
            grad_q = torch.empty_like(Q)
            rows = torch.empty(argmax.shape, dtype=torch.int16, device=Q.device)
            grad_d = torch.empty_like(D)
            launch(nothing, (1,), (grad_d, 1), {"FLAG": False}, static_key=("floor", 1), caller_tensors=())
            del rows
            return grad_q, grad_d

    def run(Q, D, layout):
        if layout != "cross":
            raise NotImplementedError("the floor is written for the cross product")
        return Floor.apply(Q, D)
    return run


def cpu_ops(step, reps=10, top=14):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    rows = [(e.key[:60], e.count / reps, e.self_cpu_time_total / reps) for e in prof.key_averages()]
    rows.sort(key=lambda r: -r[2])
    return rows[:top]


def host_us(step, reps=50):
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        step()
    host = (time.perf_counter() - t) / reps * 1e6
    torch.cuda.synchronize()
    return host


def kernels(step, reps=10):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if t > 0:
            rows.append((e.key[:70], e.count / reps, t / reps))
    rows.sort(key=lambda r: -r[2])
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--only", default="kd 64,pairs,colpali in-batch 64,colbert in-batch 256,hard-neg")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cpu-ops", action="store_true")
    args = ap.parse_args()
    impls = {name: impl for name, impl in implementations().items() if name not in ("eager", "lik_plugins fp8")}
    impls["lik_plugins (replan)"] = replanning(impls["lik_plugins"])
    impls["floor (autograd Function)"] = floor_impl()
    report = []
    for shape in SHAPES:
        if shape.kind != "train" or not any(p in shape.name for p in args.only.split(",")):
            continue
        Q, D = make_inputs(shape)
        Q.requires_grad_(); D.requires_grad_()
        with torch.no_grad():
            g = torch.randn_like(impls["lik_plugins"](Q, D, shape.layout).float())
        steps = {name: step_fn(impl, shape.layout, Q, D, g) for name, impl in impls.items()
                 if shape.layout == "cross" or not name.startswith("floor")}
        rounds = {name: [] for name in steps}
        for _ in range(args.rounds):
            for name, step in steps.items():
                rounds[name].append((event_ms(step, reps=50), host_us(step)))
        for name, step in steps.items():
            events, hosts = zip(*rounds[name])
            row = {"shape": shape.name, "impl": name, "event_ms": statistics.median(events),
                   "event_ms_rounds": events, "host_us": statistics.median(hosts), "host_us_rounds": hosts}
            ks = kernels(step)
            row["kernel_us"] = sum(k[2] for k in ks)
            row["kernels"] = ks
            report.append(row)
            print(f"{shape.name:26s} {name:26s} event {row['event_ms']*1e3:7.1f} us "
                  f"({', '.join(f'{e*1e3:.0f}' for e in events)})  host {row['host_us']:7.1f} us"
                  f"  kernels {row['kernel_us']:7.1f} us", flush=True)
            for k in ks[:8]:
                print(f"      {k[1]:4.1f}x {k[2]:8.1f} us  {k[0]}")
            if args.cpu_ops and name in ("lik_plugins", "flash-maxsim", "late-interaction-kernels"):
                row["cpu_ops"] = cpu_ops(step)
                for k in row["cpu_ops"]:
                    print(f"      cpu {k[1]:4.1f}x {k[2]:8.1f} us  {k[0]}")
            if name == "lik_plugins":
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(50):
                    step()
                pr.disable()
                torch.cuda.synchronize()
                s = io.StringIO()
                pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
                row["cprofile"] = s.getvalue()
                print("\n".join(s.getvalue().splitlines()[:40]))
    from lik_plugins.kernels.triton import tuning

    chosen = {repr(k): v for k, v in tuning._chosen.items()}
    print("autotuned configs:", json.dumps(chosen, indent=1))
    with open(args.out, "w") as f:
        json.dump({"steps": report, "autotuned": chosen}, f, indent=1)


if __name__ == "__main__":
    main()
