"""Host-resident candidates staged chunk by chunk (``listed._staged_table`` / ``score_table``):
the same scores as the candidates read in place, whatever the chunking -- chunks of a few
candidates, a candidate longer than a chunk, one chunk -- per query and in the cross product.
On the CPU (interpreter) the staging runs without pinned memory or events; the GPU run of
tests/kernels/test_listed.py covers the CUDA staging."""
from __future__ import annotations

import pytest
import torch

DIM = 16


@pytest.fixture
def listed(monkeypatch):
    if torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        from lik_plugins._config import triton_interpret

        if not triton_interpret():
            pytest.skip("the Triton kernels on CPU need TRITON_INTERPRET=1")
        device = torch.device("cpu")
    from lik_plugins.kernels.triton import listed as module

    return module, device


def _inputs(dtype):
    g = torch.Generator().manual_seed(11)
    lengths = [3, 1, 40, 7, 7, 2, 19, 5, 1, 30]
    docs = [(torch.randn(n, DIM, generator=g) - 0.1).to(dtype) for n in lengths]
    queries = [torch.randn(n, DIM, generator=g).to(dtype) for n in (5, 9, 2)]
    return queries, docs


@pytest.mark.parametrize("stage_rows", [1, 12, 45, 1000])
@pytest.mark.parametrize("cross", [False, True])
def test_staged_scores_equal_in_place_scores(listed, monkeypatch, stage_rows, cross):
    module, device = listed
    dtype = torch.bfloat16
    queries, docs = _inputs(dtype)
    in_place = [d.to(device) for d in docs]
    table = module.candidate_table(in_place, dtype, DIM, device, extra=[q.shape[0] for q in queries])
    assert table.addresses is not None
    monkeypatch.setattr(module, "STAGE_BYTES", stage_rows * DIM * 2)
    staged = module._staged_table(docs, [d.shape[0] for d in docs], [q.shape[0] for q in queries], dtype, DIM,
                                  device)
    chunks = staged.hold[1]
    assert staged.addresses is None and sum(r1 - r0 for r0, r1, _ in chunks) == len(docs)
    assert all(tokens <= stage_rows or r1 - r0 == 1 for r0, r1, tokens in chunks)   # a long one alone
    n = len(docs)
    qidx = None if cross else torch.tensor([p % 3 for p in range(n)], device=device)
    pad = torch.tensor([p % 2 == 0 for p in range(n)], device=device)
    want = module.score_table(queries, table.extra, table, qidx, pad, round_maxima=True)
    got = module.score_table(queries, staged.extra, staged, qidx, pad, round_maxima=True)
    assert got.shape == want.shape == ((3, n) if cross else (n,))
    assert torch.equal(got, want)


def test_pylate_rerank_of_a_staged_table_equals_in_place(listed, monkeypatch):
    """PyLate's rerank over a staged table (host-resident candidates for a CUDA device) ranks
    like the same candidates read in place: the adapter must not need the addresses."""
    from lik_plugins.pylate._rerank import _rerank_listed

    module, device = listed
    dtype = torch.bfloat16
    queries, docs = _inputs(dtype)
    counts = [4, 3, 3]
    extra = [q.shape[0] for q in queries] + counts
    ids = [[f"q{i}d{j}" for j in range(n)] for i, n in enumerate(counts)]
    starts = [0, 4, 7]
    longest = [max(d.shape[0] for d in docs[s:s + n]) for s, n in zip(starts, counts)]
    on_device = [q.to(device) for q in queries]
    in_place = module.candidate_table([d.to(device) for d in docs], dtype, DIM, device, extra=extra)
    monkeypatch.setattr(module, "STAGE_BYTES", 12 * DIM * 2)
    staged = module._staged_table(docs, [d.shape[0] for d in docs], extra, dtype, DIM, device)
    want = _rerank_listed(on_device, in_place, counts, longest, ids, device)
    got = _rerank_listed(on_device, staged, counts, longest, ids, device)
    assert [len(r) for r in got] == counts
    assert got == want
