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
again step by step, one query at a time, in float64 after fast-plaid's fp16 roundings:
the oracle of the tests.  ``fast_plaid_stub/fast_plaid`` beside this file is a stand-in package with
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
