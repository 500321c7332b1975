"""Shared by the CUDA cases (marker ``gpu``) of the kernel-family tests: the marks, one table
of tolerances against the float64 reference, the sizes, and random inputs made on the device.

The CUDA cases run the compiled kernels at realistic sizes on a GPU (``pytest -m gpu tests``,
``benchmarks/run_gpu.sh tests``); without a CUDA device they are collected and skipped.
"""
from __future__ import annotations

import pytest
import torch

import lik_plugins as lik

DEVICE = "cuda"
CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# Relative max-norm error against the float64 reference: (scores, gradients).  Gradients are
# written in the input dtype (one rounding), and bf16 one-hot products round g to bf16, as the
# host's own bf16 backward does.
TOL = {torch.float32: (2e-5, 1e-4), torch.float16: (2e-3, 1e-2), torch.bfloat16: (1e-2, 4e-2)}
# Gradients through tokens built on chip in bf16 compare in the relative L2 norm: where the
# kernel's fp32 normalisation and the oracle's round one token element to neighbouring bf16
# values, a near tie can flip, moving one winner's whole gradient row -- an O(1) error in
# the max-norm, about 3e-2 of the L2 norm at these sizes.  Rounding alone is ~2e-3.
BUILT_BF16_GRAD_L2 = 4e-2
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]

# Sizes of the packed and compressed cases in one place: a rerank (1 query x 1000 candidates),
# an in-batch training batch (B = 64), PLAID / int8 / hidden-state batches.  Document lengths
# are uniform in LD.
SIZES = dict(LD=(50, 300), LQ=32, RERANK_DOCS=1000, TRAIN_B=64, CROSS_Q=24, CROSS_D=40, PAIR_Q=16, PAIR_D=60,
             PAIRS=300, PAD_B=8, PAD_C=16, RES_Q=8, RES_D=200, RES_LD=180, CENTROIDS=1024, APPROX_D=1000,
             INT8_Q=16, INT8_D=64, INT8_K=8, HID_Q=8, HID_D=24, HID_LD=180)


def cuda_generator(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


def dense_inputs(nq, nj, lq, ld, d, dtype, kd, holes=True, seed=0):
    """``Q``, ``D`` (cross product, or per-query candidates with ``kd``) and masks with holes:
    query 0's token 0 masked and the first document fully masked."""
    g = cuda_generator(seed)
    Q = torch.randn(nq, lq, d, device=DEVICE, dtype=dtype, generator=g)
    shape = (nq, nj, ld, d) if kd else (nj, ld, d)
    D = torch.randn(*shape, device=DEVICE, dtype=dtype, generator=g)
    qm = dm = None
    if holes:
        qm = torch.rand(nq, lq, device=DEVICE, generator=g) > 0.2
        dm = torch.rand(*shape[:-1], device=DEVICE, generator=g) > 0.2
        dm.view(-1, ld)[0] = False          # a fully masked document
        qm[0, 0] = False
    return Q, D, qm, dm


def random_lengths(g, n, lo, hi) -> list[int]:
    return torch.randint(lo, hi + 1, (n,), generator=g, device=DEVICE).tolist()


def ragged(g, lengths, d, dtype):
    return [torch.randn(n, d, generator=g, device=DEVICE).to(dtype) for n in lengths]


def hole_mask(g, n, p=0.25):
    return torch.rand(n, generator=g, device=DEVICE) > p


def served(entry: str, path: str = "triton", calls: int = 1) -> None:
    """The call was served by ``path`` (the Triton kernels on CUDA), not a fallback."""
    assert lik.routing_counts().get(entry) == {path: calls}, lik.routing_counts()


def rel_l2(x, ref) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-12)).item()


def weighted_grads(out, inputs, w):
    return torch.autograd.grad((out.double() * w).sum(), inputs)


@pytest.fixture
def fresh_routing_counts():
    """Routing counts start at zero, so ``served`` sees this test's calls only."""
    lik.reset_routing_counts()
