"""``benchmarks/multi_gpu.py``, the NCCL script, run on two gloo CPU ranks with tiny configs:
what it reports on the GPUs is what this checks on CPU.

* fp32 parity crosses the ranks: patched loss and all-reduced gradient equal the unpatched
  oracle on every rank (the gathered gradient, the per-rank labels and the loss scaling
  all pass through our op);
* the patched runs were routed into our op on every rank, the vanilla ones were not;
* bf16: the patched step is no further from the fp32 oracle than the host's own bf16 step
  (with slack: both round at bf16, 12-18 % apart on this tiny model);
* the scaling rows exist for both variants, with one median per round.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pylate")
torch = pytest.importorskip("torch")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "multi_gpu.py"
OURS = {"triton", "metal", "torch-chunked", "reference"}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("multi_gpu")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("LIK_DISABLE", None)
    done = subprocess.run([sys.executable, str(SCRIPT), str(out), "--device", "cpu", "--tiny", "--models", "colbert",
                           "--rounds", "2", "--steps", "1", "--max-batch", "4"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "multi_gpu.md").read_text().count("| 4 |") == 1
    return json.loads((out / "multi_gpu.json").read_text())


def test_two_gloo_ranks(report):
    assert report["meta"]["world_size"] == 2 and report["meta"]["backend"] == "gloo"
    assert report["meta"]["nccl_nvls_enable"] == "0"


def test_fp32_patched_equals_the_oracle_on_every_rank(report):
    ranks = report["models"]["colbert"]["parity"]["ranks"]
    assert len(ranks) == 2
    for r in ranks:
        assert r["loss"]["fp32_patched"] == pytest.approx(r["loss"]["fp32_vanilla"], rel=1e-5)
        assert r["grad_rel_err"]["fp32_patched_vs_oracle"] < 1e-4
    # different data on each rank: the two ranks' losses differ
    assert ranks[0]["loss"]["fp32_vanilla"] != ranks[1]["loss"]["fp32_vanilla"]


def test_every_patched_rank_is_routed_into_our_op(report):
    for r in report["models"]["colbert"]["parity"]["ranks"]:
        for key in ("routing_patched", "routing_fp32_patched"):
            assert set(r[key].get("pylate.ColBERTScores", {})) & OURS, r[key]
        assert not r["routing_vanilla"].get("pylate.ColBERTScores"), r["routing_vanilla"]


def test_bf16_patched_is_no_further_from_the_oracle_than_the_host(report):
    for r in report["models"]["colbert"]["parity"]["ranks"]:
        err = r["grad_rel_err"]
        assert err["bf16_patched_vs_oracle"] <= 1.5 * err["bf16_vanilla_vs_oracle"] + 0.02, err


def test_scaling_rows_have_one_median_per_round(report):
    rows = report["models"]["colbert"]["scaling"]
    assert {r["variant"] for r in rows} == {"vanilla", "patched"}
    for row in rows:
        assert row["status"] == "ok" and len(row["round_ms"]) == 2 and row["step_ms"] > 0
