"""GPU suite, PLAID search (``lik_plugins.plaid_search``) on a CUDA device against fast-plaid's
algorithm in float64 (``tests/support/fast_plaid_files.py``), over an index written in
fast-plaid's on-disk layout.  Skipped without CUDA; run by ``benchmarks/run_gpu.sh tests``.

Scores agree position by position within fp16 rounding of the token similarities summed over
the query (``SCORE_TOL``); a different id at a position is a swap of two near-equal scores.
"""
from __future__ import annotations

import pytest
import torch

from lik_plugins import plaid_search as ps

from support.fast_plaid_files import search_float64, write_index

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SCORE_TOL = 2e-2


def test_plaid_search_on_cuda_matches_fast_plaids_algorithm(tmp_path):
    g = torch.Generator().manual_seed(0)
    unit = torch.nn.functional.normalize
    topics = unit(torch.randn(32, 8, 128, generator=g), dim=-1)
    docs = []
    for j in range(600):
        n = int(torch.randint(20, 120, (1,), generator=g))
        docs.append(unit(topics[j % 32][torch.randint(0, 8, (n,), generator=g)]
                         + 0.05 * torch.randn(n, 128, generator=g), dim=-1))
    write_index(str(tmp_path), docs, nbits=2, n_centroids=256)
    queries = unit(topics[torch.arange(40) % 32][:, torch.randint(0, 8, (32,), generator=g)]
                   + 0.05 * torch.randn(40, 32, 128, generator=g), dim=-1)
    index = ps.load_fast_plaid_index(str(tmp_path), "cuda")
    scores, ids = ps.plaid_search(index, queries.cuda(), 10, n_ivf_probe=8, n_full_scores=400)
    oracle = search_float64(str(tmp_path), queries, 10, 8, 400)
    same = 0
    for got_ids, got, want in zip(ids.tolist(), scores.tolist(), oracle):
        assert len(want) == 10
        want_scores = dict(want)
        for pid, s, (w_pid, w) in zip(got_ids, got, want):
            assert abs(s - w) <= SCORE_TOL
            assert pid == w_pid or (pid in want_scores and abs(want_scores[pid] - w) <= SCORE_TOL)
        same += got_ids == [p for p, _ in want]
    assert same >= 36
