"""Forward row blocking at long queries: how many query rows a program owns.

``launch.MAX_ROWS_PER_Q`` (rows of one query per program) and ``launch.TARGET_BLOCK_M``
(rows per program, filled with several queries) decide how often each document tile is
re-read.  This times the no-grad forward for a few (max rows, target rows) pairs on
query lengths 32-1024, each with its own autotuning.

With ``--train`` it times the training forward (argmax saved) on the in-batch training
shapes instead, at 128 and 256 rows per program (``TARGET_BLOCK_M``), arg-maxes compared.

With ``--epilogue`` it times the inference forward, bf16 and fp8, with the per-tile
row reduction against the elementwise running max (``launch.RUNNING_MAX``).

With ``--argmax`` it times the training forward on the in-batch training shapes with the
per-tile argmax against the elementwise running max and tile offset
(``launch.RUNNING_ARGMAX``); scores and winners must be identical.

Usage: python benchmarks/sweep_rows.py OUT_JSON [--train | --epilogue | --argmax]
"""
from __future__ import annotations

import json
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, ".")
from lik_plugins.kernels.triton import launch, tuning  # noqa: E402

SHAPES = [("search 64x4096 Lq32", 64, 4096, 32, 256), ("search 64x4096 Lq128", 64, 4096, 128, 256),
          ("in-batch 256 Lq64", 256, 256, 64, 256), ("long-query 16x1000 Lq512", 16, 1000, 512, 1030),
          ("long-query 1x2000 Lq1024", 1, 2000, 1024, 1030)]
TRAIN_SHAPES = [("colbert 256", 256, 256, 32, 256), ("colbert 1024", 1024, 1024, 32, 256),
                ("colpali 64", 64, 64, 32, 1030), ("colpali 256", 256, 256, 32, 1030)]
VARIANTS = [(128, 128), (256, 256)]  # (rows cap, rows per program): the old and the new inference blocking


def main(out, train=False):
    rows = []
    for name, nq, nd, lq, ld in TRAIN_SHAPES if train else SHAPES:
        Q = torch.nn.functional.normalize(torch.randn(nq, lq, 128, device="cuda", dtype=torch.bfloat16), dim=-1)
        D = torch.nn.functional.normalize(torch.randn(nd, ld, 128, device="cuda", dtype=torch.bfloat16), dim=-1)
        ref = None
        for max_rows, target in VARIANTS:
            launch.MAX_ROWS_PER_Q, launch.TARGET_BLOCK_M, launch.WIDE_BLOCK_M = max_rows, target, target
            tuning._chosen.clear()
            launch.clear_plans()  # the forward plans hold the blocking and the config
            fwd = lambda: launch.forward(Q, D, None, None, cross=True, normalize=False, zero_mode=False,  # noqa: E731
                                         save_argmax=train)
            out_scores, arg = fwd()
            ref = (out_scores, arg) if ref is None else ref
            err = ((out_scores - ref[0]).abs().max() / ref[0].abs().max()).item()
            if train:
                err = max(err, float((arg != ref[1]).float().mean()))  # share of changed winners
            ms = do_bench(fwd, rep=200)
            flops = 2 * nq * nd * lq * ld * 128
            blocking = launch.row_blocking(lq, nq, True, target)
            rows.append({"shape": name, "max_rows": max_rows, "target_block_m": target, "blocking": blocking,
                         "ms": ms, "tflops": flops / ms / 1e9, "err_vs_first": err})
            print(f"{name:28s} max_rows {max_rows:3d} target {target:3d} blocking {blocking}: {ms:8.3f} ms "
                  f"{flops / ms / 1e9:6.0f} TFLOP/s (diff {err:.1e})", flush=True)
        launch.MAX_ROWS_PER_Q, launch.TARGET_BLOCK_M, launch.WIDE_BLOCK_M = 128, 128, 256
        launch.clear_plans()
        del Q, D
        torch.cuda.empty_cache()
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)


def time_variant(fwd, got, ref, flops):
    """(ms, TFLOP/s, max difference relative to ``ref``) of one variant's forward ``fwd``,
    whose output ``got`` is already computed."""
    diff = ((got - ref).abs().max() / ref.abs().max()).item()
    ms = do_bench(fwd, rep=200)
    return ms, flops / ms / 1e9, diff


def epilogue(out):
    import lik_plugins as lik

    rows = []
    for name, nq, nd, lq, ld in SHAPES:
        Q = torch.nn.functional.normalize(torch.randn(nq, lq, 128, device="cuda", dtype=torch.bfloat16), dim=-1)
        D = torch.nn.functional.normalize(torch.randn(nd, ld, 128, device="cuda", dtype=torch.bfloat16), dim=-1)
        q8, d8 = lik.quantize_fp8(Q), lik.quantize_fp8(D)
        inputs = {"bf16": (Q, D, None), "fp8": (q8.values, d8.values, (q8.scales, d8.scales))}
        for dtype, (a, b, scales) in inputs.items():
            ref = None
            for running in (False, True):
                launch.RUNNING_MAX = running
                tuning._chosen.clear()  # each variant tunes its own config
                launch.clear_plans()  # the forward plans hold the blocking and the config
                fwd = lambda: launch.forward(a, b, None, None, cross=True, normalize=False, zero_mode=False,  # noqa: E731
                                             save_argmax=False, scales=scales)[0]
                got = fwd()
                ref = got if ref is None else ref
                ms, tflops, diff = time_variant(fwd, got, ref, 2 * nq * nd * lq * ld * 128)
                rows.append({"shape": name, "dtype": dtype, "running_max": running, "ms": ms,
                             "tflops": tflops, "diff_vs_per_tile": diff})
                print(f"{name:28s} {dtype} running_max {running!s:5s}: {ms:8.3f} ms {tflops:6.0f} TFLOP/s "
                      f"(diff {diff:.1e})", flush=True)
        launch.RUNNING_MAX = True
        launch.clear_plans()
        del Q, D, q8, d8, inputs
        torch.cuda.empty_cache()
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)


def argmax_epilogue(out):
    rows = []
    for name, nq, nd, lq, ld in TRAIN_SHAPES:
        Q = torch.nn.functional.normalize(torch.randn(nq, lq, 128, device="cuda", dtype=torch.bfloat16), dim=-1)
        D = torch.nn.functional.normalize(torch.randn(nd, ld, 128, device="cuda", dtype=torch.bfloat16), dim=-1)
        ref = None
        for running in (False, True):
            launch.RUNNING_ARGMAX = running
            tuning._chosen.clear()  # each variant tunes its own config
            launch.clear_plans()
            fwd = lambda: launch.forward(Q, D, None, None, cross=True, normalize=False, zero_mode=False,  # noqa: E731
                                         save_argmax=True)
            scores, arg = fwd()
            ref = (scores, arg) if ref is None else ref
            same = bool(torch.equal(scores, ref[0]) and torch.equal(arg, ref[1]))
            ms = do_bench(fwd, rep=200)
            flops = 2 * nq * nd * lq * ld * 128
            rows.append({"shape": name, "running_argmax": running, "ms": ms, "tflops": flops / ms / 1e9,
                         "identical_to_per_tile": same,
                         "configs": {str(k): v for k, v in tuning._chosen.items()}})
            print(f"{name:14s} running_argmax {running!s:5s}: {ms:8.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s "
                  f"identical {same}", flush=True)
        launch.RUNNING_ARGMAX = True
        launch.clear_plans()
        del Q, D
        torch.cuda.empty_cache()
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    if "--argmax" in sys.argv[2:]:
        argmax_epilogue(sys.argv[1])
        sys.exit()
    if "--epilogue" in sys.argv[2:]:
        epilogue(sys.argv[1])
        sys.exit()
    main(sys.argv[1], train="--train" in sys.argv[2:])
