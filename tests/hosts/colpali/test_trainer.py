"""Real colpali-engine (installed release) ``ContrastiveTrainer`` steps on a tiny offline
model, every head, with and without negatives and smooth max: the patched run is routed
to our path, its losses and updated weights equal the unpatched run's; under
``LIK_DISABLE=1`` nothing is routed to us."""
from __future__ import annotations

import pytest

pytest.importorskip("colpali_engine", reason="colpali-engine is not installed (docs/install.md: colpali-engine beside your torch)")

import lik_plugins  # noqa: E402
from colpali_engine.loss import late_interaction_losses as L  # noqa: E402

from support.colpali_helpers import env, train_tiny  # noqa: E402

HEADS = [
    ("ColbertLoss", 0), ("ColbertPairwiseCELoss", 0), ("ColbertSigmoidLoss", 0),
    ("ColbertNegativeCELoss", 2), ("ColbertPairwiseNegativeCELoss", 2),
]


def _ours(counts, entry):
    return {p: n for p, n in counts.get(entry, {}).items() if p != "original"}


@pytest.mark.parametrize("smooth", [False, True], ids=["max", "smooth"])
@pytest.mark.parametrize("head,n_neg", HEADS)
def test_training_steps_match_unpatched(head, n_neg, smooth, tmp_path):
    make = lambda: getattr(L, head)(use_smooth_max=smooth)  # noqa: E731
    base_losses, base_params = train_tiny(make(), n_neg, tmp_path / "base")

    lik_plugins.patch_colpali_engine()
    lik_plugins.reset_routing_counts()
    losses, params = train_tiny(make(), n_neg, tmp_path / "patched")
    counts = lik_plugins.routing_counts()
    assert sum(_ours(counts, f"colpali.{head}").values()) == 2  # one call per step, both ours
    assert "original" not in counts[f"colpali.{head}"]
    if n_neg and head == "ColbertNegativeCELoss":
        assert sum(_ours(counts, "colpali.ColbertLoss").values()) == 2  # the in-batch term, once per step
    assert losses == pytest.approx(base_losses, rel=1e-5, abs=1e-6)
    for name, value in base_params.items():
        assert (params[name] - value).abs().max().item() < 1e-5, name


def test_disabled_routes_nothing(tmp_path):
    lik_plugins.patch_colpali_engine()
    base_losses, base_params = None, None
    with env(LIK_DISABLE="1"):
        lik_plugins.reset_routing_counts()
        losses, params = train_tiny(L.ColbertPairwiseNegativeCELoss(), 2, tmp_path / "off")
        counts = lik_plugins.routing_counts()
    assert all(set(paths) == {"original"} for entry, paths in counts.items() if entry.startswith("colpali."))
    assert counts["colpali.ColbertPairwiseNegativeCELoss"] == {"original": 2}
    assert not any(not e.startswith("colpali.") for e in counts), counts  # no op was reached
    lik_plugins.unpatch_colpali_engine()
    base_losses, base_params = train_tiny(L.ColbertPairwiseNegativeCELoss(), 2, tmp_path / "base")
    assert losses == base_losses
    assert all((params[k] == v).all() for k, v in base_params.items())
