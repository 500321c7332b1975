"""``patch_sentence_transformers()`` / ``unpatch_sentence_transformers()`` for 6.x.

Capture points (read from the 6.0.0 - 6.3.0 wheels; the chunk scorers are byte-identical
across them, the loops differ only in how they chunk):

=========================================================  ======================  ==========================
target                                                     kind                    replaced by
=========================================================  ======================  ==========================
``util.similarity._maxsim_score_documents`` / ``_pairs``   call-time global        one fused op call
``maxsim`` / ``maxsim_pairwise`` (``util.similarity``,     call-time globals,      ST's loop in one chunk for
``util``, ``multi_vector_encoder``, ``scoring.colbert``)   re-exports              pre-padded tensors
``scoring.colbert.colbert_scores`` / ``colbert_kd_scores``  global, re-exports,     one call over the folded
(+ ``scoring``, the losses' module globals)                loss ``__init__``       document groups
``<loss>.similarity_fct`` of losses built before           instance                class-level slot property
``MultiVectorEncoder._similarity(_pairwise)``               instance (resolved by   class-level slot property
                                                           ``similarity_fn_name``)
6.3: ``scoring.colbert._colbert_scores`` /                  globals (the losses'    one call of the model's
``_colbert_kd_scores`` (``partial(_colbert_scores,          default path)           scorer over the folded
model.similarity)``)                                                               document groups
6.3: ``_MaxSimScorer.__call__`` / ``pairwise`` /            class methods (models   ``_model_scorer``: the
``_score_documents`` / ``_score_pairs``                     with ``use_kernels`` /  precedence over ST's
                                                           ``kernel_config``)      kernel layers
=========================================================  ======================  ==========================

6.3 also ships ST's own plug-in point for our kernels: :func:`kernel_config` (``_kernel_config``)
maps ``STMaxSim`` / ``STMaxSimPairwise`` to the layer repository inside this package.

``mean_*`` scorers, ``colbert_scores_pairwise``, ``SimilarityFunction``,
``model.similarity`` and the evaluators reach the replaced globals at call time.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable

from .._patching import PatchLedger
from . import _model_scorer, _scores

SIMILARITY = "sentence_transformers.util.similarity"
COLBERT = "sentence_transformers.multi_vector_encoder.scoring.colbert"
LOSSES = "sentence_transformers.multi_vector_encoder.losses"
MODEL = "sentence_transformers.multi_vector_encoder.model"

#: Imported by the patcher so every module-level copy of a scorer exists before we look.
MODULES = (
    SIMILARITY,
    "sentence_transformers.util",
    "sentence_transformers.multi_vector_encoder",
    "sentence_transformers.multi_vector_encoder.scoring",
    COLBERT,
    LOSSES,
    MODEL,
    "sentence_transformers.multi_vector_encoder.evaluation",
)

_ledger = PatchLedger()   # its ``current``: the STLayout patched


@dataclass(frozen=True)
class STLayout:
    """What the patcher found: the release and the original functions it replaces."""

    version: str
    originals: dict[str, Callable[..., Any]]


def detect() -> STLayout:
    """Import sentence-transformers' multi-vector modules and describe the installed release."""
    import importlib

    try:
        import sentence_transformers
    except ImportError as exc:
        raise ImportError(
            "patch_sentence_transformers() needs sentence-transformers 6.x: pip install 'sentence-transformers>=6,<7' (or 'lik_plugins[sentence-transformers]')"
        ) from exc
    version = str(getattr(sentence_transformers, "__version__", "unknown"))
    if version.split(".")[0] != "6":
        raise RuntimeError(
            f"patch_sentence_transformers() serves sentence-transformers 6.x (MultiVectorEncoder); "
            f"installed: {version}. pip install 'sentence-transformers>=6,<7' (or 'lik_plugins[sentence-transformers]')"
        )
    for name in MODULES:
        importlib.import_module(name)
    similarity, colbert = sys.modules[SIMILARITY], sys.modules[COLBERT]
    originals = {name: getattr(similarity, name) for name in _scores.SIMILARITY_ADAPTERS}
    # 6.3's private helpers (``_colbert_scores``, ``_colbert_kd_scores``) are absent before it
    originals.update({name: getattr(colbert, name) for name in _scores.SCORING_ADAPTERS if hasattr(colbert, name)})
    return STLayout(version=version, originals=originals)


def _instance_slots() -> list[tuple[type, str]]:
    slots = []
    model = getattr(sys.modules.get(MODEL), "MultiVectorEncoder", None)
    if model is not None:
        slots += [(model, "_similarity"), (model, "_similarity_pairwise")]
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(LOSSES + "."):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, type) and value.__module__ == name and hasattr(value, "forward"):
                slots.append((value, "similarity_fct"))
    return slots


def patch_sentence_transformers() -> STLayout:
    """Serve sentence-transformers 6.x multi-vector (MaxSim) scoring with ``lik_plugins``.

    After the call, ``maxsim``, ``maxsim_pairwise``, ``mean_maxsim(_pairwise)``, the scoring
    functions in ``multi_vector_encoder.scoring`` (``colbert_scores``, ``colbert_kd_scores``,
    ``colbert_scores_pairwise`` and their ``mean_`` variants), the losses
    (``MultiVectorMultipleNegativesRankingLoss``, ``CachedMultiVectorMultipleNegativesRankingLoss``,
    ``MultiVectorDistillKLDivLoss``, ``MultiVectorMarginMSELoss``), ``model.similarity`` /
    ``similarity_pairwise`` and the evaluators run on the fused kernels -- including losses
    and models built before the call.  Results keep ST's semantics: masked document tokens
    cannot win the max, masked query tokens add 0, documents without a valid token get ST's
    sentinel score, float32 output on the documents' device, masks derived from all-zero
    rows, ``length_normalize``.  ``chunk_elements`` is accepted; pre-padded inputs are scored
    in one launch.  XTR scoring stays on ST's path (a global top-k, not MaxSim).

    6.3: the losses' default path (``partial(_colbert_scores, model.similarity)``, one scorer
    call per document column in ST) becomes one call over the folded columns; the multi-vector
    Matryoshka and token-pooling losses score through the loss they wrap.  A model built with
    ``use_kernels=True`` or a ``kernel_config`` follows the precedence of
    ``lik_plugins.sentence_transformers._model_scorer``: a target mapped explicitly to another
    layer repository is served by that layer (counted as
    ``sentence_transformers.kernel_layer.<target>``), everything else by the patch.

    ``LIK_DISABLE=1`` sends every call to ST's original code.  Calling it again is harmless
    (it also covers ST modules imported since).  :func:`lik_plugins.routing_counts` shows the
    path of each scorer launch under ``sentence_transformers.maxsim`` and
    ``sentence_transformers.maxsim_pairwise`` (``colbert_scores`` / ``colbert_kd_scores``
    appear there only when they run ST's own loop).

    Returns:
        The detected :class:`STLayout` (``version``, ``originals``).

    Raises:
        ImportError: sentence-transformers is not installed.
        RuntimeError: the installed release is not 6.x.

    Example::

        import lik_plugins
        lik_plugins.patch_sentence_transformers()
        ...  # build the MultiVectorEncoder and its loss, train with MultiVectorEncoderTrainer
        print(lik_plugins.routing_counts())
    """
    return _ledger.patch(_patch)


def _patch(current: STLayout | None) -> STLayout:
    layout = current if current is not None else detect()   # ST's import may re-enter (start-up hook)
    adapters = {**_scores.SIMILARITY_ADAPTERS, **_scores.SCORING_ADAPTERS}
    _scores.bind(layout.originals, sys.modules[SIMILARITY], active=True)
    # module globals (re-exports, the losses' imports), defaults bound at definition time (none
    # in 6.0 - 6.2; a later 6.x may add some), and the instances built before the patch:
    # losses' similarity_fct, models' resolved similarity
    _ledger.serve("sentence_transformers", {original: adapters[name] for name, original in layout.originals.items()},
                  _instance_slots(), "sentence-transformers scorers served by lik_plugins")
    # 6.3's model scorer (use_kernels / kernel_config): the precedence of _model_scorer
    _model_scorer.serve(_ledger, sys.modules[COLBERT])
    return layout


def unpatch_sentence_transformers() -> None:
    """Restore every original sentence-transformers object exactly (harmless when not patched)."""
    with _ledger.hold():
        layout = _ledger.current
        _ledger.revert()
        if layout is not None:  # keep the originals bound: a stale adapter then runs ST's code
            _scores.bind(layout.originals, sys.modules.get(SIMILARITY), active=False)


def is_patched() -> bool:
    return _ledger.active
