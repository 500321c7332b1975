"""The lowmem grad_D launch on memory-bound candidate shapes, config by config.

Compares every config the autotuner may pick (with and without the fused grad_Q
gather) against the time to merely zero-fill grad_D (the write floor), and prints the
per-kernel profile of one training step of ours and of late-interaction-kernels.

Usage: python benchmarks/sweep_doc.py OUT_JSON
"""
from __future__ import annotations

import json
import sys

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")
from lik_plugins.kernels.triton import launch, tuning  # noqa: E402
from lik_plugins.kernels.triton.backward import maxsim_bwd_doc_kernel  # noqa: E402

SHAPES = [("kd 64x32", 64, 32, 32, 256), ("hard-neg 256x16", 256, 16, 32, 1030), ("pairs 512", 512, 1, 32, 256)]


def main(out):
    rows = []
    for name, nq, k, lq, ld in SHAPES:
        Q = torch.nn.functional.normalize(torch.randn(nq, lq, 128, device="cuda", dtype=torch.bfloat16), dim=-1)
        D = torch.nn.functional.normalize(torch.randn(nq, k, ld, 128, device="cuda", dtype=torch.bfloat16), dim=-1)
        _, arg = launch.forward(Q, D, None, None, cross=False, normalize=False, zero_mode=False, save_argmax=True)
        g = torch.randn(nq, k, device="cuda")
        gd = torch.empty_like(D)
        gq = torch.empty_like(Q)
        ph = torch.zeros(1, device="cuda")
        block_s, block_j, n_gather, n_split, _ = launch._gather_blocking(nq, k, lq, 128)
        fill_ms = do_bench(lambda: gd.zero_())
        fwd_ms = do_bench(lambda: launch.forward(Q, D, None, None, cross=False, normalize=False, zero_mode=False,
                                                 save_argmax=True))
        print(f"{name}: zero-fill grad_D {fill_ms*1e3:.1f} us ({D.numel()*2/fill_ms/1e9:.2f} TB/s), "
              f"forward+argmax {fwd_ms*1e3:.1f} us", flush=True)
        row = {"shape": name, "fill_us": fill_ms * 1e3, "fwd_us": fwd_ms * 1e3, "configs": []}
        configs = tuning._doc_prune(tuning._doc_configs(), {"Q": Q}, D_PAD=128, F32_DOT=False)
        for cfg in configs:
            for with_gather in (False, True):
                n_g = n_gather if with_gather else 0
                bt = cfg.kwargs["BLOCK_T"]

                def call():
                    maxsim_bwd_doc_kernel[(n_g + nq * k * triton.cdiv(ld, bt),)](
                        g, Q, D, ph, ph, arg, gd, gq, nq, k, lq, ld, 128, g.stride(0), g.stride(1),
                        *Q.stride(), *D.stride(), 0, 0, arg.stride(0), n_g,
                        CROSS=False, NORMALIZE=False, F32_DOT=False, PRECISION="tf32", UPCAST=False,
                        D_PAD=128, WITH_GATHER=with_gather, BLOCK_J=block_j, BLOCK_S=block_s,
                        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **cfg.kwargs,
                    )
                ms = do_bench(call)
                desc = f"T{bt} R{cfg.kwargs['BLOCK_R']} w{cfg.num_warps} s{cfg.num_stages} gather={with_gather}"
                row["configs"].append({"config": desc, "us": ms * 1e3})
                print(f"   {desc:40s} {ms*1e3:8.1f} us", flush=True)
        rows.append(row)
        del Q, D, gd, arg
        torch.cuda.empty_cache()
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
