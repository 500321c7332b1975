"""Rerank of one query over 100k documents: the read rate of each forward configuration.

The shape is bound by HBM (7.7 GB of documents per call); ours and both peers read at about
3.2 TB/s, ours 1 % behind in session 11's run.  This times the no-grad forward with 1, 4
and 8 documents per program, BLOCK_N 64 / 128, 4 / 8 warps and 3, 4 or 6 stages (6 is past
the autotuner's list: more bytes in flight per SM), each on its own, against what the
autotuner picked.

Usage: python benchmarks/sweep_rerank_bandwidth.py OUT_JSON
"""
from __future__ import annotations

import json
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, ".")
from lik_plugins.kernels.triton import forward as fwd_mod  # noqa: E402
from lik_plugins.kernels.triton import launch, tuning  # noqa: E402


def main(out):
    nq, nd, lq, ld = 1, 100_000, 32, 300
    Q = torch.nn.functional.normalize(torch.randn(nq, lq, 128, device="cuda", dtype=torch.bfloat16), dim=-1)
    D = torch.nn.functional.normalize(torch.randn(nd, ld, 128, device="cuda", dtype=torch.bfloat16), dim=-1)
    gbytes = D.numel() * 2 / 1e9

    def run():
        return launch.forward(Q, D, None, None, cross=True, normalize=False, zero_mode=False, save_argmax=False)[0]

    rows = []
    ref = run()
    ms = do_bench(run, rep=400)
    rows.append({"variant": "default (autotuned)", "config": tuning._chosen.copy().__repr__()[:300], "ms": ms,
                 "tb_per_s": gbytes / ms})
    print(f"default {ms:.3f} ms {gbytes / ms:.2f} TB/s  chosen {list(tuning._chosen.values())}", flush=True)
    real_dpp, real_select = launch.docs_per_program, tuning.forward_kernel_and_meta
    try:
        for dpp in (1, 4, 8):
            for block_n in (64, 128):
                for warps in (4, 8):
                    for stages in (3, 4, 6):
                        launch.docs_per_program = lambda nj, *_, dpp=dpp: dpp if nj % dpp == 0 else 1
                        meta = {"BLOCK_N": block_n, "BLOCK_K": 128, "num_warps": warps, "num_stages": stages}
                        launch.forward_kernel_and_meta = lambda meta=meta, **kw: (fwd_mod.maxsim_fwd_kernel, dict(meta), None)
                        launch.clear_plans()
                        try:
                            got = run()
                            diff = ((got - ref).abs().max() / ref.abs().max()).item()
                            ms = do_bench(run, rep=200)
                        except Exception as exc:  # noqa: BLE001 - out of shared memory etc.
                            print(f"dpp {dpp} N{block_n} W{warps} S{stages}: {type(exc).__name__}", flush=True)
                            continue
                        rows.append({"variant": f"dpp {dpp} N{block_n} W{warps} S{stages}", "ms": ms,
                                     "tb_per_s": gbytes / ms, "diff": diff})
                        print(f"dpp {dpp} N{block_n} W{warps} S{stages}: {ms:.3f} ms {gbytes / ms:.2f} TB/s "
                              f"(diff {diff:.1e})", flush=True)
    finally:
        launch.docs_per_program, launch.forward_kernel_and_meta = real_dpp, real_select
        launch.clear_plans()
    rows.sort(key=lambda r: r["ms"])
    with open(out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    print("best:", rows[:5], flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
