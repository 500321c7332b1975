"""The address-table kernel (``kernels.triton.listed``) on a GPU: candidates read in place
(views of one buffer, separate tensors, misaligned addresses) and staged from the CPU,
against the fp64 reference MaxSim with the hosts' zero-padding rule."""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from lik_plugins.kernels.triton.listed import candidate_table, score_listed  # noqa: E402


def _want(queries, docs, qidx, pad):
    out = []
    for p, d in enumerate(docs):
        q, dd = queries[qidx[p]].double().cpu(), d.double().cpu()
        if pad[p]:
            dd = torch.cat([dd, dd.new_zeros(1, dd.shape[1])])
        out.append((q @ dd.T).max(1).values.sum() if dd.shape[0] else torch.tensor(0.0, dtype=torch.float64))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("where", ["views", "separate", "misaligned", "staged"])
@pytest.mark.parametrize("dim", [128, 96])
def test_listed_scores_match_the_reference(dtype, where, dim):
    g = torch.Generator(device="cuda").manual_seed(0)
    lengths = [1, 63, 64, 65, 300, 0, 17, 129]
    source = "cpu" if where == "staged" else "cuda"
    if where == "views":
        docs = list(torch.split(torch.randn(sum(lengths), dim, device="cuda", generator=g).to(dtype), lengths))
    elif where == "misaligned":   # one element into the buffer: addresses 2 or 4 bytes off 16
        flat = torch.randn(sum(lengths) * dim + 1, device="cuda", generator=g).to(dtype)[1:]
        docs = list(torch.split(flat.view(-1, dim), lengths))
    else:
        docs = [torch.randn(n, dim, device="cuda", generator=g).to(dtype) for n in lengths]
    docs = [(d - 0.05).to(source) for d in docs]          # negatives: the zero padding wins rows
    queries = [torch.randn(n, dim, device="cuda", generator=g).to(dtype) for n in (32, 1, 200)]
    qidx = [p % 3 for p in range(len(docs))]
    pad = [p % 2 == 0 for p in range(len(docs))]
    table = candidate_table(docs, dtype, dim, torch.device("cuda"), extra=[q.shape[0] for q in queries])
    assert not isinstance(table, str), table
    assert table.aligned == (where != "misaligned")
    cu_q = torch.zeros(4, dtype=torch.int64, device="cuda")
    torch.cumsum(table.extra, 0, out=cu_q[1:])
    got = score_listed(torch.cat(queries), cu_q, 200, table.doc, table.addresses, table.lengths,
                       torch.tensor(qidx, device="cuda"), torch.tensor(pad, device="cuda"), table.aligned)
    want = _want(queries, docs, qidx, pad)
    scale = _want([q.abs() for q in queries], [d.abs() for d in docs], qidx, [False] * len(docs)) + 1
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert ((got.double().cpu() - want).abs() <= tol * scale).all(), (got, want)
