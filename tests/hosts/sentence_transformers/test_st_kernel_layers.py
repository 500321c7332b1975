"""sentence-transformers 6.3's own plug-in point: ``MultiVectorEncoder(kernel_config=kernel_config())``
loads our layer repository through ``kernels`` (offline, a folder of the package) -- no patch --
and scores like ST's own path; and the precedence when the patch is on too
(``lik_plugins.sentence_transformers._model_scorer``)."""
from __future__ import annotations

import json
import os

import pytest

from support import st_tiny

st_tiny.require_st6()
pytest.importorskip("kernels", reason="needs sentence-transformers[kernels] (ST 6.3+)")

import torch  # noqa: E402

from lik_plugins import reset_routing_counts, routing_counts  # noqa: E402
from lik_plugins.sentence_transformers import (  # noqa: E402
    KERNEL_REPOSITORY,
    kernel_config,
    patch_sentence_transformers,
    unpatch_sentence_transformers,
)

colbert = pytest.importorskip("sentence_transformers.multi_vector_encoder.scoring.colbert")
if not hasattr(colbert, "_MaxSimScorer"):
    pytest.skip("needs sentence-transformers 6.3+ (kernel layers)", allow_module_level=True)

OURS = {"triton", "metal", "torch-chunked", "reference"}
QUERIES = ["what is a kernel", "where is the river", "sun"]
DOCUMENTS = ["a kernel is fast.", "the river is in the city!", "the sun", "!!! ?", "rivers and kernels, fast"]


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    return st_tiny.save_tiny_encoder(str(tmp_path_factory.mktemp("st") / "enc"))


@pytest.fixture(autouse=True)
def _unpatched():
    unpatch_sentence_transformers()
    reset_routing_counts()
    yield
    unpatch_sentence_transformers()


def _model(encoder, **kernels):
    """The tiny encoder of ``st_tiny``, rebuilt with ``MultiVectorEncoder``'s kernel arguments."""
    from sentence_transformers import MultiVectorEncoder

    base = st_tiny.load_encoder(encoder)
    return MultiVectorEncoder(modules=list(base._modules.values()), device="cpu", **kernels)


def _scores(model):
    q = model.encode_query(QUERIES)
    d = model.encode_document(DOCUMENTS)
    padded_q = torch.nn.utils.rnn.pad_sequence(q, batch_first=True)
    padded_d = torch.nn.utils.rnn.pad_sequence(d, batch_first=True)
    return {
        "lists": model.similarity(q, d),
        "padded": model.similarity(padded_q, padded_d),
        "pairwise": model.similarity_pairwise(q, d[: len(q)]),
        "length_normalize": model.similarity(q, d, length_normalize=True),
    }


def _assert_same(ours, theirs, atol=1e-5):
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert ours[key].dtype == theirs[key].dtype and ours[key].shape == theirs[key].shape, key
        torch.testing.assert_close(ours[key], theirs[key], atol=atol, rtol=atol, msg=key)


def _served(entry):
    paths = routing_counts().get(entry, {})
    return bool(paths) and set(paths) <= OURS


# ------------------------------------------------------------------ ST's mechanism, no patch


def test_repository_is_a_kernels_layer_repository():
    from pathlib import Path

    from kernels import LocalLayerRepository

    variant = KERNEL_REPOSITORY / "torch-universal"
    assert json.loads((variant / "metadata.json").read_text())["name"] == "lik-plugins-maxsim"
    for layer in ("MaxSim", "MaxSimPairwise"):
        cls = LocalLayerRepository(repo_path=Path(KERNEL_REPOSITORY), layer_name=layer).load()
        assert cls.__name__ == layer and issubclass(cls, torch.nn.Module)
    mapping = kernel_config().kernel_mapping
    assert set(mapping) == {"STMaxSim", "STMaxSimPairwise"} and kernel_config().use_local_kernel


def test_kernel_config_scores_like_st_and_is_served(encoder):
    theirs = _scores(_model(encoder))
    assert routing_counts() == {}
    ours = _scores(_model(encoder, kernel_config=kernel_config()))
    assert _served("sentence_transformers.maxsim") and _served("sentence_transformers.maxsim_pairwise"), routing_counts()
    _assert_same(ours, theirs)
    assert torch.all(ours["lists"][:, 3] > -1e9)   # punctuation only: the special tokens are left


def test_kernel_config_masks_sentinel_and_gradients():
    """The layers on ST's chunk shapes: masks with holes, a fully masked document (ST's
    sentinel), all-negative rows, gradients -- against ST's own chunk scorers."""
    from sentence_transformers.util import similarity

    from lik_plugins.sentence_transformers.kernel_layers import MaxSim, MaxSimPairwise

    g = torch.Generator().manual_seed(0)
    Q = torch.nn.functional.normalize(torch.randn(3, 5, 12, generator=g), dim=-1).requires_grad_()
    D = (torch.nn.functional.normalize(torch.randn(4, 7, 12, generator=g), dim=-1) - 0.3).requires_grad_()
    qm, dm = torch.rand(3, 5, generator=g) > 0.3, torch.rand(4, 7, generator=g) > 0.3
    dm[1] = False
    cases = [(MaxSim(), similarity._maxsim_score_documents, D), (MaxSimPairwise(), similarity._maxsim_score_pairs, D[:3])]
    for layer, host, docs in cases:
        results = []
        for fn in (layer, host):
            Q.grad = D.grad = None
            out = fn(Q, docs, qm, dm[: docs.shape[0]])
            out.sum().backward()
            results.append((out.detach(), Q.grad.clone(), D.grad.clone()))
        for a, b in zip(*results):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert _served("sentence_transformers.maxsim") and _served("sentence_transformers.maxsim_pairwise")


@pytest.mark.parametrize("kind", ["mnrl", "distill_kl_div"])
def test_kernel_config_training_matches(encoder, tmp_path, kind):
    """The losses' default path (``model.similarity`` / ``similarity_pairwise``) through our layers."""
    def run(name, **kernels):
        model = _model(encoder, **kernels)
        return st_tiny.train(model, st_tiny.make_loss(kind, model), kind, str(tmp_path / name)), st_tiny.parameters(model)

    vanilla_losses, vanilla = run("v")
    reset_routing_counts()
    losses, trained = run("k", kernel_config=kernel_config())
    entry = "sentence_transformers.maxsim_pairwise" if kind == "distill_kl_div" else "sentence_transformers.maxsim"
    assert _served(entry), routing_counts()
    assert losses == pytest.approx(vanilla_losses, rel=1e-5, abs=1e-6)
    assert st_tiny.max_param_diff(trained, vanilla) < 1e-5


def test_kill_switch_sends_the_layers_to_st(encoder, monkeypatch):
    theirs = _scores(_model(encoder))
    monkeypatch.setenv("LIK_DISABLE", "1")
    ours = _scores(_model(encoder, kernel_config=kernel_config()))
    counts = routing_counts()
    assert counts and all(set(paths) == {"original"} for paths in counts.values()), counts
    _assert_same(ours, theirs, atol=0)


# ------------------------------------------------------------------ precedence with the patch


def test_patch_serves_a_use_kernels_model_without_loading_a_layer(encoder):
    """``use_kernels=True`` (ST's default layers are Hub repositories): the patch serves."""
    theirs = _scores(_model(encoder))
    model = _model(encoder, use_kernels=True)
    patch_sentence_transformers()
    reset_routing_counts()
    ours = _scores(model)
    counts = routing_counts()
    assert not any(e.startswith("sentence_transformers.kernel_layer") for e in counts), counts
    assert _served("sentence_transformers.maxsim") and _served("sentence_transformers.maxsim_pairwise"), counts
    assert model._similarity._operations == {}   # no kernel layer was loaded
    _assert_same(ours, theirs)


def test_patch_and_our_kernel_config_take_one_path(encoder):
    theirs = _scores(_model(encoder))
    model = _model(encoder, kernel_config=kernel_config())
    patch_sentence_transformers()
    reset_routing_counts()
    q = model.encode_query(QUERIES)
    d = torch.nn.utils.rnn.pad_sequence(model.encode_document(DOCUMENTS), batch_first=True)
    reset_routing_counts()
    model.similarity(torch.nn.utils.rnn.pad_sequence(q, batch_first=True), d)
    counts = routing_counts()
    assert set(counts["sentence_transformers.maxsim"]) <= OURS
    assert sum(counts["sentence_transformers.maxsim"].values()) == 1   # one launch, counted once
    assert not any(e.startswith("sentence_transformers.kernel_layer") for e in counts), counts
    _assert_same(_scores(model), theirs)


def test_an_explicit_foreign_layer_wins_and_is_counted(encoder, tmp_path):
    """A ``kernel_config`` naming another repository for ``STMaxSim``: that layer serves (here
    one that returns 7 everywhere, so its result is unmistakable), counted as the host's
    kernel layer; ``STMaxSimPairwise``, not mapped, stays with the patch."""
    from transformers import KernelConfig

    repo = _foreign_repository(tmp_path)
    theirs = _scores(_model(encoder))
    model = _model(encoder, kernel_config=KernelConfig({"STMaxSim": f"{repo}:MaxSim"}, use_local_kernel=True))
    patch_sentence_transformers()
    reset_routing_counts()
    q = model.encode_query(QUERIES)
    d = model.encode_document(DOCUMENTS)
    reset_routing_counts()
    scores = model.similarity(q, d)
    assert torch.all(scores == 7.0)
    assert routing_counts() == {"sentence_transformers.kernel_layer.STMaxSim": {"original": 1}}
    reset_routing_counts()
    pairs = model.similarity_pairwise(q, d[: len(q)])
    torch.testing.assert_close(pairs, theirs["pairwise"], atol=1e-5, rtol=1e-5)
    assert not any(e.startswith("sentence_transformers.kernel_layer") for e in routing_counts())


def test_a_use_kernels_model_built_before_the_patch_is_served(encoder):
    """Its ``similarity_pairwise`` is ST's bound method, stored at construction."""
    theirs = _scores(_model(encoder))
    model = _model(encoder, use_kernels=True)
    patch_sentence_transformers()
    reset_routing_counts()
    ours = _scores(model)
    assert _served("sentence_transformers.maxsim_pairwise") or _served("sentence_transformers.maxsim_pairwise_lists")
    _assert_same(ours, theirs)
    unpatch_sentence_transformers()
    reset_routing_counts()
    _scores(model)
    assert not any(set(p) & OURS for p in routing_counts().values()), routing_counts()


def _foreign_repository(tmp_path):
    variant = tmp_path / "foreign" / "torch-universal"
    variant.mkdir(parents=True)
    (variant / "metadata.json").write_text(json.dumps({
        "id": f"foreign_maxsim_{os.getpid()}", "name": "foreign-maxsim", "version": 1, "license": "Apache-2.0",
        "python-depends": [], "backend": {"type": "universal"}}))
    (variant / "__init__.py").write_text(
        "import torch\n\n\n"
        "class MaxSim(torch.nn.Module):\n"
        "    def forward(self, a, b, a_mask, b_mask):\n"
        "        return a.new_full((a.shape[0], b.shape[0]), 7.0, dtype=torch.float32)\n\n\n"
        "class layers:\n"
        "    MaxSim = MaxSim\n")
    return tmp_path / "foreign"
