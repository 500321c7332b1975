"""Time and peak memory of the in-batch training step per backward variant.

``unified`` with its fp32 buffer capped at 64 / 16 / 4 MiB (``launch.UNIFIED_BUFFER_BYTES``:
above the cap the documents are scattered slab by slab from the host) and ``lowmem``
(destination-owned, no fp32 buffer; each tile lists its rows first, and ``lowmem dense``: every
query row against every tile) and the one-launch ring at 32 / 16 slabs, measured as ``bench_kernels.py`` measures a training
step (median over rotating inputs; peak above the inputs, gradients included).

Shapes: every cross-product training shape of the benchmark (in-batch and the small 8x8).

Usage: python benchmarks/sweep_backward_memory.py OUT_JSON [NAME_SUBSTRING] [VARIANT,VARIANT,...]
"""
from __future__ import annotations

import json
import math
import sys

import torch

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")
import lik_plugins as lik  # noqa: E402
from bench_kernels import ALL_SHAPES, bench_one, make_inputs  # noqa: E402
from lik_plugins.kernels import chunked  # noqa: E402
from lik_plugins.kernels.triton import launch  # noqa: E402

VARIANTS = [("unified 64MiB", "unified", 64 << 20), ("unified 16MiB", "unified", 16 << 20),
            ("unified 4MiB", "unified", 4 << 20), ("lowmem", "lowmem", None), ("lowmem dense", "dense", None),
            ("ring 32 slabs", "ring", 32), ("ring 16 slabs", "ring", 16)]


def main(out, only="", variants=""):
    ring_default = (launch.RING_ENABLED, launch.RING_SLABS)
    rows = []
    for shape in [s for s in ALL_SHAPES if s.kind == "train" and s.layout == "cross" and only in s.name]:
        n_sets = max(1, min(8, math.ceil(120e6 / ((shape.nq * shape.lq + shape.nj * shape.ld) * 128 * 2 * 3))))
        sets = []
        for i in range(n_sets):
            Q, D = make_inputs(shape, seed=i)
            sets.append((Q.requires_grad_(), D.requires_grad_()))
        with torch.no_grad():
            ref32, _ = chunked.forward(sets[0][0].detach().float(), sets[0][1].detach().float(), None, None,
                                       cross=True, normalize=False, zero_mode=False, save_argmax=False)
        for name, strategy, cap in VARIANTS:
            if variants and name not in variants.split(","):
                continue
            def step(Q, D, layout, strategy=strategy, cap=cap):
                if strategy == "ring":  # unified through the one-launch ring with `cap` slabs
                    launch.RING_ENABLED, launch.RING_SLABS = True, cap
                    return lik.maxsim(Q, D, backward="unified")
                launch.RING_ENABLED = False
                launch.COMPACT_LOWMEM = strategy != "dense"
                if strategy == "dense":
                    strategy = "lowmem"
                if cap is not None:
                    launch.UNIFIED_BUFFER_BYTES = cap
                return lik.maxsim(Q, D, backward=strategy)
            ms, peak, err = bench_one(step, shape, sets, ref32, 30)
            launch.UNIFIED_BUFFER_BYTES = 64 << 20
            launch.RING_ENABLED, launch.RING_SLABS = ring_default
            launch.COMPACT_LOWMEM = True
            rows.append({"shape": shape.name, "variant": name, "ms": ms, "peak_mib": peak / 2**20, "err": err})
            print(f"{shape.name:24s} {name:14s} {ms:8.3f} ms  peak {peak / 2**20:7.1f} MiB  err {err:.1e}", flush=True)
        del sets
        torch.cuda.empty_cache()
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:4])
