"""Shared test data: colpali-style zero-padded embeddings and a run-and-compare harness."""
from __future__ import annotations

import contextlib
import os

import torch

import lik_plugins


def padded(shape, n_pad, generator, dtype=torch.float32):
    """Raw embeddings ``E`` and the mask that zero-pads the last ``n_pad`` tokens of every
    sequence (varying per row, at least one token kept).  Models compute
    ``normalize(E) * mask`` — the gradient parity is taken w.r.t. ``E`` through that
    product, exactly as a model's parameters see it."""
    E = torch.randn(*shape, generator=generator, dtype=torch.float64)
    length = shape[-2]
    lead = shape[:-2]
    pads = torch.randint(0, n_pad + 1, lead, generator=generator)
    pads = pads.clamp(max=length - 1)
    mask = (torch.arange(length) < (length - pads).unsqueeze(-1)).to(torch.float64)
    return E.to(dtype), mask.to(dtype)


def embed(E, mask):
    return torch.nn.functional.normalize(E, dim=-1) * mask.unsqueeze(-1)


@contextlib.contextmanager
def env(**values):
    old = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def routed(entry: str) -> dict:
    return dict(lik_plugins.routing_counts().get(entry, {}))


def delta(before: dict, after: dict) -> dict:
    keys = set(before) | set(after)
    return {k: after.get(k, 0) - before.get(k, 0) for k in keys if after.get(k, 0) != before.get(k, 0)}


def loss_and_grads(head, raw, call):
    """Run ``call(head, *embedded)``; return the loss and the gradients w.r.t. the raw
    embeddings (``None`` entries for inputs not given)."""
    leaves = [None if r is None else r[0].detach().clone().requires_grad_() for r in raw]
    embedded = [None if r is None else embed(leaf, r[1]) for leaf, r in zip(leaves, raw)]
    loss = call(head, *embedded)
    loss.backward()
    return loss.detach(), [None if leaf is None else leaf.grad for leaf in leaves]


# --------------------------------------------------------------------------- tiny training setup
VOCAB, HIDDEN, DIM = 64, 32, 128


class TinyEncoder(torch.nn.Module):
    """A version-robust multi-vector encoder: embedding -> 1 transformer layer -> 128-d
    projection -> L2 norm -> zeroed pad rows (what every Col* model's forward does)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.layer = torch.nn.TransformerEncoderLayer(HIDDEN, 2, 64, dropout=0.0, batch_first=True)
        self.proj = torch.nn.Linear(HIDDEN, DIM)

    def forward(self, input_ids, attention_mask, **_):
        h = self.layer(self.embed(input_ids), src_key_padding_mask=attention_mask == 0)
        out = torch.nn.functional.normalize(self.proj(h), dim=-1)
        return out * attention_mask.unsqueeze(-1)


class TinyCollator:
    """Synthetic query/page token ids from a dataset index, right-padded with 0, with
    colpali's batch keys and the three prefix attributes its trainer reads."""

    query_prefix, pos_doc_prefix, neg_doc_prefix = "query_", "doc_", "neg_doc_"

    def __init__(self, n_neg: int = 0, lq: int = 6, ld: int = 12):
        self.n_neg, self.lq, self.ld = n_neg, lq, ld

    def _seq(self, seed: int, length: int):
        g = torch.Generator().manual_seed(seed)
        n = int(torch.randint(max(2, length // 2), length + 1, (1,), generator=g))
        ids = torch.zeros(length, dtype=torch.long)
        ids[:n] = torch.randint(1, VOCAB, (n,), generator=g)
        return ids, (ids != 0).long()

    def __call__(self, rows):
        out = {}
        idx = [int(r["idx"]) for r in rows]
        for key, length, salt in (("query_", self.lq, 0), ("doc_", self.ld, 1)):
            ids, mask = zip(*(self._seq(1000 * salt + i, length) for i in idx))
            out[key + "input_ids"], out[key + "attention_mask"] = torch.stack(ids), torch.stack(mask)
        if self.n_neg:
            ids, mask = zip(*(self._seq(5000 + 10 * i + k, self.ld) for i in idx for k in range(self.n_neg)))
            out["neg_doc_input_ids"] = torch.stack(ids).view(len(idx), self.n_neg, -1)
            out["neg_doc_attention_mask"] = torch.stack(mask).view(len(idx), self.n_neg, -1)
        return out


def train_tiny(loss_func, n_neg: int, tmpdir, steps: int = 2, batch: int = 4, ld: int = 12):
    """``steps`` ContrastiveTrainer steps (colpali 0.3.18 installed) on pages of ``ld``
    tokens; returns (losses, params)."""
    import datasets
    from transformers import TrainingArguments

    from colpali_engine.trainer.contrastive_trainer import ContrastiveTrainer

    torch.manual_seed(0)
    model = TinyEncoder()
    args = TrainingArguments(
        output_dir=str(tmpdir), per_device_train_batch_size=batch, max_steps=steps, report_to=[], use_cpu=True,
        save_strategy="no", logging_steps=1, learning_rate=1e-2, disable_tqdm=True, seed=0,
        # SGD: the updated weights then reflect the gradients themselves.  Adam would turn
        # the pure rounding noise of exactly-zero gradients (attention key biases) into
        # lr-sized steps in both runs, differently.
        optim="sgd",
    )
    trainer = ContrastiveTrainer(
        model=model, args=args, train_dataset=datasets.Dataset.from_dict({"idx": list(range(4 * batch))}),
        eval_dataset=None, data_collator=TinyCollator(n_neg, ld=ld), loss_func=loss_func, is_vision_model=False,
    )
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
