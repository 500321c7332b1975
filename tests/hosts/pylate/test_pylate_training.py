"""Training with the real PyLate: patched runs route through lik_plugins and match vanilla."""
from __future__ import annotations

import os

import pytest

pytest.importorskip("pylate.scores", reason="PyLate is not installed (docs/install.md: PyLate beside your torch)")

from support import pylate_tiny as tiny  # noqa: E402

from lik_plugins import routing_counts, reset_routing_counts  # noqa: E402
from lik_plugins.pylate import patch_pylate, unpatch_pylate  # noqa: E402

OURS = {"triton", "metal", "torch-chunked", "reference"}


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    return tiny.save_tiny_encoder(str(tmp_path_factory.mktemp("encoder")))


@pytest.fixture(scope="module")
def scenario(encoder, tmp_path_factory):
    result = tiny.run_scenario(encoder, str(tmp_path_factory.mktemp("work")))
    yield result
    unpatch_pylate()


@pytest.mark.parametrize("kind", ["contrastive", "cached", "distillation"])
def test_patched_training_is_routed_and_matches_vanilla(scenario, kind):
    run = scenario["losses"][kind]
    pylate_entries = {k: v for k, v in run["counts"].items() if k.startswith("pylate.")}
    assert pylate_entries, f"no PyLate scoring call was routed: {run['counts']}"
    for entry, paths in pylate_entries.items():
        assert set(paths) <= OURS, f"{entry} fell back: {paths}"
    assert run["patched"] == pytest.approx(run["vanilla"], abs=1e-5, rel=1e-5)
    assert len(run["patched"]) >= 2
    assert run["params_moved"] > 30  # training really changed the weights...
    assert run["param_diff"] < 1e-4  # ...and identically


@pytest.mark.parametrize("kind", ["contrastive", "cached", "distillation"])
def test_kill_switch_routes_nothing(scenario, kind):
    run = scenario["losses"][kind]
    assert run["disabled_counts"], "the patched entries were not even called"
    for entry, paths in run["disabled_counts"].items():
        assert set(paths) == {"original"}, f"{entry} ran our path under LIK_DISABLE=1: {paths}"
    assert run["disabled"] == run["vanilla"]  # bit-identical: PyLate's own code


def test_expected_call_counts(scenario):
    # ColBERTScores (1.5.0+) is one fused call per query chunk, not one per document group
    contrastive = scenario["losses"]["contrastive"]["counts"]
    assert contrastive["pylate.ColBERTScores"] == {"torch-chunked": 2}  # 2 steps, 1 chunk
    cached = scenario["losses"]["cached"]["counts"]
    assert cached["pylate.ColBERTScores"] == {"torch-chunked": 4}  # 2 steps x 2 query chunks
    distillation = scenario["losses"]["distillation"]["counts"]
    assert distillation["pylate.colbert_kd_scores"] == {"torch-chunked": 2}


def test_inference_entry_points_routed_with_identical_results(scenario):
    counts = scenario["inference_counts"]
    assert scenario["inference_vanilla_counts"] == {}
    assert counts["pylate.colbert_scores"]["torch-chunked"] == 1  # similarity
    assert counts["pylate.rerank"] == {"original": 1}              # a CPU: PyLate's own loop (faster there)
    assert counts["pylate.colbert_scores_pairwise"]["torch-chunked"] == 2  # triplet evaluator
    assert counts["pylate.colbert_kd_scores"]["torch-chunked"] == 1  # distillation evaluator
    vanilla, patched = scenario["inference_vanilla"], scenario["inference_patched"]
    assert patched["rerank"] == vanilla["rerank"]
    for row_patched, row_vanilla in zip(patched["similarity"], vanilla["similarity"]):
        assert row_patched == pytest.approx(row_vanilla, abs=1e-5)
    assert patched["triplet"] == vanilla["triplet"]
    assert patched["distillation"] == pytest.approx(vanilla["distillation"], abs=1e-6)


def test_backend_matrix(scenario):
    for how in ("env", "arg"):
        backend = {k.split(":")[1]: v for k, v in scenario["backend"].items() if k.startswith(how)}
        assert backend == {"auto": ["torch-chunked"], "lik": ["torch-chunked"], "torch": ["original"],
                           "flash": "RuntimeError", "bogus": "ValueError"}, (how, backend)


def test_ir_evaluator_built_before_the_patch(encoder):
    from pylate import evaluation

    unpatch_pylate()
    model = tiny.load_colbert(encoder)
    queries = {f"q{i}": t[0] for i, t in enumerate(tiny.TRIPLES)}
    corpus = {f"d{i}": t[1] for i, t in enumerate(tiny.TRIPLES)}
    corpus.update({f"n{i}": t[2] for i, t in enumerate(tiny.TRIPLES)})
    relevant = {f"q{i}": {f"d{i}"} for i in range(len(tiny.TRIPLES))}
    evaluator = evaluation.PyLateInformationRetrievalEvaluator(
        queries=queries, corpus=corpus, relevant_docs=relevant, name="tiny", show_progress_bar=False
    )
    reset_routing_counts()
    vanilla = evaluator(model)  # fills evaluator.score_functions with the original scorer
    assert routing_counts() == {}
    patch_pylate()
    try:
        reset_routing_counts()
        patched = evaluator(model)
        counts = routing_counts()
    finally:
        unpatch_pylate()
    assert set(counts["pylate.colbert_scores"]) <= OURS
    assert patched == pytest.approx(vanilla, abs=1e-6)


def test_env_disable_is_read_at_call_time(encoder):
    import torch
    from pylate import scores

    patch_pylate()
    try:
        Q, D = torch.randn(2, 4, 8), torch.randn(3, 5, 8)
        reset_routing_counts()
        a = scores.colbert_scores(Q, D)
        os.environ["LIK_DISABLE"] = "1"
        try:
            b = scores.colbert_scores(Q, D)
        finally:
            del os.environ["LIK_DISABLE"]
        c = scores.colbert_scores(Q, D)
    finally:
        unpatch_pylate()
    assert routing_counts()["pylate.colbert_scores"] == {"torch-chunked": 2, "original": 1}
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(a, c)
