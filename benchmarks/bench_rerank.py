"""Reranking through the hosts' own entry points: ours (patched) against each host's own backends.

    python benchmarks/bench_rerank.py OUT_DIR [--quick] [--cpu] [--only pylate,colpali,st]
        [--reps 5] [--warmup 2] [--rounds 1] [--skip host:variant,...] [--cases part,...]

Hosts and cases (d 128, unit-norm random tokens, seeded):

* PyLate ``rank.rerank``: 100 queries of 32 tokens x 1000 candidates of 50-300 tokens, candidates
  on the GPU in fp16 / bf16 / fp32, and fp32 candidates on the CPU with ``device="cuda"``;
  variants: PyLate's own loop with ``PYLATE_SCORES_BACKEND`` = ``torch`` / ``flash`` (flash-maxsim) /
  ``lik`` (late-interaction-kernels), and ``ours`` (``patch_pylate()``, ``auto``).
  ``--cpu``: 20 x 150 candidates, fp32, on the CPU (``torch`` against ``ours``).
* colpali-engine ``score_multi_vector``: 16 queries of 15-30 tokens x 2000 pages of 700-1030
  tokens, bf16, ``batch_size=128``; colpali's own (``COLPALI_SCORES_BACKEND=torch``), its LIK
  backend (``auto`` with late-interaction-kernels installed), ``ours``.
* sentence-transformers 6 ``util.maxsim`` on lists: 100 queries of 32 tokens x 5000 documents of
  50-300 tokens, bf16; ST's own chunked path against ``ours``.

Each variant runs in its own process (a fresh CUDA context, allocator and caches); every case
is timed after ``--warmup`` calls (the first compiles our kernel; the hosts' loops warm their
allocator and caches too), then ``--reps`` synchronised calls, each after a garbage collection
(the hosts' loops leave thousands of tensors behind; a collection inside a timed call would
land on whichever variant comes next).  ``--rounds N`` runs every variant's process N times,
interleaved (host A, B, ours, A, B, ours, ...), so a drift of the machine over the run shows
in the spread instead of in one variant's figure; the timed calls of all rounds are pooled.
Reported: the median seconds per call, its spread (min-max and p10-p90 over the pooled calls),
queries/s, peak GPU memory above the inputs, the share of queries whose full ranking (and top
10) is identical to the host's own first backend's, and two ratios against the host's fastest
own backend: medians, and the worst case (the host backend's fastest call against our slowest).
Writes ``rerank.json`` and ``rerank.md`` (with the command) into OUT_DIR.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
DIM = 128

# host -> [(variant, environment)]; the first variant is the host's own reference ranking.
# A host variable set to lik / auto turns lik_plugins on at start-up (lik_plugins_autoactivate.pth):
# the hosts' own LIK backends run with LIK_DISABLE=1 (the patch then steps aside), and ``ours``
# patches explicitly with the variables unset.
VARIANTS = {
    "pylate": [("torch", {"PYLATE_SCORES_BACKEND": "torch"}), ("flash", {"PYLATE_SCORES_BACKEND": "flash"}),
               ("lik", {"PYLATE_SCORES_BACKEND": "lik", "LIK_DISABLE": "1"}), ("ours", {})],
    "colpali": [("torch", {"COLPALI_SCORES_BACKEND": "torch"}),
                ("lik", {"COLPALI_SCORES_BACKEND": "auto", "LIK_DISABLE": "1"}), ("ours", {})],
    "st": [("st", {}), ("ours", {})],
}
HOST_VARIABLES = ("PYLATE_SCORES_BACKEND", "COLPALI_SCORES_BACKEND", "LIK_PATCH", "LIK_DISABLE")


def _ragged(n, lo, hi, dtype, device, seed):
    """``n`` unit-norm ``[L, DIM]`` tensors, ``L`` in ``[lo, hi]``: views of one buffer, as an
    encoder's split output is."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    gen_device = "cuda" if torch.cuda.is_available() else "cpu"
    gd = torch.Generator(device=gen_device).manual_seed(seed)
    flat = torch.nn.functional.normalize(torch.randn(sum(lengths), DIM, generator=gd, device=gen_device), dim=-1)
    return list(torch.split(flat.to(device=device, dtype=dtype), lengths))


def _cases(host, quick, cpu):
    scale = 10 if quick else 1
    if host == "pylate":
        if cpu:
            return [("cpu-fp32", torch.float32, "cpu", None, 20, 150)]
        return [(f"cuda-{name}", dtype, "cuda", None, 100, 1000 // scale)
                for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16), ("fp32", torch.float32))] + \
               [("cpu-resident-fp32", torch.float32, "cpu", "cuda", 100, 1000 // scale)]
    if host == "colpali":
        return [("cuda-bf16", torch.bfloat16, "cuda", "cuda", 16, 2000 // scale)]
    return [("cuda-bf16", torch.bfloat16, "cuda", None, 100, 5000 // scale)]


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time(fn, reps, warmup):
    """(seconds of each timed call, peak GPU bytes above the memory in use before them, last output)."""
    for _ in range(warmup):
        fn()
    _sync()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    times, out = [], None
    for _ in range(reps):
        out = None
        gc.collect()
        _sync()
        t0 = time.perf_counter()
        out = fn()
        _sync()
        times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() - base) if torch.cuda.is_available() else 0
    return times, peak, out


def _run_variant(host, variant, quick, cpu, reps, warmup, tmp, cases=""):
    """One process: every case of ``host`` under ``variant``; rankings saved to ``tmp``."""
    results = []
    if variant == "ours":
        if host == "pylate":
            from lik_plugins.pylate import patch_pylate
            patch_pylate()
        elif host == "colpali":
            import lik_plugins
            lik_plugins.patch_colpali_engine()
        else:
            from lik_plugins.sentence_transformers import patch_sentence_transformers
            patch_sentence_transformers()
    for case, dtype, where, device, nq, nc in _cases(host, quick, cpu):
        if cases and not any(part in case for part in cases.split(",")):
            continue
        if not torch.cuda.is_available():   # a smoke run of the harness on a CPU-only machine
            where, device = "cpu", None if device is None else "cpu"
        if case.startswith("cpu-resident") and variant in ("flash", "lik"):
            continue   # the transfer dominates: PyLate's backends differ in the scoring only
        if host == "pylate":
            from pylate import rank
            queries = _ragged(nq, 32, 32, dtype, where, 1)
            docs = [_ragged(nc, 50, 300, dtype, where, 100 + i) for i in range(nq)]
            ids = [list(range(nc)) for _ in range(nq)]

            def call():
                return rank.rerank(ids, queries, docs, device=device)

            def ranking(out):
                return torch.tensor([[r["id"] for r in q] for q in out], dtype=torch.int32)
        elif host == "colpali":
            from colpali_engine.utils.processing_utils import BaseVisualRetrieverProcessor as Base
            queries = _ragged(nq, 15, 30, dtype, where, 1)
            docs = _ragged(nc, 700, 1030, dtype, where, 2)

            def call():
                return Base.score_multi_vector(queries, docs, batch_size=128, device=device)

            def ranking(out):
                return torch.sort(out.float().cpu(), dim=1, descending=True, stable=True).indices.int()
        else:
            from sentence_transformers.util import maxsim
            queries = _ragged(nq, 32, 32, dtype, where, 1)
            docs = _ragged(nc, 50, 300, dtype, where, 2)

            def call():
                return maxsim(queries, docs)

            def ranking(out):
                return torch.sort(out.float().cpu(), dim=1, descending=True, stable=True).indices.int()
        try:
            times, peak, out = _time(call, reps, warmup)
        except Exception as exc:  # noqa: BLE001 -- a peer missing on this machine is a row, not a crash
            results.append({"host": host, "case": case, "variant": variant, "error": f"{type(exc).__name__}: {exc}"})
            print(f"[bench] {host} {case} {variant}: {exc}", flush=True)
            continue
        torch.save(ranking(out), os.path.join(tmp, f"{host}_{case}_{variant}.pt"))
        results.append({"host": host, "case": case, "variant": variant, "dtype": str(dtype).replace("torch.", ""),
                        "queries": nq, "candidates_per_query": nc, "all_seconds": times, "peak_gpu_bytes": peak})
        print(f"[bench] {host} {case} {variant}: median {statistics.median(times):.4f} s "
              f"(min {min(times):.4f}, max {max(times):.4f})", flush=True)
        del queries, docs, out
    return results


def _share_identical(a, b):
    return float((a == b).all(dim=1).float().mean())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--only", default="pylate,colpali,st")
    parser.add_argument("--reps", type=int, default=5, help="timed calls per case and process")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls first (compile, caches)")
    parser.add_argument("--rounds", type=int, default=1, help="processes per variant, interleaved")
    parser.add_argument("--skip", default="", help="host:variant,... not to run (e.g. peers a previous run "
                        "measured slower than the host's fastest backend)")
    parser.add_argument("--cases", default="", help="run only the cases whose name contains one of these "
                        "comma-separated parts (e.g. cpu-resident)")
    parser.add_argument("--variant")      # internal: host:variant, run in this process
    parser.add_argument("--tmp")
    args = parser.parse_args()
    if args.variant:
        host, variant = args.variant.split(":")
        rows = _run_variant(host, variant, args.quick, args.cpu, args.reps, args.warmup, args.tmp, args.cases)
        with open(os.path.join(args.tmp, f"{host}_{variant}.json"), "w") as f:
            json.dump(rows, f)
        return
    os.makedirs(args.out, exist_ok=True)
    tmp = tempfile.mkdtemp()
    measured = {}        # (host, case, variant) -> row with every round's calls pooled
    errors = []
    hosts = [h for h in args.only.split(",") if h]
    for host in hosts:
        variants = VARIANTS[host] if not args.cpu else [v for v in VARIANTS[host] if v[0] in ("torch", "ours")]
        variants = [(v, env) for v, env in variants if f"{host}:{v}" not in args.skip.split(",")]
        for round_ in range(args.rounds):
            for variant, env in variants:
                cmd = [sys.executable, os.path.abspath(__file__), args.out, "--variant", f"{host}:{variant}",
                       "--tmp", tmp, "--reps", str(args.reps), "--warmup", str(args.warmup)] + \
                      (["--quick"] if args.quick else []) + (["--cpu"] if args.cpu else []) + \
                      (["--cases", args.cases] if args.cases else [])
                base = {k: v for k, v in os.environ.items() if k not in HOST_VARIABLES}
                proc = subprocess.run(cmd, env={**base, **env}, capture_output=True, text=True)
                sys.stdout.write(proc.stdout)
                path = os.path.join(tmp, f"{host}_{variant}.json")
                if proc.returncode != 0 or not os.path.exists(path):
                    errors.append({"host": host, "variant": variant, "round": round_, "error": proc.stderr[-2000:]})
                    print(proc.stderr[-2000:], flush=True)
                    continue
                with open(path) as f:
                    for row in json.load(f):
                        _pool(measured, row, round_)
                os.remove(path)
                _report(args, list(measured.values()) + errors, tmp)
    _report(args, list(measured.values()) + errors, tmp)


def _pool(measured, row, round_):
    """One process's row added to the pooled row of its (host, case, variant)."""
    if "all_seconds" not in row:
        measured[(row["host"], row.get("case"), row["variant"], round_)] = row    # an error: kept per round
        return
    key = (row["host"], row["case"], row["variant"])
    if key not in measured:
        measured[key] = {**row, "all_seconds": [], "round_medians": [], "peak_gpu_bytes": 0}
    pooled = measured[key]
    pooled["all_seconds"] += row["all_seconds"]
    pooled["round_medians"].append(statistics.median(row["all_seconds"]))
    pooled["peak_gpu_bytes"] = max(pooled["peak_gpu_bytes"], row["peak_gpu_bytes"])


def _quantile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _report(args, rows, tmp):
    """Statistics, rankings compared, speed-ups, JSON + Markdown written (after every variant:
    a run cut short by its time limit keeps what it measured)."""
    for row in rows:
        if "all_seconds" not in row:
            continue
        times = row["all_seconds"]
        row.update(seconds=statistics.median(times), min_seconds=min(times), max_seconds=max(times),
                   p10_seconds=_quantile(times, 0.1), p90_seconds=_quantile(times, 0.9))
        row["queries_per_s"] = row["queries"] / row["seconds"]
    # identical rankings and speed-ups against the host's own variants, per case
    for row in rows:
        if "seconds" not in row:
            continue
        ref_variant = VARIANTS[row["host"]][0][0]
        same_case = [r for r in rows
                     if r.get("host") == row["host"] and r.get("case") == row["case"] and "seconds" in r]
        ref = [r for r in same_case if r["variant"] == ref_variant]
        own = [r for r in same_case if r["variant"] != "ours"]
        if ref:
            a = torch.load(os.path.join(tmp, f"{row['host']}_{row['case']}_{row['variant']}.pt"))
            b = torch.load(os.path.join(tmp, f"{row['host']}_{row['case']}_{ref_variant}.pt"))
            row["identical_ranking_share"] = _share_identical(a, b)
            row["identical_top10_share"] = _share_identical(a[:, :10], b[:, :10])
        if own:
            fastest = min(own, key=lambda r: r["seconds"])
            row["fastest_host_backend"] = fastest["variant"]
            row["speedup_vs_fastest_host_backend"] = fastest["seconds"] / row["seconds"]
            # the fastest own backend's fastest call against this variant's slowest
            row["worst_case_speedup"] = fastest["min_seconds"] / row["max_seconds"]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    import triton
    meta = {"command": " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]), "device": device,
            "torch": torch.__version__, "triton": triton.__version__, "cpu_count": os.cpu_count(),
            "reps": args.reps, "warmup": args.warmup, "rounds": args.rounds}
    with open(os.path.join(args.out, "rerank.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    lines = [f"# Reranking through the hosts' entry points ({device})", "",
             f"`{meta['command']}` -- torch {meta['torch']}, triton {meta['triton']}; each variant in its own "
             f"process ({args.rounds} round(s), interleaved); {args.warmup} warm-up calls, then {args.reps} timed "
             "calls a process, pooled over the rounds: median, min-max, p10-p90. x fastest host backend: ratio of "
             "medians; worst case: that backend's fastest call against this variant's slowest.", "",
             "| host | case | variant | s / call (median) | min-max | p10-p90 | queries/s | x fastest host backend | "
             "worst case | identical rankings | identical top-10 | peak GPU MiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "seconds" not in r:
            lines.append(f"| {r['host']} | {r.get('case', '')} | {r['variant']} | error | | | | | | | | |")
            continue
        lines.append(f"| {r['host']} | {r['case']} | {r['variant']} | {r['seconds']:.4f} | "
                     f"{r['min_seconds']:.4f}-{r['max_seconds']:.4f} | {r['p10_seconds']:.4f}-{r['p90_seconds']:.4f} | "
                     f"{r['queries_per_s']:.1f} | {r.get('speedup_vs_fastest_host_backend', float('nan')):.2f} "
                     f"({r.get('fastest_host_backend', '')}) | {r.get('worst_case_speedup', float('nan')):.2f} | "
                     f"{r.get('identical_ranking_share', float('nan')):.3f} | "
                     f"{r.get('identical_top10_share', float('nan')):.3f} | {r['peak_gpu_bytes'] / 2**20:.0f} |")
    with open(os.path.join(args.out, "rerank.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
