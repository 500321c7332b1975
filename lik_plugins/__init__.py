"""lik_plugins: fused MaxSim kernels for late-interaction retrievers, behind a one-line switch.

Importing this package is cheap: it never imports Triton, PyLate or colpali-engine
eagerly.  Public surface::

    maxsim, maxsim_pairs, retrieve, MaxSimScorer      # the ops
    maxsim_varlen, score_pairs_packed, maxsim_padded  # packed (cu_seqlens), pair-list, padded+lengths
    pack, unpack                                      # ragged tensors <-> (packed, cu_seqlens, max_seqlen)
    smooth_maxsim                                     # fused tau * logsumexp(s / tau) over doc tokens
    quantize_fp8, maxsim_fp8, Fp8Tokens               # opt-in fp8 (e4m3) inference
    routing_counts, reset_routing_counts              # which path served each call
    patch_pylate, unpatch_pylate                      # PyLate integration
    patch_colpali_engine, unpatch_colpali_engine      # colpali-engine integration
"""
from __future__ import annotations

import importlib

from ._routing import reset_routing_counts, routing_counts

__version__ = "0.1.0"

_LAZY = {
    "maxsim": ("lik_plugins.ops", "maxsim"),
    "maxsim_pairs": ("lik_plugins.ops", "maxsim_pairs"),
    "retrieve": ("lik_plugins.ops", "retrieve"),
    "maxsim_varlen": ("lik_plugins.packed", "maxsim_varlen"),
    "score_pairs_packed": ("lik_plugins.packed", "score_pairs_packed"),
    "maxsim_padded": ("lik_plugins.packed", "maxsim_padded"),
    "pack": ("lik_plugins.packed", "pack"),
    "unpack": ("lik_plugins.packed", "unpack"),
    "MaxSimScorer": ("lik_plugins.modules", "MaxSimScorer"),
    "smooth_maxsim": ("lik_plugins.ops", "smooth_maxsim"),
    "quantize_fp8": ("lik_plugins.fp8", "quantize_fp8"),
    "maxsim_fp8": ("lik_plugins.fp8", "maxsim_fp8"),
    "Fp8Tokens": ("lik_plugins.fp8", "Fp8Tokens"),
    "patch_pylate": ("lik_plugins.pylate", "patch_pylate"),
    "unpatch_pylate": ("lik_plugins.pylate", "unpatch_pylate"),
    "patch_colpali_engine": ("lik_plugins.colpali", "patch_colpali_engine"),
    "unpatch_colpali_engine": ("lik_plugins.colpali", "unpatch_colpali_engine"),
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
