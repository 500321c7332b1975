"""Hierarchical (Ward) token pooling: shrink each document's tokens to about ``1/pool_factor``.

Each document's poolable tokens are clustered agglomeratively from their cosine distances
(``1 - x @ x.T``) with Ward's criterion, the tree is cut into at most ``n // pool_factor``
clusters (``maxclust``), and every cluster becomes the mean of its tokens.  This is the
index-shrinking step PyLate (``ColBERT.pool_embeddings_hierarchical``) and colpali-engine
(``HierarchicalTokenPooler``) run per document; here a whole list of documents is served at
once, with the same partitions:

* the Ward linkage and the ``maxclust`` cut stay scipy's (``linkage`` / ``fcluster``, compiled
  code), so partitions and cluster labels are scipy's own -- including its tie-breaking;
* around them, no Python loop over tokens or clusters: each document's similarities are the
  one ``mm`` a host computes, its condensed distances one gather at offsets cached per length,
  and every cluster mean of a chunk of documents one ``index_add_``.

Two distance inputs, one per host convention (``cluster_on``):

``"distances"`` (PyLate)
    Ward on the cosine distances themselves (the condensed matrix).
``"distance_rows"`` (colpali-engine)
    Ward on the Euclidean distances between the *rows* of the cosine-distance matrix, each
    row read as an ``n``-dimensional point (what ``linkage(square_matrix, metric="euclidean")``
    does).  scipy computes those ``n^2 / 2`` distances over ``n`` coordinates each with a
    scalar loop; here one float64 Gram matrix of the rows (shifted by 1, which removes the
    cancellation of the Gram identity) gives them, duplicated tokens computed once, so equal
    tokens keep exactly equal and exactly zero distances as in scipy.

scipy is needed by this op only; it is imported when the op first runs.
"""
from __future__ import annotations

import functools
from typing import Literal, Sequence

import torch

CLUSTER_ON = ("distances", "distance_rows")
#: documents whose cluster means are computed in one ``index_add_``
CHUNK_DOCUMENTS = 64


def _scipy_hierarchy():
    try:
        from scipy.cluster import hierarchy
    except ImportError as error:  # only this op needs scipy: say how to get it
        raise ImportError("lik_plugins.ops.hierarchical_pool needs scipy for the Ward linkage: "
                          "pip install scipy") from error
    return hierarchy


@functools.lru_cache(maxsize=1024)
def _upper_triangle_offsets(n: int, width: int) -> torch.Tensor:
    """Flat offsets, in an ``[width, width]`` matrix, of the pairs ``i < j < n`` in scipy's
    condensed order (row by row)."""
    i, j = torch.triu_indices(n, n, offset=1)
    return i * width + j


def _condensed_distances(tokens: torch.Tensor) -> torch.Tensor:
    """``1 - x @ x.T`` of one document, condensed, in its dtype: the very ``mm`` a per-document
    pooler calls (so every similarity is the same number), then ``1 - s`` on the upper triangle
    alone, read with offsets cached per length (a host rebuilding ``triu_indices`` for every
    document spends as long on that as on the product)."""
    n = tokens.shape[0]
    return 1 - torch.mm(tokens, tokens.t()).reshape(-1).take(_upper_triangle_offsets(n, n))


def _row_distances(tokens: torch.Tensor) -> torch.Tensor:
    """Condensed float64 Euclidean distances between the rows of ``1 - x @ x.T`` (float32
    rows, as colpali-engine rounds them).  Equal tokens share one row: computed once, their
    mutual distance exactly 0 and their distances to the rest identical, as scipy's are."""
    n = tokens.shape[0]
    unique, inverse = torch.unique(tokens, dim=0, return_inverse=True)
    first = torch.full((unique.shape[0],), n).scatter_reduce_(0, inverse, torch.arange(n), "amin")
    rows = (1 - torch.mm(tokens, tokens.t()))[first]                    # [U, n]: one row per distinct token
    shifted = rows.double() - 1.0                                       # same differences, small norms
    gram = shifted @ shifted.t()                                        # [U, U]
    norms = gram.diagonal()
    squared = (norms[:, None] + norms[None, :] - 2 * gram).clamp_min_(0)
    squared.fill_diagonal_(0)
    full = squared.sqrt()[inverse][:, inverse]                          # [n, n]
    return full.reshape(-1).take(_upper_triangle_offsets(n, n))


def _labels(condensed: torch.Tensor, n_clusters: int, hierarchy) -> torch.Tensor:
    """scipy's Ward linkage and ``maxclust`` cut: 0-based cluster label of each token."""
    tree = hierarchy.linkage(condensed.double().numpy(), method="ward")
    return torch.from_numpy(hierarchy.fcluster(tree, t=n_clusters, criterion="maxclust")).long() - 1


def hierarchical_pool(
    documents: Sequence[torch.Tensor],
    pool_factor: int,
    protected_tokens: int = 0,
    *,
    cluster_on: Literal["distances", "distance_rows"] = "distances",
    normalize: bool = False,
    return_labels: bool = False,
):
    """Ward-pool each document's tokens to at most ``n // pool_factor`` cluster means.

    Args:
        documents: ``[n_i, d]`` float tensors (``float16``, ``float32`` or ``float64``; rows
            normally L2-normalised, so ``x @ x.T`` is the cosine similarity).  Computed on the
            CPU in their own dtype (the linkage is CPU code); results are CPU tensors.
        pool_factor: ``>= 1``; a document keeps ``max(n // pool_factor, 1)`` clusters at most
            (fewer when the linkage has tied heights at the cut, as scipy's ``fcluster``).
        protected_tokens: leading tokens of each document (e.g. ``[CLS]``) kept as they are,
            before the pooled tokens.  A document whose remaining ``n`` tokens would not
            shrink (``max(n // pool_factor, 1) >= n``) is returned whole, unchanged.
        cluster_on: ``"distances"``: Ward on the cosine distances (PyLate); ``"distance_rows"``:
            Ward on the Euclidean distances between rows of the cosine-distance matrix
            (colpali-engine).
        normalize: L2-normalise each cluster mean (colpali-engine) or not (PyLate).
        return_labels: also return, per document, the 0-based cluster label of each pooled
            token (``int64 [n]``; ``None`` for a document returned unchanged).

    Returns:
        A list of ``[protected + clusters, d]`` tensors: protected tokens first, then one mean
        per non-empty cluster in label order (scipy's ``fcluster`` numbering); with
        ``return_labels``, ``(pooled, labels)``.

    The Ward linkage is scipy's (``scipy.cluster.hierarchy.linkage`` / ``fcluster``), so the
    partition is the one each host computes; the similarity matrices, distances and means
    around it are batched.

    Example::

        pooled = hierarchical_pool([torch.nn.functional.normalize(torch.randn(200, 128), dim=1)], 2, 1)
        pooled[0].shape  # torch.Size([100, 128]): [CLS] + 99 cluster means
    """
    _check(documents, pool_factor, protected_tokens, cluster_on)
    hierarchy = _scipy_hierarchy()
    pooled: list[torch.Tensor | None] = [None] * len(documents)
    labels: list[torch.Tensor | None] = [None] * len(documents)
    to_pool = []   # (position, protected, tokens, n_clusters)
    for position, document in enumerate(documents):
        document = document.cpu()
        tokens = document[protected_tokens:]
        n_clusters = max(tokens.shape[0] // pool_factor, 1)
        if n_clusters >= tokens.shape[0]:
            pooled[position] = document
        else:
            to_pool.append((position, document[:protected_tokens], tokens, n_clusters))

    # documents of one dtype and width are batched together
    groups: dict[tuple, list] = {}
    for item in to_pool:
        groups.setdefault((item[2].dtype, item[2].shape[1]), []).append(item)
    for group in groups.values():
        for start in range(0, len(group), CHUNK_DOCUMENTS):
            _pool_chunk(group[start:start + CHUNK_DOCUMENTS], cluster_on, normalize, hierarchy, pooled, labels)
    return (pooled, labels) if return_labels else pooled


def _pool_chunk(chunk, cluster_on, normalize, hierarchy, pooled, labels) -> None:
    tokens = [item[2] for item in chunk]
    distances = _condensed_distances if cluster_on == "distances" else _row_distances
    condensed = [distances(t) for t in tokens]
    chunk_labels = [_labels(c, item[3], hierarchy) for c, item in zip(condensed, chunk)]

    # every cluster of the chunk gets a row: document b's labels shifted by the clusters before it
    capacity = torch.tensor([item[3] for item in chunk])
    first_row = torch.cumsum(capacity, 0) - capacity
    rows = torch.cat([lab + first_row[b] for b, lab in enumerate(chunk_labels)])
    all_tokens = torch.cat(tokens)
    sums = all_tokens.new_zeros(int(capacity.sum()), all_tokens.shape[1]).index_add_(0, rows, all_tokens)
    counts = torch.bincount(rows, minlength=sums.shape[0])
    means = sums / counts.clamp_min(1).unsqueeze(1).to(sums.dtype)
    if normalize:
        means = torch.nn.functional.normalize(means, p=2, dim=-1)
    # fcluster may leave labels unused (tied heights at the cut): only non-empty clusters stay
    for b, (position, protected, _, _) in enumerate(chunk):
        block = slice(int(first_row[b]), int(first_row[b] + capacity[b]))
        kept = means[block][counts[block] > 0]
        pooled[position] = torch.cat([protected, kept]) if protected.shape[0] else kept
        labels[position] = chunk_labels[b]


def _check(documents, pool_factor, protected_tokens, cluster_on) -> None:
    if cluster_on not in CLUSTER_ON:
        raise ValueError(f"cluster_on must be one of {CLUSTER_ON}; got {cluster_on!r}")
    if isinstance(pool_factor, bool) or not isinstance(pool_factor, int) or pool_factor < 1:
        raise ValueError(f"pool_factor must be an integer >= 1, got {pool_factor!r}")
    if isinstance(protected_tokens, bool) or not isinstance(protected_tokens, int) or protected_tokens < 0:
        raise ValueError(f"protected_tokens must be an integer >= 0, got {protected_tokens!r}")
    for i, document in enumerate(documents):
        if not isinstance(document, torch.Tensor) or document.dim() != 2:
            raise ValueError(f"documents[{i}] must be a 2-D [tokens, dim] tensor")
        if document.dtype not in (torch.float16, torch.float32, torch.float64):
            raise TypeError(f"documents[{i}] must be float16, float32 or float64, got {document.dtype}")
