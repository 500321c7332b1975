"""Where the time of the launch-bound shapes goes: host (Python + launch) vs GPU.

For rerank 1x1000 and the 8x8 forward: the kernel alone at each forward config (GPU time,
``do_bench``), the whole ``lik.maxsim`` call (CUDA events around many back-to-back calls),
and the host time of one call (wall clock, no sync).

Usage: python benchmarks/probe_small.py OUT_JSON
"""
from __future__ import annotations

import json
import sys
import time

import torch
from triton.testing import do_bench

sys.path.insert(0, ".")
import lik_plugins as lik  # noqa: E402
from lik_plugins.kernels.triton import launch, tuning  # noqa: E402

SHAPES = [("rerank 1x1000 Lq32 Ld300", 1, 1000, 32, 300), ("small fwd 8x8 Lq32 Ld256", 8, 8, 32, 256)]


def main(out):
    rows = []
    for name, nq, nd, lq, ld in SHAPES:
        Q = torch.nn.functional.normalize(torch.randn(nq, lq, 128, device="cuda", dtype=torch.bfloat16), dim=-1)
        D = torch.nn.functional.normalize(torch.randn(nd, ld, 128, device="cuda", dtype=torch.bfloat16), dim=-1)
        with torch.no_grad():
            call = lambda: lik.maxsim(Q, D)  # noqa: E731
            call()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(200):
                call()
            host_us = (time.perf_counter() - t0) / 200 * 1e6
            torch.cuda.synchronize()
            call_ms = do_bench(call, rep=200)
            row = {"shape": name, "call_ms": call_ms, "host_us_per_call": host_us, "chosen": dict(tuning._chosen)}
            rows.append({k: (str(v) if k == "chosen" else v) for k, v in row.items()})
            print(f"{name}: whole call {call_ms * 1e3:.1f} us (do_bench), host {host_us:.1f} us per call", flush=True)
            rows_per_q, qpb, n_chunks = launch.row_blocking(lq, nq, True, launch.WIDE_BLOCK_M)
            for cfg in tuning._configs():
                tuning._chosen.clear()
                launch.clear_plans()  # the forward plans hold the blocking and the config
                key = (rows_per_q, qpb, 128, False, False, torch.bfloat16)
                tuning._chosen[key] = {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
                launch.clear_plans()
                try:
                    ms = do_bench(lambda: launch.forward(Q, D, None, None, cross=True, normalize=False,  # noqa: E731
                                                         zero_mode=False, save_argmax=False), rep=100)
                except Exception as exc:  # noqa: BLE001 - out of shared memory etc.
                    print(f"   {tuning._chosen[key]}: {type(exc).__name__}")
                    continue
                rows.append({"shape": name, "config": str(tuning._chosen[key]), "kernel_ms": ms})
                print(f"   {tuning._chosen[key]}: launch.forward {ms * 1e3:.1f} us", flush=True)
            tuning._chosen.clear()
            launch.clear_plans()  # the forward plans hold the blocking and the config
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
