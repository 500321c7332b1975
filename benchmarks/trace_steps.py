"""Where a training step's time goes on the small shapes: GPU kernels versus host.

For each shape and implementation: the event-timed step (as bench_kernels.py measures it),
the host's wall time per step when the GPU never waits (host throughput), and the sum of
the step's kernel times from the profiler, with the kernels listed.  A cProfile of our
own step shows which Python lines the host time is spent in.

Usage: python benchmarks/trace_steps.py OUT_JSON [--only kd,pairs]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
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
    args = ap.parse_args()
    impls = implementations()
    impls.pop("eager", None)
    report = []
    for shape in SHAPES:
        if shape.kind != "train" or not any(p in shape.name for p in args.only.split(",")):
            continue
        Q, D = make_inputs(shape)
        Q.requires_grad_(); D.requires_grad_()
        with torch.no_grad():
            g = torch.randn_like(impls["lik_plugins"](Q, D, shape.layout).float())
        for name, impl in impls.items():
            step = step_fn(impl, shape.layout, Q, D, g)
            row = {"shape": shape.name, "impl": name, "event_ms": event_ms(step, reps=50), "host_us": host_us(step)}
            ks = kernels(step)
            row["kernel_us"] = sum(k[2] for k in ks)
            row["kernels"] = ks
            report.append(row)
            print(f"{shape.name:26s} {name:26s} event {row['event_ms']*1e3:7.1f} us  host {row['host_us']:7.1f} us"
                  f"  kernels {row['kernel_us']:7.1f} us", flush=True)
            for k in ks[:8]:
                print(f"      {k[1]:4.1f}x {k[2]:8.1f} us  {k[0]}")
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
