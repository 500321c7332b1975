"""``patch_colpali_engine()`` / ``unpatch_colpali_engine()`` for colpali-engine 0.3.10 - 0.3.18.

Capture points (the generation is detected from the loaded modules, not the version
string, so any release's files work, installed or loaded side by side):

=====================================================  =========  =====================================
target                                                 releases   replaced by
=====================================================  =========  =====================================
``BaseVisualRetrieverProcessor.score_multi_vector``    all        :func:`score_multi_vector` (static)
``late_interaction_losses.<Head>.forward`` (5 heads)   all        a forward from :mod:`.heads`
``ColbertModule._inbatch_scores``                      0.3.17+    :func:`.heads.inbatch_scores`
``utils._lik_backend.maxsim_inbatch_lik`` / ``_kd_lik``  0.3.17+    :func:`maxsim_inbatch_lik` / ``_kd_lik``
fast-plaid's ``FastPlaid.search`` (``get_topk_plaid``)  0.3.18     :mod:`lik_plugins.fast_plaid` (held)
``HierarchicalTokenPooler._pool_embeddings_impl``      where any  :func:`_pool_embeddings_impl_for`
=====================================================  =========  =====================================
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect

import torch

from .. import _install
from .._patching import PatchLedger
from ..fast_plaid import _patch as fast_plaid
from .._routing import record
from .._config import disabled
from ..ops.pooling import hierarchical_pool
from . import _scores as sc
from . import heads
from .heads import Generation

LOSSES = "colpali_engine.loss.late_interaction_losses"
PROCESSING = "colpali_engine.utils.processing_utils"
LIK_BACKEND = "colpali_engine.utils._lik_backend"
TOKEN_POOLING = "colpali_engine.compression.token_pooling.hierarchical_token_pooling"

_ledger = PatchLedger()   # its ``current``: the name of the loss generation patched


# --------------------------------------------------------------------------- detection
def _sigmoid_sign(cls) -> float:
    """0.3.13 computes ``softplus(S * mask)``, 0.3.14+ ``softplus(-S * mask)``: ask the
    original head once on a 1x1 problem (S = 0.5) which one this release does.  Smooth max
    (exact on one token) keeps the probe off colpali's backend dispatcher."""
    head = cls(temperature=1.0, normalize_scores=False, use_smooth_max=True)
    with torch.no_grad():
        out = cls.forward(head, torch.ones(1, 1, 1), torch.full((1, 1, 1), 0.5))
    plus = torch.nn.functional.softplus(torch.tensor(0.5))
    return 1.0 if torch.isclose(out, plus) else -1.0


def detect_generation(losses) -> Generation:
    legacy = not hasattr(losses, "ColbertModule")
    sigmoid = getattr(losses, "ColbertSigmoidLoss", None)
    dispatcher = hasattr(losses, "maxsim_kd") and hasattr(losses.ColbertModule, "_inbatch_scores")
    sign = _sigmoid_sign(sigmoid) if sigmoid is not None else -1.0
    if legacy:
        name = "0.3.10"
    elif sigmoid is None:
        name = "0.3.11-0.3.12"
    elif dispatcher:
        name = "0.3.17+"
    else:
        name = "0.3.13" if sign > 0 else "0.3.14-0.3.16"
    return Generation(name=name, legacy=legacy, neg_4d=sigmoid is not None, sigmoid_sign=sign, dispatcher=dispatcher)


# --------------------------------------------------------------------------- wrappers
def _forward_for(cls, impl, gen: Generation):
    original = vars(cls)["forward"]
    signature = inspect.signature(original)
    entry = f"colpali.{cls.__name__}"

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)  # colpali's own TypeError on a bad call
        if not sc.use_original():
            bound.apply_defaults()
            result = impl(self, bound.arguments, gen)
            if result is not None:
                loss, path = result
                record(entry, path)
                return loss
        record(entry, "original")
        return original(self, *args, **kwargs)

    return forward


def _inbatch_scores_for(original):
    @functools.wraps(original)
    def _inbatch_scores(self, query_embeddings, doc_embeddings):
        if not sc.use_original() and heads._ok_inbatch(self, query_embeddings, doc_embeddings):
            scores, path = heads.inbatch_scores(self, query_embeddings, doc_embeddings)
            record("colpali.ColbertModule._inbatch_scores", path)
            return scores
        record("colpali.ColbertModule._inbatch_scores", "original")
        return original(self, query_embeddings, doc_embeddings)

    return _inbatch_scores


def _lik_slots(backend_module):
    """Replacements for colpali's ``_lik_backend`` entry points (looked up at call time by
    ``colpali_engine.utils.maxsim``, for ``auto`` and ``lik``): we serve every device our
    ops serve, CPU included, whether or not late-interaction-kernels is installed, and
    raise ``LIKUnsupportedError`` (silent fallback under ``auto``) where we do not."""
    unsupported = backend_module.LIKUnsupportedError

    def _check(query, doc, doc_dim):
        if not (torch.is_tensor(query) and torch.is_tensor(doc) and query.dim() == 3 and doc.dim() == doc_dim):
            raise unsupported(f"lik_plugins expects query [B, L, d] and a {doc_dim}-D doc tensor.")
        if query.device != doc.device:
            raise unsupported(f"query and doc are on different devices ({query.device} vs {doc.device}).")
        if doc_dim == 4 and doc.size(0) != query.size(0):
            raise unsupported("KD layout expects one candidate list per query.")
        if not sc.eligible(query, doc):
            raise unsupported("lik_plugins serves floating tensors of one dtype, non-empty, with equal dims.")

    def _slot(name: str, doc_dim: int, scorer: str):
        original, entry = getattr(backend_module, name), f"colpali.{name}"

        @functools.wraps(original)
        def slot(query, doc):
            if disabled():
                record(entry, "original")
                return original(query, doc)
            _check(query, doc, doc_dim)
            scores, path = getattr(sc, scorer)(query, doc)
            record(entry, path)
            return scores

        return slot

    return {name: _slot(name, doc_dim, scorer)
            for name, doc_dim, scorer in (("maxsim_inbatch_lik", 3, "inbatch"), ("maxsim_kd_lik", 4, "candidates"))}


def _score_multi_vector_for(processing, original):
    """``score_multi_vector(qs, ps, batch_size=128, device=None)`` with colpali's semantics,
    in one launch over the passages where they lie (:func:`._scores.multi_vector_lists`):
    ``[n_q, n_p]`` float32 on CPU; colpali's own loop where that does not serve."""

    @functools.wraps(original)
    def score_multi_vector(qs, ps, batch_size: int = 128, device=None):
        served = None
        if not sc.use_original():
            device = device or processing.get_torch_device("auto")
            if len(qs) == 0:
                raise ValueError("No queries provided")
            if len(ps) == 0:
                raise ValueError("No passages provided")
            queries, passages = list(qs), list(ps)
            items = queries + passages
            if all(torch.is_tensor(x) and x.dim() == 2 and x.shape[0] > 0 for x in items) and sc.eligible(*items) \
                    and isinstance(batch_size, int) and batch_size > 0:
                served = sc.multi_vector_lists(queries, passages, batch_size, device)
        if served is None:
            record("colpali.score_multi_vector", "original")
            return original(qs, ps, batch_size, device)
        scores, path = served
        record("colpali.score_multi_vector", path)
        return scores

    return score_multi_vector


# --------------------------------------------------------------------------- public
INSTALL_HINT = _install.missing_host("patch_colpali_engine()", "colpali-engine (0.3.10 - 0.3.18)", _install.COLPALI)


def _pool_embeddings_impl_for(original):
    """``HierarchicalTokenPooler``'s per-page Ward pooling as one batched
    :func:`~lik_plugins.ops.hierarchical_pool` call with colpali's conventions: float32 on the
    CPU, Ward on the rows of the distance matrix, re-normalised means in label order, back on
    the page's device and dtype, with the ``{cluster id: (token indices,)}`` maps."""

    def _pool_embeddings_impl(self, embeddings, pool_factor, num_workers=None):
        served = (not disabled() and type(pool_factor) is int and pool_factor >= 2
                  and (num_workers is None or (type(num_workers) is int and num_workers >= 1))
                  and all(isinstance(e, torch.Tensor) and e.dim() == 2 and e.shape[0] > 1
                          and e.is_floating_point() for e in embeddings))
        if not served:   # pool factor 1, a single token, bad workers: colpali's own answer or error
            record("colpali.token_pooling", "original")
            return original(self, embeddings, pool_factor=pool_factor, num_workers=num_workers)
        record("colpali.token_pooling", "torch-chunked")
        pages = [e.to(torch.float32).cpu() for e in embeddings]
        pooled, labels = hierarchical_pool(pages, pool_factor, cluster_on="distance_rows", normalize=True,
                                           return_labels=True)
        maps = []
        for page_labels in labels:
            clusters = max(page_labels.shape[0] // pool_factor, 1)
            order = torch.argsort(page_labels, stable=True)   # token indices ascending within a cluster
            sizes = torch.bincount(page_labels, minlength=clusters).tolist()
            maps.append({cluster: (indices,) for cluster, indices in enumerate(order.split(sizes))})
        return [p.to(e.device).to(e.dtype) for p, e in zip(pooled, embeddings)], maps

    return _pool_embeddings_impl


def _serve_token_pooling() -> None:
    """``HierarchicalTokenPooler._pool_embeddings_impl``, where the release has it and scipy
    (which its module imports) is installed; quietly nothing otherwise."""
    try:
        module = importlib.import_module(TOKEN_POOLING)
    except ImportError:
        return
    cls = getattr(module, "HierarchicalTokenPooler", None)
    if cls is not None and "_pool_embeddings_impl" in vars(cls):
        _ledger.set_attr(cls, "_pool_embeddings_impl", _pool_embeddings_impl_for(vars(cls)["_pool_embeddings_impl"]))


def _import_colpali():
    """colpali's loss and processing modules, or an ImportError that says what to do.

    A missing colpali-engine gets the install hint; an installed one that fails to import
    (most often a torchvision built for another torch, which transformers imports) keeps
    its own error, with a pointer to that cause."""
    try:
        return importlib.import_module(LOSSES), importlib.import_module(PROCESSING)
    except ImportError as exc:
        if importlib.util.find_spec("colpali_engine") is None:
            raise ImportError(INSTALL_HINT) from exc
        raise ImportError(
            f"colpali-engine is installed but does not import ({exc}); a torchvision that does not "
            "match the installed torch breaks transformers' imports: install torchvision from the index "
            "your torch came from (for a CPU torch: pip install torchvision --index-url "
            "https://download.pytorch.org/whl/cpu), or pip uninstall torchvision (colpali-engine runs "
            "without it on transformers below 5.5)"
        ) from exc


def patch_colpali_engine() -> str:
    """Route colpali-engine's scoring and every loss head through lik_plugins.

    Works on every release from 0.3.10 to 0.3.18 (the generation is detected from the
    loaded modules).  Patching twice is harmless; :func:`unpatch_colpali_engine` restores
    every original object exactly (``score_multi_vector`` stays a ``staticmethod``).

    After the call, every patched entry reads ``LIK_DISABLE`` and ``COLPALI_SCORES_BACKEND``
    on every call: ``LIK_DISABLE=1`` or ``torch`` run colpali's original code, ``auto`` /
    ``lik`` run ours, any other value raises colpali's ValueError (also on releases older than
    the variable).  :func:`lik_plugins.routing_counts` shows which path served each call
    under the entries ``colpali.score_multi_vector``, ``colpali.<LossClass>``,
    ``colpali.ColbertModule._inbatch_scores``, ``colpali.maxsim_inbatch_lik`` and
    ``colpali.maxsim_kd_lik``; ``HierarchicalTokenPooler.pool_embeddings`` under
    ``colpali.token_pooling`` (:func:`lik_plugins.ops.hierarchical_pool`); ``get_topk_plaid``'s searches (fast-plaid installed) under
    ``fast_plaid.search`` (:func:`lik_plugins.fast_plaid.patch_fast_plaid`, held while
    colpali-engine is patched).

    Returns:
        The detected loss generation: ``"0.3.10"``, ``"0.3.11-0.3.12"``, ``"0.3.13"``,
        ``"0.3.14-0.3.16"`` or ``"0.3.17+"``.

    Raises:
        ImportError: colpali-engine is not installed (the message says how to install it) or
            does not import.
    """
    return _ledger.patch(_patch)


def _patch(current: str | None) -> str:
    if current is not None:
        return current
    losses, processing = _import_colpali()    # may re-enter patch_colpali_engine (start-up hook)
    gen = detect_generation(losses)
    try:
        for name, (modern, legacy) in heads.HEADS.items():
            cls = getattr(losses, name, None)
            impl = legacy if gen.legacy else modern
            if cls is None or impl is None or "forward" not in vars(cls):
                continue
            _ledger.set_attr(cls, "forward", _forward_for(cls, impl, gen))
        if gen.dispatcher:
            module = losses.ColbertModule
            _ledger.set_attr(module, "_inbatch_scores", _inbatch_scores_for(vars(module)["_inbatch_scores"]))
            backend = importlib.import_module(LIK_BACKEND)
            for name, slot in _lik_slots(backend).items():
                _ledger.set_attr(backend, name, slot)
        base = processing.BaseVisualRetrieverProcessor
        original = vars(base)["score_multi_vector"]
        original_fn = original.__func__ if isinstance(original, staticmethod) else original
        _ledger.set_attr(base, "score_multi_vector", staticmethod(_score_multi_vector_for(processing, original_fn)))
        _serve_token_pooling()
        fast_plaid.hold("colpali")       # get_topk_plaid searches through fast-plaid (where installed)
    except BaseException:
        _ledger.revert()
        raise
    return gen.name


def unpatch_colpali_engine() -> None:
    """Restore every object :func:`patch_colpali_engine` replaced (no-op when not patched)."""
    with _ledger.hold():
        _ledger.revert()
        fast_plaid.let_go("colpali")


def is_patched() -> bool:
    return _ledger.active


def patched_generation() -> str | None:
    """The loss generation the active patch was built for, or ``None``."""
    return _ledger.current
