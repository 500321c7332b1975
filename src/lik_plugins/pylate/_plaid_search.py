"""PyLate's PLAID index searched by :func:`lik_plugins.plaid_search.plaid_search`.

PyLate 1.6's ``indexes.PLAID`` (``use_fast=True``, its default) answers
``retrieve.ColBERT(index).retrieve(...)`` through ``FastPlaid.__call__``, which maps
document ids and calls ``fast_plaid.search.FastPlaid.search(queries_embeddings, top_k,
batch_size, n_full_scores, n_ivf_probe, show_progress, subset, n_processes)``.  That method
is the capture point: :func:`search` takes its place on fast-plaid's class, reads the same
index folder (``self.index``) and returns what fast-plaid returns (per query a list of
``(passage_id, score)``, best first), so PyLate's id mapping and subset translation run
unchanged.

Ours serves when the index is searched on one CUDA device (or on the CPU under
``LIK_BACKEND=triton``, the interpreter's tests), ``low_memory`` is off (the user asked for
the documents to stay in host memory), the queries are a 3-D tensor or a list of 2-D / 3-D
tensors and ``PYLATE_SCORES_BACKEND`` is not ``torch`` / ``flash``.
Everything else -- a CPU index (fast-plaid's threads are the faster path there), several
devices, ``LIK_DISABLE=1`` -- runs fast-plaid's own search.  ``batch_size`` (a fast-plaid
tuning knob; PyLate passes ``1 << 18``) does not change our memory: the search sizes its own
query batches.

PyLate's own wrapper (``pylate.indexes.fast_plaid.FastPlaid.__call__``) unpickles its two
id mappings from disk on every search, which takes longer than our search of a 100k-document
index for one query: while that call runs, :func:`make_call` has the two loaders return the
mapping cached per file (path, modification time, size).  Only ``__call__`` (which reads them)
sees the cached objects; ``add_documents`` / ``remove_documents``, which modify the mappings
they load, get fresh ones from PyLate's loaders as before.

Once ours has served an index, fast-plaid's copy of it on the device is released
(``FastPlaid.indices``); fast-plaid reloads it from disk by itself if it is asked to search
again (after ``unpatch_pylate()``, say): one copy of the index on the GPU, not two.
"""
from __future__ import annotations

import os
import threading

import torch

from .. import _routing
from .._config import disabled, forced_backend
from ..kernels.dispatch import served_by
from . import _scores

ENTRY = "pylate.PLAID.search"


def _normalised_subset(subset, n_queries: int):
    """fast-plaid's own normalisation of ``subset`` (``FastPlaid._prepare_search``)."""
    if subset is None:
        return None
    if isinstance(subset, int):
        subset = [subset] * n_queries
    if isinstance(subset, list) and len(subset) == 0:
        return None
    if isinstance(subset, list) and isinstance(subset[0], int):
        subset = [subset] * n_queries
    if len(subset) != n_queries:
        raise ValueError("Subset length must match number of queries.")
    return subset


def _queries(queries_embeddings):
    if isinstance(queries_embeddings, list):
        if not queries_embeddings or not all(isinstance(q, torch.Tensor) and q.dim() in (2, 3)
                                             for q in queries_embeddings):
            return None
        return torch.nn.utils.rnn.pad_sequence([q[0] if q.dim() == 3 else q for q in queries_embeddings],
                                               batch_first=True, padding_value=0.0)
    if isinstance(queries_embeddings, torch.Tensor) and queries_embeddings.dim() == 3:
        return queries_embeddings
    return None


def _our_device(fast_plaid) -> torch.device | None:
    """The device ours searches on for this fast-plaid object, or None (fast-plaid serves)."""
    if disabled() or _scores.requested_backend(None) in ("torch", "flash"):
        return None
    devices = getattr(fast_plaid, "devices", None)
    if not isinstance(devices, list) or len(devices) != 1 or getattr(fast_plaid, "low_memory", True):
        return None
    device = torch.device(devices[0])
    if device.type == "cuda" or (device.type == "cpu" and forced_backend() == "triton"):
        return device if served_by(torch.empty(0, dtype=torch.float16, device=device), "residual") == "triton" \
            else None
    return None


def _release_host_copy(fast_plaid) -> None:
    lock = getattr(fast_plaid, "_index_swap_lock", None)
    indices = getattr(fast_plaid, "indices", None)
    if lock is None or not isinstance(indices, dict) or all(v is None for v in indices.values()):
        return
    with lock:
        fast_plaid.indices = {device: None for device in indices}


def make_search(original):
    """The replacement of ``fast_plaid.search.FastPlaid.search`` (same signature and results)."""

    def search(self, queries_embeddings, top_k: int = 10, batch_size: int = 2000, n_full_scores: int = 4096,
               n_ivf_probe: int = 8, show_progress: bool = True, subset=None, n_processes=None):
        device = _our_device(self)
        Q = _queries(queries_embeddings) if device is not None else None
        if Q is None or not os.path.exists(os.path.join(self.index, "metadata.json")):
            _routing.record(ENTRY, "original")
            return original(self, queries_embeddings, top_k=top_k, batch_size=batch_size,
                            n_full_scores=n_full_scores, n_ivf_probe=n_ivf_probe, show_progress=show_progress,
                            subset=subset, n_processes=n_processes)
        from .. import plaid_search

        subset = _normalised_subset(subset, Q.shape[0])
        with torch.inference_mode():
            _release_host_copy(self)              # before ours loads: never two copies at once
            index = plaid_search.load_fast_plaid_index(self.index, device)
            scores, ids = plaid_search.plaid_search(index, Q, top_k, n_ivf_probe=n_ivf_probe,
                                                    n_full_scores=n_full_scores, subset=subset)
        _routing.record(ENTRY, "triton")
        scores, ids = scores.cpu().tolist(), ids.cpu().tolist()                # the one read-back
        return [[(p, s) for p, s in zip(row_ids, row) if s != float("-inf")] for row_ids, row in zip(ids, scores)]

    return search


_reading = threading.local()
_mappings: dict = {}   # path -> ((mtime, size), mapping); one dict get or set at a time needs no lock


def make_call(original):
    """PyLate's ``FastPlaid.__call__``, with its id mappings read through the cache."""

    def __call__(self, *args, **kwargs):
        _reading.active = not disabled()          # under LIK_DISABLE=1, PyLate's own loaders
        try:
            return original(self, *args, **kwargs)
        finally:
            _reading.active = False

    return __call__


def make_loader(original, name: str):
    """PyLate's mapping loader ``name`` (``_load_<mapping>``, reading ``self.<mapping>_path``):
    inside ``__call__`` the object cached for that file while it is unchanged."""
    attribute = name[len("_load_"):] + "_path"

    def load(self):
        path = getattr(self, attribute, None)
        if not getattr(_reading, "active", False) or not isinstance(path, str) or not os.path.exists(path):
            return original(self)
        stat = os.stat(path)
        key = (stat.st_mtime_ns, stat.st_size)
        hit = _mappings.get(path)
        if hit is not None and hit[0] == key:
            return hit[1]
        value = original(self)
        _mappings[path] = (key, value)
        return value

    return load
