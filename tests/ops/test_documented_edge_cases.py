"""The edge cases README's "The ops" table and ``retrieve``'s docstring promise: ``top_k`` above
the corpus, and a document with no valid token."""
from __future__ import annotations

import warnings

import pytest
import torch

import lik_plugins


def test_retrieve_top_k_above_the_corpus_gives_every_document_best_first_without_a_warning():
    torch.manual_seed(0)
    Q, D = torch.randn(2, 4, 8), torch.randn(3, 6, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # the hosts clamp silently; so do we
        scores, index = lik_plugins.retrieve(Q, D, top_k=10)
    assert scores.shape == index.shape == (2, 3)
    full = lik_plugins.maxsim(Q, D)
    want_scores, want_index = full.sort(dim=1, descending=True)
    torch.testing.assert_close(scores, want_scores)
    assert torch.equal(index, want_index)


@pytest.mark.parametrize("mask_mode", ["exclude", "zero"])
def test_a_document_without_tokens_scores_zero_and_competes(mask_mode):
    torch.manual_seed(0)
    Q = torch.randn(2, 4, 8)
    D = -Q[:, :1].abs().expand(2, 6, 8).clone()        # documents every query scores below 0
    D = torch.cat([D, torch.randn(1, 6, 8)])
    mask = torch.ones(3, 6, dtype=torch.bool)
    mask[2] = False                                      # the third document has no valid token
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scores = lik_plugins.maxsim(Q, D, d_mask=mask, mask_mode=mask_mode)
        top, index = lik_plugins.retrieve(Q, D, top_k=3, d_mask=mask, mask_mode=mask_mode)
    assert torch.equal(scores[:, 2], torch.zeros(2))
    assert (scores[:, :2] < 0).any(), "the check needs a document that scores below the empty one"
    for q in range(2):                                   # 0.0 ranks where 0.0 falls among the others
        assert int((scores[q] > 0).sum()) == int((index[q] == 2).nonzero()[0, 0])
