"""sentence-transformers 6.x MaxSim scoring served by ``lik_plugins``, with ST's exact semantics.

ST scores multi-vector embeddings in two layers, both in ``sentence_transformers.util.similarity``:

* ``maxsim`` / ``maxsim_pairwise`` canonicalise the inputs (lists, numpy, a bare 2-D item,
  per-item masks), derive masks (list lengths, or all-zero rows of a padded tensor), pick the
  scoring device, pad chunk by chunk under an element budget (``chunk_elements``) and apply
  ``length_normalize``; the result stays on the documents' device;
* ``_maxsim_score_documents`` / ``_maxsim_score_pairs`` score one padded chunk: masked
  document tokens are filled with the dtype minimum before the max (our ``mask_mode="exclude"``),
  the per-token maxima are summed in float32 times the query mask, and a document without
  any valid token gets the sentinel ``_EMPTY_DOCUMENT_SCORE`` (``_fill_empty_document_scores``).

We replace the chunk scorers by one fused op call each and keep every line of the first layer
(ST's own code runs it), so its semantics cannot drift.  On top of that:

* ``maxsim`` / ``maxsim_pairwise`` on two lists of tensors (the evaluators' calls): every
  document is read where it lies by one launch over all pairs (``kernels.triton.listed``),
  no padded chunks, where the Triton kernels run and the documents lie on the scoring
  device; elsewhere ST's own loop.
* ``maxsim`` / ``maxsim_pairwise``: for pre-padded tensors (nothing left to pad) the chunk
  loop is collapsed to one chunk -- one launch; ``chunk_elements`` is accepted and ignored
  there, since the fused op never builds the ``(Nq, Nd, Lq, Ld)`` intermediate the budget
  bounds.  Ragged lists keep ST's chunking: it bounds the padding ST builds per chunk.
* ``colbert_scores`` (``(Qq, Lq, H)`` x ``(Qd, N, Ld, H)`` groups, query-major ``(Qq, Qd*N)``)
  and ``colbert_kd_scores`` (``(B, N, Ld, H)`` candidates per query): one ``maxsim`` /
  ``maxsim_pairwise`` call on the folded documents instead of ST's loop over the ``N``
  groups -- exact, since every document's score depends only on its own tokens and mask.

Precision: fp32 inputs match ST to summation order.  fp16 / bf16 inputs: ST rounds every
token similarity to the input dtype before the max (its einsum runs in half precision) and
sums the maxima in float32 without a final rounding.  On lists (the listed kernel) each
row's max is rounded to the input dtype the same way (rounding is monotone) before the
fp32 sum: ST's scores bit for bit, but where a similarity lies within fp32 accumulation
error of a 16-bit rounding midpoint (one step of that max, rare), so rankings match ST's,
ties included.  The padded-chunk scorers keep the similarities in fp32; their scores
differ by that rounding (relative ~4e-3 per token for bf16), never by a different mask
semantics.  XTR scoring (a global top-k over the batch's tokens)
is not MaxSim: ``xtr_scores`` & co. stay on ST's path.

``LIK_DISABLE=1`` sends every call to ST's original function with the caller's arguments.
"""
from __future__ import annotations

import inspect
from operator import attrgetter
from typing import Any, Callable

import numpy as np
import torch

from .._config import disabled
from .._routing import record
from ..ops.listed import plan_lists, score_lists

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

#: A chunk budget no input reaches: ST's chunk loop then runs once (one fused launch).
ONE_CHUNK = 1 << 62

#: Set by the patcher; read on every call.
_originals: dict[str, Callable] = {}
_signatures: dict[str, inspect.Signature] = {}
_similarity_module: Any = None
_active = False


def bind(originals: dict[str, Callable] | None, similarity_module: Any, active: bool) -> None:
    global _similarity_module, _active
    _originals.clear()
    _signatures.clear()
    if originals:
        _originals.update(originals)
        _signatures.update({name: inspect.signature(fn) for name, fn in originals.items()})
    _similarity_module, _active = similarity_module, active


def _serving() -> bool:
    return _active and not disabled()


# --------------------------------------------------------------------------- chunk scorers


def _binary_query_mask(mask: torch.Tensor | None) -> bool:
    """ST multiplies the per-token maxima by the query mask: only 0/1 masks mean "drop the
    token" (a weight of 0.5 scales it, which is ST's business, not a mask)."""
    if mask is None or mask.dtype == torch.bool:
        return True
    if mask.is_complex():
        return False
    return bool(((mask == 0) | (mask == 1)).all())


def _servable_chunk(a, b, a_mask, b_mask, pairs: bool) -> bool:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    if a.dim() != 3 or b.dim() != 3 or a.dtype != b.dtype or a.dtype not in SUPPORTED_DTYPES:
        return False
    if a.device != b.device or a.shape[-1] != b.shape[-1] or a.shape[1] == 0 or b.shape[1] == 0:
        return False  # zero-width documents: ST's own sentinel path (nothing to take a max over)
    if pairs and a.shape[0] != b.shape[0]:
        return False
    for mask, owner in ((a_mask, a), (b_mask, b)):
        if mask is not None and (
            not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(owner.shape[:2]) or mask.device != owner.device
        ):
            return False
    return _binary_query_mask(a_mask)


def _finish(scores: torch.Tensor, a_mask, b_mask, similarity: Any) -> torch.Tensor:
    """ST's output dtype (float32 times the query mask's dtype) and its empty-document sentinel."""
    if a_mask is not None:
        scores = scores.to(torch.promote_types(torch.float32, a_mask.dtype))
    if b_mask is not None:
        scores = similarity._fill_empty_document_scores(scores, ~b_mask.bool().any(dim=-1))
    return scores


def _host_chunk_scorer(name: str) -> Callable:
    """ST's own chunk scorer ``name``: the one the patcher recorded, else (no patch: a kernel
    layer of ours called by ST) the one ST's module holds, which is then its own."""
    if name in _originals:
        return _originals[name]
    return getattr(_host_similarity(), name)


def _host_similarity() -> Any:
    if _similarity_module is not None:
        return _similarity_module
    from sentence_transformers.util import similarity

    return similarity


def score_chunk(a, b, a_mask, b_mask, pairs: bool, serve: bool):
    """One of ST's chunk scorers as one fused call where ``serve`` and the inputs allow, else
    ST's own; counted under ``sentence_transformers.maxsim(_pairwise)`` either way.  The
    patch's adapters pass ``serve`` = patched and not disabled, our kernel layers (which ST
    calls without the patch) pass ``serve`` = not disabled."""
    entry, original = (("sentence_transformers.maxsim_pairwise", "_maxsim_score_pairs") if pairs
                       else ("sentence_transformers.maxsim", "_maxsim_score_documents"))
    if not (serve and _servable_chunk(a, b, a_mask, b_mask, pairs=pairs)):
        record(entry, "original")
        return _host_chunk_scorer(original)(a, b, a_mask, b_mask)
    from .. import ops

    record(entry, ops.served_by(a))
    op = ops.maxsim_pairs if pairs else ops.maxsim
    return _finish(op(a, b, a_mask, b_mask, mask_mode="exclude").float(), a_mask, b_mask, _host_similarity())


def score_documents(a, b, a_mask, b_mask):
    """``_maxsim_score_documents`` as one fused call: ``(Na, Lq, H)`` x ``(Nb, Ld, H)`` -> ``(Na, Nb)``."""
    return score_chunk(a, b, a_mask, b_mask, pairs=False, serve=_serving())


def score_pairs(a, b, a_mask, b_mask):
    """``_maxsim_score_pairs`` as one fused call: ``(B, Lq, H)`` x ``(B, Ld, H)`` -> ``(B,)``."""
    return score_chunk(a, b, a_mask, b_mask, pairs=True, serve=_serving())


# ------------------------------------------------------------------------ the chunk loops


def _one_chunk(name: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call with ``chunk_elements`` raised so that ST's loop runs once, when both sides
    are already padded and the query mask is one the fused scorer serves."""
    signature = _signatures[name]
    if "chunk_elements" not in signature.parameters:
        return args, kwargs
    bound = signature.bind(*args, **kwargs)  # ST's own TypeError on a bad call comes from ST below
    a, b = bound.arguments.get("a"), bound.arguments.get("b")
    a_mask = bound.arguments.get("a_mask")
    if not (isinstance(a, (torch.Tensor, np.ndarray)) and isinstance(b, (torch.Tensor, np.ndarray))):
        return args, kwargs
    if a_mask is not None and not (isinstance(a_mask, torch.Tensor) and _binary_query_mask(a_mask)):
        return args, kwargs
    bound.arguments["chunk_elements"] = ONE_CHUNK
    return bound.args, bound.kwargs


def _listed(name: str, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """``maxsim`` / ``maxsim_pairwise`` on two lists of ``[L, H]`` tensors, every document read
    where it lies (``kernels.triton.listed``: one launch, no padded chunk), or None where ST's
    own loop must run.  ST's list semantics: lengths are the masks (padding excluded from
    the max and the sum), a document without tokens scores ``_EMPTY_DOCUMENT_SCORE``,
    ``length_normalize`` divides by the query's token count; float32 on the documents'
    device.  Served where the Triton kernels run and the scoring device is the documents'."""
    bound = _signatures[name].bind(*args, **kwargs)
    params = bound.arguments
    a, b = params.get("a"), params.get("b")
    if not (isinstance(a, list) and isinstance(b, list) and a and b):
        return None
    if params.get("a_mask") is not None or params.get("b_mask") is not None:
        return None
    pairwise = name == "maxsim_pairwise"
    if pairwise and len(a) != len(b):
        return None   # ST's own error
    first = a[0]
    if not isinstance(first, torch.Tensor) or first.dtype not in SUPPORTED_DTYPES or first.dim() != 2:
        return None
    dtype, dim, device = first.dtype, first.shape[1], first.device
    if not all(isinstance(q, torch.Tensor) and q.dim() == 2 and q.shape[0] > 0 and q.shape[1] == dim
               and q.dtype == dtype and q.device == device for q in a):
        return None
    target = params.get("device")
    if not isinstance(b[0], torch.Tensor) or b[0].device != device or (
            target is not None and torch.device(target) != device):
        return None
    _, table = plan_lists(first, device, b, [q.shape[0] for q in a])
    if table is None or isinstance(table, str):
        return None
    nq = len(a)
    # every document is a plain tensor now (candidate_table checked): one C-level pass
    if torch.is_grad_enabled() and (any(q.requires_grad for q in a) or any(map(_REQUIRES_GRAD, b))):
        return None   # scores only: a gradient goes through ST's chunk scorers
    q_lens = table.extra
    with torch.no_grad():   # pairwise: query i against document i ([nq]); else every pair ([nq, nd])
        scores = score_lists(a, q_lens, table, torch.arange(nq, device=device) if pairwise else None, None,
                             round_maxima=True)
    scores = scores.masked_fill(table.lengths == 0, _similarity_module._EMPTY_DOCUMENT_SCORE)
    if params.get("length_normalize", False):
        counts = q_lens.to(scores.dtype)
        scores = scores / (counts if pairwise else counts.unsqueeze(1))
    return scores


_REQUIRES_GRAD = attrgetter("requires_grad")


def _loop(name: str) -> Callable:
    entry = f"sentence_transformers.{name}_lists"

    def run(*args, **kwargs):
        if _serving():
            try:
                served = _listed(name, args, kwargs)
                if served is not None:
                    record(entry, "triton")
                    return served
                args, kwargs = _one_chunk(name, args, kwargs)
            except TypeError:
                pass  # let ST raise its own error for a bad call
        return _originals[name](*args, **kwargs)

    return run


maxsim = _loop("maxsim")
maxsim_pairwise = _loop("maxsim_pairwise")


# ------------------------------------------------------------------------ group folding


def _per_document_scorer(scorer: Any, pairwise: bool) -> bool:
    """Whether ``scorer`` (what 6.3's ``_colbert_scores`` / ``_colbert_kd_scores`` receive) scores
    every document from its own tokens and mask alone -- ST's MaxSim scorers: ``maxsim`` /
    ``mean_maxsim`` (``_pairwise``), a model's ``similarity`` (``similarity_pairwise``) resolving
    to one of them or to the model's MaxSim scorer.  Only then is one call over the folded
    groups the same as ST's loop over them; anything else keeps ST's loop."""
    import sys

    names = ("maxsim_pairwise", "mean_maxsim_pairwise") if pairwise else ("maxsim", "mean_maxsim")
    similarity = _host_similarity()
    known = {inspect.unwrap(getattr(similarity, name)) for name in names if hasattr(similarity, name)}
    owner = getattr(scorer, "__self__", None)
    model_module = sys.modules.get("sentence_transformers.multi_vector_encoder.model")
    encoder = getattr(model_module, "MultiVectorEncoder", None)
    if encoder is not None and isinstance(owner, encoder):
        method = "similarity_pairwise" if pairwise else "similarity"
        if getattr(scorer, "__func__", None) is not getattr(encoder, method, None):
            return False   # a subclass's own similarity: its business
        getattr(owner, "similarity_fn_name", None)   # resolves _similarity on first use, as similarity() does
        scorer = getattr(owner, "_similarity_pairwise" if pairwise else "_similarity", None)
        owner = getattr(scorer, "__self__", None)
    colbert = sys.modules.get("sentence_transformers.multi_vector_encoder.scoring.colbert")
    model_scorer = getattr(colbert, "_MaxSimScorer", None)
    if model_scorer is not None and isinstance(owner if pairwise else scorer, model_scorer):
        return not pairwise or getattr(scorer, "__name__", None) == "pairwise"
    try:
        return inspect.unwrap(scorer) in known
    except (TypeError, ValueError):  # unhashable or a __wrapped__ cycle: not one of ST's
        return False


def _fold(name: str, pairwise: bool, scorer_param: str | None = None) -> Callable:
    """``colbert_scores`` (``pairwise=False``) / ``colbert_kd_scores`` (``pairwise=True``)
    as one ``maxsim`` / ``maxsim_pairwise`` call over the ``Qd * N`` folded documents; with
    ``scorer_param`` (6.3's ``_colbert_scores(score_documents, ...)`` and
    ``_colbert_kd_scores(score_pairs, ...)``, the losses' default path through the model's
    similarity) one call of that scorer, when it is one of ST's per-document MaxSim scorers."""
    entry = f"sentence_transformers.{name.lstrip('_')}"

    def run(*args, **kwargs):
        Q = None
        if _serving():
            try:
                bound = _signatures[name].bind(*args, **kwargs)
                bound.apply_defaults()
                params = dict(bound.arguments)
                score = params.pop(scorer_param) if scorer_param else None
                convert = _similarity_module._convert_to_tensor
                Q = convert(params.pop("queries_embeddings"))
                D = convert(params.pop("documents_embeddings"))
                q_mask, d_mask = (None if m is None else convert(m)
                                  for m in (params.pop("queries_mask", None), params.pop("documents_mask", None)))
                if scorer_param:
                    if not _per_document_scorer(score, pairwise):
                        Q = None
                    elif params.get("length_normalize") is None:
                        params.pop("length_normalize", None)   # ST's helpers pass it only when set
            except Exception:  # noqa: BLE001 -- a bad call or input: ST raises its own error below
                Q = None
        if (
            not isinstance(Q, torch.Tensor) or Q.dim() != 3 or not isinstance(D, torch.Tensor) or D.dim() != 4
            or (d_mask is not None and tuple(d_mask.shape) != tuple(D.shape[:3]))
            or (pairwise and (D.shape[0] != Q.shape[0] or (q_mask is not None and q_mask.shape[0] != Q.shape[0])))
        ):
            record(entry, "original")
            return _originals[name](*args, **kwargs)
        groups, n, length, dim = D.shape
        folded = D.reshape(groups * n, length, dim)
        folded_mask = None if d_mask is None else d_mask.reshape(groups * n, length)
        if score is None:
            score = _similarity_module.maxsim_pairwise if pairwise else _similarity_module.maxsim
        if pairwise:  # pair every query with each of its own N candidates
            Q = Q.repeat_interleave(n, dim=0)
            q_mask = None if q_mask is None else q_mask.repeat_interleave(n, dim=0)
            return score(Q, folded, a_mask=q_mask, b_mask=folded_mask, **params).reshape(groups, n)
        # column d * N + k is document d, slot k: ST's query-major layout
        return score(Q, folded, a_mask=q_mask, b_mask=folded_mask, **params)

    return run


colbert_scores = _fold("colbert_scores", pairwise=False)
colbert_kd_scores = _fold("colbert_kd_scores", pairwise=True)
colbert_scores_through = _fold("_colbert_scores", pairwise=False, scorer_param="score_documents")
colbert_kd_scores_through = _fold("_colbert_kd_scores", pairwise=True, scorer_param="score_pairs")

#: ``{name in util.similarity / scoring.colbert: adapter}``; wrapped as lookalikes by the patcher.
SIMILARITY_ADAPTERS = {
    "_maxsim_score_documents": score_documents,
    "_maxsim_score_pairs": score_pairs,
    "maxsim": maxsim,
    "maxsim_pairwise": maxsim_pairwise,
}
#: 6.3 adds the private helpers its losses score through (``partial(_colbert_scores,
#: model.similarity)``); a release without them has nothing to capture there.
SCORING_ADAPTERS = {
    "colbert_scores": colbert_scores,
    "colbert_kd_scores": colbert_kd_scores,
    "_colbert_scores": colbert_scores_through,
    "_colbert_kd_scores": colbert_kd_scores_through,
}
