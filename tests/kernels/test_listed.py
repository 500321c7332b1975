"""The address-table kernel (``kernels.triton.listed``) on a GPU: candidates read in place
(views of one buffer, separate tensors) and staged from the CPU, per-query pairs and the
cross product, against the fp64 reference MaxSim (``kernels.reference``) with the hosts'
zero-padding rule; addresses off 16 bytes are refused (the hosts then run their own code).
The hosts' list adapters run this kernel under the interpreter in tests/hosts."""
from __future__ import annotations

import pytest
import torch

from lik_plugins.kernels import reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _want(queries, docs, qidx, pad):
    """fp64 reference scores of each candidate against its query; a padded candidate gets
    one zero token (the hosts' padding, which takes part in the max)."""
    out = []
    for p, d in enumerate(docs):
        q, dd = queries[qidx[p]].double().cpu(), d.double().cpu()
        if pad[p]:
            dd = torch.cat([dd, dd.new_zeros(1, dd.shape[1])])
        out.append(reference.maxsim(q[None], dd[None])[0, 0])
    return torch.stack(out)


def _listed():
    from lik_plugins.kernels.triton.listed import candidate_table, score_listed

    return candidate_table, score_listed


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("where", ["views", "separate", "misaligned", "staged"])
@pytest.mark.parametrize("dim", [128, 96])
def test_listed_scores_match_the_reference(dtype, where, dim):
    g = torch.Generator(device="cuda").manual_seed(0)
    lengths = [1, 63, 64, 65, 300, 0, 17, 129]
    source = "cpu" if where == "staged" else "cuda"
    # shifted: negatives make the zero padding win rows
    if where == "views":
        flat = torch.randn(sum(lengths), dim, device="cuda", generator=g) - 0.05
        docs = list(torch.split(flat.to(dtype), lengths))
    elif where == "misaligned":   # one element into the buffer: addresses 2 or 4 bytes off 16
        flat = (torch.randn(sum(lengths) * dim + 1, device="cuda", generator=g) - 0.05).to(dtype)[1:]
        docs = list(torch.split(flat.view(-1, dim), lengths))
    else:
        docs = [(torch.randn(n, dim, device="cuda", generator=g) - 0.05).to(dtype).to(source) for n in lengths]
    queries = [torch.randn(n, dim, device="cuda", generator=g).to(dtype) for n in (32, 1, 200)]
    qidx = [p % 3 for p in range(len(docs))]
    pad = [p % 2 == 0 for p in range(len(docs))]
    candidate_table, score_listed = _listed()
    table = candidate_table(docs, dtype, dim, torch.device("cuda"), extra=[q.shape[0] for q in queries])
    if where == "misaligned":
        assert isinstance(table, str) and "16 bytes" in table
        return
    assert not isinstance(table, str), table
    qidx_t, pad_t = torch.tensor(qidx, device="cuda"), torch.tensor(pad, device="cuda")
    if where == "staged":   # host-resident candidates: staged chunk by chunk by score_table
        from lik_plugins.kernels.triton.listed import score_table

        assert table.addresses is None
        got = score_table(queries, table.extra, table, qidx_t, pad_t)
    else:
        cu_q = torch.zeros(4, dtype=torch.int64, device="cuda")
        torch.cumsum(table.extra, 0, out=cu_q[1:])
        got = score_listed(torch.cat(queries), cu_q, 200, table.doc, table.addresses, table.lengths, qidx_t, pad_t)
    want = _want(queries, docs, qidx, pad)
    scale = _want([q.abs() for q in queries], [d.abs() for d in docs], qidx, [False] * len(docs)) + 1
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert ((got.double().cpu() - want).abs() <= tol * scale).all(), (got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_listed_cross_product_matches_the_reference(dtype):
    g = torch.Generator(device="cuda").manual_seed(1)
    lengths = [700, 1030, 5, 64, 0, 129]
    docs = list(torch.split(torch.randn(sum(lengths), 128, device="cuda", generator=g).to(dtype) - 0.05, lengths))
    queries = [torch.randn(n, 128, device="cuda", generator=g).to(dtype) for n in (20, 31, 1, 140, 7)]
    pad = [p % 2 == 1 for p in range(len(docs))]
    candidate_table, score_listed = _listed()
    table = candidate_table(docs, dtype, 128, torch.device("cuda"), extra=[q.shape[0] for q in queries])
    cu_q = torch.zeros(len(queries) + 1, dtype=torch.int64, device="cuda")
    torch.cumsum(table.extra, 0, out=cu_q[1:])
    got = score_listed(torch.cat(queries), cu_q, 140, table.doc, table.addresses, table.lengths, None,
                       torch.tensor(pad, device="cuda"))
    assert got.shape == (len(queries), len(docs))
    for i in range(len(queries)):
        want = _want(queries, docs, [i] * len(docs), pad)
        scale = _want([q.abs() for q in queries], [d.abs() for d in docs], [i] * len(docs), [False] * len(docs)) + 1
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert ((got[i].double().cpu() - want).abs() <= tol * scale).all(), (i, got[i], want)
