"""``patch_pylate()`` / ``unpatch_pylate()``: every PyLate capture point, applied and reverted.

Three kinds of capture points (the release table in :mod:`._layout`):

* **module globals** -- every ``pylate.*`` module attribute that *is* one of the three
  original scorers (defining module, ``pylate.scores``, similarity functions,
  ``rank.rank``, losses, evaluators) is replaced by its adapter, found by identity so
  re-exports in any release are covered;
* **default arguments** -- ``__defaults__`` / ``__kwdefaults__`` of functions and methods
  defined in PyLate that hold an original (``Distillation`` in every release,
  ``Contrastive`` / ``CachedContrastive`` up to 1.4.x);
* **instances** -- ``loss.score_metric``, ``model._similarity(_pairwise)`` and an
  evaluator's ``score_functions`` of objects built *before* the patch
  (:func:`lik_plugins._patching.instance_slot_property`).

Plus ``ColBERTScores.__call__`` (1.5.0 and newer): one fused call over all document
groups instead of PyLate's loop; and ``rank.rerank`` (every release, wherever it was
imported, the retrievers included): one packed launch over every query's candidates
(``_layout.LOOPS``, :mod:`._rerank`); and fast-plaid's ``FastPlaid.search``, which PyLate's
``indexes.PLAID`` calls: fast-plaid's own patch (:mod:`lik_plugins.fast_plaid`, a host of its
own that colpali-engine's patch holds too), held while PyLate is patched, plus PyLate's id
mappings read once (:mod:`._plaid_search`).
"""
from __future__ import annotations

import sys

import torch

from .._config import disabled
from .._patching import PatchLedger, lookalike
from ..fast_plaid import _patch as fast_plaid
from .._routing import record
from ..ops.pooling import hierarchical_pool
from . import _layout as layout_mod
from . import _plaid_search, _rerank, _scores

_ledger = PatchLedger()   # its ``current``: the PyLateLayout patched
#: the adapter of each captured name: the scoring functions, and the whole loops (``_layout.LOOPS``)
_ADAPTERS = {**_scores.ADAPTERS, "rerank": _rerank.rerank}


def _apply(layout: layout_mod.PyLateLayout) -> None:
    adapters = {original: _ADAPTERS[n] for n, original in layout.originals.items() if n in _ADAPTERS}
    # 1.-3. module globals, defaults bound at import time, instance slots of objects built before
    slots = [(cls, attr) for module, class_name, attr in layout_mod.INSTANCE_SLOTS
             if (cls := getattr(sys.modules.get(module), class_name, None)) is not None]
    _ledger.serve("pylate", adapters, slots, "PyLate scorers served by lik_plugins",
                  owns=lambda obj: str(getattr(obj, "__module__", "") or "").startswith("pylate"))

    # 4. ColBERTScores: one fused call over all document groups (1.5.0 and newer)
    if layout.colbert_scores_class is not None:
        _serve_method(layout.colbert_scores_class, "__call__", lambda _: _scores.colbert_scores_call)

    # 5. token pooling: encode(..., pool_factor=k) calls self.pool_embeddings_hierarchical (1.6.0)
    colbert = getattr(sys.modules.get("pylate.models.colbert"), "ColBERT", None)
    _serve_method(colbert, "pool_embeddings_hierarchical", _pool_embeddings_hierarchical_for)

    # 6. PLAID search: fast-plaid's FastPlaid.search, which PyLate's indexes.PLAID calls --
    # fast-plaid's own patch (lik_plugins.fast_plaid), held for PyLate; and PyLate's id mappings
    fast_plaid.hold("pylate")
    module_name, class_name, call, loaders = layout_mod.PLAID_MAPPINGS
    cls = getattr(layout_mod.import_optional(module_name), class_name, None)
    if _serve_method(cls, call, _plaid_search.make_call):
        for name in loaders:
            _serve_method(cls, name, lambda original, name=name: _plaid_search.make_loader(original, name))


def _serve_method(cls: type | None, method: str, make) -> bool:
    """``cls.method`` (defined on ``cls`` itself) becomes a lookalike of ``make(original)``,
    once; whether it is served by us now."""
    if cls is None or method not in vars(cls):
        return False
    if not _ledger.changed(cls, method):
        original = vars(cls)[method]
        _ledger.set_attr(cls, method, lookalike(make(original), original))
    return True


POOLED_DTYPES = (torch.float16, torch.float32, torch.float64)   # PyLate's .numpy() refuses bfloat16


def _pool_embeddings_hierarchical_for(original):
    """PyLate's per-document Ward pooling as one batched :func:`~lik_plugins.ops.hierarchical_pool`
    call (same partitions, CPU results, protected tokens first, clusters in scipy's label order,
    no re-normalisation); inputs it does not serve run PyLate's own loop."""

    def pool_embeddings_hierarchical(self, documents_embeddings, pool_factor=1, protected_tokens=1):
        served = (not disabled() and isinstance(documents_embeddings, (list, tuple))
                  and all(isinstance(d, torch.Tensor) and d.dim() == 2 and d.dtype in POOLED_DTYPES
                          for d in documents_embeddings)
                  and type(pool_factor) is int and pool_factor >= 1
                  and type(protected_tokens) is int and protected_tokens >= 0)
        if not served:
            record("pylate.pool_embeddings_hierarchical", "original")
            return original(self, documents_embeddings, pool_factor, protected_tokens)
        record("pylate.pool_embeddings_hierarchical", "torch-chunked")
        return hierarchical_pool(list(documents_embeddings), pool_factor, protected_tokens)

    return pool_embeddings_hierarchical


def patch_pylate() -> layout_mod.PyLateLayout:
    """Serve PyLate's MaxSim scoring with ``lik_plugins`` kernels (PyLate 1.3.3 - 1.6.x).

    After the call, ``colbert_scores``, ``colbert_kd_scores``, ``colbert_scores_pairwise``
    (wherever PyLate looks them up: defining module, ``pylate.scores``, similarity
    functions, ``rank.rerank``, the evaluators), ``ColBERTScores`` and the losses
    ``Contrastive``, ``CachedContrastive`` and ``Distillation`` run on the kernels --
    including losses and models built before the call.  Results keep PyLate's mask
    semantics and output dtype; inputs the kernels cannot serve run PyLate's own code.

    The backend is chosen per call as in PyLate >= 1.5.1 (``backend=`` argument, else
    ``PYLATE_SCORES_BACKEND``): ``lik`` (ours, on every device, errors instead of falling
    back), ``auto`` (ours where it applies, else PyLate's), ``torch`` / ``flash``
    (PyLate's).  ``LIK_DISABLE=1`` sends every call to PyLate's original code.

    Calling it again is harmless (it also covers PyLate modules imported since).
    :func:`lik_plugins.routing_counts` shows which path served each call, under the
    entries ``pylate.colbert_scores``, ``pylate.colbert_kd_scores``,
    ``pylate.colbert_scores_pairwise``, ``pylate.ColBERTScores`` and ``pylate.rerank``;
    ``ColBERT.pool_embeddings_hierarchical`` (``encode(..., pool_factor=k)``, 1.6.0) under
    ``pylate.pool_embeddings_hierarchical`` (:func:`lik_plugins.ops.hierarchical_pool`);
    ``indexes.PLAID`` searches (fast-plaid installed) under ``fast_plaid.search``: a batch
    of queries at a time on the GPU (:mod:`lik_plugins.plaid_search`), fast-plaid's own
    search for CPU indexes (:func:`lik_plugins.fast_plaid.patch_fast_plaid`).

    Returns:
        The detected :class:`PyLateLayout` (``version``, ``group``, originals).

    Example::

        import lik_plugins
        lik_plugins.patch_pylate()
        ...  # build the ColBERT model and loss, train as usual
        print(lik_plugins.routing_counts())
    """
    return _ledger.patch(_patch)


def _patch(current: layout_mod.PyLateLayout | None) -> layout_mod.PyLateLayout:
    layout = current if current is not None else layout_mod.detect()
    for name in layout_mod.MODULES:
        layout_mod.import_optional(name)   # PyLate's imports may re-enter patch_pylate (start-up hook)
    _apply(layout)
    _scores.bind(layout, active=True)
    return layout


def unpatch_pylate() -> None:
    """Restore every original PyLate object exactly (harmless when not patched)."""
    with _ledger.hold():
        layout = _ledger.current
        _ledger.revert()
        _scores.bind(layout, active=False)
        fast_plaid.let_go("pylate")


def is_patched() -> bool:
    return _ledger.active
