"""PyLate 1.3.3 (scores.py layout, default-argument capture), 1.4.0 and 1.5.0 (first
colbert.py layout, no backend=), each installed side by side and run in a subprocess."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("pylate.scores", reason="PyLate is not installed (docs/install.md: PyLate beside your torch)")

from support import pylate_releases  # noqa: E402

OURS = {"triton", "metal", "torch-chunked", "reference"}

# routed scoring calls for 2 steps, batch 4, one hard negative, CachedContrastive mini-batch 2
EXPECTED = {
    "1.3.3": {"contrastive": ("pylate.colbert_scores", 4), "cached": ("pylate.colbert_scores", 16)},
    "1.4.0": {"contrastive": ("pylate.colbert_scores", 4), "cached": ("pylate.colbert_scores", 16)},
    "1.5.0": {"contrastive": ("pylate.ColBERTScores", 2), "cached": ("pylate.ColBERTScores", 4)},
}


@pytest.mark.parametrize("version", sorted(pylate_releases.REQUIREMENTS))
def test_release(version, tmp_path):
    try:
        result = pylate_releases.run(version, str(tmp_path / "out.json"))
    except pylate_releases.InstallError as exc:
        if "No matching distribution" in str(exc) or "Could not find" in str(exc) or "network" in str(exc).lower():
            pytest.skip(f"PyLate {version} cannot be downloaded here: {exc}")
        raise
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads((tmp_path / "out.json").read_text())
    assert summary["version"] == version
    for kind, run in summary["losses"].items():
        ours = {k: v for k, v in run["counts"].items() if k.startswith("pylate.")}
        assert ours and all(set(p) <= OURS for p in ours.values()), (kind, run["counts"])
        assert run["patched"] == pytest.approx(run["vanilla"], abs=1e-5)
        assert run["param_diff"] < 1e-4 and run["params_moved"] > 30
        assert all(set(p) == {"original"} for p in run["disabled_counts"].values()), run["disabled_counts"]
        assert run["disabled"] == run["vanilla"]
    for kind, (entry, calls) in EXPECTED[version].items():
        assert summary["losses"][kind]["counts"][entry] == {"torch-chunked": calls}
    # Distillation binds colbert_kd_scores as a default argument in every release
    assert summary["losses"]["distillation"]["counts"]["pylate.colbert_kd_scores"] == {"torch-chunked": 2}
    counts = summary["inference_counts"]
    # similarity; rank.rerank on a CPU is PyLate's own loop (faster there), its 3 colbert_scores too
    assert counts["pylate.colbert_scores"] == {"torch-chunked": 1, "original": 3}
    assert counts["pylate.rerank"] == {"original": 1}
    assert counts["pylate.colbert_scores_pairwise"] == {"torch-chunked": 2}
    assert counts["pylate.colbert_kd_scores"] == {"torch-chunked": 1}
    assert summary["inference_patched"]["rerank"] == summary["inference_vanilla"]["rerank"]
    assert summary["inference_patched"]["triplet"] == summary["inference_vanilla"]["triplet"]
    # the backend variable keeps its meanings on releases that predate it
    for how in ("env", "arg"):
        backend = {k.split(":")[1]: v for k, v in summary["backend"].items() if k.startswith(how)}
        assert backend == {"auto": ["torch-chunked"], "lik": ["torch-chunked"], "torch": ["original"],
                           "flash": "RuntimeError", "bogus": "ValueError"}, (how, backend)
