"""``patch_pylate()`` / ``unpatch_pylate()``: every PyLate capture point, applied and reverted.

Three kinds of capture points (``notes/pylate.md`` section 4):

* **module globals** -- every ``pylate.*`` module attribute that *is* one of the three
  original scorers (defining module, ``pylate.scores``, similarity functions,
  ``rank.rank``, losses, evaluators) is replaced by its adapter, found by identity so
  re-exports in any release are covered;
* **default arguments** -- ``__defaults__`` / ``__kwdefaults__`` of functions and methods
  defined in PyLate that hold an original (``Distillation`` in every release,
  ``Contrastive`` / ``CachedContrastive`` up to 1.4.x);
* **instances** -- ``loss.score_metric``, ``model._similarity(_pairwise)`` and an
  evaluator's ``score_functions`` of objects built *before* the patch: a class-level
  property maps an original scorer to its adapter on read and stores the original on
  write, so objects built before, during or after the patch behave alike and
  ``unpatch_pylate()`` leaves them exactly as PyLate made them.

Plus ``ColBERTScores.__call__`` (1.5.0 and newer): one fused call over all document
groups instead of PyLate's loop; and ``rank.rerank`` (every release, wherever it was
imported, the retrievers included): one packed launch over every query's candidates
(``_layout.LOOPS``, :mod:`._rerank`); and fast-plaid's ``FastPlaid.search``, which PyLate's
``indexes.PLAID`` calls (``_layout.PLAID_SEARCH``, :mod:`._plaid_search`).
"""
from __future__ import annotations

import sys
from typing import Any

from .._patching import PatchLedger, PatchLock, instance_slot_property, lookalike
from . import _layout as layout_mod
from . import _plaid_search, _rerank, _scores

_lock = PatchLock()
_ledger = PatchLedger("pylate")
_current: layout_mod.PyLateLayout | None = None
#: One lookalike per original for the life of a patch (identity matters: the instance slots
#: map adapters back to originals, and re-applying must find the same objects).
_served: dict = {}
#: the adapter of each captured name: the scoring functions, and the whole loops (``_layout.LOOPS``)
_ADAPTERS = {**_scores.ADAPTERS, "rerank": _rerank.rerank}


def _lookalikes(layout: layout_mod.PyLateLayout) -> dict:
    """``{original: adapter}``, each adapter carrying its original's name, module, docstring
    and signature, so PyLate's doctests are still collected and run through the patch."""
    if not _served:
        for name in (*layout_mod.FUNCTIONS, *(n for n in layout_mod.LOOPS if n in layout.originals)):
            original = layout.originals[name]
            _served[original] = lookalike(_ADAPTERS[name], original)
        call = layout.originals.get("ColBERTScores.__call__")
        if call is not None:
            _served[call] = lookalike(_scores.colbert_scores_call, call)
    return _served


def _pylate_modules() -> list:
    return [m for n, m in list(sys.modules.items()) if m is not None and (n == "pylate" or n.startswith("pylate."))]


def _defined_in_pylate(obj: Any) -> bool:
    return str(getattr(obj, "__module__", "") or "").startswith("pylate")


def _apply(layout: layout_mod.PyLateLayout) -> None:
    served = _lookalikes(layout)
    names = (*layout_mod.FUNCTIONS, *(n for n in layout_mod.LOOPS if n in layout.originals))
    to_adapter = {layout.originals[n]: served[layout.originals[n]] for n in names}
    to_original = {adapter: original for original, adapter in to_adapter.items()}

    for module in _pylate_modules():
        # 1. module globals (found by identity: covers re-exports in every release)
        _ledger.replace_globals(module, to_adapter)
        # 2. default arguments bound at import time
        _ledger.replace_module_defaults(module, to_adapter, owns=_defined_in_pylate)

    # 3. instance slots of objects built before the patch
    for module_name, class_name, attr in layout_mod.INSTANCE_SLOTS:
        module = sys.modules.get(module_name)
        cls = getattr(module, class_name, None) if module is not None else None
        if cls is None or _ledger.changed(cls, attr):
            continue
        if isinstance(vars(cls).get(attr), property):
            continue  # the host made it a property itself: leave it alone
        _ledger.set_attr(cls, attr, instance_slot_property(attr, to_adapter, to_original, doc=f"{attr} (PyLate scorers served by lik_plugins)"))

    # 4. ColBERTScores: one fused call over all document groups (1.5.0 and newer)
    cls = layout.colbert_scores_class
    if cls is not None and not _ledger.changed(cls, "__call__"):
        _ledger.set_attr(cls, "__call__", served[layout.originals["ColBERTScores.__call__"]])

    # 5. PLAID search: fast-plaid's FastPlaid.search, where PyLate's indexes.PLAID hands it over
    module_name, class_name, method = layout_mod.PLAID_SEARCH
    module = layout_mod.import_optional(module_name)
    cls = getattr(module, class_name, None) if module is not None else None
    if cls is not None and method in vars(cls) and not _ledger.changed(cls, method):
        original = vars(cls)[method]
        _ledger.set_attr(cls, method, lookalike(_plaid_search.make_search(original), original))
    module_name, class_name, call, loaders = layout_mod.PLAID_MAPPINGS
    module = layout_mod.import_optional(module_name)
    cls = getattr(module, class_name, None) if module is not None else None
    if cls is not None and call in vars(cls) and not _ledger.changed(cls, call):
        original = vars(cls)[call]
        _ledger.set_attr(cls, call, lookalike(_plaid_search.make_call(original), original))
        for name in loaders:
            if name in vars(cls):
                original = vars(cls)[name]
                _ledger.set_attr(cls, name, lookalike(_plaid_search.make_loader(original, name), original))


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
    ``indexes.PLAID`` searches (fast-plaid installed) under ``pylate.PLAID.search``: a batch
    of queries at a time on the GPU (:mod:`lik_plugins.plaid_search`), fast-plaid's own
    search for CPU indexes.

    Returns:
        The detected :class:`PyLateLayout` (``version``, ``group``, originals).

    Example::

        import lik_plugins
        lik_plugins.patch_pylate()
        ...  # build the ColBERT model and loss, train as usual
        print(lik_plugins.routing_counts())
    """
    return _lock.patch(_patch, lambda: _current)


def _patch() -> layout_mod.PyLateLayout:
    global _current
    layout = _current if _current is not None else layout_mod.detect()
    for name in layout_mod.MODULES:
        layout_mod.import_optional(name)   # PyLate's imports may re-enter patch_pylate (start-up hook)
    if _current is None and layout.colbert_scores_class is not None:
        originals = dict(layout.originals)
        originals["ColBERTScores.__call__"] = vars(layout.colbert_scores_class)["__call__"]
        layout = layout_mod.PyLateLayout(**{**layout.__dict__, "originals": originals})
    _apply(layout)
    _current = layout
    _scores.bind(layout, active=True)
    return layout


def unpatch_pylate() -> None:
    """Restore every original PyLate object exactly (harmless when not patched)."""
    global _current
    with _lock.hold():
        _ledger.revert()
        _scores.bind(_current, active=False)
        _current = None
        _served.clear()


def is_patched() -> bool:
    return _ledger.active
