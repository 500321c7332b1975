"""The first ``pylate.rank.rerank`` call of a fresh process: ours against PyLate's own backends.

    python benchmarks/first_rerank.py OUT_DIR [--repeats 2] [--impls lik_plugins,torch]
                                              [--where cuda-fp16,cpu-fp32] [--profile]

The call form a user writes: 100 queries of 32 tokens, 1000 candidates each of 50-300 tokens,
d 128, string ids (``"q3d17"``), queries and candidates as Python lists of per-item tensors (each
its own allocation, as an encoder's output is), ``device="cuda"``.  ``cuda-fp16``: every tensor
on the GPU in fp16; ``cpu-fp32``: candidates in CPU memory in fp32, queries on the GPU.

Each (implementation, placement, repeat) is a fresh process on an empty Triton cache.  The data
are made first (CUDA is initialised by then, as in a user's process), then the first call is
timed to its return (the results are Python lists, so the call has synchronised), then three
more calls (the steady cost).  ``--profile`` adds one process per placement for ours under
cProfile (``profile_<placement>.txt``: where the first call's time goes).
Writes ``first_rerank.json`` and ``first_rerank.md``.
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

NQ, NC, LQ, LO, HI, DIM = 100, 1000, 32, 50, 300, 128


def make_inputs(where: str):
    import torch

    g = torch.Generator(device="cuda").manual_seed(0)
    lengths = torch.randint(LO, HI + 1, (NQ, NC), generator=g, device="cuda").tolist()
    dtype, home = (torch.float16, "cuda") if where == "cuda-fp16" else (torch.float32, "cpu")
    unit = torch.nn.functional.normalize
    queries = [unit(torch.randn(LQ, DIM, generator=g, device="cuda"), dim=-1).to(dtype) for _ in range(NQ)]
    docs = []
    for row in lengths:
        block = unit(torch.randn(sum(row), DIM, generator=g, device="cuda"), dim=-1).to(dtype).to(home)
        docs.append([part.clone() for part in torch.split(block, row)])   # one allocation per item
        del block
    ids = [[f"q{i}d{j}" for j in range(NC)] for i in range(NQ)]
    torch.cuda.synchronize()
    return ids, queries, docs


def cell(impl: str, where: str, profile_to: str | None) -> dict:
    import torch
    from pylate import rank

    if impl == "lik_plugins":
        import lik_plugins

        lik_plugins.patch_pylate()
    else:
        os.environ["PYLATE_SCORES_BACKEND"] = impl
    ids, queries, docs = make_inputs(where)
    profiler = None
    if profile_to:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    started = time.perf_counter()
    first = rank.rerank(ids, queries, docs, device="cuda")
    first_s = time.perf_counter() - started
    if profiler:
        import pstats

        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(40)
        with open(profile_to, "w") as f:
            f.write(text.getvalue())
    steady = []
    for _ in range(3):
        started = time.perf_counter()
        rank.rerank(ids, queries, docs, device="cuda")
        steady.append(time.perf_counter() - started)
    top10 = [[r["id"] for r in ranked[:10]] for ranked in first]
    row = {"impl": impl, "where": where, "first_s": first_s, "steady_s": steady, "top10": top10,
           "torch": torch.__version__}
    if impl == "lik_plugins":      # launches no shipped binary served (each compiled by the JIT)
        from lik_plugins.kernels.triton import binaries_loader

        row["jit_launches"] = binaries_loader.diagnostics()["missing"]
    return row


def spawn(impl, where, out_dir, profile=False):
    env = {k: v for k, v in os.environ.items() if k not in ("PYLATE_SCORES_BACKEND", "LIK_DISABLE", "LIK_PATCH")}
    with tempfile.TemporaryDirectory() as cache:
        env["TRITON_CACHE_DIR"] = cache          # an empty cache, as a fresh machine has
        cmd = [sys.executable, __file__, out_dir, "--cell", f"{impl}:{where}"]
        if profile:
            cmd.append("--profile")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        return {"impl": impl, "where": where, "error": proc.stderr[-2000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def report(rows, out_dir):
    lines = ["| placement | impl | first call s (each process) | steady s (median) | top-10 = torch's |", "|---|---|---|---|---|"]
    keyed = {}
    for r in rows:
        keyed.setdefault((r["where"], r["impl"]), []).append(r)
    for (where, impl), rs in sorted(keyed.items()):
        ok = [r for r in rs if "error" not in r]
        if not ok:
            lines.append(f"| {where} | {impl} | error: {rs[0]['error'].splitlines()[-1] if rs[0]['error'] else '?'} | | |")
            continue
        ref = next((x for x in keyed.get((where, "torch"), []) if "error" not in x), None)
        same = (sum(a == b for a, b in zip(ok[0]["top10"], ref["top10"])) if ref else None)
        firsts = ", ".join(f"{r['first_s']:.3f}" for r in ok)
        steady = statistics.median(s for r in ok for s in r["steady_s"])
        lines.append(f"| {where} | {impl} | {firsts} | {steady:.3f} | {same}/{NQ} |")
    text = "\n".join(lines)
    with open(os.path.join(out_dir, "first_rerank.md"), "w") as f:
        f.write(text + "\n")
    for r in rows:
        r.pop("top10", None)
    meta = {"command": "python benchmarks/first_rerank.py " + " ".join(sys.argv[2:]), "host": "pylate",
            "shape": f"{NQ} queries x {NC} candidates of {LO}-{HI} tokens, d {DIM}"}
    with open(os.path.join(out_dir, "first_rerank.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(text)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--impls", default="lik_plugins,torch")
    parser.add_argument("--where", default="cuda-fp16,cpu-fp32")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--cell")      # internal: impl:placement, run in this process
    args = parser.parse_args()
    if args.cell:
        impl, where = args.cell.split(":")
        profile_to = os.path.join(args.out, f"profile_{where}.txt") if args.profile else None
        print(json.dumps(cell(impl, where, profile_to)))
        return
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for where in args.where.split(","):
        for _ in range(args.repeats):
            for impl in args.impls.split(","):       # alternated, so drift hits both alike
                rows.append(spawn(impl, where, args.out))
                r = rows[-1]
                print(where, impl, r.get("first_s", r.get("error", "")[-300:]), r.get("steady_s"),
                      r.get("jit_launches", ""), flush=True)
        if args.profile:
            spawn("lik_plugins", where, args.out, profile=True)
    report(rows, args.out)


if __name__ == "__main__":
    main()
