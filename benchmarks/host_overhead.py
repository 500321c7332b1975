"""Where a memory-bound rerank call's time goes: host or GPU.

    python benchmarks/host_overhead.py OUT [--reps 200] [--profile]

For each call (bf16 ``maxsim`` and ``maxsim_int8`` on 1 query x 10k documents of 300 tokens,
the int8 query quantised inside the scoring kernel or by its own launch; a small 8 x 8
forward, and the same forward one layer down -- the op's implementation, as eager calls run
it, against the registered ``lik::maxsim_forward`` through the dispatcher, as a compiled
graph calls it; ``plaid_approx_score`` over the same 10k documents' codes), three numbers in
microseconds, medians over ``--reps`` calls:

* ``host``: wall time of the call with an empty GPU queue (a launch returns once queued,
  so this is the Python, checks and launch path -- unless something in it synchronises,
  and then it includes the GPU's time and says so);
* ``gpu``: CUDA events around the call, one call at a time (GPU work only when the host is
  faster; the launch gap otherwise);
* ``back_to_back``: wall time per call over ``reps`` calls in a row, one sync at the end --
  a serving loop's cost: ``max(host, gpu)`` when nothing synchronises.

``--profile`` writes ``OUT/host_profile.txt``: cProfile's top functions of each call.
Writes ``OUT/host_overhead.json`` and ``.md``.
"""
from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import lik_plugins as lik
from lik_plugins.autograd import dense as library
from lik_plugins.kernels import triton_ops as fp8


def _calls():
    g = torch.Generator(device="cpu").manual_seed(0)
    unit = lambda *s: F.normalize(torch.randn(*s, generator=g), dim=-1).cuda().bfloat16()  # noqa: E731
    D, Q = unit(10000, 300, 128), unit(1, 32, 128)
    index = lik.quantize_int8(D)
    Qs, Ds = unit(8, 32, 128), unit(8, 300, 128)
    centroid_scores = torch.randn(16384, 32, generator=g).cuda()
    codes = torch.randint(0, 16384, (10000, 300), generator=g, dtype=torch.int32).cuda()
    lengths = torch.full((10000,), 300, dtype=torch.int32).cuda()
    fused_limit = fp8.FUSED_QUANTISATION_ELEMENTS
    small = (Qs, Ds, None, None, library.CROSS, False, False, False, "", "auto", False, False)

    def with_limit(limit, fn):
        def call():
            fp8.FUSED_QUANTISATION_ELEMENTS = limit
            try:
                return fn()
            finally:
                fp8.FUSED_QUANTISATION_ELEMENTS = fused_limit
        return call

    return {
        "bf16 maxsim 1x10000 Ld300": lambda: lik.maxsim(Q, D),
        "int8 maxsim_int8 1x10000 Ld300 (default)": lambda: lik.maxsim_int8(Q, index),
        "int8 maxsim_int8, query quantised in the kernel": with_limit(1 << 40, lambda: lik.maxsim_int8(Q, index)),
        "int8 maxsim_int8, query quantised by its own launch": with_limit(0, lambda: lik.maxsim_int8(Q, index)),
        "bf16 maxsim 8x8 Ld300 (launch-bound)": lambda: lik.maxsim(Qs, Ds),
        "plaid_approx_score 1x10000 Ld300 C16384": lambda: lik.plaid_approx_score(centroid_scores, codes, lengths),
        # the same 8 x 8 forward one layer down: as an eager call runs it (the op's Python
        # implementation) and as a compiled graph does (the registered op, through the dispatcher)
        "lik::maxsim_forward 8x8, implementation (eager)": lambda: library.maxsim_forward(*small),
        "lik::maxsim_forward 8x8, registered op (compiled graphs)": lambda: library.maxsim_forward.op(*small),
    }


def _measure(fn, reps):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    host, gpu = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        gpu.append(start.elapsed_time(end) * 1e3)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    b2b = (time.perf_counter() - t0) / reps * 1e6
    return {"host_us": statistics.median(host), "host_p90_us": sorted(host)[int(0.9 * reps)],
            "gpu_us": statistics.median(gpu), "back_to_back_us": b2b}


def _profile(fn, reps) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(reps):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(18)
    return text.getvalue()


def main(out: str, reps: int, profile: bool) -> int:
    os.makedirs(out, exist_ok=True)
    rows, profiles = [], []
    with torch.no_grad():
        for name, fn in _calls().items():
            row = {"call": name, **_measure(fn, reps)}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if profile:
                profiles.append(f"## {name}\n{_profile(fn, reps)}")
    device = torch.cuda.get_device_name()
    meta = {"device": device, "torch": torch.__version__, "command": " ".join(["python", *sys.argv]), "rows": rows}
    with open(os.path.join(out, "host_overhead.json"), "w") as f:
        json.dump(meta, f, indent=1)
    lines = [f"# Host against GPU time per call -- {device}", "", f"Command: `{meta['command']}`", "",
             "| call | host us (p90) | gpu us | back to back us |", "|---|---|---|---|"]
    lines += [f"| {r['call']} | {r['host_us']:.0f} ({r['host_p90_us']:.0f}) | {r['gpu_us']:.0f} | "
              f"{r['back_to_back_us']:.0f} |" for r in rows]
    with open(os.path.join(out, "host_overhead.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    if profile:
        with open(os.path.join(out, "host_profile.txt"), "w") as f:
            f.write("\n".join(profiles))
    return 0


if __name__ == "__main__":
    argv = sys.argv[1:]
    n = int(argv[argv.index("--reps") + 1]) if "--reps" in argv else 200
    sys.exit(main(argv[0], n, "--profile" in argv))
