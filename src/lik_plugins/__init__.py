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
    hierarchical_pool                                 # Ward token pooling, the hosts' poolers' partitions
    routing_counts, reset_routing_counts              # which path served each call
    routing_reasons                                   # why a call went to the host's own code
    patch_pylate, unpatch_pylate                      # PyLate integration
    patch_colpali_engine, unpatch_colpali_engine      # colpali-engine integration
    patch_sentence_transformers, unpatch_sentence_transformers  # sentence-transformers 6.x
    patch_fast_plaid, unpatch_fast_plaid              # fast-plaid's FastPlaid.search, used directly
"""
from __future__ import annotations

import importlib

from ._routing import reset_routing_counts, routing_counts, routing_reasons

_DISTRIBUTION = "lik_plugins"

# Names read from lik_plugins.ops (one module per family there).
_OPS = (
    "maxsim", "maxsim_pairs", "retrieve", "smooth_maxsim", "maxsim_from_hidden", "MaxSimScorer",
    "maxsim_varlen", "score_pairs_packed", "maxsim_padded", "pack", "unpack",
    "quantize_fp8", "maxsim_fp8", "Fp8Tokens", "quantize_int8", "maxsim_int8", "Int8Tokens",
    "maxsim_residual", "maxsim_residual_varlen", "plaid_approx_score", "hierarchical_pool",
)
_LAZY = {
    **{name: ("lik_plugins.ops", name) for name in _OPS},
    "patch_pylate": ("lik_plugins.pylate", "patch_pylate"),
    "unpatch_pylate": ("lik_plugins.pylate", "unpatch_pylate"),
    "patch_colpali_engine": ("lik_plugins.colpali", "patch_colpali_engine"),
    "unpatch_colpali_engine": ("lik_plugins.colpali", "unpatch_colpali_engine"),
    "patch_sentence_transformers": ("lik_plugins.sentence_transformers", "patch_sentence_transformers"),
    "unpatch_sentence_transformers": ("lik_plugins.sentence_transformers", "unpatch_sentence_transformers"),
    "patch_fast_plaid": ("lik_plugins.fast_plaid", "patch_fast_plaid"),
    "unpatch_fast_plaid": ("lik_plugins.fast_plaid", "unpatch_fast_plaid"),
}

__all__ = ["routing_counts", "reset_routing_counts", "routing_reasons", *_LAZY]


def _version() -> str:
    """This package's version: in a source tree (a clone, installed editable or not) the one
    its pyproject.toml declares -- the code that runs is the tree's, and an editable install's
    metadata keeps the version of the day it was installed; otherwise the installed
    distribution's metadata; ``0+unknown`` when neither says."""
    import re
    from importlib import metadata
    from pathlib import Path

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    if pyproject.is_file():
        # the [project] table, read by pattern: tomllib is 3.11+ and the package supports 3.10
        text = pyproject.read_text(encoding="utf-8")
        project = re.search(r"^\[project\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
        table = project.group(1) if project else ""
        name = re.search(r'^name\s*=\s*"([^"]+)"', table, re.M)
        version = re.search(r'^version\s*=\s*"([^"]+)"', table, re.M)
        if name and version and name.group(1).replace("-", "_") == _DISTRIBUTION:
            return version.group(1)
    try:
        return metadata.version(_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "0+unknown"


def __getattr__(name: str):
    if name == "__version__":       # read on first use: importing the package stays cheap
        value = globals()["__version__"] = _version()
        return value
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'lik_plugins' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | {"__version__"})
