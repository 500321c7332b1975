"""The public ops: validation with clear errors, the contract in each docstring.

One module per family, named for what it takes (a newcomer finds an op's contract here, its
registered op and autograd under the same name in :mod:`lik_plugins.autograd`, and its tests
under ``tests/ops``):

=================  =====================================================================
``dense``          padded ``[N, L, d]`` tokens: maxsim, maxsim_pairs, retrieve,
                   smooth_maxsim, maxsim_from_hidden (documents as hidden states)
``packed``         packed (``cu_seqlens``) tokens and pair lists: maxsim_varlen,
                   score_pairs_packed; padded candidates with lengths: maxsim_padded;
                   pack, unpack
``plaid``          PLAID / ColBERTv2 residual indexes: compress, decompress,
                   maxsim_residual, maxsim_residual_varlen, plaid_approx_score
``quantized``      fp8 and int8 inference: quantize_fp8, maxsim_fp8, Fp8Tokens and the
                   int8 twins
``pooling``        hierarchical (Ward) token pooling of documents: hierarchical_pool
``modules``        nn.Module wrappers: MaxSimScorer
``validate``       the argument checks the ops share
=================  =====================================================================

Every name below is also reachable from ``lik_plugins`` itself (lazily).
"""
from __future__ import annotations

from ..kernels.dispatch import served_by
from .dense import maxsim, maxsim_from_hidden, maxsim_pairs, retrieve, smooth_maxsim
from .modules import MaxSimScorer
from .pooling import hierarchical_pool
from .packed import maxsim_padded, maxsim_varlen, pack, score_pairs_packed, unpack
from .plaid import (
    ResidualIndex, compress, decompress, fit_centroids, maxsim_residual, maxsim_residual_varlen, plaid_approx_score,
)
from .quantized import Fp8Tokens, Int8Tokens, maxsim_fp8, maxsim_int8, quantize_fp8, quantize_int8

__all__ = [
    "maxsim", "maxsim_pairs", "retrieve", "smooth_maxsim", "maxsim_from_hidden",
    "maxsim_varlen", "score_pairs_packed", "maxsim_padded", "pack", "unpack",
    "ResidualIndex", "fit_centroids", "compress", "decompress", "maxsim_residual", "maxsim_residual_varlen",
    "plaid_approx_score",
    "Fp8Tokens", "Int8Tokens", "quantize_fp8", "quantize_int8", "maxsim_fp8", "maxsim_int8",
    "MaxSimScorer", "hierarchical_pool",
    "served_by",  # which path serves a call (the chooser's answer), for adapters that record routing
]
