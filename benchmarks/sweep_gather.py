"""The cross product's training step by parts, the grad_Q gather's blocking, and the
forward's documents per program.

Per in-batch training shape: the forward with its argmax, the listed-rows grad_D launch
alone, the grad_Q gather alone for each (max tokens per program, elements per step)
variant, and the whole step (as ``bench_kernels.py`` times it) for each variant.  CUDA-event
medians of back-to-back calls.

Why: at ColBERT 256 the gather runs one program per query (32 tokens): 256 programs of 4
warps for 132 SMs, about 8 warps per SM, for a kernel made of dependent random row loads.
Fewer tokens per program give more programs (and warps in flight) without partial sums.
The forward: a program that scores 2 or 4 documents loads its query block once for them.

Usage: python benchmarks/sweep_gather.py OUT_JSON [NAME_SUBSTRING]
"""
from __future__ import annotations

import json
import sys

import torch

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")
import lik_plugins as lik  # noqa: E402
from bench_kernels import ALL_SHAPES, bench_one, make_inputs  # noqa: E402
from lik_plugins.kernels import chunked  # noqa: E402
from lik_plugins.kernels.triton import launch  # noqa: E402
from profile_parts import timed  # noqa: E402

VARIANTS = [(32, 8192), (32, 16384), (16, 8192), (16, 16384), (8, 8192), (8, 16384), (4, 8192)]
DOCS_PER_PROGRAM = (1, 2, 4)
# the launcher's own settings, restored after each variant sweep
GATHER_DEFAULT = (launch.GATHER_MAX_BLOCK_S, launch.GATHER_STEP_ELEMS)
DOCS_DEFAULT = launch.FORWARD_DOCS_PER_PROGRAM


def forward_ms(Q, D, save_argmax):
    return timed(lambda: launch.forward(Q, D, None, None, cross=True, normalize=False, zero_mode=False,
                                        save_argmax=save_argmax), reps=50)


def sweep_docs_per_program(shape, row, sets=None, ref32=None):
    Q, D = make_inputs(shape)
    for dpp in DOCS_PER_PROGRAM:
        launch.FORWARD_DOCS_PER_PROGRAM = dpp
        launch.clear_plans()
        row[f"fwd_nograd_dpp{dpp}_ms"] = forward_ms(Q, D, False)
        msg = f"fwd no-grad {row[f'fwd_nograd_dpp{dpp}_ms']:.4f}"
        if sets is not None:
            row[f"fwd_argmax_dpp{dpp}_ms"] = forward_ms(Q, D, True)
            ms, peak, err = bench_one(lambda q, d, layout: lik.maxsim(q, d), shape, sets, ref32, 30)
            row[f"step_dpp{dpp}_ms"], row[f"step_dpp{dpp}_err"] = ms, err
            msg += f" argmax {row[f'fwd_argmax_dpp{dpp}_ms']:.4f} step {ms:.4f} err {err:.1e}"
        print(shape.name, f"docs/program {dpp}:", msg, flush=True)
    launch.FORWARD_DOCS_PER_PROGRAM = DOCS_DEFAULT
    launch.clear_plans()


def main(out, only=""):
    rows = []
    for shape in [s for s in ALL_SHAPES if s.kind == "inference" and s.layout == "cross" and only in s.name]:
        row = {"shape": shape.name}
        sweep_docs_per_program(shape, row)
        rows.append(row)
        write(out, rows)
    for shape in [s for s in ALL_SHAPES if s.kind == "train" and s.layout == "cross" and only in s.name]:
        Q, D = make_inputs(shape)
        with torch.no_grad():
            ref32, _ = chunked.forward(Q.float(), D.float(), None, None, cross=True, normalize=False,
                                       zero_mode=False, save_argmax=False)
            scores, argmax = launch.forward(Q, D, None, None, cross=True, normalize=False, zero_mode=False,
                                            save_argmax=True)
        grad = torch.randn_like(scores)
        placeholder = torch.zeros(1, device="cuda")
        row = {"shape": shape.name}
        row["fwd_argmax_ms"] = timed(lambda: launch.forward(Q, D, None, None, cross=True, normalize=False,
                                                             zero_mode=False, save_argmax=True), reps=50)
        row["bwd_grad_d_only_ms"] = timed(lambda: launch.backward(
            grad, Q, D, argmax, cross=True, normalize=False, need_q=False, need_d=True, strategy="lowmem",
            q_masked=False), reps=50)
        grad_q = torch.empty_like(Q)
        sets = [tuple(t.requires_grad_() for t in make_inputs(shape, seed=i)) for i in range(3)]
        for block_s, elems in VARIANTS:
            launch.GATHER_MAX_BLOCK_S, launch.GATHER_STEP_ELEMS = block_s, elems
            key = f"s{block_s}_e{elems}"
            row[f"gather_{key}_ms"] = timed(lambda: launch._gather_pass(
                grad, Q, D, argmax, placeholder, placeholder, grad_q, None, cross=True, normalize=False), reps=50)
            ms, peak, err = bench_one(lambda q, d, layout: lik.maxsim(q, d), shape, sets, ref32, 30)
            row[f"step_{key}_ms"], row[f"step_{key}_mib"], row[f"step_{key}_err"] = ms, peak / 2**20, err
            print(shape.name, key, f"gather {row[f'gather_{key}_ms']:.4f} step {ms:.4f} ms {peak / 2**20:.1f} MiB "
                  f"err {err:.1e}", flush=True)
        launch.GATHER_MAX_BLOCK_S, launch.GATHER_STEP_ELEMS = GATHER_DEFAULT
        sweep_docs_per_program(shape, row, sets, ref32)
        print(shape.name, f"fwd {row['fwd_argmax_ms']:.4f} grad_d {row['bwd_grad_d_only_ms']:.4f}", flush=True)
        rows.append(row)
        write(out, rows)
        del sets, Q, D
        torch.cuda.empty_cache()


def write(out, rows):
    # after every shape: a call cut by its time limit keeps what it measured
    with open(out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:])
