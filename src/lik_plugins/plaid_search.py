"""PLAID search over a fast-plaid index on disk, a batch of queries at a time, on the GPU.

fast-plaid (PyLate's ``indexes.PLAID``, colpali-engine's ``get_topk_plaid``) searches in
libtorch ops with host synchronisations along the way (1.4: one query at a time; 1.5 and newer
in chunks planned from free memory).  :func:`plaid_search` runs the same algorithm (fast-plaid
1.4.6's ``rust/search/search.rs``; 1.7.0 returns the same lists, ``tests/hosts/fast_plaid``)
for a whole batch, with no host synchronisation until the results are read back once:

1. centroid scores ``S = centroids @ Q.T`` for every query token;
2. IVF probe: the ``n_ivf_probe`` best centroids of each query token, and the union of
   their inverted lists -- a dense ``[B, N]`` candidate mask (:mod:`.kernels.triton.plaid_probe`);
3. approximate score of every candidate from its codes (``sum_s max_t S[code_t, s]``);
4. the ``max(n_full_scores // 4, 1)`` best candidates by that score (fast-plaid keeps the
   top ``n_full_scores`` and then decompresses the top quarter of those: the same set);
5. their exact MaxSim -- the query tokens as given against the decompressed, L2-normalised
   residual tokens, fast-plaid's score -- read in place from the packed index
   (``plaid_probe.fast_plaid_scores``);
6. the top ``k``.

Rounding and order, as fast-plaid computes them (its index, queries and codec tensors are
fp16; every step is a libtorch op on them), reproduced here step by step:

* centroid scores: an fp16 matmul -- fp32 accumulation, each score rounded to fp16 (the same
  torch op here);
* probe: ``topk`` of each query token's fp16 scores; equal scores at the cut go to the lower
  centroid id (CUDA's ``topk``, here too);
* approximate score: the fp16 maximum over the document's codes per query token, summed over
  the query tokens in fp32 (``sum(dtype=float)``);
* candidate cut: ``topk`` by approximate score; equal scores at the cut go to the lower
  document id (CUDA ``topk`` gathers ties in index order; fast-plaid's candidates are sorted
  by id);
* exact score: each token ``x = fp16(centroid + bucket_weight)``; its norm
  ``fp16(sqrt(sum x^2))``, the squares summed in fp32 in the order of PyTorch's CUDA row
  reduction (``plaid_probe._torch_cuda_row_sum``); ``fp16(x / norm)`` (fp32 IEEE division);
  each similarity with the fp16 query an fp32 dot rounded to fp16; the fp16 maximum over the
  document's tokens; the sum over the query tokens in fp32.  A sum of fp16 values in fp32 is
  exact in any order while its partial sums stay below ``2**k`` and every nonzero term is at
  least ``2**(k - 14)`` in magnitude (cosine maxima of 32 query tokens: below 32, terms from
  ``2**-9``), so the summation order of the two query sums does not matter there;
* final order: fast-plaid sorts the exact scores with a stable sort (CUDA sorts of 33 to 4096
  keys are stable), so equal scores keep the order of the kept documents: by approximate score,
  then by id, when the cut removed candidates, and by id when all of them were kept.  Here
  the kept documents are put in that order and sorted stably.

What may still differ: the fp32 accumulation order inside a dot product (cuBLAS's and Triton's
tensor-core sums), which changes an fp16-rounded similarity only when its fp32 value falls
within a few fp32 ulps of an fp16 rounding boundary; PyTorch's row-reduction order where a
release changes it; a search with 32 or fewer kept documents (fast-plaid's bitonic sort of
those is unstable).

Memory is bounded whatever the batch: queries are taken ``B`` at a time with ``B`` sized so
that the centroid scores and the ``[B, N]`` candidate buffers fit :data:`WORKSPACE_BYTES`
(the index's size, between 32 and 512 MiB).

Queries: fast-plaid 1.4 searches the padded batch as given (a zero token probes cells like
any other); 1.5 and newer drop each query's trailing zero tokens before searching.  With
``query_lengths`` a query's tokens past its length are left out of the probe (the only step
where a zero token counts: it adds 0 to every score), which is the newer releases' search.

The index (:func:`load_fast_plaid_index`) is read from fast-plaid's files, in any release's
layout, once per (folder, device, modification times) and kept on the device: codes int32
(fast-plaid holds int64), residuals uint8 as stored, centroids fp16, inverted lists int32.
"""
from __future__ import annotations

import json
import logging
import os
import threading
from typing import NamedTuple

import numpy as np
import torch

from . import _routing
from .fast_plaid._files import chunks, index_files
from .ops.validate import check_tensor
from .kernels.dispatch import served_by

__all__ = ["FastPlaidIndex", "load_fast_plaid_index", "plaid_search", "clear_index_cache"]

logger = logging.getLogger(__name__)

#: Bounds on one query batch's scratch memory, otherwise the index's own size (module
#: docstring): a search's scratch stays below the index it searches.
WORKSPACE_BYTES = (32 << 20, 512 << 20)
# CUDA's limit on a grid's second dimension (the approximate-score kernel's queries)
_MAX_GRID_Y = 65535


class FastPlaidIndex(NamedTuple):
    """A fast-plaid index held on one device (:func:`load_fast_plaid_index`)."""

    centroids: torch.Tensor        # [C, d] fp16
    bucket_weights: torch.Tensor   # [2**nbits] fp32
    nbits: int
    codes: torch.Tensor            # [T] int32, every document's tokens back to back
    residuals: torch.Tensor        # [T, d * nbits / 8] uint8
    doc_offsets: torch.Tensor      # [N + 1] int32
    ivf: torch.Tensor              # [E] int32 document ids, every centroid's list back to back
    ivf_offsets: torch.Tensor      # [C + 1] int64
    max_doclen: int
    host_offsets: np.ndarray       # doc_offsets in host memory (subset filtering)
    layout: str                    # the files it was read from: "shards", "merged" or "mixed"

    @property
    def n_docs(self) -> int:
        return self.doc_offsets.shape[0] - 1

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self if isinstance(t, torch.Tensor))


_cache: dict = {}
_cache_lock = threading.Lock()


def _read_index(path: str, device: torch.device) -> FastPlaidIndex:
    files = index_files(path)
    load = lambda name: np.load(os.path.join(path, name))  # noqa: E731
    centroids = load("centroids.npy")
    nbits = int(files.meta["nbits"])
    codes, residuals = [], []
    # chunk by chunk to the device: one host copy of a chunk at a time, never the index
    for chunk_codes, chunk_residuals in chunks(files):
        codes.append(torch.from_numpy(chunk_codes.astype(np.int32)).to(device))
        residuals.append(torch.from_numpy(np.array(chunk_residuals)).to(device))     # a writable copy
    offsets = np.concatenate(([0], np.cumsum(files.lengths, dtype=np.int64)))
    if offsets[-1] >= 2**31:
        raise ValueError(f"{path}: {offsets[-1]} tokens; at most 2**31 - 1 are supported")
    ivf_offsets = np.concatenate(([0], np.cumsum(load("ivf_lengths.npy"), dtype=np.int64)))
    return FastPlaidIndex(
        centroids=torch.from_numpy(centroids).to(device, torch.float16).contiguous(),
        bucket_weights=torch.from_numpy(load("bucket_weights.npy")).to(device, torch.float32),
        nbits=nbits,
        codes=torch.cat(codes) if codes else torch.zeros(0, dtype=torch.int32, device=device),
        residuals=torch.cat(residuals) if residuals else torch.zeros(0, 0, dtype=torch.uint8, device=device),
        doc_offsets=torch.from_numpy(offsets.astype(np.int32)).to(device),
        ivf=torch.from_numpy(load("ivf.npy").astype(np.int32)).to(device),
        ivf_offsets=torch.from_numpy(ivf_offsets).to(device),
        max_doclen=int(max(files.lengths, default=0)),
        host_offsets=offsets,
        layout=files.layout,
    )


def _stamp(path: str) -> tuple:
    """What changes whenever fast-plaid rewrites the index: ``metadata.json`` (every create /
    update / delete) and 1.7's merge manifests (a merge of staged chunks)."""
    names = ("metadata.json", "merged_codes.manifest.json", "merged_residuals.manifest.json")
    return tuple(os.stat(p).st_mtime_ns if os.path.exists(p) else None for p in (os.path.join(path, n) for n in names))


def load_fast_plaid_index(path: str, device: str | torch.device) -> FastPlaidIndex:
    """The fast-plaid index in folder ``path`` on ``device``, in whichever layout a fast-plaid
    release wrote it (1.4's per-chunk files, 1.7's single merged copy with its manifest, or
    1.7's staged chunks beside it: :mod:`lik_plugins.fast_plaid._files`).

    Read once per (folder, device, modification times of ``metadata.json``, which fast-plaid
    rewrites on every create / update / delete, and of 1.7's merge manifests); later calls
    return the cached tensors.  The bytes it holds are logged (``FastPlaidIndex.nbytes``).

    Raises:
        lik_plugins.fast_plaid.UnknownIndexLayout: the files are in no layout it reads.

    Example::

        >>> index = load_fast_plaid_index("indexes/plaid/fast_plaid_index", "cuda")
    """
    device = torch.device(device)
    key = (os.path.realpath(path), str(device))
    stamp = _stamp(path)
    with _cache_lock:
        hit = _cache.get(key)
        if hit is not None and hit[0] == stamp:
            return hit[1]
        _cache.pop(key, None)                     # an outdated copy goes before the new one loads
        index = _read_index(path, device)
        _cache[key] = (stamp, index)
    logger.info("lik_plugins: fast-plaid index %s (%s layout) on %s: %d documents, %d tokens, %.1f MiB", path,
                index.layout, device, index.n_docs, index.codes.shape[0], index.nbytes / 2**20)
    return index


def clear_index_cache() -> None:
    """Drop every index :func:`load_fast_plaid_index` holds."""
    with _cache_lock:
        _cache.clear()


def _batch_size(index: FastPlaidIndex, lq: int, n_rerank: int) -> int:
    per_query = (index.centroids.shape[0] * lq * 2            # centroid scores, fp16
                 + index.n_docs * 16                          # mask, approx scores, the cut's buffers
                 + n_rerank * 64)                             # pair lists, orders, exact scores, sorts
    budget = min(max(index.nbytes, WORKSPACE_BYTES[0]), WORKSPACE_BYTES[1])
    return int(max(1, min(_MAX_GRID_Y, budget // max(per_query, 1))))


def _subset_masks(index: FastPlaidIndex, subset: list, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``([B, N] int8, [B, C] bool)``: each query's allowed documents, and the centroids
    their tokens use (fast-plaid probes only those)."""
    docs = torch.zeros((len(subset), index.n_docs), dtype=torch.int8, device=device)
    cells = torch.zeros((len(subset), index.centroids.shape[0]), dtype=torch.bool, device=device)
    for b, ids in enumerate(subset):
        ids = np.asarray(ids, dtype=np.int64)
        ids = ids[(ids >= 0) & (ids < index.n_docs)]
        if not ids.size:
            continue
        starts, lengths = index.host_offsets[ids], index.host_offsets[ids + 1] - index.host_offsets[ids]
        tokens = np.repeat(starts - np.cumsum(lengths) + lengths, lengths) + np.arange(int(lengths.sum()))
        docs[b, torch.from_numpy(ids).to(device)] = 1
        cells[b, index.codes[torch.from_numpy(tokens).to(device)].long()] = True
    return docs, cells


def _keep_best(approx: torch.Tensor, n_keep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``n_keep`` best of each row of ``approx [B, N]`` (values, column ids): equal values
    at the cut go to the lower ids, as CUDA's ``topk`` (fast-plaid's cut) leaves them -- made
    explicit so that every device cuts alike: of the values equal to the ``n_keep``-th, only
    the lowest-id ones that fit stay eligible."""
    kth = approx.topk(n_keep, dim=1).values[:, -1:]                                 # [B, 1]
    room = n_keep - (approx > kth).sum(dim=1, keepdim=True)
    at_kth = approx == kth
    excess = at_kth & (at_kth.cumsum(dim=1, dtype=torch.int32) > room)
    return approx.masked_fill(excess, float("-inf")).topk(n_keep, dim=1)


def _search_batch(index: FastPlaidIndex, Q: torch.Tensor, out_k: int, n_ivf_probe: int, n_rerank: int,
                  subset: list | None, lengths: torch.Tensor | None):
    from .kernels.triton import operands, plaid_probe

    nq, lq, _ = Q.shape
    n_docs = index.n_docs
    # 1. centroid scores [B, C, Lq], fp16 as fast-plaid's (centroids fp16 @ queries fp16)
    S = torch.matmul(index.centroids, Q.transpose(1, 2))
    # 2. IVF probe: each query token's best cells, their lists' union as a [B, N] mask
    # (with a subset, among the centroids its documents use: other cells hold none of them)
    n_probe = min(n_ivf_probe, index.centroids.shape[0])
    allowed, probed = None, S
    if subset is not None:
        allowed, usable = _subset_masks(index, subset, Q.device)
        probed = S.masked_fill(~usable[:, :, None], float("-inf"))
    cells = probed.topk(n_probe, dim=1).indices                                    # [B, n_probe, Lq]
    del probed
    if lengths is not None:
        # a token past its query's length probes nothing: it repeats the first token's cells
        past = torch.arange(lq, device=Q.device)[None, None, :] >= lengths[:, None, None]
        cells = torch.where(past, cells[:, :, :1], cells)
    cells = cells.reshape(nq, n_probe * lq)
    mask = plaid_probe.mark_candidates(cells, index.ivf, index.ivf_offsets, n_docs)
    if allowed is not None:
        mask &= allowed
    n_candidates = mask.sum(dim=1, dtype=torch.int32)
    # 3. approximate scores (-inf off the candidates), 4. the best n_rerank of them
    approx = plaid_probe.approx_scores(S, index.codes, index.doc_offsets, mask)
    del S, mask
    n_keep = min(n_rerank, n_docs)
    top_approx, picked = _keep_best(approx, n_keep)                                  # [B, n_keep]
    del approx
    # fast-plaid's order of the kept documents, which its stable sort keeps among equal exact
    # scores: by approximate score (then id) when it cut, by id when every candidate was kept
    picked, by_id = picked.sort(dim=1)
    top_approx = top_approx.gather(1, by_id)
    cut = (n_candidates > n_keep)[:, None]
    _, order = torch.where(cut, top_approx, 0.0).sort(dim=1, descending=True, stable=True)
    picked, top_approx = picked.gather(1, order), top_approx.gather(1, order)
    # 5. fast-plaid's exact score of each query against its kept documents, read in place
    pair_q = torch.arange(nq, device=Q.device, dtype=torch.int32).repeat_interleave(n_keep)
    exact = plaid_probe.fast_plaid_scores(Q, pair_q, picked.reshape(-1).to(torch.int32), index.codes,
                                          index.residuals, index.centroids,
                                          operands.stream_order_weights(index.bucket_weights, index.nbits),
                                          index.doc_offsets, index.nbits)
    exact = exact.reshape(nq, n_keep).masked_fill(top_approx == float("-inf"), float("-inf"))
    # 6. top k: a stable sort, so equal scores keep the order above
    scores, at = exact.sort(dim=1, descending=True, stable=True)
    return scores[:, :out_k], picked.gather(1, at[:, :out_k])


def plaid_search(index: FastPlaidIndex, Q: torch.Tensor, k: int = 10, *, n_ivf_probe: int = 8,
                 n_full_scores: int = 4096, subset: list | None = None,
                 query_lengths: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """PLAID search of ``Q`` against a fast-plaid index, as fast-plaid (1.4.6 - 1.7) searches it.

    Args:
        index: from :func:`load_fast_plaid_index` (on the device that computes).
        Q: ``[Nq, Lq, d]`` query tokens, or ``[Lq, d]`` for one; rounded to fp16 and used
            as given (not normalised), as fast-plaid uses them; zero tokens (padding)
            contribute 0.
        k: results per query.
        n_ivf_probe: centroids probed per query token.
        n_full_scores: candidates kept by approximate score; the best quarter of them
            (at least one) is scored exactly, as fast-plaid does.
        subset: per query, the document ids it may return (a list of ``Nq`` lists), or
            None; as fast-plaid, the probe then picks among the centroids those documents use.
        query_lengths: per query, its tokens (1 to ``Lq``), or None: every token of ``Q``.
            Tokens past a query's length must be zero; they probe no cell (fast-plaid 1.5
            and newer drop them).

    Returns:
        ``(scores, ids)``, ``[Nq, min(k, n)]`` fp32 and int64 on the index's device, best
        first; a query with fewer candidates than ``k`` has ``-inf`` scores (and arbitrary
        ids) in its last places.

    Needs the Triton kernels (CUDA, or ``TRITON_INTERPRET=1`` with ``LIK_BACKEND=triton``).

    Example::

        >>> index = load_fast_plaid_index(path, "cuda")
        >>> scores, ids = plaid_search(index, Q.cuda(), 10, n_ivf_probe=8, n_full_scores=8192)
    """
    if Q.dim() == 2:
        Q = Q.unsqueeze(0)
    check_tensor("Q", Q, 3)
    if Q.shape[-1] != index.centroids.shape[1]:
        raise ValueError(f"embedding dims differ: Q has d={Q.shape[-1]}, the index d={index.centroids.shape[1]}")
    for name, value in (("k", k), ("n_ivf_probe", n_ivf_probe), ("n_full_scores", n_full_scores)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    device = index.codes.device
    Q = Q.to(device, torch.float16).contiguous()
    path = served_by(Q, "residual")
    if path != "triton":
        raise RuntimeError(f"plaid_search needs the Triton kernels; tensors on {device} are served by {path}")
    _routing.record("plaid_search", "triton")
    n_rerank = max(n_full_scores // 4, 1)
    nq, lq = Q.shape[0], Q.shape[1]
    out_k = min(k, n_rerank, index.n_docs)
    if nq == 0 or index.n_docs == 0 or lq == 0:
        return (torch.full((nq, out_k), float("-inf"), device=device),
                torch.zeros((nq, out_k), dtype=torch.int64, device=device))
    step = _batch_size(index, lq, n_rerank)
    if subset is not None and len(subset) != nq:
        raise ValueError(f"subset must hold one list per query ({nq}), got {len(subset)}")
    lengths = None
    if query_lengths is not None:
        if len(query_lengths) != nq or not all(isinstance(n, int) and 1 <= n <= lq for n in query_lengths):
            raise ValueError(f"query_lengths must hold {nq} ints between 1 and {lq}")
        lengths = torch.tensor(query_lengths, device=device)
    parts = [_search_batch(index, Q[i:i + step], out_k, n_ivf_probe, n_rerank,
                           None if subset is None else subset[i:i + step],
                           None if lengths is None else lengths[i:i + step]) for i in range(0, nq, step)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
