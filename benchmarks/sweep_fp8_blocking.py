"""fp8 inference forward: rows per program and documents per program.

The fp8 path kept the 16-bit choices without its own measurement: 256-row programs
(``launch.WIDE_BLOCK_M``) and one document per program (``launch.docs_per_program``
returns 1 for fp8).  This times the fp8 no-grad forward (documents and queries
quantised beforehand, so the scoring launch alone) on the search shapes for 128 / 256
rows and 1 / 4 documents per program, each variant with its own autotuning; the scores
must not change.

Usage: python benchmarks/sweep_fp8_blocking.py OUT_JSON [NAME_SUBSTRING,...]
"""
from __future__ import annotations

import json
import sys

import torch

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")
import lik_plugins as lik  # noqa: E402
from lik_plugins.kernels.triton import launch, tuning  # noqa: E402
from sweep_rows import time_variant  # noqa: E402

# the two search shapes were measured in session 10 (NOTES v16); the other Lq 32 shapes decide
# whether "fp8, Lq <= 32: 128 rows x 4 documents" can become the rule
SHAPES = [("search 64x4096 Lq32", 64, 4096, 32, 256), ("search 64x4096 Lq128", 64, 4096, 128, 256),
          ("in-batch 256 Lq32", 256, 256, 32, 256), ("colpali 16x1000 Lq32", 16, 1000, 32, 1030)]


def main(out, only=None):
    rows = []
    default_rule, default_wide = launch.docs_per_program, launch.WIDE_BLOCK_M
    default_short = launch.FP8_SHORT_QUERY_MAX_LQ
    launch.FP8_SHORT_QUERY_MAX_LQ = 0   # the variants below set the blocking themselves
    for name, nq, nd, lq, ld in SHAPES:
        if only and not any(part in name for part in only.split(",")):
            continue
        Q = torch.nn.functional.normalize(torch.randn(nq, lq, 128, device="cuda", dtype=torch.bfloat16), dim=-1)
        D = torch.nn.functional.normalize(torch.randn(nd, ld, 128, device="cuda", dtype=torch.bfloat16), dim=-1)
        q8, d8 = lik.quantize_fp8(Q), lik.quantize_fp8(D)
        ref = None
        for wide in (256, 128):
            for dpp in (1, 4):
                launch.WIDE_BLOCK_M = wide
                launch.docs_per_program = lambda nj, *_, dpp=dpp: dpp if nj % dpp == 0 else 1
                tuning._chosen.clear()
                launch.clear_plans()

                def fwd():
                    return launch.forward(q8.values, d8.values, None, None, cross=True, normalize=False,
                                          zero_mode=False, save_argmax=False, scales=(q8.scales, d8.scales))[0]
                try:
                    got = fwd()
                except Exception as e:  # a combination the kernel may not compile: record it
                    rows.append({"shape": name, "rows_per_program": wide, "docs_per_program": dpp, "error": repr(e)})
                    print(f"{name:24s} rows {wide:3d} docs {dpp}: {e!r}"[:300], flush=True)
                    continue
                ref = got if ref is None else ref
                ms, tflops, diff = time_variant(fwd, got, ref, 2 * nq * nd * lq * ld * 128)
                rows.append({"shape": name, "rows_per_program": wide, "docs_per_program": dpp, "ms": ms,
                             "tflops": tflops, "diff_vs_first": diff})
                print(f"{name:24s} rows {wide:3d} docs {dpp}: {ms:7.3f} ms {tflops:6.0f} TFLOP/s "
                      f"(diff {diff:.1e})", flush=True)
                with open(out, "w") as f:
                    json.dump(rows, f, indent=1)
        launch.docs_per_program, launch.WIDE_BLOCK_M = default_rule, default_wide
        launch.FP8_SHORT_QUERY_MAX_LQ = default_short
        launch.clear_plans()
        tuning._chosen.clear()
        del Q, D, q8, d8
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
