"""colpali-engine's loss heads with their scores on our ops.

Each head keeps everything colpali does around the scores — normalisation by query
length (through the instance's own ``_apply_normalization``, prints included), the
temperature, ``offset`` for multi-GPU gathers, positive-aware filtering (in place on
the scores), ``in_batch_term_weight`` (through the instance's own, patched, inner head)
— and only replaces the einsum/max/sum that produced the scores.

A head implementation returns ``(loss, path)``, or ``None`` when the inputs are not
ones it serves exactly (the patcher then runs the original ``forward``).

Generations (see ``Generation``): ``legacy`` is 0.3.10 (plain modules, no offset, hard
max through ``.max``, ValueError on out-of-range normalised scores); from 0.3.11 the
heads derive from ``ColbertModule``; ``neg_4d`` (0.3.13+) means explicit negatives are
``[B, n_neg, Ld, d]`` scored per candidate (before: one ``[B, Ld, d]`` negative);
``sigmoid_sign`` is +1 on 0.3.13 (its sign bug) and -1 from 0.3.14.
"""
from __future__ import annotations

from dataclasses import dataclass
import functools

import torch
import torch.nn.functional as F

from . import _scores as sc


@dataclass(frozen=True)
class Generation:
    name: str
    legacy: bool
    neg_4d: bool
    sigmoid_sign: float
    dispatcher: bool  # colpali >= 0.3.17: utils.maxsim + _lik_backend + _inbatch_scores


def _smooth(self) -> bool:
    return bool(getattr(self, "use_smooth_max", False))


def _tau(self) -> float:
    return float(getattr(self, "tau", 0.1))


def _ok_inbatch(self, Q, D) -> bool:
    if not (torch.is_tensor(Q) and torch.is_tensor(D) and Q.dim() == 3 and D.dim() == 3):
        return False
    if _smooth(self) and not _tau(self) > 0:
        return False
    return sc.eligible(Q, D)


# --------------------------------------------------------------------------- 0.3.11+
def inbatch_scores(self, Q, D):
    """``ColbertModule._inbatch_scores`` (0.3.17+) and the in-batch score of every
    generation from 0.3.11: raw MaxSim (or smooth max), then ``/ len`` if normalising."""
    S, path = sc.inbatch(Q, D, _smooth(self), _tau(self))
    if self.normalize_scores:
        S = self._apply_normalization(S, sc.query_lengths(Q))
    return S, path


def _inbatch_prologue(self, a):
    Q, D, offset = a["query_embeddings"], a["doc_embeddings"], a.get("offset", 0)
    S, path = inbatch_scores(self, Q, D)
    _, pos_idx = self._get_idx(S.size(0), offset, S.device)
    if self.pos_aware_negative_filtering:
        self._filter_high_negatives(S, pos_idx)
    return S, pos_idx, offset, path


def colbert_loss(self, a, gen: Generation):
    if not _ok_inbatch(self, a["query_embeddings"], a["doc_embeddings"]):
        return None
    S, pos_idx, _, path = _inbatch_prologue(self, a)
    return self.ce_loss(S / self.temperature, pos_idx), path


def pairwise_ce_loss(self, a, gen: Generation):
    Q, D = a["query_embeddings"], a["doc_embeddings"]
    if not _ok_inbatch(self, Q, D) or D.size(0) < 2:
        return None
    S, _, offset, path = _inbatch_prologue(self, a)
    pos = S.diagonal(offset=offset)
    top2 = S.topk(2, dim=1).values
    neg = torch.where(top2[:, 0] == pos, top2[:, 1], top2[:, 0])
    return F.softplus((neg - pos) / self.temperature).mean(), path


def sigmoid_loss(self, a, gen: Generation):
    Q, D = a["query_embeddings"], a["doc_embeddings"]
    if not _ok_inbatch(self, Q, D) or a.get("offset", 0) != 0 or D.size(0) != Q.size(0):
        return None  # colpali's flat indexing assumes a square [B, B]; let it raise its own error
    S, pos_idx, _, path = _inbatch_prologue(self, a)
    batch_size = S.size(0)
    pos_mask = -torch.ones(batch_size * batch_size, device=S.device)
    pos_mask[pos_idx * (batch_size + 1)] = 1.0
    flat = S.reshape(-1) / self.temperature
    return F.softplus(gen.sigmoid_sign * flat * pos_mask).mean(), path   # times +1 or -1: exact


def _negative_scores(self, a, gen: Generation, pos_rows: str):
    """``(pos [B], neg [B, n_neg] or [B], path)`` or ``None``: the positive term as pairs,
    the explicit negatives as per-query candidates (one launch)."""
    Q, D, N, offset = a["query_embeddings"], a["doc_embeddings"], a["neg_doc_embeddings"], a.get("offset", 0)
    if not (_ok_inbatch(self, Q, D) and torch.is_tensor(N)) or N.dim() != (4 if gen.neg_4d else 3) \
            or N.size(0) != Q.size(0):
        return None
    if gen.neg_4d:
        n_rows = N.size(0) if pos_rows == "neg" else Q.size(0)
        D_pos = D[offset : offset + n_rows]
    else:
        D_pos = D  # 0.3.11-12 score the positives against D unsliced (correct only for C == B)
    if D_pos.size(0) != Q.size(0) or not sc.eligible(Q, D_pos, N):
        return None
    smooth, tau = _smooth(self), _tau(self)
    pos, path = sc.pairs(Q, D_pos, smooth, tau)
    neg, _ = (sc.candidates if gen.neg_4d else sc.pairs)(Q, N, smooth, tau)
    if self.normalize_scores:
        lengths = sc.query_lengths(Q)
        pos = self._apply_normalization(pos, lengths)
        neg = self._apply_normalization(neg, lengths)
    return pos, neg, path


def _negative_ce(self, a, gen: Generation, pos_rows: str, inner: str):
    """The two negative-CE heads: softplus of (negative - positive) over the temperature, plus
    the in-batch term of the head's ``inner`` loss (read only when it is weighted in)."""
    got = _negative_scores(self, a, gen, pos_rows=pos_rows)
    if got is None:
        return None
    pos, neg, path = got
    if gen.neg_4d:
        pos = pos.unsqueeze(1)
    loss = F.softplus((neg - pos) / self.temperature).mean()
    w = self.in_batch_term_weight
    if w > 0:
        loss_ib = getattr(self, inner)(a["query_embeddings"], a["doc_embeddings"], a.get("offset", 0))
        loss = loss * (1 - w) + loss_ib * w
    return loss, path


negative_ce_loss = functools.partial(_negative_ce, pos_rows="neg", inner="inner_loss")
pairwise_negative_ce_loss = functools.partial(_negative_ce, pos_rows="query", inner="inner_pairwise")


# --------------------------------------------------------------------------- 0.3.10
def _legacy_pairwise_term(S):
    pos = S.diagonal()
    neg = (S - torch.eye(S.shape[0], device=S.device) * 1e6).max(dim=1)[0]
    return F.softplus(neg - pos).mean()


def _legacy_ce_term(self, Q, D):
    """0.3.10's in-batch cross-entropy (the positives on the diagonal) and its path."""
    S, path = sc.inbatch(Q, D)
    if self.normalize_scores:
        S = S / sc.query_lengths(Q).unsqueeze(-1)
        if not (S >= 0).all().item() or not (S <= 1).all().item():
            raise ValueError("Scores must be between 0 and 1 after normalization")
    return self.ce_loss(S / self.temperature, torch.arange(S.shape[0], device=S.device)), path


def legacy_colbert_loss(self, a, gen: Generation):
    Q, D = a["query_embeddings"], a["doc_embeddings"]
    if not _ok_inbatch(self, Q, D):
        return None
    return _legacy_ce_term(self, Q, D)


def legacy_pairwise_ce_loss(self, a, gen: Generation):
    Q, D = a["query_embeddings"], a["doc_embeddings"]
    if not _ok_inbatch(self, Q, D):
        return None
    S, path = sc.inbatch(Q, D)
    return _legacy_pairwise_term(S), path


def _legacy_pos_neg(a):
    Q, D, N = a["query_embeddings"], a["doc_embeddings"], a["neg_doc_embeddings"]
    if not all(torch.is_tensor(t) and t.dim() == 3 for t in (Q, D, N)):
        return None
    if not (Q.size(0) == D.size(0) == N.size(0)) or not sc.eligible(Q, D, N):
        return None
    pos, path = sc.pairs(Q, D)
    neg, _ = sc.pairs(Q, N)
    return pos, neg, path


def legacy_negative_ce_loss(self, a, gen: Generation):
    got = _legacy_pos_neg(a)
    if got is None:
        return None
    pos, neg, path = got
    loss = F.softplus(neg / self.temperature - pos / self.temperature).mean()
    if self.in_batch_term:
        loss += _legacy_ce_term(self, a["query_embeddings"], a["doc_embeddings"])[0]
    return loss / 2, path


def legacy_pairwise_negative_ce_loss(self, a, gen: Generation):
    got = _legacy_pos_neg(a)
    if got is None:
        return None
    pos, neg, path = got
    loss = F.softplus(neg - pos).mean()
    if self.in_batch_term:
        S, _ = sc.inbatch(a["query_embeddings"], a["doc_embeddings"])
        loss += _legacy_pairwise_term(S)
    return loss / 2, path


HEADS = {
    # class name: (0.3.11+ implementation, 0.3.10 implementation)
    "ColbertLoss": (colbert_loss, legacy_colbert_loss),
    "ColbertPairwiseCELoss": (pairwise_ce_loss, legacy_pairwise_ce_loss),
    "ColbertSigmoidLoss": (sigmoid_loss, None),
    "ColbertNegativeCELoss": (negative_ce_loss, legacy_negative_ce_loss),
    "ColbertPairwiseNegativeCELoss": (pairwise_negative_ce_loss, legacy_pairwise_negative_ce_loss),
}
