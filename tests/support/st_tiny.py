"""An offline tiny sentence-transformers 6.x MultiVectorEncoder and a few training steps.

The encoder is the random 2-layer BERT with an in-memory WordPiece vocabulary from
``tests/support/pylate_tiny.py`` (nothing is downloaded); on top of it a bias-free projection
to 16 dims, ST's ``MultiVectorMask`` (punctuation skiplist: holes inside documents) and
``Normalize``.  Also used by the training recipe's test and the GPU parity script.
"""
from __future__ import annotations

import os
import string

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from support import pylate_tiny  # noqa: E402  (offline tokenizer + BERT, shared with the PyLate tests)

TRIPLES = pylate_tiny.TRIPLES
save_tiny_encoder = pylate_tiny.save_tiny_encoder
parameters = pylate_tiny.parameters
max_param_diff = pylate_tiny.max_param_diff

LOSSES = ("mnrl", "cached_mnrl", "distill_kl_div", "margin_mse")


def st_major() -> int | None:
    """The installed sentence-transformers major version, read without importing it."""
    from importlib import metadata

    try:
        return int(metadata.version("sentence-transformers").split(".")[0])
    except Exception:  # noqa: BLE001 -- not installed, or an unparsable version
        return None


def load_encoder(path: str, seed: int = 0):
    """A ``MultiVectorEncoder`` over the saved BERT: projection seeded, skiplist = punctuation."""
    import torch
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask

    torch.manual_seed(seed)
    transformer = Transformer(path, query_length=8, document_length=24)
    dense = Dense(32, 16, bias=False, activation_function=None, module_input_name="token_embeddings")
    return MultiVectorEncoder(
        modules=[transformer, dense, MultiVectorMask(skiplist_words=list(string.punctuation)),
                 Normalize(module_input_name="token_embeddings")],
        device="cpu",
    )


def dataset(kind: str):
    from datasets import Dataset

    queries = [t[0] for t in TRIPLES]
    if kind in ("mnrl", "cached_mnrl"):
        return Dataset.from_dict({"query": queries, "positive": [t[1] for t in TRIPLES], "negative": [t[2] for t in TRIPLES]})
    if kind == "distill_kl_div":
        third = [TRIPLES[(i + 1) % len(TRIPLES)][1] for i in range(len(TRIPLES))]
        return Dataset.from_dict({
            "query": queries, "positive": [t[1] for t in TRIPLES], "negative": [t[2] for t in TRIPLES], "other": third,
            "label": [[0.9, 0.1, 0.3 + 0.05 * i] for i in range(len(TRIPLES))],
        })
    if kind == "margin_mse":
        return Dataset.from_dict({
            "query": queries, "positive": [t[1] for t in TRIPLES], "negative": [t[2] for t in TRIPLES],
            "label": [0.5 + 0.1 * i for i in range(len(TRIPLES))],
        })
    raise ValueError(kind)


def make_loss(kind: str, model):
    from sentence_transformers.multi_vector_encoder import losses

    if kind == "mnrl":
        return losses.MultiVectorMultipleNegativesRankingLoss(model)
    if kind == "cached_mnrl":
        return losses.CachedMultiVectorMultipleNegativesRankingLoss(model, mini_batch_size=2)
    if kind == "distill_kl_div":
        return losses.MultiVectorDistillKLDivLoss(model)
    if kind == "margin_mse":
        return losses.MultiVectorMarginMSELoss(model)
    raise ValueError(kind)


def train(model, loss, kind: str, out_dir: str, steps: int = 2) -> list[float]:
    """``steps`` optimiser steps with ``MultiVectorEncoderTrainer``; returns every loss value."""
    from sentence_transformers import MultiVectorEncoderTrainer, MultiVectorEncoderTrainingArguments

    values: list[float] = []
    hook = loss.register_forward_hook(lambda _m, _i, out: values.append(float(out.detach())))
    args = MultiVectorEncoderTrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=4, max_steps=steps, learning_rate=1e-3,
        report_to="none", use_cpu=True, save_strategy="no", logging_strategy="no", disable_tqdm=True,
        seed=0, dataloader_num_workers=0,
    )
    trainer = MultiVectorEncoderTrainer(model=model, args=args, train_dataset=dataset(kind), loss=loss)
    trainer.train()
    hook.remove()
    return values


def require_st6() -> None:
    """Skip the calling test module unless sentence-transformers 6.x is installed."""
    import pytest

    if st_major() != 6:
        pytest.skip("needs sentence-transformers 6.x (run ci/st6_env.sh)", allow_module_level=True)
