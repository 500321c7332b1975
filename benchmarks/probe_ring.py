"""The ring backward's intermittent wrong grad_D (NOTES v11-v13): vector vs scalar atomics.

Hypothesis of session 6: Hopper's vector atomics (``atom.add.v4.f32``) in the scatter are
not all performed when the grid barrier's release lets other programs read the slot.
The "scalar" variant is the same kernel with the pitch of the scatter (``dim``) left
unspecialised, so the compiler cannot prove 16-element alignment and emits one-element
atomics.  Each trial compares the ring's grad_D with lowmem's (deterministic, tested) on
the shape that failed 5 of 6 runs.  Measured on an H100 (session 7,
results/h100/probe_ring*.json): vector 2 of 6 wrong, then scalar 0 of 6, then scalar 4 of
10 -- the hypothesis is refuted, and the scalar ring was also slower than lowmem.

Usage: python benchmarks/probe_ring.py OUT_JSON [TRIALS] [scalar|vector|both]
"""
from __future__ import annotations

import json
import sys

import torch
import triton

sys.path.insert(0, ".")
import lik_plugins as lik  # noqa: E402
from lik_plugins.kernels.triton import backward, launch  # noqa: E402

VECTOR = backward.maxsim_bwd_ring_kernel
SCALAR = triton.jit(do_not_specialize=["n_q", "n_j", "lq", "ld", "slab", "n_slabs", "n_programs",
                                       "rows_per_program", "dim"])(VECTOR.fn)


def main(out, trials=6, which="both"):
    nq, nj, lq, ld = 48, 40, 32, 1030
    g = torch.Generator(device="cuda").manual_seed(0)
    Q = torch.randn(nq, lq, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    D = torch.randn(nj, ld, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    launch.RING_SLABS = -(-nj // 3)
    rows = []
    for name, kernel in [(n, k) for n, k in (("vector", VECTOR), ("scalar", SCALAR)) if which in (n, "both")]:
        launch.maxsim_bwd_ring_kernel = kernel
        wrong = 0
        for t in range(trials):
            grad = torch.randn(nq, nj, device="cuda", generator=g)
            launch.RING_ENABLED = False
            want = torch.autograd.grad(lik.maxsim(Q, D, backward="lowmem"), (D,), grad)[0].float()
            launch.RING_ENABLED = True
            got = torch.autograd.grad(lik.maxsim(Q, D, backward="unified"), (D,), grad)[0].float()
            err = ((got - want).abs().max() / want.abs().max()).item()
            wrong += err > 4e-2
            rows.append({"atomics": name, "trial": t, "rel_err": err})
            print(name, t, f"{err:.2e}", flush=True)
        print(f"{name}: {wrong} of {trials} wrong", flush=True)
    launch.RING_ENABLED = False
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 6, sys.argv[3] if len(sys.argv) > 3 else "both")
