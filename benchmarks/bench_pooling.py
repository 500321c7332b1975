"""CPU benchmark of hierarchical (Ward) token pooling: the hosts' poolers against
lik_plugins.ops.hierarchical_pool on random unit vectors, d 128.

Workloads: 1000 documents of 100-300 tokens (pool factor 2, PyLate's pooler, 1 protected
token) and 100 pages of 1030 tokens (pool factor 3, PyLate's and colpali-engine's).  Prints
the ms per document of each, the ratio, and the share of documents whose partition is
identical (same pooled shape and vectors within 1e-5); ``--out`` writes the table as
Markdown.

    python benchmarks/bench_pooling.py --out benchmarks/results/cpu/<date>/pooling.md
"""
from __future__ import annotations

import argparse
import os
import platform
import time
import warnings

import torch

from lik_plugins.ops import hierarchical_pool


def unit_documents(count: int, low: int, high: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (count,), generator=g).tolist()
    return [torch.nn.functional.normalize(torch.randn(n, 128, generator=g), dim=1) for n in lengths]


def seconds(function, repeats: int) -> tuple[float, object]:
    """Best of ``repeats`` wall times (the machine may be shared) and the last result."""
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = function()
        best = min(best, time.perf_counter() - start)
    return best, result


def identical_share(ours, theirs) -> float:
    same = sum(a.shape == b.shape and torch.allclose(a, b, rtol=0, atol=1e-5) for a, b in zip(ours, theirs))
    return same / len(theirs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=1000)
    parser.add_argument("--pages", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from pylate.models.colbert import ColBERT
    from colpali_engine.compression.token_pooling import HierarchicalTokenPooler
    warnings.filterwarnings("ignore", category=UserWarning)   # scipy's "looks like a distance matrix"

    def pylate(docs, factor):
        return ColBERT.pool_embeddings_hierarchical(None, docs, factor, 1)

    def colpali(docs, factor):
        return HierarchicalTokenPooler().pool_embeddings(docs, pool_factor=factor)

    documents = unit_documents(args.documents, 100, 300, seed=0)
    pages = unit_documents(args.pages, 1030, 1030, seed=1)
    cases = [
        ("PyLate", "1000 documents, 100-300 tokens, factor 2", documents, 2,
         lambda: pylate(documents, 2), lambda: hierarchical_pool(documents, 2, 1)),
        ("PyLate", "pages of 1030 tokens, factor 3", pages, 3,
         lambda: pylate(pages, 3), lambda: hierarchical_pool(pages, 3, 1)),
        ("colpali-engine", "pages of 1030 tokens, factor 3", pages, 3,
         lambda: colpali(pages, 3),
         lambda: hierarchical_pool(pages, 3, cluster_on="distance_rows", normalize=True)),
    ]
    hierarchical_pool(documents[:4], 2, 1)   # scipy imported, caches warm
    rows = []
    for host, workload, docs, _, theirs_fn, ours_fn in cases:
        host_s, theirs = seconds(theirs_fn, args.repeats)
        ours_s, ours = seconds(ours_fn, args.repeats)
        host_ms, ours_ms = host_s / len(docs) * 1e3, ours_s / len(docs) * 1e3
        share = identical_share(ours, theirs)
        rows.append((host, workload.replace("1000 documents", f"{len(docs)} documents")
                     if host == "PyLate" and docs is documents else f"{len(docs)} {workload}",
                     host_ms, ours_ms, host_ms / ours_ms, share))
        print(f"{host:15s} {rows[-1][1]:45s} host {host_ms:8.3f} ms/doc  ours {ours_ms:8.3f} ms/doc  "
              f"x{host_ms / ours_ms:5.2f}  identical {share:.1%}")
    if args.out:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            f.write("# Hierarchical token pooling on the CPU: the hosts' poolers against hierarchical_pool\n\n")
            f.write(f"`python benchmarks/bench_pooling.py --out {args.out}`; random unit vectors, d 128; "
                    f"best of {args.repeats} runs; torch {torch.__version__}, {torch.get_num_threads()} threads, "
                    f"{os.cpu_count()} CPUs ({platform.machine()}). Identical: same pooled shape and vectors "
                    "within 1e-5 (the same partition).\n\n")
            f.write("| host pooler | workload | host ms/doc | ours ms/doc | speed-up | identical |\n")
            f.write("|---|---|---:|---:|---:|---:|\n")
            for host, workload, host_ms, ours_ms, ratio, share in rows:
                f.write(f"| {host} | {workload} | {host_ms:.3f} | {ours_ms:.3f} | {ratio:.2f}x | {share:.1%} |\n")


if __name__ == "__main__":
    main()
