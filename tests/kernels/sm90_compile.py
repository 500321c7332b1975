"""Compile a Triton kernel for an H100 (sm_90) on a machine without a GPU.

    python tests/kernels/sm90_compile.py [KERNEL=module.name] NAME=VALUE ...
        (constexprs, pointer types, num_warps/num_stages; KERNEL defaults to forward.maxsim_fwd_kernel,
        modules of lik_plugins.kernels.triton)

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

import importlib

POINTERS = {"Q": "*bf16", "D": "*bf16", "QM": "*u8", "DM": "*u8", "RQ": "*fp32", "RD": "*fp32", "OUT": "*fp32",
            "ARG": "*i16", "CU_Q": "*i32", "CU_D": "*i32", "PAIR_Q": "*i32", "PAIR_D": "*i32", "A0": "*fp32",
            "A1": "*fp32", "A2": "*fp32", "G": "*fp32", "GQ": "*fp32", "GD32": "*fp32"}
META = dict(HAS_QM=False, HAS_DM=True, ZERO_MODE=False, NORMALIZE=False, SAVE_ARG=True, ROWS_PER_Q=32, QPB=8,
            BLOCK_N=64, BLOCK_K=128, D_PAD=128, UPCAST=False, PRECISION="tf32")


def compile_kernel(settings: dict):
    pointers, meta, options = dict(POINTERS), dict(META), {}
    module, name = settings.pop("KERNEL", "forward.maxsim_fwd_kernel").split(".")
    fn = getattr(importlib.import_module(f"lik_plugins.kernels.triton.{module}"), name)
    for key, value in settings.items():
        if key in ("num_warps", "num_stages"):
            options[key] = value
        elif key in pointers or str(value).startswith("*"):
            pointers[key] = value
        else:
            meta[key] = value
    signature, constants = specialisation(fn, meta, pointers)
    return triton.compile(ASTSource(fn, signature, constants), target=GPUTarget("cuda", 90, 32), options=options)


def specialisation(fn, meta: dict, pointers: dict) -> tuple[dict, dict]:
    """Triton's ``(signature, constants)`` of ``fn``: parameters in ``meta`` or annotated
    constexpr are constants (``meta``'s value, else the default), the others take their type
    from ``pointers`` (integers: ``i32``)."""
    signature, constants = {}, {}
    for i, p in enumerate(inspect.signature(fn.fn).parameters.values()):
        if p.name in meta or "constexpr" in str(p.annotation):
            signature[p.name] = "constexpr"
            constants[(i,)] = meta.get(p.name, p.default)
        else:
            signature[p.name] = pointers.get(p.name, "i32")
    return signature, constants


if __name__ == "__main__":
    settings = {}
    for arg in sys.argv[1:]:
        key, value = arg.split("=", 1)
        settings[key] = value if value.startswith("*") or key == "KERNEL" else eval(value)  # noqa: S307
    print(f"shared={compile_kernel(settings).metadata.shared}")
