"""fast-plaid 1.7's own ``FastPlaid.search`` against ours (``patch_fast_plaid()``) on one index.

    python benchmarks/bench_fastplaid17.py                 # CUDA: 100k documents, 1000 queries
    python benchmarks/bench_fastplaid17.py --tiny          # any machine: 60 documents, 6 queries

Builds (once, reused while its parameters match) a fast-plaid index of synthetic clustered
documents -- ``--docs`` of 30-300 tokens, d 128, unit tokens around ``--topics`` directions --
with fast-plaid's own ``create``, then measures each implementation in a fresh process (so
that ``torch.cuda.max_memory_allocated`` is its own: the index it loads included):

* ``queries_per_s``: every query in one ``search`` call (fast-plaid's defaults:
  ``batch_size="auto"``, ``n_full_scores=4096``, ``n_ivf_probe=8``), after one warm-up call;
* ``p50_ms``: the median of ``--single`` one-query calls;
* ``peak_gpu_mib``: the peak over the whole run, index load included;
* ``top10_agreement``: per query, the share of fast-plaid's top-10 ids that ours returns
  (1.0 for the fast-plaid row), averaged; ``same_lists``: the share of queries whose ids are
  equal in order.

Rows go to ``fastplaid17.csv`` under ``$OUT`` (else ``--out``, else the current folder).
With ``--tiny`` off CUDA, ours runs the kernels under Triton's interpreter (CPU), so its
timings there say nothing about speed: the tiny run checks that the script works.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

FIELDS = ("impl", "device", "fast_plaid", "n_docs", "n_tokens", "n_queries", "query_tokens", "top_k",
          "queries_per_s", "p50_ms", "peak_gpu_mib", "top10_agreement", "same_lists", "served_by")


def _arguments(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="60 documents, 6 queries: checks the script anywhere")
    ap.add_argument("--docs", type=int, default=100_000)
    ap.add_argument("--min-tokens", type=int, default=30)
    ap.add_argument("--max-tokens", type=int, default=300)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--topics", type=int, default=2048)
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--query-tokens", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=10)
    ap.add_argument("--nbits", type=int, default=4)
    ap.add_argument("--single", type=int, default=100, help="one-query calls timed for the p50")
    ap.add_argument("--index-dir", default=None, help="where the index is built (default: under the output folder)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--measure", choices=("fast-plaid", "ours"), default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.tiny:
        # the interpreter runs one program per (query, document) scored: keep both few
        args.docs, args.min_tokens, args.max_tokens, args.dim = 60, 4, 30, 32
        args.topics, args.queries, args.query_tokens, args.single = 16, 6, 8, 2
    args.out = os.environ.get("OUT") or args.out or "."
    args.index_dir = args.index_dir or os.path.join(args.out, "fastplaid17_index")
    return args


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _topics(args):
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.nn.functional.normalize(torch.randn(args.topics, args.dim, generator=g), dim=-1)


def _around(topics, topic_ids, noise: float, g):
    import torch

    x = topics[topic_ids] + noise * torch.randn(len(topic_ids), topics.shape[1], generator=g)
    return torch.nn.functional.normalize(x, dim=-1)


def _documents(args):
    """fp16 documents, each mixing 4 topics (seeded: the same corpus on every run)."""
    import torch

    topics, g = _topics(args), torch.Generator().manual_seed(1)
    lengths = torch.randint(args.min_tokens, args.max_tokens + 1, (args.docs,), generator=g).tolist()
    docs = []
    for n in lengths:
        themes = torch.randint(0, args.topics, (4,), generator=g)
        docs.append(_around(topics, themes[torch.randint(0, 4, (n,), generator=g)], 0.35, g).half())
    return docs


def _queries(args):
    """``[n, query_tokens, d]`` queries, each around 2 of the documents' topics."""
    import torch

    topics, g = _topics(args), torch.Generator().manual_seed(2)
    queries = []
    for _ in range(args.queries):
        themes = torch.randint(0, args.topics, (2,), generator=g)
        queries.append(_around(topics, themes[torch.randint(0, 2, (args.query_tokens,), generator=g)], 0.45, g))
    return torch.stack(queries)


def _stamp(args) -> str:
    return json.dumps({k: getattr(args, k) for k in ("docs", "min_tokens", "max_tokens", "dim", "topics", "nbits")})


def build_index(args) -> int:
    """The index in ``args.index_dir`` (built unless its stamp matches); its token count."""
    stamp_file = os.path.join(args.index_dir, "bench_stamp.json")
    if os.path.exists(stamp_file) and open(stamp_file).read() == _stamp(args):
        return json.load(open(os.path.join(args.index_dir, "metadata.json")))["num_embeddings"]
    from fast_plaid import search

    shutil.rmtree(args.index_dir, ignore_errors=True)
    docs = _documents(args)
    started = time.perf_counter()
    search.FastPlaid(index=args.index_dir, device=_device()).create(documents_embeddings=docs, nbits=args.nbits)
    print(f"index: {len(docs)} documents built in {time.perf_counter() - started:.0f} s", flush=True)
    with open(stamp_file, "w") as fh:
        fh.write(_stamp(args))
    return sum(int(d.shape[0]) for d in docs)


def measure(args) -> dict:
    """One implementation in this process: timings, peak memory, its top-k ids."""
    import torch

    import lik_plugins
    from fast_plaid import search

    device = _device()
    if args.measure == "ours":
        from lik_plugins.fast_plaid import patch_fast_plaid

        patch_fast_plaid()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    queries = _queries(args)
    index = search.FastPlaid(index=args.index_dir, device=device)
    run = dict(top_k=args.top_k, show_progress=False)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    index.search(queries[:8], **run)                                       # loads the index, compiles
    sync()
    lik_plugins.reset_routing_counts()
    started = time.perf_counter()
    results = index.search(queries, **run)
    sync()
    batch_s = time.perf_counter() - started
    single = []
    for q in queries[:args.single]:
        started = time.perf_counter()
        index.search(q[None], **run)
        sync()
        single.append(time.perf_counter() - started)
    served = lik_plugins.routing_counts().get("fast_plaid.search", {})
    return {"queries_per_s": len(queries) / batch_s, "p50_ms": 1e3 * statistics.median(single),
            "peak_gpu_mib": torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else 0.0,
            "served_by": "+".join(sorted(served)) or "unpatched", "ids": [[p for p, _ in row] for row in results]}


def _measure_in_process(args, impl: str) -> dict:
    """:func:`measure` of ``impl`` in a fresh interpreter (its own CUDA peak), read back."""
    env = dict(os.environ)
    if _device() == "cpu":          # the kernels under the interpreter: --tiny checks only
        env.update(TRITON_INTERPRET="1", LIK_BACKEND="triton")
    command = [sys.executable, os.path.abspath(__file__), "--measure", impl, "--out", args.out,
               "--index-dir", args.index_dir]
    for name in ("docs", "min_tokens", "max_tokens", "dim", "topics", "queries", "query_tokens", "top_k", "nbits",
                 "single"):
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    subprocess.run(command, check=True, env=env)
    with open(os.path.join(args.out, f"fastplaid17_{impl}.json")) as fh:
        return json.load(fh)


def main(argv=None) -> int:
    args = _arguments(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.measure:
        result = measure(args)
        with open(os.path.join(args.out, f"fastplaid17_{args.measure}.json"), "w") as fh:
            json.dump(result, fh)
        return 0
    n_tokens = build_index(args)
    from importlib.metadata import version

    theirs = _measure_in_process(args, "fast-plaid")
    ours = _measure_in_process(args, "ours")
    rows = []
    for impl, result in (("fast-plaid", theirs), ("ours", ours)):
        overlap = [len(set(a) & set(b)) / max(len(b), 1) for a, b in zip(result["ids"], theirs["ids"])]
        rows.append({"impl": impl, "device": _device(), "fast_plaid": version("fast-plaid"), "n_docs": args.docs,
                     "n_tokens": n_tokens, "n_queries": args.queries, "query_tokens": args.query_tokens,
                     "top_k": args.top_k, "queries_per_s": round(result["queries_per_s"], 2),
                     "p50_ms": round(result["p50_ms"], 3), "peak_gpu_mib": round(result["peak_gpu_mib"], 1),
                     "top10_agreement": round(statistics.fmean(overlap), 4),
                     "same_lists": round(statistics.fmean(a == b for a, b in zip(result["ids"], theirs["ids"])), 4),
                     "served_by": result["served_by"]})
    path = os.path.join(args.out, "fastplaid17.csv")
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    for row in rows:
        print(", ".join(f"{k}={row[k]}" for k in FIELDS))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
