"""What the first PyLate scoring call of a fresh process costs: ours against PyLate's torch path.

    python benchmarks/first_call.py OUT_DIR [--repeats 4] [--impls lik_plugins,torch] [--profile]

The call PyLate's ``Contrastive`` makes at batch 128 with one hard negative, through PyLate's
own ``pylate.scores.colbert_scores``: queries ``[128, 32, 128]`` against documents
``[256, 300, 128]`` (fp32, as the normalised embeddings are) with a bool document mask (as
``extract_skiplist_mask`` returns it), under CUDA autocast; forward, then the backward of the
scores' sum, each timed to a device synchronisation.  Then the same call twice more (the
steady cost).

Why this and not only ``real_loop.py --loops pylate``: a PyLate process's first training step
moves by a few hundred ms from one process to the next (the encoder's first calls: cuDNN and
cuBLAS heuristics, kernel modules loaded on first use), so ten processes cannot resolve the
tens of ms in which the two paths differ.  Here CUDA and cuBLAS are warmed first (one bf16
matmul), so the first call pays only what scoring's first use adds: our imports, the shipped
binaries' archive, loads and self-check, or PyTorch's einsum, mask and max kernels loaded on
first launch.

Each (implementation, repeat) is a fresh process on an empty Triton cache; repeats alternate
the implementations.  ``--profile`` adds one process per implementation under cProfile, with
autograd's device threads off so the backward's Python shows (``profile_<impl>.txt``).
Writes ``first_call.json`` and ``first_call.md``.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

BATCH, NEGATIVES, LQ, LD, DIM = 128, 1, 32, 300, 128


def cell(impl: str, profile_to: str | None) -> dict:
    import torch

    import pylate.scores

    if impl == "lik_plugins":
        import lik_plugins

        lik_plugins.patch_pylate()
    else:
        os.environ["PYLATE_SCORES_BACKEND"] = impl
    warm = torch.randn(512, 512, device="cuda", dtype=torch.bfloat16)
    (warm @ warm).sum().item()
    profiler = None
    if profile_to:
        import cProfile

        profiler = cProfile.Profile()
        torch.autograd.set_multithreading_enabled(False)
    g = torch.Generator(device="cuda").manual_seed(0)
    calls = []
    for i in range(3):
        Q = torch.nn.functional.normalize(torch.randn(BATCH, LQ, DIM, device="cuda", generator=g), dim=-1)
        D = torch.nn.functional.normalize(torch.randn(BATCH * (1 + NEGATIVES), LD, DIM, device="cuda", generator=g),
                                          dim=-1)
        d_mask = torch.rand(D.shape[:2], device="cuda", generator=g) > 0.1
        Q.requires_grad_()
        D.requires_grad_()
        torch.cuda.synchronize()
        if profiler and i == 0:
            profiler.enable()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            scores = pylate.scores.colbert_scores(Q, D, documents_mask=d_mask)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        scores.float().sum().backward()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if profiler and i == 0:
            profiler.disable()
            _dump(profiler, profile_to)
        calls.append(dict(forward_ms=(t1 - t0) * 1e3, backward_ms=(t2 - t1) * 1e3))
    row = dict(impl=impl, calls=calls, profiled=bool(profiler))
    if impl == "lik_plugins":
        row["routing"] = lik_plugins.routing_counts()
    return row


def _dump(profiler, path: str) -> None:
    import pstats

    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("cumulative").print_stats(80)
    stats.sort_stats("tottime").print_stats(40)
    with open(path, "w") as fh:
        fh.write(text.getvalue())


def _spawn(impl: str, profile_to: str | None) -> dict:
    with tempfile.TemporaryDirectory(prefix="first-call-cache-") as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=cache, PYTHONUNBUFFERED="1")
        # each cell chooses its path itself: an exported switch must not turn ours into PyLate's
        env.pop("LIK_DISABLE", None)
        env.pop("PYLATE_SCORES_BACKEND", None)
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--cell", impl,
                               *(["--profile-to", profile_to] if profile_to else [])],
                              env=env, capture_output=True, text=True, timeout=300)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return dict(impl=impl, error=(done.stderr.strip().splitlines() or ["no output"])[-1][:300])


def markdown(rows: list, meta: dict) -> str:
    def spread(values):
        return f"{statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]"

    out = [f"# First PyLate scoring call in a fresh process ({meta['device']}, {meta['date']})", "",
           f"torch {meta['torch']}; command: `{meta['command']}`", "",
           "Contrastive's call at batch 128, one hard negative (Q [128, 32, 128] against D [256, 300, 128], "
           "bool document mask, autocast bf16), through `pylate.scores.colbert_scores`; CUDA and cuBLAS warm. "
           "Milliseconds, median [min-max] over the processes.", "",
           "| implementation | processes | first call: forward | backward | forward + backward "
           "| later calls: forward + backward |", "|---|---|---|---|---|---|"]
    for impl in dict.fromkeys(r["impl"] for r in rows):
        rs = [r for r in rows if r["impl"] == impl and "error" not in r and not r["profiled"]]
        if not rs:
            continue
        first = [r["calls"][0] for r in rs]
        later = [c["forward_ms"] + c["backward_ms"] for r in rs for c in r["calls"][1:]]
        out.append(f"| {impl} | {len(rs)} | {spread([c['forward_ms'] for c in first])} | "
                   f"{spread([c['backward_ms'] for c in first])} | "
                   f"{spread([c['forward_ms'] + c['backward_ms'] for c in first])} | {spread(later)} |")
    errors = [r for r in rows if "error" in r]
    return "\n".join(out + [f"\nerror ({r['impl']}): {r['error']}" for r in errors]) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out")
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--impls", default="lik_plugins,torch")
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    import datetime

    import torch

    impls = args.impls.split(",")
    meta = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__,
                date=datetime.date.today().isoformat(), command="python " + " ".join(sys.argv))
    rows = []
    for repeat in range(args.repeats):
        for impl in impls[repeat % len(impls):] + impls[:repeat % len(impls)]:
            row = _spawn(impl, None)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.profile:
        for impl in impls:
            rows.append(_spawn(impl, os.path.join(args.out, f"profile_{impl}.txt")))
    with open(os.path.join(args.out, "first_call.json"), "w") as fh:
        json.dump(dict(meta=meta, rows=rows), fh, indent=1)
    text = markdown(rows, meta)
    with open(os.path.join(args.out, "first_call.md"), "w") as fh:
        fh.write(text)
    print(text)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--cell":
        profile_to = sys.argv[sys.argv.index("--profile-to") + 1] if "--profile-to" in sys.argv else None
        print("RESULT " + json.dumps(cell(sys.argv[2], profile_to)), flush=True)
    else:
        main()
