"""Host-side cost of one small call (launch-bound regime): cProfile of repeated calls."""
import cProfile
import pstats
import sys

import torch

sys.path.insert(0, ".")
import lik_plugins as lik  # noqa: E402

Q = torch.randn(1, 32, 128, device="cuda", dtype=torch.bfloat16)
D = torch.randn(1000, 300, 128, device="cuda", dtype=torch.bfloat16)
with torch.no_grad():
    for _ in range(5):
        lik.maxsim(Q, D)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        lik.maxsim(Q, D)
    prof.disable()
pstats.Stats(prof).sort_stats("tottime").print_stats(18)
