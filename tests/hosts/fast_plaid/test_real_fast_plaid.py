"""The real fast-plaid on the CPU: an index it creates, searched by fast-plaid alone and then
through ``patch_fast_plaid()`` (the kernels under Triton's interpreter), the same top-k ids.

Each release named in ``FAST_PLAID_RELEASES`` (``os.pathsep``-separated: ``installed`` for the
one in site-packages, or a folder holding another release's ``fast_plaid``) is loaded in turn
(``ci/fastplaid_env.sh``: 1.7.0 installed, 1.4.6 beside it).  Without fast-plaid every test
here skips: it pins its own torch, so only that environment has it.
"""
from __future__ import annotations

import inspect
import json
import os
import shutil
import sys

import numpy as np
import pytest
import torch

import lik_plugins
from lik_plugins.fast_plaid import patch_fast_plaid, unpatch_fast_plaid
from lik_plugins.fast_plaid._files import index_files

RELEASES = os.environ.get("FAST_PLAID_RELEASES", "installed").split(os.pathsep)
DIM = 32
SEARCH = dict(top_k=5, n_ivf_probe=4, n_full_scores=64, show_progress=False)
# fast-plaid's CPU ops round differently from the CUDA roundings ours reproduces: a score may
# sit an fp16 step or two away (scores here are below 8: a step is at most 2**-8)
SCORE_TOL = 2.0 ** -7


def _forget_fast_plaid() -> None:
    for name in [n for n in sys.modules if n == "fast_plaid" or n.startswith("fast_plaid.")]:
        del sys.modules[name]


@pytest.fixture(scope="module", params=RELEASES)
def release(request):
    """``fast_plaid.search`` of one release; unpatched and forgotten afterwards."""
    folder = None if request.param == "installed" else request.param
    _forget_fast_plaid()
    if folder:
        sys.path.insert(0, folder)
    try:
        search = pytest.importorskip("fast_plaid.search", reason="fast-plaid is not installed (ci/fastplaid_env.sh)")
        yield search
    finally:
        unpatch_fast_plaid()
        _forget_fast_plaid()
        if folder:
            sys.path.remove(folder)


def _unit(x):
    return torch.nn.functional.normalize(x, dim=-1)


def _corpus(seed: int = 0):
    """Documents around 8 topics, and queries near them (scores well apart: no near ties)."""
    g = torch.Generator().manual_seed(seed)
    topics = _unit(torch.randn(8, 4, DIM, generator=g))
    docs = []
    for j in range(80):
        n = int(torch.randint(3, 24, (1,), generator=g))
        docs.append(_unit(topics[j % 8][torch.randint(0, 4, (n,), generator=g)] + 0.4 * torch.randn(n, DIM, generator=g)))
    queries = _unit(topics[torch.arange(12) % 8][:, torch.randint(0, 4, (8,), generator=g)]
                    + 0.3 * torch.randn(12, 8, DIM, generator=g))
    return docs, queries


@pytest.fixture(scope="module")
def index(release, tmp_path_factory):
    """A fast-plaid index created by the release on the CPU, placed where ours may serve it
    (1.4: ``low_memory=False``; 1.7: ``index_gpu_memory="auto"``, its default)."""
    docs, queries = _corpus()
    path = str(tmp_path_factory.mktemp("fast_plaid_index"))
    placement = {"low_memory": False} if "low_memory" in inspect.signature(release.FastPlaid.__init__).parameters \
        else {}
    fast_plaid = release.FastPlaid(index=path, device="cpu", **placement)
    fast_plaid.create(documents_embeddings=docs, nbits=2)
    return fast_plaid, queries


@pytest.fixture
def ours(monkeypatch):
    """The kernels under the interpreter (a CPU index is fast-plaid's otherwise), counts reset."""
    for name in ("LIK_DISABLE", "PYLATE_SCORES_BACKEND", "COLPALI_SCORES_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LIK_BACKEND", "triton")
    lik_plugins.reset_routing_counts()
    yield
    unpatch_fast_plaid()


def _ids(results):
    return [[p for p, _ in row] for row in results]


def _assert_same(theirs, got):
    assert _ids(got) == _ids(theirs)
    assert all(abs(s - t) <= SCORE_TOL for a, b in zip(theirs, got) for (_, t), (_, s) in zip(a, b))


def _searches(fast_plaid, queries):
    """The calls compared: a padded batch, ragged queries (one padded with zero tokens, as
    colpali-engine's get_topk_plaid pads), keywords only (get_topk_plaid's call), a subset, and
    one-token queries padded with zero tokens probing one cell each: 1.5 and newer drop the
    zero tokens, 1.4 probes with them too (other candidates, other lists)."""
    ragged = [queries[0, :5], queries[1], torch.cat([queries[2, :3], torch.zeros(4, DIM)])]
    one_token = torch.cat([queries[:, :1], torch.zeros(queries.shape[0], 7, DIM)], dim=1)
    return {
        "one token": lambda: fast_plaid.search(one_token, **{**SEARCH, "n_ivf_probe": 1}),
        "batch": lambda: fast_plaid.search(queries, **SEARCH),
        "ragged": lambda: fast_plaid.search(ragged, **SEARCH),
        "keywords": lambda: fast_plaid.search(queries_embeddings=torch.nn.utils.rnn.pad_sequence(ragged, True), top_k=3),
        "subset": lambda: fast_plaid.search(queries, subset=list(range(0, 80, 3)), **SEARCH),
    }


def test_search_equals_fast_plaids_own(index, ours):
    fast_plaid, queries = index
    original = type(fast_plaid).search
    theirs = {name: call() for name, call in _searches(fast_plaid, queries).items()}
    patch_fast_plaid()
    assert type(fast_plaid).search is not original
    got = {name: call() for name, call in _searches(fast_plaid, queries).items()}
    assert lik_plugins.routing_counts()["fast_plaid.search"] == {"triton": 5}
    for name in theirs:
        _assert_same(theirs[name], got[name])
    assert all(p % 3 == 0 for row in got["subset"] for p, _ in row)
    unpatch_fast_plaid()
    assert type(fast_plaid).search is original


def test_layout_read_from_the_files(index, release, ours):
    """1.4 writes a chunk's codes and residuals in its own files; 1.7 one merged copy with a
    manifest; 1.7's staged chunks (``storage.materialize_shards``, what its update / delete
    stage) beside the merged copy are read from where they lie."""
    fast_plaid, queries = index
    storage = getattr(sys.modules.get("fast_plaid.search"), "storage", None)
    theirs = fast_plaid.search(queries, **SEARCH)
    assert index_files(fast_plaid.index).layout == ("merged" if storage is not None else "shards")
    if storage is not None:
        n_chunks = json.load(open(os.path.join(fast_plaid.index, "metadata.json")))["num_chunks"]
        storage.materialize_shards(fast_plaid.index, n_chunks, "codes")
        assert index_files(fast_plaid.index).layout == "mixed"
    patch_fast_plaid()
    _assert_same(theirs, fast_plaid.search(queries, **SEARCH))
    assert lik_plugins.routing_counts()["fast_plaid.search"] == {"triton": 1}


def test_unknown_layout_is_served_by_fast_plaid(release, tmp_path, ours):
    """Files in no layout ours reads: fast-plaid's own search answers (here from the copy it
    holds in memory), and the reason is counted."""
    docs, queries = _corpus(1)
    placement = {"low_memory": False} if "low_memory" in inspect.signature(release.FastPlaid.__init__).parameters \
        else {}
    fast_plaid = release.FastPlaid(index=str(tmp_path), device="cpu", **placement)
    fast_plaid.create(documents_embeddings=docs[:40], nbits=2)
    theirs = fast_plaid.search(queries, **SEARCH)                 # fast-plaid loads its copy
    shard = tmp_path / "0.codes.npy"
    if shard.exists():          # 1.4: the chunk's codes become floats
        np.save(shard, np.load(shard).astype(np.float64))
    else:                       # 1.7: a manifest that lists the chunk somewhere else
        (tmp_path / "merged_codes.manifest.json").write_text(json.dumps({"0.codes.npy": {"rows": 1, "in": "x"}}))
    patch_fast_plaid()
    assert fast_plaid.search(queries, **SEARCH) == theirs
    assert lik_plugins.routing_counts()["fast_plaid.search"] == {"original": 1}
    assert lik_plugins.routing_reasons()["fast_plaid.search"] == {"unknown index layout": 1}


def test_unknown_parameter_is_served_by_fast_plaid(index, release, ours, monkeypatch):
    """A release whose search takes a parameter ours does not know (its meaning unknown):
    fast-plaid serves every call, with the reason counted."""
    fast_plaid, queries = index
    real = release.FastPlaid.search

    def search(self, queries_embeddings, top_k=10, batch_size=2000, n_full_scores=4096, n_ivf_probe=8,
               show_progress=True, subset=None, n_processes=None, rerank_depth=None):
        return real(self, queries_embeddings, top_k=top_k, n_full_scores=n_full_scores, n_ivf_probe=n_ivf_probe,
                    show_progress=show_progress, subset=subset, n_processes=n_processes)

    monkeypatch.setattr(release.FastPlaid, "search", search)
    theirs = fast_plaid.search(queries, **SEARCH)
    patch_fast_plaid()
    assert fast_plaid.search(queries, **SEARCH) == theirs
    assert lik_plugins.routing_reasons()["fast_plaid.search"] == {"unknown search parameter 'rerank_depth'": 1}
    unpatch_fast_plaid()                                # before monkeypatch puts the real one back


def test_fast_plaids_own_errors_and_switches(index, ours, monkeypatch):
    """A value ours does not take is fast-plaid's to judge (its own error), and the switches
    send calls to fast-plaid: each reason counted."""
    fast_plaid, queries = index
    patch_fast_plaid()
    if inspect.signature(type(fast_plaid).search).parameters["batch_size"].default == "auto":   # 1.5 and newer
        with pytest.raises(ValueError, match="batch_size"):
            fast_plaid.search(queries, batch_size="huge", **SEARCH)
        assert lik_plugins.routing_reasons()["fast_plaid.search"]["batch_size='huge'"] == 1
        fast_plaid.search(queries, batch_size="auto", **SEARCH)              # ours
    monkeypatch.setenv("PYLATE_SCORES_BACKEND", "torch")
    fast_plaid.search(queries[:1], **SEARCH)
    monkeypatch.setenv("LIK_DISABLE", "1")
    fast_plaid.search(queries[:1], **SEARCH)
    reasons = lik_plugins.routing_reasons()
    assert reasons["fast_plaid.search"]["PYLATE_SCORES_BACKEND=torch"] == 1
    assert reasons["fast_plaid.search"]["LIK_DISABLE=1"] == 1
