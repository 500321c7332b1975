"""Compile the forward kernel for sm_90 on a machine without a GPU and summarise its PTX.

For a refactor that should not change the compiled code: run it before and after, then
compare the opcode counts (register numbering and the order of independent instructions
may move; a different count is a different kernel).  The variants are the ColBERT 256
training / inference configurations (bf16, 8 queries x 32 tokens per program, BLOCK_N 64,
8 warps, 3 stages), one and four documents per program, strides specialised as at launch.

Usage: python benchmarks/ptx_forward.py OUT_PREFIX   (writes OUT_PREFIX_<variant>.ptx and
OUT_PREFIX_opcodes.json)
"""
from __future__ import annotations

import collections
import inspect
import json
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, ".")
from lik_plugins.kernels.triton.forward import maxsim_fwd_kernel  # noqa: E402

POINTERS = {"Q": "*bf16", "D": "*bf16", "QM": "*u8", "DM": "*u8", "RQ": "*fp32", "RD": "*fp32", "OUT": "*fp32",
            "ARG": "*i16"}
# contiguous [Nq, 32, 128] queries and [Nd, 256, 128] documents of the cross product
SPECIALISED = {"dim": 128, "s_qh": 1, "s_dh": 1, "s_di": 0}


def compile_ptx(save_arg: bool, docs_per_program: int) -> str:
    params = list(inspect.signature(maxsim_fwd_kernel.fn).parameters)
    const = dict(HAS_QM=False, HAS_DM=False, ZERO_MODE=False, NORMALIZE=False, SAVE_ARG=save_arg, ROWS_PER_Q=32,
                 QPB=8, BLOCK_N=64, BLOCK_K=128, D_PAD=128, UPCAST=False, PRECISION="tf32", RUNNING_MAX=False,
                 QUANT_Q=False, FP8_LIMIT=448.0, DOCS_PER_PROGRAM=docs_per_program, TAIL_N=0, **SPECIALISED)
    const = {n: v for n, v in const.items() if n in params}
    signature = {n: POINTERS.get(n, "constexpr" if n in const else "i32") for n in params}
    compiled = triton.compile(ASTSource(fn=maxsim_fwd_kernel, signature=signature, constexprs=const),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_stages": 3})
    return compiled.asm["ptx"]


def opcodes(ptx: str) -> dict:
    return dict(sorted(collections.Counter(re.findall(r"^\s+([a-z][\w.]*)", ptx, flags=re.M)).items()))


def main(prefix: str) -> None:
    summary = {}
    for save_arg in (True, False):
        for dpp in (1, 4):
            name = f"{'argmax' if save_arg else 'nograd'}_docs{dpp}"
            ptx = compile_ptx(save_arg, dpp)
            with open(f"{prefix}_{name}.ptx", "w") as f:
                f.write(ptx)
            summary[name] = opcodes(ptx)
            print(name, sum(summary[name].values()), "instructions,", "wgmma" if "wgmma" in ptx else "no wgmma")
    with open(f"{prefix}_opcodes.json", "w") as f:
        json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
