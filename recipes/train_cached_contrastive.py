"""Train a ColBERT model with PyLate's ``CachedContrastive`` loss (large batches, GradCache).

The batch is scored in query chunks and the encoder runs in mini-batches, so the batch
size is bounded by the scoring memory -- which ``lik_plugins`` shrinks.  Offline CPU
default as in ``train_contrastive.py``; on a GPU pass ``--model`` and a real
``--batch-size`` (e.g. 1024 with ``--mini-batch-size 64``).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402


def build(args, model, train_pairs):
    from pylate import losses

    dataset = _common.triplets(_common.with_hard_negatives(train_pairs, seed=args.seed))
    return losses.CachedContrastive(model=model, mini_batch_size=args.mini_batch_size), dataset


def extra(p):
    p.add_argument("--mini-batch-size", type=int, default=4, help="encoder mini-batch (and query chunk) size")


if __name__ == "__main__":
    _common.main(__doc__.splitlines()[0], build, batch_size=16, steps=10, lr=5e-5, extra=extra)
