"""fp8 scores with the query quantised inside the scoring kernel (fused) against
quantising it first (two launches), and both against the float64 specification of the
same quantised tokens.  Session 7 on an H100: 1-ulp differences in up to 40 % of the
scores, the same error against the specification (NOTES v13).

Usage: python benchmarks/diag_fp8_fused.py
"""
import sys, torch
sys.path.insert(0, ".")
import lik_plugins as lik
from lik_plugins import fp8
from lik_plugins.kernels import reference
g = torch.Generator(device="cuda").manual_seed(0)
for (nq, nj, lq, ld, d) in [(8, 8, 32, 256, 128), (3, 5, 32, 70, 200), (5, 7, 8, 20, 16)]:
    Q = torch.randn(nq, lq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    D = torch.randn(nj, ld, d, device="cuda", dtype=torch.bfloat16, generator=g)
    index, qi = lik.quantize_fp8(D), lik.quantize_fp8(Q)
    two = lik.maxsim_fp8(qi, index)
    fused = lik.maxsim_fp8(Q, index)
    spec = reference.maxsim_fp8(qi, index, dtype=torch.float64)
    rel = lambda a: ((a.double() - spec).abs().max() / spec.abs().max()).item()  # noqa: E731,B023
    print((nq, nj, lq, ld, d), "fused==two", torch.equal(fused, two), "max|fused-two|/max", ((fused - two).abs().max() / two.abs().max()).item(),
          "two vs spec", rel(two), "fused vs spec", rel(fused), "share equal", (fused == two).float().mean().item())
