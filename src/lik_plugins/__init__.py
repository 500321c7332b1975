"""lik_plugins: fused MaxSim kernels for late-interaction retrievers, behind a one-line switch.

Importing this package is cheap: it never imports Triton, PyLate or colpali-engine
eagerly.  The ops live in :mod:`lik_plugins.ops` (one module per family), their registered
ops and autograd in :mod:`lik_plugins.autograd`, the kernels and the one chooser of the device
path in :mod:`lik_plugins.kernels`.  Public surface::

    maxsim, maxsim_pairs, retrieve, MaxSimScorer      # the ops
    maxsim_varlen, score_pairs_packed, maxsim_padded  # packed (cu_seqlens), pair-list, padded+lengths
    pack, unpack                                      # ragged tensors <-> (packed, cu_seqlens, max_seqlen)
    smooth_maxsim                                     # fused tau * logsumexp(s / tau) over doc tokens
    quantize_fp8, maxsim_fp8, Fp8Tokens               # opt-in fp8 (e4m3) inference
    quantize_int8, maxsim_int8, Int8Tokens            # opt-in int8 inference (Ampere and newer)
    maxsim_from_hidden                                # the projection head fused into the scoring
    maxsim_residual, maxsim_residual_varlen,          # PLAID / ColBERTv2 compressed indexes
    plaid_approx_score                                #   (lik_plugins.ops: compress, decompress)
    routing_counts, reset_routing_counts              # which path served each call
    patch_pylate, unpatch_pylate                      # PyLate integration
    patch_colpali_engine, unpatch_colpali_engine      # colpali-engine integration
    patch_sentence_transformers, unpatch_sentence_transformers  # sentence-transformers 6.x
"""
from __future__ import annotations

import importlib

from ._routing import reset_routing_counts, routing_counts

__version__ = "0.1.0"

# Names read from lik_plugins.ops (one module per family there).
_OPS = (
    "maxsim", "maxsim_pairs", "retrieve", "smooth_maxsim", "maxsim_from_hidden", "MaxSimScorer",
    "maxsim_varlen", "score_pairs_packed", "maxsim_padded", "pack", "unpack",
    "quantize_fp8", "maxsim_fp8", "Fp8Tokens", "quantize_int8", "maxsim_int8", "Int8Tokens",
    "maxsim_residual", "maxsim_residual_varlen", "plaid_approx_score",
)
_LAZY = {
    **{name: ("lik_plugins.ops", name) for name in _OPS},
    "patch_pylate": ("lik_plugins.pylate", "patch_pylate"),
    "unpatch_pylate": ("lik_plugins.pylate", "unpatch_pylate"),
    "patch_colpali_engine": ("lik_plugins.colpali", "patch_colpali_engine"),
    "unpatch_colpali_engine": ("lik_plugins.colpali", "unpatch_colpali_engine"),
    "patch_sentence_transformers": ("lik_plugins.sentence_transformers", "patch_sentence_transformers"),
    "unpatch_sentence_transformers": ("lik_plugins.sentence_transformers", "unpatch_sentence_transformers"),
}

__all__ = ["routing_counts", "reset_routing_counts", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'lik_plugins' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
