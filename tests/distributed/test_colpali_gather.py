"""colpali-engine's loss heads on pages gathered across a real two-process gloo job (the
``ContrastiveTrainer``'s own gather and ``offset``): patched training is routed into our
op on every rank and trains exactly like unpatched colpali; ``LIK_DISABLE=1`` routes
nothing.

What gathering means in colpali-engine 0.3.18 (``trainer/contrastive_trainer.py``,
``loss/late_interaction_losses.py``), and so what parity must preserve:

* with more than one process, the trainer left-pads the page embeddings with zero tokens
  to the longest page length over ranks (``pad_across_processes(..., pad_first=True)``),
  all-gathers them with gradients (``torch.distributed.nn.all_gather``: the backward sums
  every rank's gradient for a page into its owner) and calls the head with
  ``offset = rank * B``; explicit negatives stay local;
* the in-batch heads score ``[B, W*B]``; the positive of local query ``i`` is column
  ``offset + i`` (``ColbertLoss`` labels, ``ColbertPairwiseCELoss`` ``diagonal(offset)``);
  the negative heads take their positives as pairs from ``D[offset : offset + B]``;
* no masks: the zero tokens (front padding and the model's own masked rows) score 0 and
  take part in the max;
* the loss is not rescaled; DDP averages gradients over ranks.

Our heads replace only the score computations; colpali's gather, offset, normalisation,
temperature and the trainer run unchanged.  ``ColbertSigmoidLoss`` raises on gathered
pages in colpali itself (it builds a ``B*B`` positive mask for a ``B*W*B`` score vector);
the patch hands such calls to colpali's own forward, so the same error comes back.

On gloo the unpatched run needs a torch fix first (explained in
``colpali_gather_worker.py``): torch 2.13 scrambles a permuted gradient in the all-gather
backward, and colpali's einsum produces one.  The worker measures that on a direct call,
then applies the fix to every arm alike.

Tolerances: scores are fp32 sums over 6 query tokens of maxima of unit-vector dot products;
our chunked path rounds differently, ~1e-6 relative, so losses agree to 1e-5 relative.
Two SGD steps at lr 1e-2 move weights by ~1e-3..1e-2; gradients equal to ~1e-6 relative
give weights equal to ~1e-7, bound 1e-5.  The kill-switch run is colpali's own code:
bit-identical.
"""
from __future__ import annotations

from pathlib import Path

from support.dist_launch import assert_gloo_job, require_distributed, run_ranks

require_distributed("colpali_engine", "datasets", "accelerate")

import pytest  # noqa: E402
import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
WORLD, BATCH = 2, 4
HEADS = {  # result key: (class, inner head reached through in_batch_term_weight or None)
    "ColbertLoss": ("ColbertLoss", None),
    "ColbertLoss-smooth": ("ColbertLoss", None),
    "ColbertPairwiseCELoss": ("ColbertPairwiseCELoss", None),
    "ColbertNegativeCELoss": ("ColbertNegativeCELoss", "ColbertLoss"),
    "ColbertPairwiseNegativeCELoss": ("ColbertPairwiseNegativeCELoss", "ColbertPairwiseCELoss"),
}


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("colpali_gather")
    ranks = run_ranks(HERE / "colpali_gather_worker.py", out, world_size=WORLD, timeout=300)
    params = [torch.load(out / f"params{r}.pt") for r in range(WORLD)]
    return ranks, params


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _ours(paths: dict) -> int:
    return sum(n for p, n in paths.items() if p != "original")


def test_the_job_ran_on_gloo_with_two_ranks(job):
    assert_gloo_job(job[0], WORLD)


@pytest.mark.parametrize("key", sorted(HEADS))
def test_every_head_call_gets_the_gathered_pages_and_its_offset(job, key):
    for r in job[0]:
        for mode in ("vanilla", "patched", "disabled"):
            calls = r[f"{key}/{mode}"]["calls"]
            assert len(calls) == 2, (r["rank"], mode)
            for call in calls:
                assert call["q"][0] == BATCH and call["d"][0] == WORLD * BATCH
                assert call["d"][1] == 15  # rank 0's 12-token pages were padded to rank 1's 15
                assert call["offset"] == r["rank"] * BATCH
                assert call["zero_tokens"] >= BATCH * 3  # the front padding at least


@pytest.mark.parametrize("key", sorted(HEADS))
def test_every_rank_is_routed_into_our_op(job, key):
    head, inner = HEADS[key]
    for r in job[0]:
        assert r[f"{key}/vanilla"]["counts"] == {}
        counts = r[f"{key}/patched"]["counts"]
        assert _ours(counts[f"colpali.{head}"]) == 2 and "original" not in counts[f"colpali.{head}"], counts
        if inner:
            assert _ours(counts[f"colpali.{inner}"]) == 2 and "original" not in counts[f"colpali.{inner}"], counts
        assert all("original" not in paths for paths in counts.values()), counts


@pytest.mark.parametrize("key", sorted(HEADS))
def test_patched_training_matches_vanilla_on_every_rank(job, key):
    ranks, params = job
    for r, p in zip(ranks, params):
        vanilla, patched = r[f"{key}/vanilla"]["losses"], r[f"{key}/patched"]["losses"]
        assert patched == pytest.approx(vanilla, rel=1e-5, abs=1e-6), r["rank"]
        assert _max_diff(p[f"{key}/vanilla"], p[f"{key}/patched"]) < 1e-5
        assert vanilla[1] != vanilla[0]  # the first step changed the model
    assert ranks[0][f"{key}/vanilla"]["losses"] != ranks[1][f"{key}/vanilla"]["losses"]  # different data
    for mode in ("vanilla", "patched", "disabled"):
        assert _max_diff(params[0][f"{key}/{mode}"], params[1][f"{key}/{mode}"]) == 0.0, mode  # DDP in sync


@pytest.mark.parametrize("key", sorted(HEADS))
def test_kill_switch_routes_nothing(job, key):
    ranks, params = job
    for r, p in zip(ranks, params):
        disabled = r[f"{key}/disabled"]
        assert disabled["counts"], "the patched entries were not even called"
        for entry, paths in disabled["counts"].items():
            assert set(paths) == {"original"}, (r["rank"], entry, paths)
        assert disabled["losses"] == r[f"{key}/vanilla"]["losses"]
        assert _max_diff(p[f"{key}/vanilla"], p[f"{key}/disabled"]) == 0.0


def test_sigmoid_head_keeps_colpalis_own_error_on_gathered_pages(job):
    for r in job[0]:
        vanilla, patched = r["sigmoid/vanilla"], r["sigmoid/patched"]
        assert vanilla["outcome"] != "no error"
        assert patched["outcome"] == vanilla["outcome"]
        assert patched["counts"]["colpali.ColbertSigmoidLoss"] == {"original": 1}


def test_page_gradients_through_the_gather_are_the_sum_over_ranks(job):
    """Our backward's page gradient reaches its owner rank intact, with or without the
    torch/gloo workaround; with it, colpali's own does too (the parity baseline)."""
    for r in job[0]:
        for check in ("gather_gradient_unfixed", "gather_gradient_fixed"):
            patched = r[check]["patched"]
            assert patched["error"] <= 1e-6 * patched["scale"], (r["rank"], check, patched)
        vanilla = r["gather_gradient_fixed"]["vanilla"]
        assert vanilla["error"] <= 1e-6 * vanilla["scale"], (r["rank"], vanilla)
