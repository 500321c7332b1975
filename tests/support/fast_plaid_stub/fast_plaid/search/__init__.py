"""``fast_plaid.search.FastPlaid`` as PyLate calls it: ``create`` writes fast-plaid's files,
``search`` is fast-plaid's algorithm in float64 (``fast_plaid_files.search_float64``)."""
from __future__ import annotations

import math
import os
import threading

import torch
from support.fast_plaid_files import search_float64, write_index


class FastPlaid:
    def __init__(self, index: str, device=None, low_memory: bool = True, **kwargs) -> None:
        self.index = index
        self.devices = [device] if isinstance(device, str) else list(device or ["cpu"])
        self.low_memory = low_memory
        self._index_swap_lock = threading.Lock()
        os.makedirs(index, exist_ok=True)
        self.indices = {d: None for d in self.devices}
        self.searches = 0

    def create(self, documents_embeddings, nbits: int = 4, seed: int = 42, **kwargs) -> None:
        docs = [d.squeeze(0) if d.dim() == 3 else d for d in documents_embeddings]
        n_tokens = sum(int(d.shape[0]) for d in docs)
        # fast-plaid's partition count (2**floor(log2(16 sqrt(T)))), capped for tiny corpora
        n_centroids = min(2 ** int(math.log2(16 * math.sqrt(n_tokens))), max(n_tokens // 4, 1))
        write_index(self.index, docs, nbits, n_centroids, seed)
        self.indices = {d: "loaded" for d in self.devices}

    def search(self, queries_embeddings, top_k: int = 10, batch_size: int = 2000, n_full_scores: int = 4096,
               n_ivf_probe: int = 8, show_progress: bool = True, subset=None, n_processes=None):
        self.searches += 1
        self.indices = {d: "loaded" for d in self.devices}        # fast-plaid reloads what was released
        if isinstance(queries_embeddings, list):
            queries_embeddings = torch.nn.utils.rnn.pad_sequence(
                [q[0] if q.dim() == 3 else q for q in queries_embeddings], batch_first=True, padding_value=0.0)
        n = queries_embeddings.shape[0]
        if subset is not None:
            if isinstance(subset, list) and len(subset) == 0:
                subset = None
            elif isinstance(subset[0], int):
                subset = [subset] * n
        return search_float64(self.index, queries_embeddings, top_k, n_ivf_probe, n_full_scores, subset)
