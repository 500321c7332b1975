"""Host profile of one PyLate Contrastive step, vanilla vs patched, at a small batch.

Usage: python benchmarks/profile_pylate_step.py [BATCH]
Prints the cProfile of 10 patched and 10 vanilla steps (``LIK_DISABLE`` toggled), sorted by
cumulative time, so a per-step host cost of the patch shows up by name.
"""
import cProfile
import pstats
import sys
import tempfile
import time

import torch

sys.path.insert(0, "benchmarks")
from pylate_e2e import build_model, features, train_step, use_variant  # noqa: E402

import lik_plugins  # noqa: E402

lik_plugins.patch_pylate()
from pylate import losses  # noqa: E402

batch = int(sys.argv[1]) if len(sys.argv) > 1 else 8
with tempfile.TemporaryDirectory() as tmp:
    model = build_model(tmp)
model.train()
loss = losses.Contrastive(model=model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
feats = [features(model, batch, seed=i) for i in range(2)]


def step(i):
    train_step(loss, opt, feats[i % 2])
    torch.cuda.synchronize()


for variant in ("patched", "vanilla", "patched", "vanilla"):
    use_variant(variant)
    for i in range(3):
        step(i)
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    for i in range(10):
        step(i)
    prof.disable()
    print(f"==== {variant}: {(time.perf_counter() - t) * 100:.1f} ms/step (profiled)")
    pstats.Stats(prof).sort_stats("cumulative").print_stats(28)

# The autograd engine runs backward functions on its own thread, which cProfile does not
# see: the torch profiler does.
from torch.profiler import ProfilerActivity, profile  # noqa: E402

for variant in ("patched", "vanilla"):
    use_variant(variant)
    for i in range(2):
        step(i)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(5):
            step(i)
    print(f"==== torch profiler, {variant}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=60))
