"""``score_multi_vector`` on lists: one packed launch, colpali's per-chunk zero padding kept."""
from __future__ import annotations

import torch

import lik_plugins
from colpali_engine.utils.processing_utils import BaseVisualRetrieverProcessor as Base


def _ragged(lengths, d, seed, shift=0.0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.functional.normalize(torch.randn(n, d, generator=g), dim=-1) - shift for n in lengths]


def test_one_packed_launch_with_colpalis_chunk_padding():
    qs = _ragged((3, 7, 1, 5), 16, 0)
    ps = _ragged((9, 2, 14, 4, 4, 11, 1), 16, 1, shift=0.4)   # negative similarities: padding wins rows
    want = {bs: Base.score_multi_vector(qs, ps, batch_size=bs, device="cpu") for bs in (2, 3, 128)}
    lik_plugins.patch_colpali_engine()
    try:
        for bs, expected in want.items():
            lik_plugins.reset_routing_counts()
            got = Base.score_multi_vector(qs, ps, batch_size=bs, device="cpu")
            counts = lik_plugins.routing_counts()
            assert counts["maxsim_varlen"] == {"torch-chunked": 1}       # one launch, whatever batch_size
            assert counts["colpali.score_multi_vector"] == {"torch-chunked": 1}
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        # an empty passage: colpali's own code (and its behaviour)
        lik_plugins.reset_routing_counts()
        Base.score_multi_vector(qs, ps[:2] + [torch.zeros(0, 16)] + ps[3:], batch_size=2, device="cpu")
        assert lik_plugins.routing_counts()["colpali.score_multi_vector"] == {"original": 1}
    finally:
        lik_plugins.unpatch_colpali_engine()
