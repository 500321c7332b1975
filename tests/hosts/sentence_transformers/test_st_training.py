"""Training a tiny offline MultiVectorEncoder with every multi-vector loss of sentence-transformers
6.x: patched vs unpatched vs ``LIK_DISABLE=1`` -- routed, same losses, same weights; then the
evaluators and ``model.similarity`` on the trained model."""
from __future__ import annotations

import os

import pytest

from support import st_tiny

st_tiny.require_st6()

import torch  # noqa: E402

from lik_plugins import reset_routing_counts, routing_counts  # noqa: E402
from lik_plugins.sentence_transformers import patch_sentence_transformers, unpatch_sentence_transformers  # noqa: E402

OURS = {"triton", "metal", "torch-chunked", "reference"}


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    return st_tiny.save_tiny_encoder(str(tmp_path_factory.mktemp("st") / "enc"))


def _run(encoder, kind, out_dir):
    model = st_tiny.load_encoder(encoder)
    loss = st_tiny.make_loss(kind, model)
    values = st_tiny.train(model, loss, kind, out_dir)
    return values, st_tiny.parameters(model)


@pytest.mark.parametrize("kind", st_tiny.LOSSES)
def test_training_is_routed_and_identical(encoder, tmp_path, kind):
    unpatch_sentence_transformers()
    before = st_tiny.parameters(st_tiny.load_encoder(encoder))
    vanilla_losses, vanilla = _run(encoder, kind, str(tmp_path / "v"))
    patch_sentence_transformers()
    try:
        reset_routing_counts()
        patched_losses, patched = _run(encoder, kind, str(tmp_path / "p"))
        counts = routing_counts()
        served = {e: p for e, p in counts.items() if e.startswith("sentence_transformers.")}
        assert served and all(set(p) <= OURS for p in served.values()), counts
        os.environ["LIK_DISABLE"] = "1"
        try:
            reset_routing_counts()
            disabled_losses, disabled = _run(encoder, kind, str(tmp_path / "d"))
            assert all(set(p) == {"original"} for e, p in routing_counts().items() if e.startswith("sentence_transformers."))
        finally:
            del os.environ["LIK_DISABLE"]
    finally:
        unpatch_sentence_transformers()
    assert len(vanilla_losses) >= 2
    assert patched_losses == pytest.approx(vanilla_losses, rel=1e-5, abs=1e-6)
    assert disabled_losses == vanilla_losses  # bit for bit
    assert st_tiny.max_param_diff(patched, vanilla) < 1e-5
    assert st_tiny.max_param_diff(disabled, vanilla) == 0.0
    assert st_tiny.max_param_diff(vanilla, before) > 1e-4  # training did move the weights


def _wrapping_loss(wrapper: str, model):
    """6.3's losses that wrap another one: Matryoshka dimensions, token pooling (Ward)."""
    from sentence_transformers.multi_vector_encoder import losses

    if wrapper == "matryoshka":
        return losses.MultiVectorMatryoshkaLoss(model, st_tiny.make_loss("mnrl", model), matryoshka_dims=[16, 7])
    if wrapper == "matryoshka_kd":
        return losses.MultiVectorMatryoshkaLoss(model, st_tiny.make_loss("distill_kl_div", model), matryoshka_dims=[16, 5])
    from sentence_transformers.multi_vector_encoder.modules import HierarchicalTokenPooling

    return losses.MultiVectorTokenPoolingLoss(model, st_tiny.make_loss("mnrl", model),
                                              [None, HierarchicalTokenPooling(pool_factor=2)])


@pytest.mark.parametrize("wrapper", ["matryoshka", "matryoshka_kd", "token_pooling"])
def test_wrapping_losses_are_routed_and_identical(encoder, tmp_path, wrapper):
    """6.3+: the multi-vector Matryoshka and token-pooling losses score through the loss they
    wrap (odd truncated dims included); patched and vanilla train alike."""
    from sentence_transformers.multi_vector_encoder import losses

    if not hasattr(losses, "MultiVectorMatryoshkaLoss"):
        pytest.skip("sentence-transformers 6.3+ (multi-vector Matryoshka / token-pooling losses)")
    inner = "distill_kl_div" if wrapper == "matryoshka_kd" else "mnrl"

    def run(name):
        model = st_tiny.load_encoder(encoder)
        values = st_tiny.train(model, _wrapping_loss(wrapper, model), inner, str(tmp_path / name))
        return values, st_tiny.parameters(model)

    unpatch_sentence_transformers()
    vanilla_losses, vanilla = run("v")
    patch_sentence_transformers()
    try:
        reset_routing_counts()
        patched_losses, patched = run("p")
        counts = routing_counts()
    finally:
        unpatch_sentence_transformers()
    entry = "sentence_transformers.maxsim_pairwise" if inner == "distill_kl_div" else "sentence_transformers.maxsim"
    assert set(counts.get(entry, {})) <= OURS and counts.get(entry), counts
    assert all(set(p) <= OURS for e, p in counts.items() if e.startswith("sentence_transformers.")), counts
    assert len(vanilla_losses) >= 2
    assert patched_losses == pytest.approx(vanilla_losses, rel=1e-5, abs=1e-6)
    assert st_tiny.max_param_diff(patched, vanilla) < 1e-5


def test_evaluators_and_similarity_match(encoder):
    from sentence_transformers.multi_vector_encoder.evaluation import (
        MultiVectorDistillationEvaluator,
        MultiVectorInformationRetrievalEvaluator,
        MultiVectorTripletEvaluator,
    )

    unpatch_sentence_transformers()
    model = st_tiny.load_encoder(encoder, seed=3)
    triples = st_tiny.TRIPLES
    queries = {f"q{i}": t[0] for i, t in enumerate(triples)}
    corpus = {f"d{i}": t[1] for i, t in enumerate(triples)} | {f"n{i}": t[2] for i, t in enumerate(triples)}
    corpus["punct"] = "!!! ?"  # punctuation only: every token but the specials on the skiplist
    relevant = {f"q{i}": {f"d{i}"} for i in range(len(triples))}

    def evaluate():
        ir = MultiVectorInformationRetrievalEvaluator(queries, corpus, relevant, name="ir", corpus_chunk_size=5)
        trip = MultiVectorTripletEvaluator([t[0] for t in triples], [t[1] for t in triples], [t[2] for t in triples], name="tr")
        docs = [[t[1], t[2]] for t in triples]
        dist = MultiVectorDistillationEvaluator([t[0] for t in triples], docs, [[0.9, 0.2]] * len(triples), name="ds")
        q = model.encode_query([t[0] for t in triples])
        d = model.encode_document([t[1] for t in triples])
        d = [*d, d[0].new_zeros(0, d[0].shape[1])]  # a document with no token: ST's sentinel
        return ir(model), trip(model), dist(model), model.similarity(q, d), model.similarity_pairwise(q, d[: len(q)])

    theirs = evaluate()
    patch_sentence_transformers()
    try:
        reset_routing_counts()
        ours = evaluate()
        counts = routing_counts()
    finally:
        unpatch_sentence_transformers()
    assert set(counts.get("sentence_transformers.maxsim", {})) <= OURS and counts.get("sentence_transformers.maxsim")
    assert set(counts.get("sentence_transformers.maxsim_pairwise", {})) <= OURS and counts.get("sentence_transformers.maxsim_pairwise")
    for a, b in zip(ours[:3], theirs[:3]):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key
    for a, b in zip(ours[3:], theirs[3:]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert torch.all(ours[3][:, -1] == -1e9) and torch.all(ours[3][:, :-1] > 0)  # the empty document: ST's sentinel
