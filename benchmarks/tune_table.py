"""Sweep the forward and lowmem-backward configs on this GPU and write its config table.

    LIK_AUTOTUNE=1 python benchmarks/tune_table.py OUT.json

Runs every benchmark shape (``bench_kernels.ALL_SHAPES``: training shapes forward and
backward, inference shapes forward, fp8 forward where the GPU has fp8 units) plus the
length buckets of ``real_loop.py``'s changing-length loops, each with the autotuner on, then
writes the configs it chose as ``lik_plugins/kernels/triton/configs/<arch>.json``'s format
(commit the file there: a fresh process then tunes nothing for these keys; see
``kernels/triton/tuning.py``).
"""
from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ["LIK_AUTOTUNE"] = "1"

import lik_plugins as lik  # noqa: E402
from bench_kernels import ALL_SHAPES, make_inputs  # noqa: E402
from lik_plugins.kernels.triton import tuning  # noqa: E402


def _run(Q, D, layout, train, dm=None):
    fn = lik.maxsim_pairs if layout == "pairs" else lik.maxsim
    if train:
        Q, D = Q.detach().requires_grad_(), D.detach().requires_grad_()
        fn(Q, D, None, dm).float().sum().backward()
    else:
        with torch.no_grad():
            fn(Q, D, None, dm)


def main(out: str) -> int:
    t0 = time.perf_counter()
    fp8 = torch.cuda.get_device_capability() >= (8, 9)
    for shape in ALL_SHAPES:
        Q, D = make_inputs(shape)
        _run(Q, D, shape.layout, shape.kind == "train")
        if shape.kind == "inference":
            dm = torch.ones(D.shape[:-1], dtype=torch.bool, device="cuda")
            _run(Q, D, shape.layout, False, dm)           # with a mask: same keys, other variant
            if fp8 and shape.layout != "pairs":
                with torch.no_grad():
                    lik.maxsim_fp8(Q, lik.quantize_fp8(D))
        print(f"{shape.name}: {time.perf_counter() - t0:.0f}s", flush=True)
    # the real loops' buckets: ColBERT-like (64 x 64, Ld 60-300), ColPali-like (32 x 32, Ld 1030),
    # PyLate Contrastive with one hard negative (128 queries x 256 documents, 512 x 1024)
    for nq, nd, ld in ((64, 64, 300), (64, 64, 100), (32, 32, 1030), (128, 256, 300), (512, 1024, 300)):
        for lq in (8, 16, 32):
            Q = torch.nn.functional.normalize(torch.randn(nq, lq, 128, device="cuda"), dim=-1).bfloat16()
            D = torch.nn.functional.normalize(torch.randn(nd, ld, 128, device="cuda"), dim=-1).bfloat16()
            dm = torch.ones(nd, ld, dtype=torch.bool, device="cuda")
            _run(Q, D, "cross", True, dm)
    arch = tuning.architecture()
    n = tuning.export_table(out, arch)
    print(f"{n} configs for {arch} -> {out} in {time.perf_counter() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
