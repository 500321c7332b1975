"""ColBERT.pool_embeddings_hierarchical (what encode(..., pool_factor=k) calls) served by
hierarchical_pool: PyLate's own results, routed counts, unpatch and the kill switch."""
import pytest
import torch

from lik_plugins import routing_counts

colbert = pytest.importorskip("pylate.models.colbert")
pytest.importorskip("scipy")
ColBERT = colbert.ColBERT
ENTRY = "pylate.pool_embeddings_hierarchical"


def documents() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    docs = [torch.nn.functional.normalize(torch.randn(n, 32, generator=g), dim=1) for n in (1, 2, 5, 17, 40)]
    exact = torch.zeros(12, 32)
    exact[torch.arange(12), torch.arange(12) % 4] = 1.0   # three copies of four one-hot tokens: exact ties
    return docs + [exact, docs[3].clone()]


def pool(model, docs, pool_factor=2, protected_tokens=1):
    # encode() calls it as a method: self.pool_embeddings_hierarchical(...)
    return model.pool_embeddings_hierarchical(documents_embeddings=docs, pool_factor=pool_factor,
                                              protected_tokens=protected_tokens)


@pytest.fixture
def model():
    return ColBERT.__new__(ColBERT)   # the pooler reads nothing from the model


def host(docs, pool_factor=2, protected_tokens=1):
    from lik_plugins.pylate import is_patched
    assert not is_patched()
    return ColBERT.pool_embeddings_hierarchical(None, docs, pool_factor, protected_tokens)


@pytest.mark.parametrize("pool_factor, protected_tokens", [(2, 1), (3, 0), (2, 4), (1, 1)])
def test_same_results_as_pylate(model, pool_factor, protected_tokens):
    docs = documents()
    expected = host(docs, pool_factor, protected_tokens)
    from lik_plugins.pylate import patch_pylate, unpatch_pylate
    patch_pylate()
    try:
        before = routing_counts().get(ENTRY, {}).get("torch-chunked", 0)
        ours = pool(model, docs, pool_factor, protected_tokens)
        assert routing_counts()[ENTRY]["torch-chunked"] == before + 1
    finally:
        unpatch_pylate()
    for got, want in zip(ours, expected):
        assert got.shape == want.shape and got.dtype == want.dtype and got.device == want.device
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_unpatch_restores_the_original(model):
    original = vars(ColBERT)["pool_embeddings_hierarchical"]
    from lik_plugins.pylate import patch_pylate, unpatch_pylate
    patch_pylate()
    assert vars(ColBERT)["pool_embeddings_hierarchical"] is not original
    unpatch_pylate()
    assert vars(ColBERT)["pool_embeddings_hierarchical"] is original


def test_kill_switch_and_unserved_inputs_run_pylate(patched, model, monkeypatch):
    docs = documents()
    monkeypatch.setenv("LIK_DISABLE", "1")
    pool(model, docs)
    monkeypatch.delenv("LIK_DISABLE")
    with pytest.raises(TypeError):   # bfloat16: PyLate's own .numpy() refuses it, and says so
        pool(model, [d.bfloat16() for d in docs[2:4]])
    assert routing_counts()[ENTRY] == {"original": 2}
