"""The patch and sentence-transformers 6.3's kernel layers: which one serves a model's similarity.

From 6.3 a ``MultiVectorEncoder(use_kernels=True)`` or ``MultiVectorEncoder(kernel_config=...)``
scores ``model.similarity`` / ``similarity_pairwise`` (and so the evaluators and the losses'
default path) through a ``_MaxSimScorer``, whose chunks go to the kernel layers ``kernels``
installed for the targets ``STMaxSim`` / ``STMaxSimPairwise``: ST's defaults are Hub layers
(``sentence-transformers/late-interaction-kernels``, CUDA only), a ``kernel_config`` may map
a target to any repository.  With the patch on too, two accelerated paths could claim the
same call.  The rule, per call and per target:

1. The patch is off, or ``LIK_DISABLE=1``: ST's own behaviour, untouched.
2. The model's ``kernel_config`` maps the target explicitly to a layer that is not ours:
   that layer serves, and each of its launches is counted as
   ``sentence_transformers.kernel_layer.<target>: {"original": n}`` (the host's mechanism
   served, not lik_plugins).  Where ``kernels`` installed no layer for the device (a mapping
   for ``cuda`` only, scoring on the CPU) ST's plain forward runs, which the patch serves:
   counted under ``sentence_transformers.maxsim`` as usual.
3. Otherwise -- ``use_kernels=True`` with ST's default layers, a ``kernel_config`` that maps
   only other targets (the backbone, ``STWardClustering``), or our own layers
   (:func:`~lik_plugins.sentence_transformers.kernel_config`) -- the patch serves the call
   exactly as it serves ``util.maxsim`` (lists read in place, padded tensors in one launch),
   without loading any kernel layer; counted under ``sentence_transformers.maxsim`` /
   ``..._pairwise`` (``_lists``).

Why this order: an explicit mapping of one target is the most specific request a user can
make, per model, naming the layer they want -- overriding it from a process-wide switch
(``patch_sentence_transformers()``, ``LIK_PATCH``) would silently discard a deliberate
choice.  ``use_kernels=True`` is a blanket request for speed covering the backbone and Ward
pooling too; for MaxSim the patch already answers it, exactly (ST's results) and offline,
where ST's default layer is a Hub download that exists for CUDA alone.  Our own layers and
the patch run the same chunk scorer, so rule 3 changes nothing but skipping the layer load.
Each call takes one path and is counted once; nothing here raises where ST would not.

6.0 - 6.2 have no ``_MaxSimScorer``: nothing to capture there.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from .._routing import record
from . import _scores
from ._kernel_config import is_our_layer

TARGETS = ("STMaxSim", "STMaxSimPairwise")


def explicit_foreign_layer(scorer: Any, target: str) -> bool:
    """Whether ``scorer``'s ``kernel_config`` maps ``target`` to a layer that is not ours."""
    config = getattr(scorer, "kernel_config", None)
    mapping = getattr(config, "kernel_mapping", None)
    if not isinstance(mapping, dict) or target not in mapping:
        return False
    return not is_our_layer(mapping[target], bool(getattr(config, "use_local_kernel", False)))


def _served_call(original: Callable, target: str, pairwise: bool) -> Callable:
    """``_MaxSimScorer.__call__`` (``pairwise``: ``.pairwise``) under the rule above."""
    patched_entry = _scores.maxsim_pairwise if pairwise else _scores.maxsim

    def served(self, a, b, a_mask=None, b_mask=None, chunk_elements=None, length_normalize=None, device=None):
        if not _scores._serving() or explicit_foreign_layer(self, target):
            return original(self, a, b, a_mask, b_mask, chunk_elements, length_normalize, device)
        normalize = self.length_normalize if length_normalize is None else length_normalize
        return patched_entry(a, b, a_mask=a_mask, b_mask=b_mask, chunk_elements=chunk_elements,
                             length_normalize=normalize, device=device)

    served.__name__, served.__qualname__, served.__doc__ = original.__name__, original.__qualname__, original.__doc__
    served.__wrapped__ = original
    return served


def _served_chunk(original: Callable, target: str, index: int) -> Callable:
    """``_MaxSimScorer._score_documents`` / ``_score_pairs`` (one padded chunk) under the rule
    above.  This level matters where ``__call__`` / ``pairwise`` are not ours: a model built
    before the patch holds ``scorer.pairwise`` bound to ST's method.  A launch of a foreign
    kernel layer (rule 2) is read from the operation ST used: ``kernels`` records the
    repository it installed (``_kernel_repo``); none means ST's plain forward ran, which the
    patched chunk scorer counted itself."""
    ours = _scores.score_pairs if index else _scores.score_documents

    def served(self, a, b, a_mask, b_mask):
        if not _scores._serving():
            return original(self, a, b, a_mask, b_mask)
        if not explicit_foreign_layer(self, target):
            return ours(a, b, a_mask, b_mask)
        out = original(self, a, b, a_mask, b_mask)
        operations = getattr(self, "_operations", {}).get((a.device, torch.is_grad_enabled()))
        repository = None if operations is None else vars(operations[index]).get("_kernel_repo")
        if repository is not None:
            record(f"sentence_transformers.kernel_layer.{target}", "original")
        return out

    served.__name__, served.__qualname__ = original.__name__, original.__qualname__
    served.__wrapped__ = original
    return served


def serve(ledger: Any, colbert_module: Any) -> None:
    """Install the rule on 6.3's ``_MaxSimScorer`` (class level: scorers built before the
    patch follow it too); reverted with the rest of the patch.  No-op before 6.3."""
    scorer = getattr(colbert_module, "_MaxSimScorer", None)
    if scorer is None:
        return
    methods = {
        "__call__": lambda f: _served_call(f, "STMaxSim", pairwise=False),
        "pairwise": lambda f: _served_call(f, "STMaxSimPairwise", pairwise=True),
        "_score_documents": lambda f: _served_chunk(f, "STMaxSim", 0),
        "_score_pairs": lambda f: _served_chunk(f, "STMaxSimPairwise", 1),
    }
    for name, wrap in methods.items():
        original = vars(scorer).get(name)
        if original is None or ledger.changed(scorer, name):
            continue   # a release without it, or patched already
        ledger.set_attr(scorer, name, wrap(original))
