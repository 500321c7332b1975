"""The forward kernel (and the packed backward) compiles for an H100 without one (PTX + ptxas on the CPU), for the
variants the interpreter alone would let through, and the config a fresh process uses for
fp32 without a sweep fits the H100's shared memory (227 KiB per block)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HELPER = Path(__file__).with_name("sm90_compile.py")
H100_SHARED = 232448

VARIANTS = {
    "training bf16": [],
    "packed pairs": ["VARLEN=True", "PAIRS=True", "QPB=1"],
    "residual 2-bit": ["DOC_FORMAT=2", "NBITS=2", "D=*u8", "A0=*i32", "A1=*bf16", "NORMALIZE=True"],
    "projection head": ["DOC_FORMAT=3", "A0=*bf16", "A1=*bf16", "NORMALIZE=True", "HAS_BIAS=True"],
    "packed backward, pairs": ["KERNEL=backward.maxsim_bwd_varlen_kernel", "NEED_Q=True", "SCATTER_D=True",
                               "NORMALIZE=True", "ATOMIC_Q=True", "PAIRS=True", "BLOCK_J=1", "BLOCK_S=16", "D_PAD=128"],
    "packed backward, cross": ["KERNEL=backward.maxsim_bwd_varlen_kernel", "NEED_Q=True", "SCATTER_D=True",
                               "NORMALIZE=False", "ATOMIC_Q=False", "PAIRS=False", "BLOCK_J=4", "BLOCK_S=16",
                               "D_PAD=128"],
    "packed input checks": ["KERNEL=checks.packed_inputs_ok_kernel", "BLOCK=1024", "PAIR_BLOCK=4096", "CU_D=*i64",
                            "PAIR_Q=*i64", "PAIR_D=*i64", "OK=*i32"],
}


def _compile(args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}   # the real compiler
    done = subprocess.run([sys.executable, str(HELPER), *args], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return int(done.stdout.strip().rsplit("shared=", 1)[1])


@pytest.mark.parametrize("name", list(VARIANTS))
def test_kernel_compiles_for_sm90(name):
    shared = _compile(VARIANTS[name])
    assert shared <= H100_SHARED
    if name.startswith(("training", "packed pairs", "residual", "projection")):   # the forward's tiles
        assert shared > 0


@pytest.mark.parametrize("fmt", ["dense", "residual"])
def test_the_fp32_default_config_fits(monkeypatch, fmt):
    # residual documents are built in the query's dtype: the config must be sized for fp32
    # operands, not for the uint8 residual bytes
    from lik_plugins.kernels.triton import tuning

    monkeypatch.setattr(tuning, "_smem_budget", lambda: H100_SHARED)
    if fmt == "dense":
        key, extra = torch.float32, ["D=*fp32"]
    else:
        key = (torch.float32, torch.uint8, 2)
        extra = ["D=*u8", "A0=*i32", "A1=*fp32", "DOC_FORMAT=2", "NBITS=4", "NORMALIZE=True"]
    cfg = tuning._default_forward(128, 128, 128, key)
    shared = _compile(["Q=*fp32", *extra, "ROWS_PER_Q=32", "QPB=4", "PRECISION='tf32x3'",
                       f"BLOCK_N={cfg['BLOCK_N']}", f"num_warps={cfg['num_warps']}", f"num_stages={cfg['num_stages']}"])
    assert shared <= H100_SHARED
