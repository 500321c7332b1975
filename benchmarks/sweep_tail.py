"""Tail tiles: what a document's last ``Ld % BLOCK_N`` tokens cost the forward.

For each shape, the forward alone (each variant autotuned on its own, do_bench):
- Ld 1030 with tail tiles (``launch.TAIL_TILES``, the default),
- Ld 1030 with the last whole tile masked (the forward before tail tiles),
- Ld 1024 (no tail at any BLOCK_N): the control, the time a tail could at best come down to
  plus 6/1024 of it.
Scores (and winners, where saved) of the two Ld-1030 variants must be identical.  The
config each variant's autotuner settled on is recorded, since the tail changes which
BLOCK_N wins.

With ``--ab``: memory-bound reranks (one query, Ld 300) with and without tail tiles,
interleaved over rounds, on one tuned config (the autotuner's key leaves the tail out, so
both variants launch the same BLOCK_N and pipeline): the spread of the rounds says what
difference is noise.

Usage: python benchmarks/sweep_tail.py OUT_JSON [--ab]
"""
from __future__ import annotations

import json
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, ".")
import lik_plugins as lik  # noqa: E402
from lik_plugins.kernels.triton import launch, tuning  # noqa: E402

# (name, layout, nq, nj, lq, save_argmax, fp8)
SHAPES = [
    ("colpali 16x1000 Lq32", "cross", 16, 1000, 32, False, False),
    ("long-query 1x2000 Lq1024", "cross", 1, 2000, 1024, False, False),
    ("long-query 16x1000 Lq512", "cross", 16, 1000, 512, False, False),
    ("colpali in-batch 64 (training fwd)", "cross", 64, 64, 32, True, False),
    ("colpali in-batch 256 (training fwd)", "cross", 256, 256, 32, True, False),
    ("hard-neg 256x16 (training fwd)", "kd", 256, 16, 32, True, False),
    ("fp8 colpali 16x1000 Lq32", "cross", 16, 1000, 32, False, True),
    ("fp8 long-query 1x2000 Lq1024", "cross", 1, 2000, 1024, False, True),
]
VARIANTS = [("tail tiles", 1030, True), ("masked tile", 1030, False), ("Ld 1024", 1024, False)]


def _inputs(layout, nq, nj, lq, ld):
    gen = torch.Generator(device="cuda").manual_seed(0)
    Q = torch.randn(nq, lq, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
    shape = (nj, ld, 128) if layout == "cross" else (nq, nj, ld, 128)
    D = torch.randn(*shape, device="cuda", generator=gen, dtype=torch.bfloat16)
    return torch.nn.functional.normalize(Q, dim=-1), torch.nn.functional.normalize(D, dim=-1)


def main(out):
    rows = []
    for name, layout, nq, nj, lq, save_arg, fp8 in SHAPES:
        ref = None
        for variant, ld, tails in VARIANTS:
            launch.TAIL_TILES = tails
            tuning._chosen.clear()
            launch.clear_plans()
            Q, D = _inputs(layout, nq, nj, lq, ld)
            if fp8:
                index = lik.quantize_fp8(D)
                fwd = lambda: (lik.maxsim_fp8(Q, index), None)  # noqa: E731
            else:
                fwd = lambda: launch.forward(Q, D, None, None, cross=layout == "cross",  # noqa: E731
                                             normalize=False, zero_mode=False, save_argmax=save_arg)
            scores, arg = fwd()
            same = None
            if ld == 1030:
                if ref is None:
                    ref = (scores, arg)
                else:
                    same = bool(torch.equal(scores, ref[0]) and (arg is None or torch.equal(arg, ref[1])))
            ms = do_bench(fwd, rep=300)
            flops = 2 * nq * nj * lq * ld * 128
            config = {str(k): v for k, v in tuning._chosen.items()}
            rows.append({"shape": name, "variant": variant, "ld": ld, "tail_n": launch.tail_tile(ld), "ms": ms,
                         "tflops": flops / ms / 1e9, "identical_to_tail_tiles": same, "configs": config})
            print(f"{name:38s} {variant:12s} Ld {ld}: {ms:8.4f} ms {flops / ms / 1e9:6.0f} TFLOP/s"
                  f" same={same} {list(config.values())}", flush=True)
            del Q, D
            torch.cuda.empty_cache()
        with open(out, "w") as f:  # after every shape: a call cut short keeps what it measured
            json.dump(rows, f, indent=1)
    launch.TAIL_TILES = True
    launch.clear_plans()


AB_SHAPES = [("rerank 1x100k Lq32 Ld300", 1, 100_000, 32, 300), ("rerank 1x1000 Lq32 Ld300", 1, 1000, 32, 300),
             ("rerank 1x4096 Lq32 Ld1030 (pages)", 1, 4096, 32, 1030)]


def ab(out, rounds=3):
    rows = []
    for name, nq, nj, lq, ld in AB_SHAPES:
        Q, D = _inputs("cross", nq, nj, lq, ld)
        tuning._chosen.clear()
        fwd = lambda: launch.forward(Q, D, None, None, cross=True, normalize=False,  # noqa: E731
                                     zero_mode=False, save_argmax=False)
        for r in range(rounds):
            for tails in (True, False):
                launch.TAIL_TILES = tails
                launch.clear_plans()
                fwd()
                ms = do_bench(fwd, rep=300)
                config = list(tuning._chosen.values())
                rows.append({"shape": name, "round": r, "tail_tiles": tails, "tail_n": launch.tail_tile(ld), "ms": ms,
                             "configs": config})
                print(f"{name:44s} round {r} tails {tails!s:5s}: {ms:8.4f} ms {config}", flush=True)
        del Q, D
        torch.cuda.empty_cache()
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)
    launch.TAIL_TILES = True
    launch.clear_plans()


if __name__ == "__main__":
    ab(sys.argv[1]) if "--ab" in sys.argv[2:] else main(sys.argv[1])
