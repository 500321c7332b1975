"""fast-plaid 1.4.6's on-disk index, written without fast-plaid, and its search in float64.

fast-plaid pins one exact torch (1.4.6.2110: torch 2.11.0).  The CPU test environment has
torch 2.13: there the 2110 wheel imports but its ``create`` crashes (segmentation fault)
in the libtorch it was not built for.  So CI writes the index files itself, in the layout
fast-plaid's ``rust/index/create.rs`` writes (``metadata.json``, ``centroids.npy``,
``bucket_cutoffs.npy``, ``bucket_weights.npy``, ``avg_residual.npy``, ``ivf.npy`` with
``ivf_lengths.npy``: each centroid's documents, unique and sorted, ``doclens.<i>.json``,
``<i>.codes.npy`` int64, ``<i>.residuals.npy`` uint8), with the residual bytes of
``lik_plugins.plaid.compress`` (fast-plaid's own bytes: ``benchmarks/fast_plaid_parity.py``).

:func:`search_float64` is fast-plaid's ``search`` (``rust/search/search.rs``) written
again step by step, one query at a time, in float64 after fast-plaid's fp16 roundings of its
inputs and centroid scores.  :func:`search_fast_plaid_dtypes` is the same search with every
rounding fast-plaid's CUDA ops make (the rule in ``lik_plugins.plaid_search``'s docstring),
written here independently with float64 / fp32 torch ops on the CPU, its tie rules
explicit: the oracle our path must equal list for list.  ``fast_plaid_stub/fast_plaid`` beside this file is a stand-in package with
fast-plaid's ``search.FastPlaid`` interface over these two functions, so PyLate's
``indexes.PLAID`` runs unmodified on a CPU without fast-plaid.
"""
from __future__ import annotations

import json
import os

import numpy as np
import torch

from lik_plugins.ops import plaid

# the folder that holds the stand-in ``fast_plaid``: a test puts it first on sys.path
STUB_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fast_plaid_stub")


def write_index(path: str, documents: list[torch.Tensor], nbits: int, n_centroids: int, seed: int = 0) -> None:
    os.makedirs(path, exist_ok=True)
    tokens = torch.cat([d.float() for d in documents])
    g = torch.Generator().manual_seed(seed)
    # centroids: normalised sample tokens (k-means quality is not what the tests check)
    centroids = torch.nn.functional.normalize(tokens[torch.randperm(tokens.shape[0], generator=g)[:n_centroids]],
                                              dim=-1).half()
    index = plaid.compress(tokens, centroids.float(), nbits)
    lengths = [int(d.shape[0]) for d in documents]
    pids = torch.repeat_interleave(torch.arange(len(documents)), torch.tensor(lengths))
    ivf, ivf_lengths = [], []
    for c in range(n_centroids):
        members = torch.unique(pids[index.codes.long() == c])
        ivf.append(members)
        ivf_lengths.append(members.numel())
    save = lambda name, a: np.save(os.path.join(path, name), a)  # noqa: E731
    save("centroids.npy", centroids.numpy())
    save("bucket_cutoffs.npy", index.bucket_cutoffs.half().numpy())
    save("bucket_weights.npy", index.bucket_weights.half().numpy())
    save("avg_residual.npy", np.zeros(tokens.shape[1], dtype=np.float16))
    save("ivf.npy", torch.cat(ivf).numpy().astype(np.int64))
    save("ivf_lengths.npy", np.asarray(ivf_lengths, dtype=np.int32))
    save("0.codes.npy", index.codes.numpy().astype(np.int64))
    save("0.residuals.npy", index.residuals.numpy())
    with open(os.path.join(path, "doclens.0.json"), "w") as fh:
        json.dump(lengths, fh)
    with open(os.path.join(path, "0.metadata.json"), "w") as fh:
        json.dump({"num_documents": len(lengths), "num_embeddings": sum(lengths), "embedding_offset": 0}, fh)
    with open(os.path.join(path, "metadata.json"), "w") as fh:
        json.dump({"num_chunks": 1, "nbits": nbits, "num_partitions": n_centroids, "num_embeddings": sum(lengths),
                   "avg_doclen": sum(lengths) / max(len(lengths), 1), "num_documents": len(lengths),
                   "compress_only": False}, fh)


def _read(path: str):
    load = lambda name: np.load(os.path.join(path, name))  # noqa: E731
    with open(os.path.join(path, "metadata.json")) as fh:
        nbits = json.load(fh)["nbits"]
    with open(os.path.join(path, "doclens.0.json")) as fh:
        lengths = json.load(fh)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    ivf_offsets = np.concatenate([[0], np.cumsum(load("ivf_lengths.npy"))])
    return (torch.from_numpy(load("centroids.npy")), torch.from_numpy(load("bucket_weights.npy")), nbits,
            torch.from_numpy(load("0.codes.npy")), torch.from_numpy(load("0.residuals.npy")), offsets,
            torch.from_numpy(load("ivf.npy")), ivf_offsets)


def search_float64(path: str, queries: torch.Tensor, top_k: int, n_ivf_probe: int, n_full_scores: int,
                   subset: list[list[int]] | None = None) -> list[list[tuple[int, float]]]:
    """fast-plaid's search, one query at a time, in float64 after fp16 rounding of the queries,
    centroids and centroid scores (fast-plaid's own dtypes); the exact score takes the query
    tokens as given and the decompressed tokens L2-normalised, as fast-plaid does."""
    centroids, weights, nbits, codes, residuals, offsets, ivf, ivf_offsets = _read(path)
    tokens = plaid.decompress(codes.to(torch.int32), residuals, centroids.double(), weights.double(), nbits)
    tokens = torch.nn.functional.normalize(tokens, dim=-1)
    results = []
    for qi, q in enumerate(queries.half()):
        S = (centroids.double() @ q.double().T).half().double()                  # [C, Lq], fp16 as theirs
        cells = S.topk(min(n_ivf_probe, S.shape[0]), dim=0).indices.flatten().unique()
        cands = torch.cat([ivf[ivf_offsets[c]:ivf_offsets[c + 1]] for c in cells.tolist()]).unique()
        if subset is not None:
            cands = cands[torch.isin(cands, torch.tensor(subset[qi], dtype=torch.int64))]
        approx = torch.stack([S[codes[offsets[p]:offsets[p + 1]]].max(0).values.sum() for p in cands.tolist()]) \
            if cands.numel() else torch.zeros(0, dtype=torch.float64)
        keep = approx.topk(min(max(n_full_scores // 4, 1), cands.numel())).indices
        exact = torch.stack([(q.double() @ tokens[offsets[p]:offsets[p + 1]].T).max(1).values.sum()
                             for p in cands[keep].tolist()]) if keep.numel() else torch.zeros(0, dtype=torch.float64)
        order = exact.argsort(descending=True)[:top_k]
        results.append([(int(cands[keep][i]), float(exact[i])) for i in order.tolist()])
    return results


def _cuda_row_sum(sq: torch.Tensor) -> torch.Tensor:
    """Each row of ``sq [T, d]`` (fp32) summed as PyTorch's CUDA reduction of a contiguous row
    sums it: lanes (32; fewer for rows under 32) each add their elements into up to four fp32
    accumulators -- 4-vectors ``4t .. 4t + 3`` for rows of 128 or more, else elements ``t, t +
    lanes, ..`` -- combined left to right, then a shuffle tree adding lane ``t + offset`` to lane
    ``t``, offsets halving."""
    n, d = sq.shape
    if d >= 128:
        lanes, vectors = 32, sq.reshape(n, d // 4, 4)
        acc = torch.zeros(n, lanes, 4)
        for v0 in range(0, d // 4, lanes):
            chunk = vectors[:, v0:v0 + lanes]
            acc[:, :chunk.shape[1]] += chunk
        per_lane = ((acc[..., 0] + acc[..., 1]) + acc[..., 2]) + acc[..., 3]
    else:
        lanes = min(32, 1 << (d.bit_length() - 1))
        acc = torch.zeros(4, n, lanes)
        for i, e0 in enumerate(range(0, d, lanes)):
            chunk = sq[:, e0:e0 + lanes]
            acc[i % 4, :, :chunk.shape[1]] += chunk
        per_lane = ((acc[0] + acc[1]) + acc[2]) + acc[3]
    while lanes > 1:
        lanes //= 2
        per_lane = per_lane[:, :lanes] + per_lane[:, lanes:2 * lanes]
    return per_lane[:, 0]


def _fp16_of_fp32(x: torch.Tensor) -> torch.Tensor:
    """float64 dot products stored as an fp32-accumulating fp16 op stores them."""
    return x.float().half().double()


def search_fast_plaid_dtypes(path: str, queries: torch.Tensor, top_k: int, n_ivf_probe: int, n_full_scores: int,
                             near: float = 2.0 ** -10):
    """fast-plaid's search with fast-plaid's CUDA roundings, one query at a time.

    Returns ``(results, unsure)``: per query a list of ``(id, score)`` best first, and whether
    the query has a near tie that an fp32 accumulation order may decide either way, or a CPU
    ``topk`` among equal values: at a query token's probe cut (scores equal or one fp16 step
    apart), at the candidate cut or between two of the best ``top_k + 1`` exact scores
    (different but within ``near``).  Equal approximate scores at the cut go to the lower id,
    equal exact scores keep fast-plaid's order (by approximate score then id after a cut, by
    id without one): those are rules, not doubts."""
    centroids, weights, nbits, codes, residuals, offsets, ivf, ivf_offsets = _read(path)
    raw = plaid.decompress(codes.to(torch.int32), residuals, centroids.double(), weights.double(), nbits)
    x = raw.float().half().float()                                        # fp16(centroid + weight)
    norm = torch.sqrt(_cuda_row_sum(x * x)).half().float().clamp_min(1e-12)
    tokens = (x / norm[:, None]).half().double()                          # fp16(x / norm), fp32 division
    n_keep = max(n_full_scores // 4, 1)
    results, unsure = [], []
    for q in queries.half().double():
        S = _fp16_of_fp32(centroids.double() @ q.T)                        # [C, Lq]
        doubt = False
        cells = set()
        for s in S.T.tolist():                                             # each query token
            order = sorted(range(len(s)), key=lambda c: (-s[c], c))
            n = min(n_ivf_probe, len(order))
            cells.update(order[:n])
            if n < len(order):
                doubt |= s[order[n - 1]] - s[order[n]] <= abs(s[order[n - 1]]) * 2.0 ** -10
        cands = sorted({p for c in cells for p in ivf[ivf_offsets[c]:ivf_offsets[c + 1]].tolist()})
        approx = {p: float(S[codes[offsets[p]:offsets[p + 1]]].max(0).values.sum()) for p in cands}
        if len(cands) > n_keep:
            ranked = sorted(cands, key=lambda p: (-approx[p], p))
            doubt |= 0 < approx[ranked[n_keep - 1]] - approx[ranked[n_keep]] <= near
            kept = ranked[:n_keep]
        else:
            kept = cands
        exact = {p: float(_fp16_of_fp32(q @ tokens[offsets[p]:offsets[p + 1]].T).max(1).values.sum())
                 for p in kept}
        final = sorted(kept, key=lambda p: -exact[p])                     # stable: ties keep `kept`'s order
        head = [exact[p] for p in final[:top_k + 1]]
        doubt |= any(0 < a - b <= near for a, b in zip(head, head[1:]))
        results.append([(p, exact[p]) for p in final[:top_k]])
        unsure.append(doubt)
    return results, unsure


def replay_exact_scores(path: str, query: torch.Tensor, ids: list[int], device: str) -> list[float]:
    """fast-plaid's exact scores of documents ``ids`` for one query, with the torch ops its
    ``search`` runs (``decompress_residuals``, ``colbert_score_reduce``) on ``device``: on a
    GPU, the very kernels fast-plaid's libtorch runs there."""
    centroids, weights, nbits, codes, residuals, offsets, _, _ = _read(path)
    centroids, weights, q = centroids.to(device), weights.to(device, torch.float16), query.to(device, torch.float16)
    out = []
    for p in ids:
        lo, hi = int(offsets[p]), int(offsets[p + 1])
        x = plaid.decompress(codes[lo:hi].to(device, torch.int32), residuals[lo:hi].to(device), centroids, weights, nbits)
        x = x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(1e-12)
        out.append(float((x @ q.T).max(0).values.sum(dtype=torch.float32)))
    return out
