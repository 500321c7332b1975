"""hierarchical_pool against the hosts' own poolers (PyLate's and colpali-engine's): the same
partitions, the same cluster order and the same vectors, ties included."""
import pytest
import torch

from lik_plugins.ops import hierarchical_pool

pytest.importorskip("scipy")


def unit(n: int, d: int = 16, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.nn.functional.normalize(torch.randn(n, d, generator=g), dim=1)


def exact_unit(n: int, d: int = 16, seed: int = 0) -> torch.Tensor:
    """Unit tokens with four entries of +-0.5: every dot product is exact, so duplicated
    tokens are at distance exactly 0 and many distances tie exactly."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.zeros(n, d)
    for row in tokens:
        row[torch.randperm(d, generator=g)[:4]] = 0.5 * (torch.randint(0, 2, (4,), generator=g) * 2 - 1).float()
    return tokens


def with_ties(seed: int = 0) -> list[torch.Tensor]:
    """Random documents and the awkward ones: exact ties, duplicated tokens, identical
    documents, two tokens, a single token, one token repeated."""
    base = exact_unit(23, seed=seed)
    duplicated = torch.cat([base[:5], base[:5], base[2:9], base[4:5].repeat(4, 1)])
    return [unit(n, seed=seed + n) for n in (7, 12, 30, 41)] + [
        duplicated, base, base.clone(), exact_unit(40, seed=seed + 1), unit(2, seed=seed), unit(1, seed=seed),
        base[:1].repeat(6, 1)]


def pylate_reference(documents, pool_factor, protected_tokens):
    """PyLate's own pooler (ColBERT.pool_embeddings_hierarchical reads nothing from self)."""
    colbert = pytest.importorskip("pylate.models.colbert")
    return colbert.ColBERT.pool_embeddings_hierarchical(None, documents, pool_factor, protected_tokens)


@pytest.mark.parametrize("pool_factor", [1, 2, 3, 5])
@pytest.mark.parametrize("protected_tokens", [0, 1, 3])
def test_equals_pylate(pool_factor, protected_tokens):
    documents = with_ties()
    expected = pylate_reference(documents, pool_factor, protected_tokens)
    ours = hierarchical_pool(documents, pool_factor, protected_tokens)
    assert len(ours) == len(expected)
    for got, want in zip(ours, expected):
        assert got.dtype == want.dtype and got.device == want.device
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_equals_pylate_float64_and_float16():
    for dtype in (torch.float64, torch.float16):
        documents = [d.to(dtype) for d in with_ties(seed=3)]
        for got, want in zip(hierarchical_pool(documents, 2, 1), pylate_reference(documents, 2, 1)):
            assert got.dtype == want.dtype and got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-3 if dtype == torch.float16 else 0, atol=1e-6)


def test_unpooled_documents_are_returned_as_they_are():
    one = unit(1)
    assert hierarchical_pool([one], 2, 0)[0] is one           # max(1 // 2, 1) = 1 cluster: nothing to pool
    short = unit(3)
    assert hierarchical_pool([short], 2, 3)[0] is short       # everything protected
    assert hierarchical_pool([short], 1, 0)[0] is short       # pool factor 1


def test_negative_distances_fail_as_in_pylate():
    """A token whose self-similarity rounds above 1, duplicated: scipy rejects the negative
    distance, in PyLate's pooler and ours alike."""
    token = next(t for t in unit(500, d=128) if float(t @ t) > 1)
    documents = [torch.stack([token, token, -token, token])]
    with pytest.raises(ValueError, match="negative distances"):
        pylate_reference(documents, 2, 0)
    with pytest.raises(ValueError, match="negative distances"):
        hierarchical_pool(documents, 2, 0)


def colpali_reference(documents, pool_factor):
    pooling = pytest.importorskip("colpali_engine.compression.token_pooling")
    out = pooling.HierarchicalTokenPooler().pool_embeddings(documents, pool_factor=pool_factor, return_dict=True)
    return out.pooled_embeddings, out.cluster_id_to_indices


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("pool_factor", [2, 3, 5])
def test_equals_colpali(pool_factor):
    documents = [d for d in with_ties(seed=1) if d.shape[0] > 1]   # colpali refuses a single token
    expected, expected_maps = colpali_reference(documents, pool_factor)
    ours, labels = hierarchical_pool(documents, pool_factor, cluster_on="distance_rows", normalize=True,
                                     return_labels=True)
    for got, want, lab, mapping in zip(ours, expected, labels, expected_maps):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        for cluster, (indices,) in mapping.items():
            assert torch.equal(torch.nonzero(lab == cluster).flatten(), indices)


def test_partition_matches_on_larger_pages():
    """Pages of a few hundred tokens: the row-distance Gram route keeps colpali's partition."""
    documents = [unit(300, d=32, seed=s) for s in range(2)]
    expected, _ = colpali_reference(documents, 3)
    for got, want in zip(hierarchical_pool(documents, 3, cluster_on="distance_rows", normalize=True), expected):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_bad_arguments():
    with pytest.raises(ValueError, match="pool_factor"):
        hierarchical_pool([unit(4)], 0)
    with pytest.raises(ValueError, match="protected_tokens"):
        hierarchical_pool([unit(4)], 2, -1)
    with pytest.raises(ValueError, match="cluster_on"):
        hierarchical_pool([unit(4)], 2, cluster_on="cosine")
    with pytest.raises(ValueError, match="2-D"):
        hierarchical_pool([torch.ones(4)], 2)
    with pytest.raises(TypeError, match="float16"):
        hierarchical_pool([unit(4).bfloat16()], 2)


def test_missing_scipy_names_the_install(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "scipy.cluster", None)
    with pytest.raises(ImportError, match="pip install scipy"):
        hierarchical_pool([unit(6)], 2)
