"""Rerank an offline corpus through PyLate: its own ``rank.rerank`` loop against the patched
one (one packed launch for every query), printing queries/second and how the rankings agree.

The corpus is the recipes' offline one (stdlib docstrings, encoded by the bundled
all-MiniLM-L6-v2 ColBERT model): each query gets ``--candidates`` passages drawn from the
corpus (its own passage among them).  ``--synthetic`` skips the model and draws unit-norm
random embeddings with document lengths in ``--min-len .. --max-len`` (the benchmark's
100 queries x 1000 candidates, Ld 50-300, on a GPU).  Defaults are small enough for a CPU.

    python recipes/rerank.py                                   # 20 queries x 100 candidates, CPU
    python recipes/rerank.py --synthetic --queries 100 --candidates 1000 --device cuda --dtype float16

PyLate's own run uses whatever backend PyLate picks (``PYLATE_SCORES_BACKEND``, default
``auto``: flash-maxsim or late-interaction-kernels where installed, else torch).
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--queries", type=int, default=20)
    p.add_argument("--candidates", type=int, default=100)
    p.add_argument("--synthetic", action="store_true", help="random embeddings instead of the encoded corpus")
    p.add_argument("--min-len", type=int, default=50, help="--synthetic: shortest document")
    p.add_argument("--max-len", type=int, default=300, help="--synthetic: longest document")
    p.add_argument("--query-length", type=int, default=32)
    p.add_argument("--dim", type=int, default=128, help="--synthetic: embedding size")
    p.add_argument("--model", default=None, help="model name or path (default: the bundled all-MiniLM-L6-v2)")
    p.add_argument("--device", default=None, help="cpu / cuda (default: cuda when available)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--repeats", type=int, default=3, help="timed repetitions of each run (median)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def _synthetic(args, torch):
    g = torch.Generator().manual_seed(args.seed)
    unit = torch.nn.functional.normalize
    dtype = getattr(torch, args.dtype)
    queries = [unit(torch.randn(args.query_length, args.dim, generator=g), dim=-1).to(dtype)
               for _ in range(args.queries)]
    lengths = torch.randint(args.min_len, args.max_len + 1, (args.queries, args.candidates), generator=g)
    docs = [[unit(torch.randn(int(n), args.dim, generator=g), dim=-1).to(dtype) for n in row] for row in lengths]
    ids = [list(range(args.candidates)) for _ in range(args.queries)]
    return ids, queries, docs


def _encoded(args, torch):
    import _common

    from pylate import models

    model_path = args.model or _common.default_model()
    model = models.ColBERT(model_name_or_path=model_path, device="cpu", query_length=args.query_length,
                           document_length=128)
    pairs = _common.docstring_pairs()
    rng = random.Random(args.seed)
    picked = rng.sample(range(len(pairs)), min(args.queries, len(pairs)))
    pool = sorted({i for i in picked} | set(rng.sample(range(len(pairs)), min(len(pairs), args.candidates * 2))))
    encode = dict(batch_size=32, convert_to_numpy=False, show_progress_bar=False)
    q_emb = model.encode([pairs[i]["query"] for i in picked], is_query=True, **encode)
    p_emb = dict(zip(pool, model.encode([pairs[i]["passage"] for i in pool], is_query=False, **encode)))
    dtype = getattr(torch, args.dtype)
    ids, docs = [], []
    for qi in picked:
        others = [i for i in pool if i != qi]
        cand = [qi] + [rng.choice(others) for _ in range(args.candidates - 1)]   # repeats allowed: ties
        rng.shuffle(cand)
        ids.append(cand)
        docs.append([p_emb[i].to(dtype) for i in cand])
    return ids, [q.to(dtype) for q in q_emb], docs


def _timed(fn, repeats, device, torch):
    times, out = [], None
    for _ in range(repeats + 1):          # the first run (compilation, tuning) is not timed
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    times = sorted(times[1:])
    return out, times[len(times) // 2]


def main():
    args = _args()
    import torch

    import lik_plugins

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    ids, queries, docs = (_synthetic if args.synthetic else _encoded)(args, torch)
    queries = [q.to(device) for q in queries]
    docs = [[d.to(device) for d in row] for row in docs]
    from pylate import rank

    lik_plugins.unpatch_pylate()
    theirs, t_theirs = _timed(lambda: rank.rerank(ids, queries, docs), args.repeats, device, torch)
    lik_plugins.patch_pylate()
    from pylate import rank as patched_rank

    lik_plugins.reset_routing_counts()
    ours, t_ours = _timed(lambda: patched_rank.rerank(ids, queries, docs), args.repeats, device, torch)
    routed = lik_plugins.routing_counts().get("pylate.rerank", {})
    lik_plugins.unpatch_pylate()

    same_order = sum([r["id"] for r in a] == [r["id"] for r in b] for a, b in zip(ours, theirs))
    top10 = sum(sum(x["id"] == y["id"] for x, y in zip(a[:10], b[:10])) / min(10, len(a))
                for a, b in zip(ours, theirs)) / len(ours)
    worst = max(abs(x["score"] - y["score"]) for a, b in zip(ours, theirs) for x, y in zip(a, b))
    n = len(queries)
    backend = os.environ.get("PYLATE_SCORES_BACKEND", "auto")
    print(f"rerank: {n} queries x {args.candidates} candidates on {device} ({args.dtype}, "
          f"{'synthetic' if args.synthetic else 'encoded corpus'})")
    print(f"  PyLate's own loop (backend {backend}): {t_theirs * 1e3:9.1f} ms  {n / t_theirs:10.1f} queries/s")
    print(f"  patched (lik_plugins, {', '.join(routed) or '?'}): {t_ours * 1e3:9.1f} ms  "
          f"{n / t_ours:10.1f} queries/s  ({t_theirs / t_ours:.1f}x)")
    print(f"  identical rankings: {same_order}/{n} queries; top-10 positions equal {top10:.3f}; "
          f"largest score difference {worst:.2e}")


if __name__ == "__main__":
    main()
