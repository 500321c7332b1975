"""Distil a dense teacher into a ColBERT model with PyLate's ``Distillation`` loss.

Each query comes with three candidate passages (its own and two from the same module)
scored by a teacher -- by default the bundled all-MiniLM-L6-v2 used as a plain
sentence-transformers bi-encoder (cosine similarity) -- and the student ColBERT learns
the teacher's score distribution (KL divergence).  Offline CPU default as in
``train_contrastive.py``; on a GPU pass ``--model``, ``--teacher`` and ``--batch-size``.
"""
from __future__ import annotations

import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402


def build(args, model, train_pairs):
    import torch
    from datasets import Dataset
    from pylate import losses
    from sentence_transformers import SentenceTransformer

    rng = random.Random(args.seed)
    rows = train_pairs[: args.batch_size * args.steps]
    by_module: dict[str, list[str]] = {}
    for p in train_pairs:
        by_module.setdefault(p["module"], []).append(p["passage"])
    candidates = []
    for p in rows:
        pool = [x for x in by_module[p["module"]] if x != p["passage"]] or [x["passage"] for x in train_pairs[:50]]
        candidates.append([p["passage"], *rng.sample(pool, k=min(2, len(pool)))] + [p["passage"]] * (2 - min(2, len(pool))))
    teacher = SentenceTransformer(args.teacher or args.model, device=args.device)
    with torch.no_grad():
        q = teacher.encode([p["query"] for p in rows], convert_to_tensor=True, normalize_embeddings=True)
        flat = teacher.encode([c for cs in candidates for c in cs], convert_to_tensor=True, normalize_embeddings=True)
    teacher_scores = torch.einsum("bh,bkh->bk", q, flat.view(len(rows), 3, -1)).float().cpu().tolist()
    del teacher
    dataset = Dataset.from_dict({"query": [p["query"] for p in rows], "documents": candidates, "scores": teacher_scores})
    return losses.Distillation(model=model), dataset


def extra(p):
    p.add_argument("--teacher", default=None, help="sentence-transformers teacher (default: the student's base model)")


if __name__ == "__main__":
    _common.main(__doc__.splitlines()[0], build, batch_size=8, steps=12, lr=5e-5, extra=extra)
