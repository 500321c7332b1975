"""Compile the forward kernel for an H100 (sm_90) on a machine without a GPU.

    python tests/kernel_paths/sm90_compile.py NAME=VALUE ...   (constexprs, pointer types, num_warps/num_stages)

Triton lowers to PTX and runs ptxas without a device, so this catches what the CPU
interpreter cannot: Python that Triton's compiler rejects (a non-constexpr global, a bad
type), and configs whose shared memory exceeds the H100's.  Prints ``shared=<bytes>``.
"""
from __future__ import annotations

import inspect
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from lik_plugins.kernels.triton import forward

POINTERS = {"Q": "*bf16", "D": "*bf16", "QM": "*u8", "DM": "*u8", "RQ": "*fp32", "RD": "*fp32", "OUT": "*fp32",
            "ARG": "*i16", "CU_Q": "*i32", "CU_D": "*i32", "PAIR_Q": "*i32", "PAIR_D": "*i32", "A0": "*fp32",
            "A1": "*fp32", "A2": "*fp32"}
META = dict(HAS_QM=False, HAS_DM=True, ZERO_MODE=False, NORMALIZE=False, SAVE_ARG=True, ROWS_PER_Q=32, QPB=8,
            BLOCK_N=64, BLOCK_K=128, D_PAD=128, UPCAST=False, PRECISION="tf32")


def compile_forward(settings: dict):
    pointers, meta, options = dict(POINTERS), dict(META), {}
    for key, value in settings.items():
        if key in ("num_warps", "num_stages"):
            options[key] = value
        elif key in pointers:
            pointers[key] = value
        else:
            meta[key] = value
    fn = forward.maxsim_fwd_kernel
    params = list(inspect.signature(fn.fn).parameters.values())
    signature, constants = {}, {}
    for i, p in enumerate(params):
        if p.name in meta or "constexpr" in str(p.annotation):
            signature[p.name] = "constexpr"
            constants[(i,)] = meta.get(p.name, p.default)
        else:
            signature[p.name] = pointers.get(p.name, "i32")
    return triton.compile(ASTSource(fn, signature, constants), target=GPUTarget("cuda", 90, 32), options=options)


if __name__ == "__main__":
    settings = {}
    for arg in sys.argv[1:]:
        key, value = arg.split("=", 1)
        settings[key] = value if value.startswith("*") else eval(value)  # noqa: S307 (test helper)
    print(f"shared={compile_forward(settings).metadata.shared}")
