"""Where the fp8 path's time goes on the launch-bound shapes (rerank 1x1000, small 8x8).

GPU time per call (``triton.testing.do_bench``: back-to-back calls between two events,
so a host slower than the GPU shows up here too) and host time per call of: the bf16
call, the fp8 call with the query quantised inside it (as ``bench_kernels.py`` times it),
the fp8 call with a pre-quantised query, and the query quantisation alone.

Usage: python benchmarks/probe_fp8.py OUT_JSON
"""
from __future__ import annotations

import json
import sys
import time

import torch
from triton.testing import do_bench

sys.path.insert(0, ".")
import lik_plugins as lik  # noqa: E402
from lik_plugins import fp8  # noqa: E402

SHAPES = [("rerank 1x1000 Lq32 Ld300", 1, 1000, 32, 300), ("small 8x8 Lq32 Ld256", 8, 8, 32, 256)]


def host_us(fn, calls=300):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def main(out):
    rows = []
    with torch.no_grad():
        for name, nq, nd, lq, ld in SHAPES:
            Q = torch.randn(nq, lq, 128, device="cuda", dtype=torch.bfloat16)
            D = torch.randn(nd, ld, 128, device="cuda", dtype=torch.bfloat16)
            index, q_index = lik.quantize_fp8(D), lik.quantize_fp8(Q)
            calls = {"bf16 maxsim": lambda: lik.maxsim(Q, D),  # noqa: B023
                     "fp8 (query quantised in the call)": lambda: lik.maxsim_fp8(Q, index),  # noqa: B023
                     "fp8 (query pre-quantised)": lambda: lik.maxsim_fp8(q_index, index),  # noqa: B023
                     "query quantisation alone": lambda: fp8._quantize(Q)}  # noqa: B023
            for what, fn in calls.items():
                row = {"shape": name, "call": what, "gpu_us": do_bench(fn, rep=100) * 1e3, "host_us": host_us(fn)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    import triton

    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "command": " ".join(sys.argv)}
    with open(out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
