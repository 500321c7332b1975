"""Score adapters: colpali-engine's scoring expressions on our ops, with colpali's semantics.

colpali passes no masks (zero-padded tokens score 0 and take part in the max), so none
are passed here.  Our ops return float32; colpali's own path returns the input dtype,
so every adapter casts back to it.
"""
from __future__ import annotations

import functools
from operator import attrgetter, itemgetter

import torch

from .._config import disabled, scores_backend
from ..ops.listed import plan_lists, score_lists

# COLPALI_SCORES_BACKEND, as colpali-engine >= 0.3.17 parses it (read on every call).
BACKEND_VAR = "COLPALI_SCORES_BACKEND"
VALID_BACKENDS = ("auto", "torch", "lik")


def use_original() -> bool:
    """True when a patched entry must run colpali's own code: ``LIK_DISABLE=1`` or
    ``COLPALI_SCORES_BACKEND=torch`` (``auto``, the default, and ``lik`` run ours; any other
    value raises colpali's ValueError)."""
    if disabled():
        return True
    value = scores_backend(BACKEND_VAR)
    if value not in VALID_BACKENDS:
        raise ValueError(f"{BACKEND_VAR} must be one of {VALID_BACKENDS}, got {value!r}.")
    return value == "torch"


def eligible(*tensors: torch.Tensor) -> bool:
    """Our ops serve these inputs exactly as colpali's einsum would: floating tensors of one
    dtype on one device, non-empty, same embedding dim.  Anything else runs the original
    code (which raises colpali's own error where it has one).  Each check maps a C-level
    getter over the inputs: ``score_multi_vector`` passes thousands of passages a call.  The
    loss heads pass two or three tensors, under ``torch.compile`` too, which cannot trace a
    C-level getter: a short argument list is checked one tensor at a time."""
    first = tensors[0]
    if len(tensors) <= _FEW:
        return first.is_floating_point() and all(
            isinstance(t, torch.Tensor) and t.dim() > 0 and t.dtype == first.dtype and t.device == first.device
            and t.numel() > 0 and t.shape[-1] == first.shape[-1] for t in tensors)
    if not all(issubclass(kind, torch.Tensor) for kind in set(map(type, tensors))):
        return False
    if set(map(_DTYPE, tensors)) != {first.dtype} or not first.is_floating_point():
        return False
    if set(map(_DEVICE, tensors)) != {first.device} or 0 in map(torch.Tensor.numel, tensors):
        return False
    return len(set(map(_LAST, map(_SHAPE, tensors)))) == 1


_FEW = 8        # up to this many inputs, eligible() checks them one by one
_DTYPE, _DEVICE, _SHAPE, _LAST = attrgetter("dtype"), attrgetter("device"), attrgetter("shape"), itemgetter(-1)


_OP_FOR_LAYOUT = {"cross": "maxsim", "pairs": "maxsim_pairs", "candidates": "maxsim"}


def _scored(layout: str, Q: torch.Tensor, D: torch.Tensor, smooth: bool = False, tau: float = 0.1):
    from .. import ops

    if smooth:
        return ops.smooth_maxsim(Q, D, tau=tau, layout=layout).to(Q.dtype), ops.served_by(Q, "smooth")
    return getattr(ops, _OP_FOR_LAYOUT[layout])(Q, D).to(Q.dtype), ops.served_by(Q)


# ``(scores in Q.dtype, path)`` of [B, Lq, d] x [C, Ld, d] -> [B, C] (inbatch), [B, Lq, d] x
# [B, Ld, d] -> [B] (pairs), [B, Lq, d] x [B, K, Ld, d] -> [B, K] in one launch (candidates)
inbatch = functools.partial(_scored, "cross")
pairs = functools.partial(_scored, "pairs")
candidates = functools.partial(_scored, "candidates")


def query_lengths(Q: torch.Tensor) -> torch.Tensor:
    """colpali's query length: rows whose first feature is non-zero."""
    return (Q[:, :, 0] != 0).sum(dim=1)


def multi_vector_lists(queries: list, passages: list, batch_size: int, device):
    """``score_multi_vector`` on lists with every passage read where it lies, or None where
    colpali's own loop must run: ``([n_q, n_p]`` float32 on CPU, path``).

    colpali right-pads each chunk of ``batch_size`` passages with zeros and scores them
    without masks, so a zero token takes part in the max of every passage shorter than the
    longest of its chunk (results depend on ``batch_size``, and must): such a passage is
    scored with the zero padding in its max (``kernels.triton.listed``).  Query padding adds
    exactly 0 to a sum.  Precision, as colpali's einsum computes it: each row's max rounded
    to the inputs' dtype (colpali rounds every similarity; rounding is monotone), the maxima
    summed in fp32 (exact for 16-bit maxima), the sum rounded to the dtype, then the float32
    cast -- colpali's scores bit for bit, but where a similarity lies within fp32
    accumulation error of a 16-bit rounding midpoint (one step of the grid, rare).  Equal
    scores stay equal: rankings match colpali's, ties included, under any deterministic
    sort.  Served where the Triton kernels run; elsewhere (a CPU) colpali's loop."""
    path, table = plan_lists(queries[0], torch.device(device), passages, [q.shape[0] for q in queries])
    if table is None or isinstance(table, str):
        return None
    # colpali's chunks of batch_size passages, each padded to its longest: on the device
    n_p = len(passages)
    n_chunks = -(-n_p // batch_size)
    chunked = torch.nn.functional.pad(table.lengths, (0, n_chunks * batch_size - n_p)).view(n_chunks, batch_size)
    pad = (chunked < chunked.amax(dim=1, keepdim=True)).view(-1)[:n_p]
    with torch.no_grad():   # every query against every passage: [n_q, n_p]
        scores = score_lists(queries, table.extra, table, None, pad, round_maxima=True)
    scores = scores.to(queries[0].dtype).cpu().to(torch.float32)
    return scores, path
