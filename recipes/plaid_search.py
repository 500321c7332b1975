"""PyLate's PLAID index searched by fast-plaid, then by lik_plugins (``patch_pylate()``): same
index on disk, same parameters, one process.

For each corpus, PyLate builds an ``indexes.PLAID`` (fast-plaid underneath) and
``retrieve.ColBERT(index).retrieve`` answers the queries unpatched, then patched.  Reported:
queries/s of one call with every query (batched), latency p50 / p90 / p99 of one query per
call (and of fast-plaid's ``search`` alone, which PyLate calls after unpickling its id
mappings), peak GPU memory of the batched search (the resident index included; fast-plaid's
libtorch allocates through the same CUDA caching allocator), the share of queries whose
top-10 list equals fast-plaid's -- ids in the same order; equal scores are ordered by
fast-plaid's rule (``lik_plugins.plaid_search`` reproduces its roundings and tie order) --
with the differing lists sorted by cause (:func:`differences`), and recall@10 of each against
exact bf16 MaxSim over the whole corpus.  A search that fails (fast-plaid's out of memory
among others, raised from its Rust core) is recorded as its error and the run goes on.

Corpora:
* ``synthetic``: ``--docs`` documents of 100-300 tokens drawn around a few topics each of a
  clustered token space (embeddings generated directly, no model), queries of 32 tokens
  drawn around a random document's topics;
* ``offline``: the recipes' docstring pairs encoded by ``recipes/fp8_fidelity.py
  --save-embeddings`` (``--offline-embeddings``);
* ``long``: ``--long-docs`` documents of 1000-4000 tokens (a topic per ~70 tokens) searched
  with ``n_full_scores`` 8192 by queries of ``--long-query-tokens`` tokens.  fast-plaid, under
  PyLate's fixed ``batch_size=1 << 18``, scores every candidate's codes in one padded batch
  (``rust/search/search.rs``, ``direct_pad_sequences``): ``candidates x longest candidate x
  query tokens`` fp16 scores, plus a bool padding mask and a masked copy of the same shape
  (:func:`fast_plaid_approx_bytes`).  ``--long-docs auto`` takes enough documents for that to
  exceed the GPU's memory 1.3 times over when every document is a candidate (long documents
  and long queries make them all candidates); ours keeps the same search within its bounded
  workspace.

    python recipes/plaid_search.py --device cuda --out OUT [--docs 100000] [--queries 1000]
        [--offline-embeddings benchmarks/data/plaid_offline_fp16.pt] [--long-docs auto]
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
# two exact scores this close may be ordered either way by an fp32 accumulation order that
# moves one token similarity by one fp16 step (2**-11 below 1); lists that differ only there
# are counted apart from other differences
NEAR = 2.0 ** -10
# the long corpus: documents of these lengths, a topic per this many tokens
LONG_LENGTHS = (1000, 4000)
LONG_TOKENS_PER_TOPIC = 70


def fast_plaid_approx_bytes(n_candidates: int, longest: int, query_tokens: int) -> int:
    """Bytes fast-plaid's approximate stage allocates at once for one query when its batch
    holds every candidate: the padded ``[candidates, longest, query tokens]`` fp16 scores, the
    bool mask of their padding and the masked fp16 copy (``colbert_score_reduce``)."""
    return n_candidates * longest * query_tokens * (2 + 1 + 2)


def synthetic(n_docs: int, lengths: tuple[int, int], n_queries: int, dim: int, seed: int, device: str,
              query_tokens: int = 32, tokens_per_topic: int = 0):
    """(documents as a list of [n, d] fp16 CPU tensors, queries [Nq, query_tokens, d] fp32 on
    ``device``).  A document draws its tokens around 3 topics, or one topic per
    ``tokens_per_topic`` of its longest length when that is given."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    unit = torch.nn.functional.normalize
    n_concepts, per_topic, n_topics = 8192, 16, 2048
    topics_per_doc = max(3, lengths[1] // tokens_per_topic) if tokens_per_topic else 3
    concepts = unit(torch.randn(n_concepts, dim, generator=g, device=device), dim=-1)
    topics = torch.randint(0, n_concepts, (n_topics, per_topic), generator=g, device=device)
    doc_topics = torch.randint(0, n_topics, (n_docs, topics_per_doc), generator=g, device=device)
    lens = torch.randint(lengths[0], lengths[1] + 1, (n_docs,), generator=g, device=device)
    docs = []
    step = min(4096, max(1, (1 << 22) // lengths[1]))          # at most about 4M tokens at a time
    for start in range(0, n_docs, step):
        stop = min(start + step, n_docs)
        total = int(lens[start:stop].sum())
        owner = torch.repeat_interleave(torch.arange(start, stop, device=device), lens[start:stop])
        topic = doc_topics[owner, torch.randint(0, topics_per_doc, (total,), generator=g, device=device)]
        concept = topics[topic, torch.randint(0, per_topic, (total,), generator=g, device=device)]
        tokens = unit(concepts[concept] + NOISE / dim**0.5 * torch.randn(total, dim, generator=g, device=device),
                      dim=-1)
        docs.extend(tokens.half().cpu().split(lens[start:stop].tolist()))
    source = torch.randint(0, n_docs, (n_queries,), generator=g, device=device)
    shape = (n_queries, query_tokens)
    topic = doc_topics[source[:, None], torch.randint(0, topics_per_doc, shape, generator=g, device=device)]
    concept = topics[topic, torch.randint(0, per_topic, shape, generator=g, device=device)]
    queries = unit(concepts[concept] + NOISE / dim**0.5 * torch.randn(*shape, dim, generator=g, device=device),
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


def replay_scores(index, query, ids: list) -> list:
    """fast-plaid's exact scores of documents ``ids`` for one query, recomputed with the torch
    ops its ``search`` runs, on the index's device: ``centroids[code] + bucket_weight`` in
    fp16, divided by its fp16 norm, an fp16 matmul with the fp16 query, max over the
    document's tokens, the sum over the query tokens in fp32 (``search.rs``,
    ``decompress_residuals`` and ``colbert_score_reduce``)."""
    import torch

    from lik_plugins.ops import plaid

    offsets, out = index.host_offsets, []
    q = query.to(index.codes.device, torch.float16)
    for p in ids:
        lo, hi = int(offsets[p]), int(offsets[p + 1])
        x = plaid.decompress(index.codes[lo:hi], index.residuals[lo:hi], index.centroids,
                             index.bucket_weights.half(), index.nbits)
        x = x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(1e-12)
        out.append(float((x @ q.T).max(0).values.sum(dtype=torch.float32)))
    return out


def differences(theirs: list, ours: list) -> dict:
    """Top-10 lists compared position by position: identical (ids in order), the rest split
    into ``near`` (every position's two scores within :data:`NEAR`: an order an fp32
    accumulation may decide) and ``other``; the largest score difference at equal ids."""
    identical = near = 0
    diff_max = 0.0
    for a, b in zip(theirs, ours):
        ids_a, ids_b = [r["id"] for r in a], [r["id"] for r in b]
        sa, sb = [r["score"] for r in a], [r["score"] for r in b]
        diff_max = max([diff_max] + [abs(u - v) for i, j, u, v in zip(ids_a, ids_b, sa, sb) if i == j])
        if ids_a == ids_b:
            identical += 1
        elif len(sa) == len(sb) and all(abs(u - v) <= NEAR for u, v in zip(sa, sb)):
            near += 1
    n = max(len(theirs), 1)
    return dict(identical=identical / n, near=near / n, other=(len(theirs) - identical - near) / n,
                score_abs_diff_max=diff_max)


def _ids(results):
    return [[int(r["id"]) for r in q] for q in results]


def _attempt(fn):
    """``(fn(), None)``, or ``(None, error text)`` when it raises: fast-plaid's Rust core turns a
    libtorch error (CUDA out of memory among them) into pyo3's ``PanicException``, which derives
    from ``BaseException``, not ``Exception``."""
    try:
        return fn(), None
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # noqa: BLE001 -- see above
        text = " ".join(str(err).split())
        return None, f"{type(err).__name__}: {text[:300]}"


def measure(retriever, queries, n_single: int, device: str) -> dict:
    """Batched queries/s, one-query latencies (PyLate's retrieve, and fast-plaid's ``search``
    that PyLate calls inside it), peak memory, the batched results.  A failing search ends
    the measurement with its error (``error``; ``oom`` when it ran out of memory)."""
    import torch

    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out, results = {}, None

    def retrieve(q):
        value = retriever.retrieve(queries_embeddings=q, k=TOP_K)
        sync()
        return value

    def timed(fn):
        sync()
        t0 = time.perf_counter()
        value, err = _attempt(fn)
        return time.perf_counter() - t0, value, err

    if cuda:
        sync()
        torch.cuda.reset_peak_memory_stats()
        out["allocated_before_mib"] = torch.cuda.memory_allocated() / 2**20
    err = None
    for warm in [queries[:4]] + [queries[i:i + 1] for i in range(min(3, len(queries)))]:   # load, compile
        _, err = _attempt(lambda: retrieve(warm))
        if err:
            break
    if err is None:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        elapsed, results, err = timed(lambda: retrieve(queries))
        if err is None:
            out["batched_s"], out["qps"] = elapsed, queries.shape[0] / elapsed
            out["empty_lists"] = sum(not r for r in results)                 # fast-plaid's per-query failures
    if cuda:
        out["peak_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
    if err is not None:
        out["error"], out["oom"] = err, "out of memory" in err.lower()
        if cuda:
            torch.cuda.empty_cache()
        return out, None
    fp = retriever.index._index
    lat, api = [], []
    for i in range(min(n_single, queries.shape[0])):
        q = queries[i:i + 1]
        elapsed, _, err = timed(lambda: retrieve(q))
        lat.append(elapsed)
        elapsed, _, err2 = timed(lambda: fp.fast_plaid.search(q, top_k=TOP_K, batch_size=fp.batch_size,
                                                               n_full_scores=fp.n_full_scores,
                                                               n_ivf_probe=fp.n_ivf_probe, show_progress=False))
        api.append(elapsed)
        if err or err2:
            out["single_error"] = err or err2
            break
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
    longest = max(len(d) for d in docs)
    row = dict(corpus=name, docs=len(docs), tokens=int(sum(len(d) for d in docs)), longest=longest,
               queries=int(queries.shape[0]), query_tokens=int(queries.shape[1]), nbits=args.nbits, build_s=build_s,
               n_full_scores=index._index.n_full_scores, n_ivf_probe=index._index.n_ivf_probe,
               batch_size=index._index.batch_size,
               fast_plaid_approx_gib_all_candidates=fast_plaid_approx_bytes(len(docs), longest, queries.shape[1]) / 2**30)
    print(f"[{name}] index built in {build_s:.1f} s: {row['docs']} documents, {row['tokens']} tokens; fast-plaid's "
          f"approximate stage with every document a candidate: {row['fast_plaid_approx_gib_all_candidates']:.1f} GiB",
          flush=True)
    theirs, their_results = measure(retriever, queries, args.single, args.device)
    print(f"[{name}] fast-plaid: {theirs}", flush=True)
    patch_pylate()
    lik.reset_routing_counts()
    ours, our_results = measure(retriever, queries, args.single, args.device)
    ours["routing"] = lik.routing_counts().get("pylate.PLAID.search", {})
    loaded = ps.load_fast_plaid_index(index._index.fast_plaid_index_path, args.device)
    ours["index_mib"] = loaded.nbytes / 2**20
    print(f"[{name}] lik_plugins: {ours}", flush=True)
    unpatch_pylate()
    row.update(fast_plaid=theirs, lik_plugins=ours)
    if their_results is not None and our_results is not None:
        a, b = _ids(their_results), _ids(our_results)
        cmp = differences(their_results, our_results)
        row["top10_list_identical"] = cmp["identical"]
        row["top10_differing_near"], row["top10_differing_other"] = cmp["near"], cmp["other"]
        row["score_abs_diff_max"] = cmp["score_abs_diff_max"]
        row["top10_set_identical"] = sum(set(x) == set(y) for x, y in zip(a, b)) / len(a)
        # differing lists: both lists' documents rescored with fast-plaid's own torch ops
        differ = [i for i, (x, y) in enumerate(zip(a, b)) if x != y][:100]
        if differ:
            same = {"fast_plaid": 0, "lik_plugins": 0}
            for i in differ:
                union = list(dict.fromkeys(a[i] + b[i]))
                replayed = dict(zip(union, replay_scores(loaded, queries[i], union)))
                for who, res in (("fast_plaid", their_results[i]), ("lik_plugins", our_results[i])):
                    same[who] += all(replayed[int(r["id"])] == r["score"] for r in res)
            row["differing_lists_replayed"] = len(differ)
            row["differing_scores_equal_to_replay"] = {k: v / len(differ) for k, v in same.items()}
        print(f"[{name}] top-10 lists identical to fast-plaid's (same ids, same order; equal scores in fast-plaid's "
              f"order): {cmp['identical']:.1%}; differing within {NEAR:.1e} at every position: {cmp['near']:.1%}; "
              f"other: {cmp['other']:.1%}; largest score difference at equal ids {cmp['score_abs_diff_max']:.2e}",
              flush=True)
        if args.exact:
            exact = exact_top(docs, queries, TOP_K, args.device)

            def recall(got):
                return sum(len(set(g) & set(e)) for g, e in zip(got, exact)) / (TOP_K * len(exact))

            row["recall10_vs_exact_bf16"] = {"fast_plaid": recall(a), "lik_plugins": recall(b)}
    elif our_results is not None and args.exact:
        exact = exact_top(docs, queries, TOP_K, args.device)
        row["recall10_vs_exact_bf16"] = {"lik_plugins": sum(len(set(g) & set(e)) for g, e in zip(
            _ids(our_results), exact)) / (TOP_K * len(exact))}
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
             "Top-10 list =: same ids in the same order as fast-plaid's (equal scores in fast-plaid's order: by "
             "approximate score then id after its candidate cut, by id without one). Differing lists are split into "
             f"near (every position's two scores within {NEAR:.1e}: one fp16 step of one token similarity) and "
             "other.", "",
             "| corpus | docs | tokens | query tokens | n_full_scores | queries/s fast-plaid | queries/s ours | ratio "
             "| p50 ms fast-plaid | p50 ms ours | p90 / p99 ms fast-plaid | p90 / p99 ms ours | peak MiB fast-plaid "
             "| peak MiB ours | top-10 list = | differing: near / other | max score diff | top-10 set = "
             "| recall@10 vs exact bf16 (fp / ours) | fast-plaid `search` p50 ms (fp / ours) |",
             "|" + "---|" * 20]
    for r in rows:
        t, o = r["fast_plaid"], r["lik_plugins"]

        def f(d, k, spec=".1f"):
            if d.get(k) is not None:
                return format(d[k], spec)
            return "OOM" if d.get("oom") else ("failed" if d.get("error") else "-")

        def g(k, spec=".3f"):
            return format(r[k], spec) if r.get(k) is not None else "-"

        rec = r.get("recall10_vs_exact_bf16") or {}
        lines.append(
            f"| {r['corpus']} | {r['docs']} | {r['tokens']} | {r['query_tokens']} | {r['n_full_scores']} | "
            f"{f(t, 'qps')} | {f(o, 'qps')} | {g('qps_ratio', '.2f')} | {f(t, 'p50_ms', '.2f')} | "
            f"{f(o, 'p50_ms', '.2f')} | {f(t, 'p90_ms', '.2f')} / {f(t, 'p99_ms', '.2f')} | "
            f"{f(o, 'p90_ms', '.2f')} / {f(o, 'p99_ms', '.2f')} | {f(t, 'peak_allocated_mib', '.0f')} | "
            f"{f(o, 'peak_allocated_mib', '.0f')} | {g('top10_list_identical')} | "
            f"{g('top10_differing_near')} / {g('top10_differing_other')} | {g('score_abs_diff_max', '.1e')} | "
            f"{g('top10_set_identical')} | {rec.get('fast_plaid', float('nan')):.3f} / "
            f"{rec.get('lik_plugins', float('nan')):.3f} | "
            f"{f(t, 'search_p50_ms', '.2f')} / {f(o, 'search_p50_ms', '.2f')} |")
    for r in rows:
        for who, d in (("fast-plaid", r["fast_plaid"]), ("lik_plugins", r["lik_plugins"])):
            if d.get("error"):
                need = (f"; fast-plaid's approximate stage needs {r['fast_plaid_approx_gib_all_candidates']:.1f} GiB "
                        "at once when every document is a candidate") if who == "fast-plaid" else ""
                lines.append(f"\n{r['corpus']}, {who}: {d['error']} (peak {d.get('peak_allocated_mib', 0):.0f} MiB "
                             f"before it failed{need})")
        if r.get("differing_lists_replayed"):
            eq = r["differing_scores_equal_to_replay"]
            lines.append(f"\n{r['corpus']}: of {r['differing_lists_replayed']} differing top-10 lists, rescored with "
                         f"fast-plaid's own torch ops on this GPU, fast-plaid's scores are reproduced in "
                         f"{eq['fast_plaid']:.1%} and ours in {eq['lik_plugins']:.1%}.")
    return "\n".join(lines) + "\n"


def _long_docs(value: str, query_tokens: int, device: str) -> int:
    """``--long-docs``: a count, or ``auto`` -- enough documents that fast-plaid's approximate
    stage, every document a candidate, needs 1.3 times the GPU's memory."""
    if value != "auto":
        return int(value)
    import torch

    total = torch.cuda.get_device_properties(device).total_memory
    return -(-13 * total // (10 * fast_plaid_approx_bytes(1, LONG_LENGTHS[1], query_tokens)))


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
    p.add_argument("--long-docs", default="0", help="documents of 1000-4000 tokens, or auto (0: skip)")
    p.add_argument("--long-queries", type=int, default=200)
    p.add_argument("--long-query-tokens", type=int, default=256)
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
        del docs
    n_long = _long_docs(args.long_docs, args.long_query_tokens, args.device)
    if n_long:
        docs, queries = synthetic(n_long, LONG_LENGTHS, args.long_queries, args.dim, args.seed + 1, args.device,
                                  query_tokens=args.long_query_tokens, tokens_per_topic=LONG_TOKENS_PER_TOPIC)
        report(run_corpus("long", docs, queries, args, n_full_scores=8192))
    return rows


if __name__ == "__main__":
    main()
