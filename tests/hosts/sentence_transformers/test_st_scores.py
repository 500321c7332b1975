"""Scoring-level parity with sentence-transformers 6.x's own path, the kill switch, patch/unpatch.

Every expectation is ST's own function, called with the patch removed (``unpatch`` ... ``patch``)
or through the originals the patcher recorded; inputs are fresh random tokens with holes in the
masks, fully masked and all-zero documents, odd sizes.
"""
from __future__ import annotations

import inspect

import numpy as np
import pytest

from support import st_tiny

st_tiny.require_st6()

import torch  # noqa: E402

from lik_plugins import reset_routing_counts, routing_counts  # noqa: E402
from support import host_state  # noqa: E402
from lik_plugins.sentence_transformers import patch_sentence_transformers, unpatch_sentence_transformers  # noqa: E402

OURS = {"triton", "metal", "torch-chunked", "reference"}


@pytest.fixture
def patched():
    layout = patch_sentence_transformers()
    reset_routing_counts()
    yield layout
    unpatch_sentence_transformers()


def unpatched(fn):
    """``fn()`` with the patch removed, then put back."""
    unpatch_sentence_transformers()
    try:
        return fn()
    finally:
        patch_sentence_transformers()


def _tokens(g, *shape, dtype=torch.float32):
    return torch.nn.functional.normalize(torch.randn(*shape, generator=g), dim=-1).to(dtype)


def _inputs(seed=0, nq=3, nd=5, lq=6, ld=9, h=12, dtype=torch.float32):
    """Queries and documents with zero-padded tails (ST derives its masks from all-zero rows),
    one all-zero document (empty: the sentinel) and explicit masks with holes."""
    g = torch.Generator().manual_seed(seed)
    Q, D = _tokens(g, nq, lq, h, dtype=dtype), _tokens(g, nd, ld, h, dtype=dtype)
    Q[0, lq - 2:] = 0
    D[1, ld - 4:] = 0
    D[2] = 0  # an empty document
    qm = torch.rand(nq, lq, generator=g) > 0.3
    dm = torch.rand(nd, ld, generator=g) > 0.3
    dm[3] = False  # a fully masked document
    dm[4, 0] = True
    return Q, D, qm, dm


def _ours(entry):
    return set(routing_counts().get(entry, {})) <= OURS and routing_counts().get(entry)


def _close(ours, theirs, dtype=torch.float32):
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape and ours.device == theirs.device
    tol = {torch.float32: 1e-5, torch.bfloat16: 6e-2, torch.float16: 1e-2}[dtype]
    torch.testing.assert_close(ours, theirs, atol=tol, rtol=tol)


# ------------------------------------------------------------------------ maxsim family


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("masks", ["derived", "bool", "float"])
def test_maxsim_matches_st(patched, dtype, masks):
    from sentence_transformers.util import maxsim

    Q, D, qm, dm = _inputs(seed=1, dtype=dtype)
    kw = {}
    if masks != "derived":
        kw = {"a_mask": qm, "b_mask": dm} if masks == "bool" else {"a_mask": qm.float(), "b_mask": dm.float()}
    ours = maxsim(Q, D, **kw)
    assert _ours("sentence_transformers.maxsim") == {"torch-chunked": 1}
    theirs = unpatched(lambda: maxsim(Q, D, **kw))
    _close(ours, theirs, dtype)
    assert ours.dtype == torch.float32
    # the empty / fully masked documents carry ST's sentinel, nothing else does
    sentinel = -1e9
    empty = [2] if masks == "derived" else [3]
    assert torch.all(ours[:, empty] == sentinel) and torch.all(ours[:, [0, 4]] > sentinel / 2)


def test_all_negative_similarities_are_excluded_not_zeroed(patched):
    """ST fills masked document tokens with the dtype minimum: a masked token never wins,
    even when every valid similarity is negative (PyLate's x0 mask would give 0 there)."""
    from sentence_transformers.util import maxsim

    q = torch.tensor([[[1.0, 0.0]]])
    d = torch.tensor([[[-1.0, 0.0], [0.0, 0.0], [0.5, 0.5]]])
    m = torch.tensor([[True, False, False]])
    ours = maxsim(q, d, b_mask=m)
    assert ours.item() == -1.0
    assert unpatched(lambda: maxsim(q, d, b_mask=m)).item() == -1.0


def test_lists_numpy_2d_length_normalize_chunk_elements_and_device(patched):
    from sentence_transformers.util import maxsim, mean_maxsim

    g = torch.Generator().manual_seed(2)
    qs = [_tokens(g, n, 8) for n in (3, 7, 1)]
    ds = [_tokens(g, n, 8) for n in (5, 2, 11, 1)]
    cases = {
        "ragged lists": lambda: maxsim(qs, ds),
        "ragged + tiny budget": lambda: maxsim(qs, ds, chunk_elements=50),
        "numpy": lambda: maxsim(np.stack([q.numpy() for q in qs[:1]] * 2), torch.stack(ds[:1] * 3)),
        "2-D single query": lambda: maxsim(qs[1], ds),
        "length_normalize": lambda: maxsim(qs, ds, length_normalize=True),
        "mean_maxsim": lambda: mean_maxsim(qs, ds),
        "explicit device": lambda: maxsim(qs, ds, device="cpu"),
    }
    for name, call in cases.items():
        reset_routing_counts()
        ours = call()
        assert _ours("sentence_transformers.maxsim"), name
        _close(ours, unpatched(call))


def test_padded_tensors_are_one_launch_whatever_the_budget(patched):
    from sentence_transformers.util import maxsim, maxsim_pairwise

    Q, D, _, _ = _inputs(seed=3, nq=4, nd=7)
    ours = maxsim(Q, D, chunk_elements=10)  # ST would loop over 4 x 7 chunks
    assert routing_counts()["sentence_transformers.maxsim"] == {"torch-chunked": 1}
    _close(ours, unpatched(lambda: maxsim(Q, D, chunk_elements=10)))
    reset_routing_counts()
    ours = maxsim_pairwise(Q, D[:4], chunk_elements=10)
    assert routing_counts()["sentence_transformers.maxsim_pairwise"] == {"torch-chunked": 1}
    _close(ours, unpatched(lambda: maxsim_pairwise(Q, D[:4], chunk_elements=10)))


@pytest.mark.parametrize("masks", ["derived", "bool"])
def test_maxsim_pairwise_matches_st(patched, masks):
    from sentence_transformers.util import maxsim_pairwise, mean_maxsim_pairwise

    Q, D, qm, dm = _inputs(seed=4, nq=5, nd=5)
    kw = {} if masks == "derived" else {"a_mask": qm, "b_mask": dm}
    for fn in (maxsim_pairwise, mean_maxsim_pairwise):
        reset_routing_counts()
        ours = fn(Q, D, **kw)
        assert _ours("sentence_transformers.maxsim_pairwise")
        _close(ours, unpatched(lambda: fn(Q, D, **kw)))
    g = torch.Generator().manual_seed(5)
    qs, ds = [_tokens(g, n, 8) for n in (2, 5, 3)], [_tokens(g, n, 8) for n in (4, 1, 9)]
    _close(maxsim_pairwise(qs, ds), unpatched(lambda: maxsim_pairwise(qs, ds)))


def test_gradients_match_st(patched):
    from sentence_transformers.util import maxsim, maxsim_pairwise

    Q, D, qm, dm = _inputs(seed=6)
    grads = []
    for run in (lambda f: f(), unpatched):
        q, d = Q.clone().requires_grad_(), D.clone().requires_grad_()
        w = torch.randn(Q.shape[0], D.shape[0], generator=torch.Generator().manual_seed(0))
        run(lambda: ((maxsim(q, d, a_mask=qm, b_mask=dm) * w).sum() + maxsim_pairwise(q, d[:3]).sum()).backward())
        grads.append((q.grad, d.grad))
    for ours, theirs in zip(*grads):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert grads[0][1][3].abs().sum() == 0  # the fully masked document gets no gradient


# ------------------------------------------------------------------------ scoring package


def _groups(seed, nq=3, qd=3, n=3, lq=5, ld=7, h=8):
    g = torch.Generator().manual_seed(seed)
    Q = _tokens(g, nq, lq, h)
    G = _tokens(g, qd, n, ld, h)
    G[0, 1, 4:] = 0
    qm = torch.rand(nq, lq, generator=g) > 0.2
    gm = torch.rand(qd, n, ld, generator=g) > 0.3
    gm[1, -1] = False  # a fully masked document: the sentinel
    return Q, G, qm, gm


@pytest.mark.parametrize("nq", [3, 5])  # 5 != 3 groups: the gather_across_devices shape
def test_colbert_scores_is_one_launch_over_the_groups(patched, nq):
    from sentence_transformers.multi_vector_encoder import scoring

    Q, G, qm, gm = _groups(seed=7, nq=nq)
    for fn in (scoring.colbert_scores, scoring.mean_colbert_scores):
        for kw in ({}, {"queries_mask": qm, "documents_mask": gm}):
            reset_routing_counts()
            ours = fn(Q, G, **kw)
            assert routing_counts()["sentence_transformers.maxsim"] == {"torch-chunked": 1}  # not one per group
            _close(ours, unpatched(lambda: fn(Q, G, **kw)))
            assert ours.shape == (nq, G.shape[0] * G.shape[1])


def test_colbert_kd_and_pairwise_scores(patched):
    from sentence_transformers.multi_vector_encoder import scoring

    Q, G, qm, gm = _groups(seed=8)
    for fn in (scoring.colbert_kd_scores, scoring.mean_colbert_kd_scores):
        reset_routing_counts()
        ours = fn(Q, G, queries_mask=qm, documents_mask=gm, length_normalize=True)
        assert routing_counts()["sentence_transformers.maxsim_pairwise"] == {"torch-chunked": 1}
        _close(ours, unpatched(lambda: fn(Q, G, queries_mask=qm, documents_mask=gm, length_normalize=True)))
    D = G[:, 0]
    for fn in (scoring.colbert_scores_pairwise, scoring.mean_colbert_scores_pairwise):
        _close(fn(Q, D, queries_mask=qm), unpatched(lambda: fn(Q, D, queries_mask=qm)))


def test_weighted_query_masks_and_xtr_stay_on_st(patched):
    from sentence_transformers.multi_vector_encoder import scoring
    from sentence_transformers.util import maxsim

    Q, D, qm, dm = _inputs(seed=9)
    weights = torch.rand(qm.shape, generator=torch.Generator().manual_seed(1))  # not a mask: ST's business
    _close(maxsim(Q, D, a_mask=weights, b_mask=dm), unpatched(lambda: maxsim(Q, D, a_mask=weights, b_mask=dm)))
    assert routing_counts()["sentence_transformers.maxsim"] == {"original": 1}
    Qg, G, qm, gm = _groups(seed=10)
    reset_routing_counts()
    ours = scoring.xtr_scores(Qg, G, queries_mask=qm, documents_mask=gm, top_k=4)
    assert routing_counts() == {}
    torch.testing.assert_close(ours, unpatched(lambda: scoring.xtr_scores(Qg, G, queries_mask=qm, documents_mask=gm, top_k=4)))


# ------------------------------------------------------------------------ kill switch


def test_kill_switch_is_st_bit_for_bit(patched, monkeypatch):
    from sentence_transformers.multi_vector_encoder import scoring
    from sentence_transformers.util import maxsim, maxsim_pairwise

    Q, D, qm, dm = _inputs(seed=11)
    Qg, G, _, gm = _groups(seed=11)
    calls = [
        lambda: maxsim(Q, D, a_mask=qm, b_mask=dm, chunk_elements=30),
        lambda: maxsim_pairwise(Q, D[:3]),
        lambda: scoring.colbert_scores(Qg, G, documents_mask=gm),
        lambda: scoring.colbert_kd_scores(Qg, G),
    ]
    monkeypatch.setenv("LIK_DISABLE", "1")
    ours = [c() for c in calls]
    assert routing_counts() and all(set(p) == {"original"} for p in routing_counts().values()), routing_counts()
    monkeypatch.delenv("LIK_DISABLE")
    theirs = [unpatched(c) for c in calls]
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


# ------------------------------------------------------------------------ patch / unpatch


def _snapshot():
    from support.host_state import module_globals

    names = ("maxsim", "maxsim_pairwise", "_maxsim_score_documents", "_maxsim_score_pairs", "colbert_scores", "colbert_kd_scores",
             "_colbert_scores", "_colbert_kd_scores")
    globals_ = module_globals("sentence_transformers", names)
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.multi_vector_encoder import losses

    from sentence_transformers.multi_vector_encoder.scoring import colbert

    scorer = getattr(colbert, "_MaxSimScorer", None)   # 6.3+: the model scorer of use_kernels / kernel_config
    owners = (MultiVectorEncoder, *[getattr(losses, n) for n in losses.__all__], *([scorer] if scorer else []))
    classes = {c.__name__: dict(vars(c)) for c in owners}
    return globals_, classes


def test_patch_twice_then_unpatch_restores_everything():
    patch_sentence_transformers()  # imports every module the patcher covers, so both snapshots see them
    unpatch_sentence_transformers()
    from sentence_transformers.util import similarity

    before = _snapshot()
    patch_sentence_transformers()
    patch_sentence_transformers()
    served = similarity.maxsim
    assert served is not before[0][("sentence_transformers.util.similarity", "maxsim")]
    assert served.__wrapped__ is before[0][("sentence_transformers.util.similarity", "maxsim")]
    assert served.__module__ == "sentence_transformers.util.similarity" and served.__doc__
    assert inspect.signature(served) == inspect.signature(served.__wrapped__)
    Q, D, _, _ = _inputs(seed=12)
    routes = host_state.routes_of_one_call(lambda: similarity.maxsim(Q, D))
    assert routes["sentence_transformers.maxsim"] == {"torch-chunked": 1}  # not wrapped twice
    unpatch_sentence_transformers()
    after = _snapshot()
    assert host_state.same_objects(before[0], after[0])
    assert before[1] == after[1]
    assert host_state.routes_of_one_call(lambda: similarity.maxsim(Q, D)) == {}


def test_objects_built_before_the_patch_are_served(tmp_path):
    """A model and a loss built before the patch: ``model.similarity`` and the loss's scoring
    are served after it.  6.0 - 6.2 losses hold ST's ``colbert_scores`` (``similarity_fct``);
    6.3 losses hold None and score through ``model.similarity``."""
    unpatch_sentence_transformers()
    from sentence_transformers.multi_vector_encoder import scoring
    from sentence_transformers.util import similarity

    encoder = st_tiny.save_tiny_encoder(str(tmp_path / "enc"))
    model, twin = st_tiny.load_encoder(encoder), st_tiny.load_encoder(encoder)
    model.similarity_fn_name  # noqa: B018 -- resolved before the patch
    loss, twin_loss = st_tiny.make_loss("mnrl", model), st_tiny.make_loss("mnrl", twin)
    original_maxsim, original_scores, held = similarity.maxsim, scoring.colbert_scores, loss.similarity_fct
    assert model._similarity is original_maxsim and held in (original_scores, None)
    q = model.encode_query(["what is a kernel", "where is the river"])
    d = model.encode_document(["a kernel is fast.", "the river is in the city!", "the sun"])
    theirs = model.similarity(q, d)
    their_losses = st_tiny.train(twin, twin_loss, "mnrl", str(tmp_path / "v"), steps=1)
    patch_sentence_transformers()
    try:
        if held is not None:
            assert loss.similarity_fct.__wrapped__ is original_scores
        reset_routing_counts()
        ours = model.similarity(q, d)
        assert _ours("sentence_transformers.maxsim")
        _close(ours, theirs)
        reset_routing_counts()
        our_losses = st_tiny.train(model, loss, "mnrl", str(tmp_path / "p"), steps=1)
        assert routing_counts()["sentence_transformers.maxsim"] == {"torch-chunked": 1}   # both columns, one launch
    finally:
        unpatch_sentence_transformers()
    assert our_losses == pytest.approx(their_losses, rel=1e-5, abs=1e-6)
    assert model._similarity is original_maxsim and loss.similarity_fct is held


def test_install_hint_when_st_is_missing(monkeypatch):
    import sys

    from lik_plugins.sentence_transformers import _patch

    unpatch_sentence_transformers()
    monkeypatch.setitem(sys.modules, "sentence_transformers", None)  # import raises ImportError
    with pytest.raises(ImportError, match="pip install 'sentence-transformers>=6,<7'"):
        _patch.detect()


# ------------------------------------------------------------------------ the Triton kernels


def test_st_semantics_through_the_triton_kernels(patched, monkeypatch):
    """Masks with holes, a fully masked document (sentinel), all-negative rows and gradients
    through the real Triton kernels (CPU interpreter in CI)."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 (CPU) for the kernels")
    pytest.importorskip("triton")
    from sentence_transformers.multi_vector_encoder import scoring

    monkeypatch.setenv("LIK_BACKEND", "triton")
    Q, G, qm, gm = _groups(seed=13, nq=2, qd=2, n=2, lq=5, ld=7, h=16)
    G = (G - 0.4).requires_grad_()  # mostly negative similarities
    Q = Q.requires_grad_()
    ours = scoring.colbert_scores(Q, G, queries_mask=qm, documents_mask=gm)
    assert routing_counts()["sentence_transformers.maxsim"] == {"triton": 1}
    ours.sum().backward()
    got = (ours.detach(), Q.grad.clone(), G.grad.clone())
    Q.grad, G.grad = None, None
    theirs = unpatched(lambda: scoring.colbert_scores(Q, G, queries_mask=qm, documents_mask=gm))
    theirs.sum().backward()
    torch.testing.assert_close(got[0], theirs.detach(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1], Q.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[2], G.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lists_read_in_place_by_the_triton_kernels(patched, monkeypatch, dtype):
    """``maxsim`` / ``maxsim_pairwise`` on lists: one launch over the documents where they lie
    (split views of one buffer among them), ST's list semantics: padding excluded, an empty
    document's sentinel, ``length_normalize``."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 (CPU) for the kernels")
    from sentence_transformers.util import maxsim, maxsim_pairwise

    monkeypatch.setenv("LIK_BACKEND", "triton")
    g = torch.Generator().manual_seed(21)
    qs = [_tokens(g, n, 16, dtype=dtype) for n in (3, 70, 1)]
    # shifted: all-negative rows must be excluded (never floored at a padding zero)
    ds = [_tokens(g, n, 16, dtype=dtype) - 0.4 for n in (5, 1, 90)] + list(torch.split(_tokens(g, 9, 16, dtype=dtype), [6, 0, 3]))
    cases = {
        "maxsim": (lambda: maxsim(qs, ds), "maxsim"),
        "length_normalize": (lambda: maxsim(qs, ds, length_normalize=True), "maxsim"),
        "pairwise": (lambda: maxsim_pairwise(qs, ds[:3]), "maxsim_pairwise"),
    }
    for name, (call, entry) in cases.items():
        reset_routing_counts()
        ours = call()
        assert routing_counts() == {f"sentence_transformers.{entry}_lists": {"triton": 1}}, name
        _close(ours, unpatched(call), dtype)
