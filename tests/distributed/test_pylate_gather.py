"""PyLate ``Contrastive`` / ``CachedContrastive`` with ``gather_across_devices=True`` on a
real two-process gloo job: patched training is routed into our op on every rank and
trains exactly like unpatched PyLate; ``LIK_DISABLE=1`` routes nothing.

What gathering means in PyLate 1.6.0 (``pylate/losses/contrastive.py``,
``cached_contrastive.py``, ``utils/distributed.py``), and so what parity must preserve:

* only the documents are gathered, with ``torch.distributed.nn.all_gather`` (autograd:
  its backward *sums* every rank's gradient for a document into its owner, through
  all-to-all on gloo, reduce-scatter on NCCL); queries stay local, masks are gathered
  without gradients.  Each rank scores its ``B`` queries against ``W*B`` documents per
  group: scores ``[B, W*B*N]``, query-major.
* the label of local query ``i`` is ``(rank*B + i)*N``;
* the loss is multiplied by the world size ``W``.  DDP then averages gradients over ranks,
  so the applied gradient is ``W`` times the single-process gradient of the same global
  batch, and the per-rank loss is ``W`` times its local mean cross-entropy
  (``sum_r loss_r / W**2`` is the global mean) -- checked below on a direct step.  That is
  PyLate's behaviour, not ours; parity keeps it.

Our op replaces only ``ColBERTScores`` (one fused call over the ``W*B*N`` gathered
documents); the gather, labels, scaling and DDP reduction are PyLate's and the trainer's
and run unchanged, so patched and unpatched runs see identical inputs at every step up to
the op's rounding.  Tolerances: scores are fp32 sums of ``Lq = 8`` maxima of dot products
of unit vectors (|score| <= 8); the chunked path sums them in another order, ~1e-6
relative, so the losses agree to 1e-5 relative.  Two AdamW steps at lr 1e-3 move weights by
~1e-3; a bound of 2e-5 (2 % of one step) admits rounding but not a changed gradient.  The
kill-switch run executes PyLate's own code and must be bit-identical.
"""
from __future__ import annotations

from pathlib import Path

from support.dist_launch import assert_gloo_job, require_distributed, run_ranks

require_distributed("pylate", "sentence_transformers", "accelerate")

import pytest  # noqa: E402
import torch  # noqa: E402

from support import pylate_tiny as tiny  # noqa: E402

HERE = Path(__file__).resolve().parent

OURS = {"triton", "metal", "torch-chunked", "reference"}
WORLD = 2
KINDS = {  # kind: (score calls per rank over 2 steps, shape of each score matrix)
    "contrastive": (2, [4, WORLD * 4 * 2]),  # 4 local queries x (2 ranks x 4 docs x 2 groups)
    "cached": (4, [2, WORLD * 4 * 2]),  # query chunks of mini_batch_size 2
}


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    encoder = tiny.save_tiny_encoder(str(tmp_path_factory.mktemp("encoder")))
    out = tmp_path_factory.mktemp("pylate_gather")
    ranks = run_ranks(HERE / "pylate_gather_worker.py", out, [encoder], world_size=WORLD, timeout=300)
    params = [torch.load(out / f"params{r}.pt") for r in range(WORLD)]
    return ranks, params


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def test_the_job_ran_on_gloo_with_two_ranks(job):
    assert_gloo_job(job[0], WORLD)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_rank_scores_the_gathered_documents(job, kind):
    calls, shape = KINDS[kind]
    for r in job[0]:
        for mode in ("vanilla", "patched", "disabled"):
            assert r[f"{kind}/{mode}"]["shapes"] == [shape] * calls, (r["rank"], mode)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_rank_is_routed_into_our_op(job, kind):
    calls, _ = KINDS[kind]
    for r in job[0]:
        vanilla, patched = r[f"{kind}/vanilla"]["counts"], r[f"{kind}/patched"]["counts"]
        assert vanilla == {}, vanilla
        entry = patched.get("pylate.ColBERTScores", {})
        assert set(entry) <= OURS and sum(entry.values()) == calls, (r["rank"], patched)
        assert all(set(paths) <= OURS for paths in patched.values()), patched


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_patched_training_matches_vanilla_on_every_rank(job, kind):
    ranks, params = job
    for r, p in zip(ranks, params):
        vanilla, patched = r[f"{kind}/vanilla"]["losses"], r[f"{kind}/patched"]["losses"]
        assert len(vanilla) == 2
        assert patched == pytest.approx(vanilla, rel=1e-5, abs=1e-6)
        moved = sum(int(not torch.equal(p["initial"][k], p[f"{kind}/vanilla"][k])) for k in p["initial"])
        assert moved > 30  # training really changed the weights...
        assert _max_diff(p[f"{kind}/vanilla"], p[f"{kind}/patched"]) < 2e-5  # ...and identically
    # different data per rank (the losses differ) but one model (DDP kept the weights in sync)
    assert ranks[0][f"{kind}/vanilla"]["losses"] != ranks[1][f"{kind}/vanilla"]["losses"]
    for mode in ("vanilla", "patched", "disabled"):
        assert _max_diff(params[0][f"{kind}/{mode}"], params[1][f"{kind}/{mode}"]) == 0.0, mode


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_kill_switch_routes_nothing(job, kind):
    ranks, params = job
    for r, p in zip(ranks, params):
        disabled = r[f"{kind}/disabled"]
        assert disabled["counts"], "the patched entries were not even called"
        for entry, paths in disabled["counts"].items():
            assert set(paths) == {"original"}, (r["rank"], entry, paths)
        assert disabled["losses"] == r[f"{kind}/vanilla"]["losses"]  # PyLate's own code
        assert _max_diff(p[f"{kind}/vanilla"], p[f"{kind}/disabled"]) == 0.0


def test_gathered_step_is_world_size_times_the_full_batch_step(job):
    """PyLate's semantics (host facts the parity has to keep): summed over ranks, the
    gathered losses are ``W**2`` times the single-process mean over the global batch and
    the gradients ``W**2`` times its gradient (DDP divides by ``W``: ``W`` times)."""
    ranks, params = job
    for r, p in zip(ranks, params):
        for mode in ("vanilla", "patched"):
            step = r[f"direct/{mode}"]
            assert step["loss_sum"] / WORLD**2 == pytest.approx(step["full_loss"], rel=1e-5)
            torch.testing.assert_close(
                p[f"direct/{mode}/grad_sum"] / WORLD, WORLD * p[f"direct/{mode}/full_grad"], rtol=1e-4, atol=1e-5
            )
        assert set(r["direct/patched"]["counts"]["pylate.ColBERTScores"]) <= OURS
        assert r["direct/vanilla"]["counts"] == {}
        torch.testing.assert_close(
            p["direct/patched/grad_sum"], p["direct/vanilla/grad_sum"], rtol=1e-5, atol=1e-6
        )
