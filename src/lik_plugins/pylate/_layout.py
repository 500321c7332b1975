"""Which PyLate is installed, and where it captures its scoring functions.

PyLate never looks its scorers up in one place: modules re-export them, loss classes
bind them as default arguments at import time, models and evaluators store them on
instances.  This module describes those capture points per release (the table below);
:mod:`lik_plugins.pylate._patch` applies them.

=============  =========================================  ============================
releases       scoring functions defined in               extras
=============  =========================================  ============================
1.3.3 - 1.4.x  ``pylate.scores.scores``                   losses bind ``colbert_scores``
                                                          as a default argument
1.5.0          ``pylate.scores.colbert``                  ``ColBERTScores`` (loop over
                                                          document groups)
>= 1.5.1       ``pylate.scores.colbert``                  ``backend=`` keyword and
                                                          ``PYLATE_SCORES_BACKEND``
=============  =========================================  ============================
"""
from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

from .. import _install

#: The three scoring functions, in every release.
FUNCTIONS = ("colbert_scores", "colbert_kd_scores", "colbert_scores_pairwise")

#: Whole PyLate functions served in one fused call instead of their Python loops:
#: ``name -> module defining it`` (every release).  Captured like the scorers -- every
#: module-level copy, found by identity: ``pylate.rank.rerank`` and the retrievers'
#: ``from ..rank import rerank`` (``pylate.retrieve.colbert``) included.
LOOPS = {"rerank": "pylate.rank.rank"}

#: PyLate's wrapper of fast-plaid (``indexes.PLAID``'s ``_index``): ``__call__`` unpickles the
#: two id mappings on every search; ``(module, class, call, loaders)``, see :mod:`._plaid_search`.
PLAID_MAPPINGS = ("pylate.indexes.fast_plaid", "FastPlaid", "__call__",
                  ("_load_plaid_ids_to_documents_ids", "_load_documents_ids_to_plaid_ids"))

#: Modules imported by the patcher so that every module-level copy of a scorer exists
#: (``import pylate`` itself imports no submodule).  Missing ones are skipped: a few
#: only exist in some releases or need optional dependencies.
MODULES = (
    "pylate.scores",
    "pylate.scores.similarity_functions",
    "pylate.losses",
    "pylate.losses.contrastive",
    "pylate.losses.cached_contrastive",
    "pylate.losses.distillation",
    "pylate.rank",
    "pylate.rank.rank",
    "pylate.models",
    "pylate.models.colbert",
    "pylate.evaluation",
    "pylate.evaluation.colbert_triplet",
    "pylate.evaluation.colbert_distillation",
    "pylate.evaluation.pylate_information_retrieval_evaluator",
)

#: Attributes stored on *instances* (losses, models, evaluators built before the patch
#: keep the original there): ``(module, class, attribute)``.
INSTANCE_SLOTS = (
    ("pylate.losses.contrastive", "Contrastive", "score_metric"),
    ("pylate.losses.cached_contrastive", "CachedContrastive", "score_metric"),
    ("pylate.losses.distillation", "Distillation", "score_metric"),
    ("pylate.models.colbert", "ColBERT", "_similarity"),
    ("pylate.models.colbert", "ColBERT", "_similarity_pairwise"),
    ("pylate.evaluation.pylate_information_retrieval_evaluator", "PyLateInformationRetrievalEvaluator", "score_functions"),
)


@dataclass(frozen=True)
class PyLateLayout:
    """What the patcher found: release, layout group and the originals it replaces (the scorers,
    ``LOOPS``, and ``"ColBERTScores.__call__"`` where the class exists)."""

    version: str
    group: str  # "1.3" (1.3.3 - 1.4.x), "1.5.0" or "1.5.1" (1.5.1 and newer)
    scores_module: ModuleType
    originals: dict[str, Callable[..., Any]]
    colbert_scores_class: type | None
    has_backend: bool
    resolve_backend: Callable[[str | None], str] | None
    convert_to_tensor: Callable[[Any], Any]


def import_optional(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except Exception:  # optional capture points: a module that cannot import has nothing to patch
        return None


def detect() -> PyLateLayout:
    """Import PyLate's scoring modules and describe the installed release."""
    try:
        import pylate
    except ImportError as exc:
        raise ImportError(_install.missing_host("patch_pylate()", "PyLate (1.3.3 - 1.6.x)", _install.PYLATE)) from exc

    version = str(getattr(pylate, "__version__", "unknown"))
    scores_module = import_optional("pylate.scores.colbert")
    if scores_module is None:
        scores_module = importlib.import_module("pylate.scores.scores")
    originals = {name: getattr(scores_module, name) for name in FUNCTIONS}
    for name, module_name in LOOPS.items():
        module = import_optional(module_name)
        if module is not None and callable(getattr(module, name, None)):
            originals[name] = getattr(module, name)
    has_backend = "backend" in inspect.signature(originals["colbert_scores"]).parameters
    colbert_scores_class = getattr(scores_module, "ColBERTScores", None)
    if colbert_scores_class is not None:   # replaced by one fused call (1.5.0 and newer)
        originals["ColBERTScores.__call__"] = vars(colbert_scores_class)["__call__"]
    group = "1.5.1" if has_backend else "1.5.0" if colbert_scores_class is not None else "1.3"
    from pylate.utils.tensor import convert_to_tensor

    return PyLateLayout(
        version=version,
        group=group,
        scores_module=scores_module,
        originals=originals,
        colbert_scores_class=colbert_scores_class,
        has_backend=has_backend,
        resolve_backend=getattr(scores_module, "_resolve_backend", None) if has_backend else None,
        convert_to_tensor=convert_to_tensor,
    )
