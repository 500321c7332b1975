"""The zero-code activation tests' subprocess: train a tiny offline model for two steps and
print the losses and the routing counts (none unless the start-up hook patched the host)."""
from __future__ import annotations


def training_script(tiny: str, load: str, kind: str) -> str:
    """Python source that trains ``support.<tiny>``'s model (built by its ``<load>``) with its
    ``kind`` loss; the tiny modules never import lik_plugins themselves."""
    return f"""
import json, os, sys, tempfile
from support import {tiny} as tiny
with tempfile.TemporaryDirectory() as tmp:
    encoder = tiny.save_tiny_encoder(os.path.join(tmp, "enc"))
    model = tiny.{load}(encoder)
    losses = tiny.train(model, tiny.make_loss("{kind}", model), "{kind}", os.path.join(tmp, "w"))
counts = sys.modules["lik_plugins"].routing_counts() if "lik_plugins" in sys.modules else {{}}
print(json.dumps({{"losses": losses, "counts": counts}}))
"""
