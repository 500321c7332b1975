"""Packed (``cu_seqlens``), pair-list and padded-with-lengths ops against the reference,
on the chunked path and on the Triton kernels in the interpreter; the offsets rule."""
from __future__ import annotations

import pytest
import torch

import lik_plugins as lik
from lik_plugins.kernels import reference

BACKENDS = ["torch-chunked", "triton"]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    from lik_plugins._config import triton_interpret

    if request.param == "triton" and not triton_interpret():
        pytest.skip("the Triton kernels on CPU need TRITON_INTERPRET=1")
    monkeypatch.setenv("LIK_BACKEND", request.param)
    lik.reset_routing_counts()
    return request.param


def _ragged(gen, lengths, d=12, dtype=torch.float32):
    return [torch.randn(n, d, generator=gen).to(dtype) for n in lengths]


def _holes(gen, n):
    mask = torch.rand(n, generator=gen) > 0.35
    return mask


def _grads(out, inputs, gen):
    w = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    return torch.autograd.grad((out.double() * w).sum(), inputs, allow_unused=True)


def _close(got, want, tol=2e-5):
    torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol)


# query lengths include 0; a query longer than one row block of the kernel (two chunks) has
# a test of its own (the interpreter is slow)
Q_LENGTHS = (5, 1, 0, 7)
# document lengths: an empty document inside the batch, Ld = 1, an odd long one
D_LENGTHS = (4, 0, 9, 1, 70, 3)


@pytest.mark.parametrize("mask_mode,normalize,q_lengths", [
    ("exclude", False, Q_LENGTHS), ("zero", True, Q_LENGTHS), ("zero", False, (150, 3))],
    ids=["exclude", "zero-normalize", "long-query"])
def test_varlen_matches_reference(backend, gen, mask_mode, normalize, q_lengths):
    Qp, cu_q, mq = lik.pack(_ragged(gen, q_lengths))
    Dp, cu_d, md = lik.pack(_ragged(gen, D_LENGTHS))
    q_mask, d_mask = _holes(gen, Qp.shape[0]), _holes(gen, Dp.shape[0])
    d_mask[cu_d[2]:cu_d[3]] = False                       # a fully masked document
    Qp.requires_grad_()
    Dp.requires_grad_()
    kw = dict(q_mask=q_mask, d_mask=d_mask, normalize=normalize, mask_mode=mask_mode)
    out = lik.maxsim_varlen(Qp, Dp, cu_q, cu_d, mq, md, **kw)
    want = reference.maxsim_varlen(Qp.double(), Dp.double(), cu_q, cu_d, **kw)
    assert out.shape == (len(q_lengths), len(D_LENGTHS)) and out.dtype == torch.float32
    _close(out, want)
    seed = torch.Generator().manual_seed(1)
    got_g = _grads(out, (Qp, Dp), seed)
    want_g = _grads(want, (Qp, Dp), torch.Generator().manual_seed(1))
    for got, ref in zip(got_g, want_g):
        _close(got, ref)
    assert (out[:, 1] == 0).all()                         # the empty document
    if 0 in q_lengths:
        assert (out[q_lengths.index(0)] == 0).all()
    assert lik.routing_counts()["maxsim_varlen"] == {backend: 1}


def test_pairs_unsorted_duplicates_and_grads(backend, gen):
    Qp, cu_q, _ = lik.pack(_ragged(gen, Q_LENGTHS))
    Dp, cu_d, _ = lik.pack(_ragged(gen, D_LENGTHS))
    q_mask, d_mask = _holes(gen, Qp.shape[0]), _holes(gen, Dp.shape[0])
    Qp.requires_grad_()
    Dp.requires_grad_()
    # unsorted, repeated (3, 2) three times, an empty document and an empty query
    pair_q = torch.tensor([3, 0, 3, 0, 2, 3, 1, 0])
    pair_d = torch.tensor([2, 5, 2, 4, 0, 2, 1, 0])
    kw = dict(q_mask=q_mask, d_mask=d_mask, mask_mode="zero")
    out = lik.score_pairs_packed(Qp, Dp, cu_q, cu_d, pair_q, pair_d, **kw)
    want = reference.score_pairs_packed(Qp.double(), Dp.double(), cu_q, cu_d, pair_q, pair_d, **kw)
    _close(out, want)
    assert out[0] == out[2] == out[5]
    for got, ref in zip(_grads(out, (Qp, Dp), torch.Generator().manual_seed(2)),
                        _grads(want, (Qp, Dp), torch.Generator().manual_seed(2))):
        _close(got, ref)                                  # duplicates' gradients add up
    # the pair list equals the matching entries of the full cross product
    full = lik.maxsim_varlen(Qp.detach(), Dp.detach(), cu_q, cu_d, q_mask=q_mask, d_mask=d_mask, mask_mode="zero")
    _close(out.detach(), full[pair_q, pair_d])


@pytest.mark.parametrize("mask_mode,normalize", [("exclude", False), ("zero", True)])
def test_pair_lists_in_runs_of_one_query(backend, gen, mask_mode, normalize, monkeypatch):
    # A rerank's pair list: runs of one query over its candidates.  The CPU path scores a run
    # with one product -- over the packed span where the run's documents are consecutive
    # (run 0, empty and fully masked documents inside), over gathered tokens where they are
    # not (run 1: shuffled, a repeat) -- and per pair where runs are short (the tail).
    lengths = (4, 0, 9, 1, 6, 3, 5, 2)
    Qp, cu_q, _ = lik.pack(_ragged(gen, (5, 3, 7)))
    Dp, cu_d, _ = lik.pack(_ragged(gen, lengths))
    q_mask, d_mask = _holes(gen, Qp.shape[0]), _holes(gen, Dp.shape[0])
    d_mask[cu_d[3]:cu_d[4]] = False                       # a fully masked document
    pair_q = torch.tensor([0] * 8 + [1] * 6 + [2, 0])
    pair_d = torch.tensor(list(range(8)) + [6, 2, 7, 2, 0, 3] + [5, 1])
    from lik_plugins.kernels import chunked

    runs = []
    monkeypatch.setattr(chunked, "_score_run", lambda *a, _f=chunked._score_run: runs.append(a[9]) or _f(*a))
    Qp.requires_grad_()
    kw = dict(q_mask=q_mask, d_mask=d_mask, normalize=normalize, mask_mode=mask_mode)
    out = lik.score_pairs_packed(Qp, Dp, cu_q, cu_d, pair_q, pair_d, **kw)
    want = reference.score_pairs_packed(Qp.double(), Dp.double(), cu_q, cu_d, pair_q, pair_d, **kw)
    _close(out, want)
    assert out[1] == 0 and out[15] == 0                   # the empty document
    if backend == "torch-chunked":                        # one product per run of one query
        assert [r.tolist() for r in runs] == [list(range(8)), [6, 2, 7, 2, 0, 3], [5], [1]]
    g_out, = _grads(out, (Qp,), torch.Generator().manual_seed(3))
    g_want, = _grads(want, (Qp,), torch.Generator().manual_seed(3))
    _close(g_out, g_want)
    # a NaN token poisons the scores of the pairs that read it, and only those
    Dn = Dp.clone()
    Dn[cu_d[2] + 1] = float("nan")
    kw["d_mask"] = d_mask.clone()
    kw["d_mask"][cu_d[2] + 1] = True                      # a valid token (a masked one may hide it)
    with torch.no_grad():
        out = lik.score_pairs_packed(Qp, Dn, cu_q, cu_d, pair_q, pair_d, **kw)
        want = reference.score_pairs_packed(Qp.double(), Dn.double(), cu_q, cu_d, pair_q, pair_d, **kw)
    assert torch.equal(torch.isnan(out), torch.isnan(want)) and torch.isnan(want).any()
    _close(out[~torch.isnan(want)], want[~torch.isnan(want)])


@pytest.mark.parametrize("normalize", [False, True])
def test_rerank_gradients_split_over_programs(backend, gen, normalize, monkeypatch):
    # one query against many documents: the Triton backward splits the query's documents
    # over several programs that add into one grad_Q row (fp32 atomics, finished on the host)
    from lik_plugins.kernels.device import sm_count
    from lik_plugins.kernels.triton import blocking

    n_docs = 100
    monkeypatch.setattr(blocking, "GATHER_SPLIT_MIN_STEPS", 2)
    assert blocking.gather_blocking(1, n_docs, 9, 16, sm_count(torch.device("cpu")))[3] > 1
    Qp, cu_q, mq = lik.pack(_ragged(gen, (9,)))
    Dp, cu_d, md = lik.pack(_ragged(gen, [int(n) for n in torch.randint(0, 6, (n_docs,), generator=gen)]))
    Qp.requires_grad_()
    Dp.requires_grad_()
    out = lik.maxsim_varlen(Qp, Dp, cu_q, cu_d, mq, md, normalize=normalize)
    want = reference.maxsim_varlen(Qp.double(), Dp.double(), cu_q, cu_d, normalize=normalize)
    _close(out, want)
    for got, ref in zip(_grads(out, (Qp, Dp), torch.Generator().manual_seed(3)),
                        _grads(want, (Qp, Dp), torch.Generator().manual_seed(3))):
        _close(got, ref)


def test_one_pair_and_no_queries(backend, gen):
    Qp, cu_q, _ = lik.pack(_ragged(gen, (6,)))
    Dp, cu_d, _ = lik.pack(_ragged(gen, (5, 8)))
    one = lik.score_pairs_packed(Qp, Dp, cu_q, cu_d, torch.tensor([0]), torch.tensor([1]))
    _close(one, reference.maxsim(Qp[None], Dp[None, 5:])[0])
    empty_q = torch.zeros(0, 12)
    Dp.requires_grad_()
    out = lik.maxsim_varlen(empty_q, Dp, torch.zeros(1, dtype=torch.int32), cu_d)
    assert out.shape == (0, 2)
    out.sum().backward()
    assert torch.equal(Dp.grad, torch.zeros_like(Dp))
    none = lik.score_pairs_packed(Qp, Dp, cu_q, cu_d, torch.zeros(0, dtype=torch.int32),
                                  torch.zeros(0, dtype=torch.int32))
    assert none.shape == (0,)


def test_int64_offsets_are_accepted_and_converted(gen):
    Qp, cu_q, _ = lik.pack(_ragged(gen, (3, 4)))
    Dp, cu_d, _ = lik.pack(_ragged(gen, (5, 2, 6)))
    want = lik.maxsim_varlen(Qp, Dp, cu_q, cu_d)
    got = lik.maxsim_varlen(Qp, Dp, cu_q.long(), cu_d.long())
    assert torch.equal(got, want)
    with pytest.raises(TypeError, match="int32 or int64"):
        lik.maxsim_varlen(Qp, Dp, cu_q.float(), cu_d)
    with pytest.raises(TypeError, match="int32 or int64"):
        lik.maxsim_varlen(Qp, Dp, cu_q.to(torch.int16), cu_d)


@pytest.mark.parametrize("bounds", [False, True], ids=["bounds-omitted", "bounds-given"])
def test_bad_offsets_name_the_rule_and_the_index(gen, bounds):
    # one exception type per mistake whether or not the bounds are given (CPU tensors: the
    # offsets are read on the host either way)
    Qp, cu_q, mq = lik.pack(_ragged(gen, (3, 4)))
    Dp, cu_d, md = lik.pack(_ragged(gen, (5, 2, 6)))             # packed length 13
    kw = dict(max_seqlen_q=mq, max_seqlen_d=md) if bounds else {}
    cases = {
        (0, 5, 7, 12): r"cu_seqlens_d\[3\] = 12 \(the last offset\): offsets must end at the packed length 13",
        (1, 5, 7, 13): r"cu_seqlens_d\[0\] = 1: offsets must start at 0",
        (0, 8, 7, 13): r"cu_seqlens_d\[2\] = 7 is below cu_seqlens_d\[1\] = 8: offsets must never decrease",
        (0, 5, 7, 14): r"cu_seqlens_d\[3\] = 14 is past the packed length 13",
        (0, 5, 13, 6, 13): r"cu_seqlens_d\[2\] = 13 is past|cu_seqlens_d\[3\] = 6 is below cu_seqlens_d\[2\] = 13",
    }
    for offsets, message in cases.items():
        with pytest.raises(ValueError, match=message):
            lik.maxsim_varlen(Qp, Dp, cu_q, torch.tensor(offsets), **kw)
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[0\] = 2: offsets must start at 0"):
        lik.score_pairs_packed(Qp, Dp, torch.tensor([2, 3, 7]), cu_d, torch.tensor([0]), torch.tensor([0]), **kw)
    with pytest.raises(ValueError, match=r"pair_q_idx\[1\] = 2: pair indices must lie in \[0, Nq=2\)"):
        lik.score_pairs_packed(Qp, Dp, cu_q, cu_d, torch.tensor([0, 2]), torch.tensor([0, 1]), **kw)
    with pytest.raises(ValueError, match=r"pair_d_idx\[2\] = -1: pair indices must lie in \[0, Nd=3\)"):
        lik.score_pairs_packed(Qp, Dp, cu_q, cu_d, torch.tensor([0, 1, 1]), torch.tensor([0, 2, -1]), **kw)


def test_an_offset_past_the_end_and_a_decrease_are_both_named(gen):
    Qp, cu_q, _ = lik.pack(_ragged(gen, (3,)))
    Dp, _, _ = lik.pack(_ragged(gen, (5, 2, 6)))
    with pytest.raises(ValueError) as info:
        lik.maxsim_varlen(Qp, Dp, cu_q, torch.tensor([0, 20, 7, 13]))
    message = str(info.value)
    assert "cu_seqlens_d[1] = 20 is past the packed length 13" in message
    assert "cu_seqlens_d[2] = 7 is below cu_seqlens_d[1] = 20: offsets must never decrease" in message


@pytest.mark.parametrize("int64", [False, True], ids=["int32", "int64"])
def test_max_seqlen_too_small_is_an_error_not_a_truncation(backend, gen, int64):
    Qp, cu_q, mq = lik.pack(_ragged(gen, (3, 9)))
    Dp, cu_d, md = lik.pack(_ragged(gen, (5, 11, 2)))
    if int64:
        cu_q, cu_d = cu_q.long(), cu_d.long()
    with pytest.raises(ValueError, match=r"sequence 1 \(cu_seqlens_q\[1:3\] = 3, 12\) has 9 tokens: no sequence may be "
                                         r"longer than max_seqlen_q=4"):
        lik.maxsim_varlen(Qp, Dp, cu_q, cu_d, 4, md)
    with pytest.raises(ValueError, match=r"sequence 1 .* has 11 tokens: no sequence may be longer than max_seqlen_d=10"):
        lik.maxsim_varlen(Qp, Dp, cu_q, cu_d, mq, 10)
    with pytest.raises(ValueError, match="longer than max_seqlen_d=10"):
        lik.score_pairs_packed(Qp, Dp, cu_q, cu_d, torch.tensor([0]), torch.tensor([1]), max_seqlen_q=mq,
                               max_seqlen_d=10)
    # larger bounds than needed are fine and change nothing
    _close(lik.maxsim_varlen(Qp, Dp, cu_q, cu_d, mq + 5, md + 40), lik.maxsim_varlen(Qp, Dp, cu_q, cu_d))


def test_offsets_checked_in_a_compiled_graph_are_asserted_with_the_rule(gen, monkeypatch):
    # inside torch.compile the offsets cannot be read on the host: the check becomes an
    # assertion in the graph, whose message states the whole rule
    Qp, cu_q, mq = lik.pack(_ragged(gen, (3, 9)))
    Dp, cu_d, md = lik.pack(_ragged(gen, (5, 11)))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(RuntimeError, match="cu_seqlens_q must start at 0, end at the packed length 12, never "
                                           "decrease, and no sequence may be longer than max_seqlen_q=4"):
        lik.maxsim_varlen(Qp, Dp, cu_q, cu_d, 4, md)


def test_bad_inputs(gen):
    Qp, cu_q, _ = lik.pack(_ragged(gen, (3,)))
    Dp, cu_d, _ = lik.pack(_ragged(gen, (5,), d=8))
    with pytest.raises(ValueError, match="embedding dims differ"):
        lik.maxsim_varlen(Qp, Dp, cu_q, cu_d)
    with pytest.raises(ValueError, match="must be 2-D"):
        lik.maxsim_varlen(Qp[None], Qp, cu_q, cu_q)
    with pytest.raises(ValueError, match="one length"):
        lik.score_pairs_packed(Qp, Qp, cu_q, cu_q, torch.tensor([0, 0]), torch.tensor([0]))
    with pytest.raises(ValueError, match="q_mask must have shape"):
        lik.maxsim_varlen(Qp, Qp, cu_q, cu_q, q_mask=torch.ones(2, dtype=torch.bool))


def test_maxsim_padded_matches_the_unpadded_tokens(backend, gen):
    B, C, Lq, Ld, d = 3, 4, 6, 9, 12
    Q = torch.randn(B, Lq, d, generator=gen, requires_grad=True)
    D = torch.randn(B, C, Ld, d, generator=gen, requires_grad=True)
    q_len = torch.tensor([6, 1, 0])
    d_len = torch.randint(0, Ld + 1, (B, C), generator=gen)
    d_len[0, 1] = 0
    out = lik.maxsim_padded(Q, D, q_len, d_len)
    # independent formulation: each pair scored on its sliced, unpadded tokens
    want = torch.stack([torch.stack([
        reference.maxsim(Q[b, : q_len[b]].double()[None], D[b, c, : d_len[b, c]].double()[None])[0, 0]
        for c in range(C)]) for b in range(B)])
    _close(out, want)
    for got, ref in zip(_grads(out, (Q, D), torch.Generator().manual_seed(3)),
                        _grads(want, (Q, D), torch.Generator().manual_seed(3))):
        _close(got, ref)
    assert lik.routing_counts()["maxsim_padded"] == {backend: 1}
    too_long = d_len.clone()
    too_long[1, 2] = 10
    with pytest.raises(ValueError, match=r"doc_lengths\[1, 2\] = 10: lengths must lie in \[0, 9\]"):
        lik.maxsim_padded(Q, D, q_len, too_long)
    with pytest.raises(ValueError, match=r"query_lengths\[2\] = -1: lengths must lie in \[0, 6\]"):
        lik.maxsim_padded(Q, D, torch.tensor([6, 1, -1]), d_len)


def test_pack_unpack_round_trip(gen):
    seqs = _ragged(gen, (3, 0, 5))
    packed, cu, longest = lik.pack(seqs)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 3, 8] and longest == 5
    for a, b in zip(lik.unpack(packed, cu), seqs):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="at least one"):
        lik.pack([])
    with pytest.raises(ValueError, match="sequence 1"):
        lik.pack([seqs[0], torch.randn(2, 4)])
    with pytest.raises(ValueError, match=r"cu_seqlens\[2\] = 7 \(the last offset\): offsets must end at the packed "
                                         r"length 8"):
        lik.unpack(packed, torch.tensor([0, 3, 7]))
    with pytest.raises(ValueError, match=r"cu_seqlens\[2\] = 2 is below cu_seqlens\[1\] = 3"):
        lik.unpack(packed, torch.tensor([0, 3, 2, 8]))


def test_kill_switch_runs_the_reference(monkeypatch, gen):
    Qp, cu_q, _ = lik.pack(_ragged(gen, (3, 4)))
    Dp, cu_d, _ = lik.pack(_ragged(gen, (5, 0)))
    monkeypatch.setenv("LIK_DISABLE", "1")
    lik.reset_routing_counts()
    out = lik.maxsim_varlen(Qp, Dp, cu_q, cu_d)
    _close(out, reference.maxsim_varlen(Qp.double(), Dp.double(), cu_q, cu_d))
    assert lik.routing_counts()["maxsim_varlen"] == {"reference": 1}


def test_one_launch_input_check_kernel(gen):
    # the CUDA path checks offsets and pairs in one kernel (kernels/triton/checks.py): run
    # it in the interpreter against the rule, case by case
    from lik_plugins._config import triton_interpret

    if not triton_interpret():
        pytest.skip("the Triton kernels on CPU need TRITON_INTERPRET=1")
    from lik_plugins.kernels.triton.checks import packed_inputs_ok

    cu_q = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    cu_d = torch.tensor([0, 2, 9, 9, 10], dtype=torch.int64)
    pq, pd = torch.tensor([2, 0, 1]), torch.tensor([3, 0, 2])

    def ok(cq=cu_q, rq=8, mq=5, cd=cu_d, rd=10, md=7, p=(None, None)):
        return int(packed_inputs_ok(cq, rq, mq, cd, rd, md, *p))

    assert ok() == 1 and ok(p=(pq, pd)) == 1
    assert ok(mq=4) == 0                                  # a query of 5 tokens over the bound
    assert ok(md=6) == 0
    assert ok(rq=9) == 0                                  # does not end at the packed length
    assert ok(cq=torch.tensor([1, 3, 3, 8], dtype=torch.int32)) == 0          # does not start at 0
    assert ok(cd=torch.tensor([0, 5, 4, 9, 10])) == 0     # decreasing
    assert ok(p=(torch.tensor([2, 3, 1]), pd)) == 0       # query 3 of 3
    assert ok(p=(pq, torch.tensor([3, -1, 2]))) == 0
    long_q = torch.arange(0, 3001, dtype=torch.int32)     # longer than one check block
    assert ok(cq=long_q, rq=3000, mq=1) == 1
    bad = long_q.clone()
    bad[2500] = 2498
    assert ok(cq=bad, rq=3000, mq=1) == 0
