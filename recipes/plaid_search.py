"""PyLate's PLAID index searched by fast-plaid, then by lik_plugins (``patch_pylate()``): same
index on disk, same parameters, one process.

For each corpus, PyLate builds an ``indexes.PLAID`` (fast-plaid underneath) and
``retrieve.ColBERT(index).retrieve`` answers the queries unpatched, then patched.  Reported:
queries/s of one call with every query (batched), latency p50 / p90 / p99 of one query per
call (and of fast-plaid's ``search`` alone, which PyLate calls after unpickling its id
mappings), peak GPU memory of the batched search (the resident index included; fast-plaid's
libtorch allocates through the same CUDA caching allocator), the share of queries whose
top-10 list (and set) equals fast-plaid's (also: up to near ties, :data:`TIE`), and
recall@10 of each against exact bf16 MaxSim over the whole corpus.

Corpora:
* ``synthetic``: ``--docs`` documents of 100-300 tokens drawn around a few topics each of a
  clustered token space (embeddings generated directly, no model), queries of 32 tokens
  drawn around a random document's topics;
* ``offline``: the recipes' docstring pairs encoded by ``recipes/fp8_fidelity.py
  --save-embeddings`` (``--offline-embeddings``);
* ``long``: ``--long-docs`` documents of 1000-4000 tokens searched with ``n_full_scores``
  8192 (where fast-plaid's fixed batch size has run out of memory).

    python recipes/plaid_search.py --device cuda --out OUT [--docs 100000] [--queries 1000]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

TOP_K = 10
# norm of the noise added to a token's concept (cosine to its concept about 0.86)
NOISE = 0.6
# a position of two top-10 lists counts as a near tie when their scores differ by less than
# this: fast-plaid rounds every token similarity to fp16 (about 2**-11 relative, summed over
# 32 query tokens), ours keeps them in fp32
TIE = 0.02


def synthetic(n_docs: int, lengths: tuple[int, int], n_queries: int, dim: int, seed: int, device: str):
    """(documents as a list of [n, d] fp16 CPU tensors, queries [Nq, 32, d] fp32 on ``device``)."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    unit = torch.nn.functional.normalize
    n_concepts, per_topic, n_topics = 8192, 16, 2048
    concepts = unit(torch.randn(n_concepts, dim, generator=g, device=device), dim=-1)
    topics = torch.randint(0, n_concepts, (n_topics, per_topic), generator=g, device=device)
    doc_topics = torch.randint(0, n_topics, (n_docs, 3), generator=g, device=device)
    lens = torch.randint(lengths[0], lengths[1] + 1, (n_docs,), generator=g, device=device)
    docs = []
    for start in range(0, n_docs, 4096):
        stop = min(start + 4096, n_docs)
        total = int(lens[start:stop].sum())
        owner = torch.repeat_interleave(torch.arange(start, stop, device=device), lens[start:stop])
        topic = doc_topics[owner, torch.randint(0, 3, (total,), generator=g, device=device)]
        concept = topics[topic, torch.randint(0, per_topic, (total,), generator=g, device=device)]
        tokens = unit(concepts[concept] + NOISE / dim**0.5 * torch.randn(total, dim, generator=g, device=device),
                      dim=-1)
        docs.extend(tokens.half().cpu().split(lens[start:stop].tolist()))
    source = torch.randint(0, n_docs, (n_queries,), generator=g, device=device)
    topic = doc_topics[source[:, None], torch.randint(0, 3, (n_queries, 32), generator=g, device=device)]
    concept = topics[topic, torch.randint(0, per_topic, (n_queries, 32), generator=g, device=device)]
    queries = unit(concepts[concept] + NOISE / dim**0.5 * torch.randn(n_queries, 32, dim, generator=g, device=device),
                   dim=-1)
    return docs, queries


def offline(path: str, device: str):
    """Documents and queries of a ``recipes/fp8_fidelity.py --save-embeddings`` file, or of its
    fp16 packed copy (``passages`` [tokens, d] with ``lengths``)."""
    import torch

    emb = torch.load(path)
    if "lengths" in emb:
        docs = list(emb["passages"].half().split(emb["lengths"].tolist()))
    else:
        docs = [d[m].half() for d, m in zip(emb["passages"], emb["passage_mask"])]
    return docs, emb["queries"].float().to(device)


def exact_top(docs, queries, k: int, device: str):
    """``[Nq, k]`` ids of exact bf16 MaxSim over every document (lik_plugins.maxsim, chunks of documents)."""
    import torch

    import lik_plugins as lik

    Q = queries.to(device, torch.bfloat16)
    best_s = torch.full((Q.shape[0], 0), float("-inf"), device=device)
    best_i = torch.zeros((Q.shape[0], 0), dtype=torch.int64, device=device)
    step = 4096
    for start in range(0, len(docs), step):
        chunk = docs[start:start + step]
        D = torch.nn.utils.rnn.pad_sequence(chunk, batch_first=True).to(device, torch.bfloat16)
        mask = torch.nn.utils.rnn.pad_sequence([torch.ones(len(d), dtype=torch.bool) for d in chunk],
                                               batch_first=True).to(device)
        s = lik.maxsim(Q, D, d_mask=mask)
        ids = torch.arange(start, start + len(chunk), device=device).expand_as(s)
        best_s, at = torch.cat([best_s, s], 1).topk(min(k, best_s.shape[1] + s.shape[1]), dim=1)
        best_i = torch.cat([best_i, ids], 1).gather(1, at)
    return best_i.cpu().tolist()


def float64_order(index, queries, lists_a, lists_b, k: int):
    """Per query, the top-``k`` of the two lists' union rescored in float64 exactly as fast-plaid
    scores (its fp16 queries, unnormalised; decompressed tokens normalised), from the index's
    stored codes and residuals (``lik_plugins.ops.plaid.decompress``, the reference decompression)."""
    import torch

    from lik_plugins.ops import plaid

    offsets = index.host_offsets
    centroids, weights = index.centroids.double(), index.bucket_weights.double()
    out = []
    for q, a, b in zip(queries.half().double(), lists_a, lists_b):
        union = list(dict.fromkeys(a + b))
        scores = []
        for p in union:
            lo, hi = int(offsets[p]), int(offsets[p + 1])
            tokens = plaid.decompress(index.codes[lo:hi], index.residuals[lo:hi], centroids, weights, index.nbits)
            scores.append(float((q @ torch.nn.functional.normalize(tokens, dim=-1).T).max(1).values.sum()))
        order = sorted(range(len(union)), key=lambda i: -scores[i])[:k]
        out.append([union[i] for i in order])
    return out


def _ids(results):
    return [[int(r["id"]) for r in q] for q in results]


def measure(retriever, queries, n_single: int, device: str) -> dict:
    """Batched queries/s, one-query latencies (PyLate's retrieve, and fast-plaid's ``search``
    that PyLate calls inside it), peak memory, the batched results."""
    import torch

    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    retriever.retrieve(queries_embeddings=queries[:4], k=TOP_K)                 # warm: load, compile
    for i in range(3):
        retriever.retrieve(queries_embeddings=queries[i:i + 1], k=TOP_K)
    if cuda:
        sync()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    out = {}
    try:
        sync()
        t0 = time.perf_counter()
        results = retriever.retrieve(queries_embeddings=queries, k=TOP_K)
        sync()
        out["batched_s"] = time.perf_counter() - t0
        out["qps"] = queries.shape[0] / out["batched_s"]
    except (RuntimeError, torch.OutOfMemoryError) as err:                       # OOM: report, go on
        out["error"] = f"{type(err).__name__}: {str(err)[:200]}"
        results = None
    if cuda:
        out["peak_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
        out["allocated_before_mib"] = base / 2**20
    lat = []
    for i in range(min(n_single, queries.shape[0])):
        sync()
        t0 = time.perf_counter()
        retriever.retrieve(queries_embeddings=queries[i:i + 1], k=TOP_K)
        sync()
        lat.append(time.perf_counter() - t0)
    fp = retriever.index._index
    api = []
    for i in range(min(n_single, queries.shape[0])):
        sync()
        t0 = time.perf_counter()
        fp.fast_plaid.search(queries[i:i + 1], top_k=TOP_K, batch_size=fp.batch_size, n_full_scores=fp.n_full_scores,
                             n_ivf_probe=fp.n_ivf_probe, show_progress=False)
        sync()
        api.append(time.perf_counter() - t0)
    for name, values in (("", lat), ("search_", api)):
        values = torch.tensor(values) * 1e3
        if values.numel():
            out.update({f"{name}p50_ms": float(values.quantile(0.5)), f"{name}p90_ms": float(values.quantile(0.9)),
                        f"{name}p99_ms": float(values.quantile(0.99))})
    out["single_queries"] = len(lat)
    return out, results


def run_corpus(name: str, docs, queries, args, *, n_full_scores: int | None = None) -> dict:
    import torch
    from pylate import indexes, retrieve

    import lik_plugins as lik
    from lik_plugins import plaid_search as ps
    from lik_plugins.pylate import patch_pylate, unpatch_pylate

    unpatch_pylate()
    folder = tempfile.mkdtemp(prefix=f"plaid_{name}_")
    extra = {} if n_full_scores is None else {"n_full_scores": n_full_scores}
    t0 = time.perf_counter()
    index = indexes.PLAID(index_folder=folder, index_name=name, override=True, nbits=args.nbits,
                          device=args.device, show_progress=False, **extra)
    index.add_documents(documents_ids=[str(i) for i in range(len(docs))], documents_embeddings=docs)
    build_s = time.perf_counter() - t0
    retriever = retrieve.ColBERT(index=index)
    row = dict(corpus=name, docs=len(docs), tokens=int(sum(len(d) for d in docs)), queries=int(queries.shape[0]),
               query_tokens=int(queries.shape[1]), nbits=args.nbits, build_s=build_s,
               n_full_scores=index._index.n_full_scores, n_ivf_probe=index._index.n_ivf_probe,
               batch_size=index._index.batch_size)
    print(f"[{name}] index built in {build_s:.1f} s: {row['docs']} documents, {row['tokens']} tokens", flush=True)
    theirs, their_results = measure(retriever, queries, args.single, args.device)
    print(f"[{name}] fast-plaid: {theirs}", flush=True)
    patch_pylate()
    lik.reset_routing_counts()
    ours, our_results = measure(retriever, queries, args.single, args.device)
    ours["routing"] = lik.routing_counts().get("pylate.PLAID.search", {})
    ours["index_mib"] = ps.load_fast_plaid_index(index._index.fast_plaid_index_path, args.device).nbytes / 2**20
    print(f"[{name}] lik_plugins: {ours}", flush=True)
    unpatch_pylate()
    row.update(fast_plaid=theirs, lik_plugins=ours)
    if their_results is not None and our_results is not None:
        a, b = _ids(their_results), _ids(our_results)
        row["top10_list_identical"] = sum(x == y for x, y in zip(a, b)) / len(a)
        row["top10_set_identical"] = sum(set(x) == set(y) for x, y in zip(a, b)) / len(a)
        sa = [[r["score"] for r in q] for q in their_results]
        sb = [[r["score"] for r in q] for q in our_results]
        row["top10_identical_up_to_near_ties"] = sum(
            x == y or (len(x) == len(y) and all(abs(u - v) < TIE for u, v in zip(su, sv)))
            for x, y, su, sv in zip(a, b, sa, sb)) / len(a)
        row["score_abs_diff_max"] = max((abs(u - v) for su, sv in zip(sa, sb) for u, v in zip(su, sv)), default=0.0)
        # the differing lists against float64: which order is the exact one
        differ = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
        if differ:
            index64 = ps.load_fast_plaid_index(index._index.fast_plaid_index_path, args.device)
            ref = float64_order(index64, queries[differ], [a[i] for i in differ], [b[i] for i in differ], TOP_K)
            row["differing_lists"] = len(differ)
            row["differing_equal_to_float64"] = {
                "fast_plaid": sum(a[i] == r for i, r in zip(differ, ref)) / len(differ),
                "lik_plugins": sum(b[i] == r for i, r in zip(differ, ref)) / len(differ)}
        if args.exact:
            exact = exact_top(docs, queries, TOP_K, args.device)
            def recall(got):
                return sum(len(set(g) & set(e)) for g, e in zip(got, exact)) / (TOP_K * len(exact))

            row["recall10_vs_exact_bf16"] = {"fast_plaid": recall(a), "lik_plugins": recall(b)}
    if "qps" in theirs and "qps" in ours:
        row["qps_ratio"] = ours["qps"] / theirs["qps"]
    for key in ("p50_ms", "search_p50_ms"):
        if key in theirs and key in ours:
            row[key.replace("_ms", "_ratio")] = ours[key] / theirs[key]
    del index, retriever
    torch.cuda.empty_cache() if args.device.startswith("cuda") else None
    return row


def markdown(rows: list, meta: dict) -> str:
    lines = ["# PyLate PLAID search: fast-plaid vs lik_plugins (patch_pylate), same index, same process", "",
             f"{meta['device']}; torch {meta['torch']}, triton {meta['triton']}, fast-plaid {meta['fast_plaid']}, "
             f"PyLate {meta['pylate']}. Command: `{meta['command']}`", "",
             "| corpus | docs | tokens | nbits | n_full_scores | queries/s fast-plaid | queries/s ours | ratio "
             "| p50 ms fast-plaid | p50 ms ours | p90 / p99 ms fast-plaid | p90 / p99 ms ours | peak MiB fast-plaid "
             "| peak MiB ours | top-10 list = | top-10 = up to near ties | top-10 set = "
             "| recall@10 vs exact bf16 (fp / ours) | fast-plaid `search` p50 ms (fp / ours) |",
             "|" + "---|" * 19]
    for r in rows:
        t, o = r["fast_plaid"], r["lik_plugins"]
        def f(d, k, spec=".1f"):
            return format(d[k], spec) if d.get(k) is not None else d.get("error", "-")

        rec = r.get("recall10_vs_exact_bf16")
        lines.append(
            f"| {r['corpus']} | {r['docs']} | {r['tokens']} | {r['nbits']} | {r['n_full_scores']} | {f(t, 'qps')} | "
            f"{f(o, 'qps')} | {r.get('qps_ratio', float('nan')):.2f} | {f(t, 'p50_ms', '.2f')} | "
            f"{f(o, 'p50_ms', '.2f')} | {f(t, 'p90_ms', '.2f')} / {f(t, 'p99_ms', '.2f')} | "
            f"{f(o, 'p90_ms', '.2f')} / {f(o, 'p99_ms', '.2f')} | {f(t, 'peak_allocated_mib', '.0f')} | "
            f"{f(o, 'peak_allocated_mib', '.0f')} | {r.get('top10_list_identical', float('nan')):.3f} | "
            f"{r.get('top10_identical_up_to_near_ties', float('nan')):.3f} | "
            f"{r.get('top10_set_identical', float('nan')):.3f} | "
            + (f"{rec['fast_plaid']:.3f} / {rec['lik_plugins']:.3f} | " if rec else "- | ")
            + f"{f(t, 'search_p50_ms', '.2f')} / {f(o, 'search_p50_ms', '.2f')} |")
    for r in rows:
        if r.get("differing_lists"):
            eq = r["differing_equal_to_float64"]
            lines.append(f"\n{r['corpus']}: {r['differing_lists']} top-10 lists differ; of those, the float64 "
                         f"order of the two lists' union (fast-plaid's scoring formula) equals fast-plaid's list "
                         f"in {eq['fast_plaid']:.1%} and ours in {eq['lik_plugins']:.1%}.")
    return "\n".join(lines) + "\n"


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=None)
    p.add_argument("--docs", type=int, default=100_000)
    p.add_argument("--doc-tokens", type=int, nargs=2, default=(100, 300))
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--single", type=int, default=100, help="queries timed one per call")
    p.add_argument("--nbits", type=int, default=2)
    p.add_argument("--long-docs", type=int, default=0, help="documents of 1000-4000 tokens (0: skip)")
    p.add_argument("--offline-embeddings", default=None)
    p.add_argument("--no-exact", dest="exact", action="store_false")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    import torch
    import triton

    import pylate

    try:
        from importlib.metadata import version

        fp_version = version("fast_plaid")
    except Exception:
        fp_version = "unknown"
    meta = dict(device=torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                torch=torch.__version__, triton=triton.__version__, fast_plaid=fp_version,
                pylate=pylate.__version__, command="python recipes/plaid_search.py " + " ".join(sys.argv[1:]))
    rows = []

    def report(row):        # written after every corpus: a run cut short keeps what it measured
        rows.append(row)
        text = markdown(rows, meta)
        print(text, flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "plaid_search.json"), "w") as fh:
                json.dump({"meta": meta, "rows": rows}, fh, indent=1)
            with open(os.path.join(args.out, "plaid_search.md"), "w") as fh:
                fh.write(text)

    if args.docs:
        docs, queries = synthetic(args.docs, tuple(args.doc_tokens), args.queries, args.dim, args.seed, args.device)
        report(run_corpus("synthetic", docs, queries, args))
        del docs
    if args.offline_embeddings:
        docs, queries = offline(args.offline_embeddings, args.device)
        report(run_corpus("offline", docs, queries, args))
    if args.long_docs:
        docs, queries = synthetic(args.long_docs, (1000, 4000), min(args.queries, 200), args.dim, args.seed + 1,
                                  args.device)
        report(run_corpus("long", docs, queries, args, n_full_scores=8192))
    return rows


if __name__ == "__main__":
    main()
