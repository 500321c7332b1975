"""Train a ColBERT model with PyLate's in-batch ``Contrastive`` loss and one hard negative.

Runs offline on CPU in about a minute (bundled all-MiniLM-L6-v2, query/passage pairs
from the standard library's docstrings), once as plain PyLate and once with
``lik_plugins.patch_pylate()``, then prints the side-by-side (loss curves, step time,
peak memory, retrieval on held-out queries).

    python recipes/train_contrastive.py                       # CPU default
    python recipes/train_contrastive.py --model answerdotai/ModernBERT-base \\
        --batch-size 128 --steps 200 --document-length 300    # on a GPU
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402


def build(args, model, train_pairs):
    from pylate import losses

    dataset = _common.triplets(_common.with_hard_negatives(train_pairs, seed=args.seed))
    return losses.Contrastive(model=model, temperature=args.temperature), dataset


def extra(p):
    p.add_argument("--temperature", type=float, default=1.0)


if __name__ == "__main__":
    _common.main(__doc__.splitlines()[0], build, batch_size=8, steps=12, lr=5e-5, extra=extra)
