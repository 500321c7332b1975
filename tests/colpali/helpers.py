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
