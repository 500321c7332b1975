"""HierarchicalTokenPooler served by hierarchical_pool: colpali-engine's own pooled pages and
cluster maps, routed counts, unpatch and the kill switch."""
import pytest
import torch

import lik_plugins
from lik_plugins import routing_counts

pooling = pytest.importorskip("colpali_engine.compression.token_pooling")
ENTRY = "colpali.token_pooling"
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")   # scipy's "looks like a distance matrix"


def pages() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    docs = [torch.nn.functional.normalize(torch.randn(n, 32, generator=g), dim=1) for n in (2, 3, 9, 40)]
    exact = torch.zeros(12, 32)
    exact[torch.arange(12), torch.arange(12) % 4] = 1.0   # three copies of four one-hot tokens: exact ties
    return docs + [exact, docs[3].clone()]


def run(embeddings, **kwargs):
    return pooling.HierarchicalTokenPooler().pool_embeddings(embeddings, return_dict=True, **kwargs)


def assert_same(ours, theirs):
    for got, want in zip(ours.pooled_embeddings, theirs.pooled_embeddings):
        assert got.shape == want.shape and got.dtype == want.dtype and got.device == want.device
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    for got, want in zip(ours.cluster_id_to_indices, theirs.cluster_id_to_indices):
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k][0], want[k][0]) for k in want)


@pytest.mark.parametrize("pool_factor", [2, 3])
def test_same_results_as_colpali(pool_factor):
    theirs = run(pages(), pool_factor=pool_factor)
    lik_plugins.patch_colpali_engine()
    lik_plugins.reset_routing_counts()
    ours = run(pages(), pool_factor=pool_factor)
    assert routing_counts()[ENTRY] == {"torch-chunked": 1}
    assert_same(ours, theirs)


def test_padded_batch_and_half_precision():
    padded = torch.nn.utils.rnn.pad_sequence([p.half() for p in pages()[1:4]], batch_first=True,
                                             padding_side="left")
    theirs = run(padded, pool_factor=2, padding=True, padding_side="left")
    lik_plugins.patch_colpali_engine()
    ours = run(padded, pool_factor=2, padding=True, padding_side="left")
    assert ours.pooled_embeddings.dtype == torch.float16
    torch.testing.assert_close(ours.pooled_embeddings, theirs.pooled_embeddings, rtol=0, atol=1e-3)


def test_unpatch_restores_and_kill_switch_runs_colpali(monkeypatch):
    cls = pooling.HierarchicalTokenPooler
    original = vars(cls)["_pool_embeddings_impl"]
    lik_plugins.patch_colpali_engine()
    assert vars(cls)["_pool_embeddings_impl"] is not original
    lik_plugins.reset_routing_counts()
    monkeypatch.setenv("LIK_DISABLE", "1")
    run(pages(), pool_factor=2)
    monkeypatch.delenv("LIK_DISABLE")
    run(pages(), pool_factor=1)                       # nothing to pool: colpali's own answer
    with pytest.raises(ValueError, match="more than one token"):
        run([torch.ones(1, 8)], pool_factor=2)        # colpali's own error
    assert routing_counts()[ENTRY] == {"original": 3}
    lik_plugins.unpatch_colpali_engine()
    assert vars(cls)["_pool_embeddings_impl"] is original
