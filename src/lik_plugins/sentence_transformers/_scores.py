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
from .._routing import listed_table, record

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


def _finish(scores: torch.Tensor, a_mask, b_mask) -> torch.Tensor:
    """ST's output dtype (float32 times the query mask's dtype) and its empty-document sentinel."""
    if a_mask is not None:
        scores = scores.to(torch.promote_types(torch.float32, a_mask.dtype))
    if b_mask is not None:
        scores = _similarity_module._fill_empty_document_scores(scores, ~b_mask.bool().any(dim=-1))
    return scores


def _score_chunk(a, b, a_mask, b_mask, pairs: bool):
    """One of ST's chunk scorers as one fused call, or ST's own where ours does not serve."""
    entry, original = (("sentence_transformers.maxsim_pairwise", "_maxsim_score_pairs") if pairs
                       else ("sentence_transformers.maxsim", "_maxsim_score_documents"))
    if not (_serving() and _servable_chunk(a, b, a_mask, b_mask, pairs=pairs)):
        record(entry, "original")
        return _originals[original](a, b, a_mask, b_mask)
    from .. import ops

    record(entry, ops.served_by(a))
    op = ops.maxsim_pairs if pairs else ops.maxsim
    return _finish(op(a, b, a_mask, b_mask, mask_mode="exclude").float(), a_mask, b_mask)


def score_documents(a, b, a_mask, b_mask):
    """``_maxsim_score_documents`` as one fused call: ``(Na, Lq, H)`` x ``(Nb, Ld, H)`` -> ``(Na, Nb)``."""
    return _score_chunk(a, b, a_mask, b_mask, pairs=False)


def score_pairs(a, b, a_mask, b_mask):
    """``_maxsim_score_pairs`` as one fused call: ``(B, Lq, H)`` x ``(B, Ld, H)`` -> ``(B,)``."""
    return _score_chunk(a, b, a_mask, b_mask, pairs=True)


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
    _, table = listed_table(first, device, b, [q.shape[0] for q in a])
    if table is None or isinstance(table, str):
        return None
    from ..kernels.triton.listed import score_table

    nq = len(a)
    # every document is a plain tensor now (candidate_table checked): one C-level pass
    if torch.is_grad_enabled() and (any(q.requires_grad for q in a) or any(map(_REQUIRES_GRAD, b))):
        return None   # scores only: a gradient goes through ST's chunk scorers
    q_lens = table.extra
    with torch.no_grad():   # pairwise: query i against document i ([nq]); else every pair ([nq, nd])
        scores = score_table(a, q_lens, table, torch.arange(nq, device=device) if pairwise else None, None,
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


def _fold(name: str, pairwise: bool) -> Callable:
    """``colbert_scores`` (``pairwise=False``) / ``colbert_kd_scores`` (``pairwise=True``)
    as one ``maxsim`` / ``maxsim_pairwise`` call over the ``Qd * N`` folded documents."""
    entry = f"sentence_transformers.{name}"

    def run(*args, **kwargs):
        Q = None
        if _serving():
            try:
                bound = _signatures[name].bind(*args, **kwargs)
                bound.apply_defaults()
                params = dict(bound.arguments)
                convert = _similarity_module._convert_to_tensor
                Q = convert(params.pop("queries_embeddings"))
                D = convert(params.pop("documents_embeddings"))
                q_mask, d_mask = (None if m is None else convert(m)
                                  for m in (params.pop("queries_mask", None), params.pop("documents_mask", None)))
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
        module = _similarity_module
        if pairwise:  # pair every query with each of its own N candidates
            Q = Q.repeat_interleave(n, dim=0)
            q_mask = None if q_mask is None else q_mask.repeat_interleave(n, dim=0)
            out = module.maxsim_pairwise(Q, folded, a_mask=q_mask, b_mask=folded_mask, **params)
            return out.reshape(groups, n)
        # column d * N + k is document d, slot k: ST's query-major layout
        return module.maxsim(Q, folded, a_mask=q_mask, b_mask=folded_mask, **params)

    return run


colbert_scores = _fold("colbert_scores", pairwise=False)
colbert_kd_scores = _fold("colbert_kd_scores", pairwise=True)

#: ``{name in util.similarity / scoring.colbert: adapter}``; wrapped as lookalikes by the patcher.
SIMILARITY_ADAPTERS = {
    "_maxsim_score_documents": score_documents,
    "_maxsim_score_pairs": score_pairs,
    "maxsim": maxsim,
    "maxsim_pairwise": maxsim_pairwise,
}
SCORING_ADAPTERS = {
    "colbert_scores": colbert_scores,
    "colbert_kd_scores": colbert_kd_scores,
}
