"""``recipes/train_sentence_transformers.py`` runs end to end (short): identical loss curves, routed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support import st_tiny

st_tiny.require_st6()

RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "train_sentence_transformers.py"


def test_recipe(tmp_path):
    out = tmp_path / "runs.json"
    env = {k: v for k, v in os.environ.items() if k not in ("LIK_DISABLE", "LIK_PATCH", "LIK_BACKEND")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(RECIPE.parents[1]))
    cmd = [sys.executable, str(RECIPE), "--steps", "3", "--batch-size", "4", "--eval-queries", "16", "--threads", "1",
           "--json", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loss curves: 3 steps" in proc.stdout
    runs = json.loads(out.read_text())
    vanilla, patched = runs["vanilla"], runs["patched"]
    assert len(vanilla["losses"]) == 3 and patched["losses"] == pytest.approx(vanilla["losses"], abs=1e-5)
    assert patched["accuracy"] == pytest.approx(vanilla["accuracy"])
    assert vanilla["routing"] == {}
    assert set(patched["routing"]["sentence_transformers.maxsim"]) <= {"triton", "torch-chunked", "reference"}
