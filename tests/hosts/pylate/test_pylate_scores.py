"""Scoring-level parity with PyLate's own path, the backend variable, patch/unpatch."""
from __future__ import annotations

import os

import numpy as np
import pytest

pytest.importorskip("pylate.scores", reason="PyLate is not installed (docs/install.md: PyLate beside your torch)")

import torch  # noqa: E402

from lik_plugins import reset_routing_counts, routing_counts  # noqa: E402
from support import host_state  # noqa: E402
from lik_plugins.pylate import patch_pylate, unpatch_pylate  # noqa: E402

OURS = {"triton", "metal", "torch-chunked", "reference"}


def _holes(shape, g, p=0.3):
    mask = torch.rand(shape, generator=g) > p
    return mask


def _inputs(seed=0, nq=3, nd=4, lq=5, ld=7, h=12, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    Q = torch.nn.functional.normalize(torch.randn(nq, lq, h, generator=g), dim=-1).to(dtype)
    D = torch.nn.functional.normalize(torch.randn(nd, ld, h, generator=g), dim=-1).to(dtype)
    return Q, D, _holes((nq, lq), g), _holes((nd, ld), g)


def _entry_paths(entry):
    return set(routing_counts().get(entry, {}))


MASK_DTYPES = [torch.bool, torch.int64, torch.float32, torch.bfloat16]


@pytest.mark.parametrize("mask_dtype", MASK_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_colbert_scores_masks_and_dtype(patched, dtype, mask_dtype):
    from pylate import scores

    original = patched.originals["colbert_scores"]
    Q, D, qm, dm = _inputs(dtype=dtype)
    qm, dm = qm.to(mask_dtype), dm.to(mask_dtype)
    dm[1] = 0  # a fully masked document
    got = scores.colbert_scores(Q, D, qm, dm)
    want = original(Q, D, qm, dm)
    assert got.dtype == want.dtype  # PyLate's type promotion, although the op returns fp32
    tol = 1e-5 if dtype == torch.float32 and want.dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert (got[:, 1] == 0).all()
    assert _entry_paths("pylate.colbert_scores") <= OURS


def test_all_negative_similarities_score_zero_like_pylate(patched):
    from pylate import scores

    original = patched.originals["colbert_scores"]
    Q = torch.tensor([[[1.0, 0.0]]])
    D = torch.tensor([[[-1.0, 0.0], [0.5, 0.0]]])
    dm = torch.tensor([[True, False]])  # the only valid similarity is -1; the masked token scores 0
    assert float(original(Q, D, None, dm)) == 0.0
    assert float(scores.colbert_scores(Q, D, None, dm)) == 0.0
    assert float(scores.colbert_scores(Q, D)) == pytest.approx(0.5)
    kd = scores.colbert_kd_scores(Q, D[:, None], None, dm[:, None])
    assert float(kd) == 0.0 == float(patched.originals["colbert_kd_scores"](Q, D[:, None], None, dm[:, None]))


def test_keyword_positional_numpy_and_list_inputs(patched):
    from pylate import scores

    original = patched.originals["colbert_scores"]
    Q, D, qm, dm = _inputs(seed=1)
    want = original(Q, D, qm, dm)
    variants = [
        scores.colbert_scores(queries_embeddings=Q, documents_embeddings=D, queries_mask=qm, documents_mask=dm),
        scores.colbert_scores(Q.numpy(), D.numpy(), qm, dm),
        scores.colbert_scores(list(Q.numpy()), list(D.numpy()), qm, dm),
        scores.colbert_scores(list(Q), list(D), qm, dm),
        scores.colbert_scores(Q, D, qm.numpy(), dm.numpy()),
    ]
    for got in variants:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert routing_counts()["pylate.colbert_scores"] == {"torch-chunked": len(variants)}


def test_gradients_match_pylate(patched):
    from pylate import scores

    for name, d_shape, m_shape in [
        ("colbert_scores", (4, 7, 12), (4, 7)),
        ("colbert_kd_scores", (3, 2, 7, 12), (3, 2, 7)),
    ]:
        g = torch.Generator().manual_seed(2)
        Q0 = torch.randn(3, 5, 12, generator=g)
        D0 = torch.randn(*d_shape, generator=g)
        dm = torch.rand(m_shape, generator=g) > 0.3
        qm = torch.rand(3, 5, generator=g) > 0.2
        grads = []
        for fn in (getattr(scores, name), patched.originals[name]):
            Q, D = Q0.clone().requires_grad_(), D0.clone().requires_grad_()
            out = fn(Q, D, qm, dm)
            (out * torch.arange(1, out.numel() + 1).view_as(out)).sum().backward()
            grads.append((out.detach(), Q.grad, D.grad))
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert _entry_paths("pylate.colbert_kd_scores") == {"torch-chunked"}


def test_colbert_scores_class_is_one_query_major_call(patched):
    from pylate.scores import ColBERTScores

    g = torch.Generator().manual_seed(3)
    Q = torch.randn(4, 5, 8, generator=g)
    D = torch.randn(4, 3, 6, 8, generator=g)
    dm = torch.rand(4, 3, 6, generator=g) > 0.3
    unpatch_pylate()
    want = ColBERTScores()(Q, D, None, dm)
    patch_pylate()
    reset_routing_counts()
    got = ColBERTScores()(Q, D, queries_mask=None, documents_mask=dm)
    assert got.shape == (4, 12)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert routing_counts() == {"pylate.ColBERTScores": {"torch-chunked": 1}, "maxsim": {"torch-chunked": 1}}
    # non-contiguous groups and a smaller query chunk (Contrastive's score_mini_batch_size)
    Dt = D.transpose(0, 1).contiguous().transpose(0, 1)
    torch.testing.assert_close(ColBERTScores()(Q[:2], Dt, None, dm), want[:2], atol=1e-5, rtol=1e-5)


def test_pairwise_ragged_lists_numpy_and_gradients(patched):
    from pylate import scores

    original = patched.originals["colbert_scores_pairwise"]
    g = torch.Generator().manual_seed(4)
    qs = [torch.randn(n, 8, generator=g) for n in (3, 5, 1)]
    ds = [torch.randn(n, 8, generator=g) - 0.5 for n in (7, 2, 4)]  # mostly negative: padding must not win
    torch.testing.assert_close(scores.colbert_scores_pairwise(qs, ds), original(qs, ds), atol=1e-5, rtol=1e-5)
    qn, dn = [q.numpy() for q in qs], [d.numpy() for d in ds]
    torch.testing.assert_close(scores.colbert_scores_pairwise(qn, dn), original(qn, dn), atol=1e-5, rtol=1e-5)
    Q, D = torch.randn(3, 4, 8, generator=g), torch.randn(3, 6, 8, generator=g)
    grads = []
    for fn in (scores.colbert_scores_pairwise, original):
        q, d = Q.clone().requires_grad_(), D.clone().requires_grad_()
        out = fn(queries_embeddings=q, documents_embeddings=d)
        out.sum().backward()
        grads.append((out.detach(), q.grad, d.grad))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert routing_counts()["pylate.colbert_scores_pairwise"] == {"torch-chunked": 3}


def test_unservable_inputs_fall_back_silently_under_auto(patched):
    from pylate import scores

    Q, D, qm, dm = _inputs(seed=5)
    got = scores.colbert_scores(Q.double(), D.double(), qm, dm)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, patched.originals["colbert_scores"](Q.double(), D.double(), qm, dm))
    assert routing_counts()["pylate.colbert_scores"] == {"original": 1}


def test_weighted_masks_are_pylates_business(patched):
    from pylate import scores

    Q, D, qm, dm = _inputs(seed=11)
    weights = dm.float() * 0.5  # PyLate multiplies: similarities are scaled, not masked
    got = scores.colbert_scores(Q, D, qm, weights)
    torch.testing.assert_close(got, patched.originals["colbert_scores"](Q, D, qm, weights))
    assert routing_counts()["pylate.colbert_scores"] == {"original": 1}


# ------------------------------------------------------------------------ backend variable


def test_backend_values(patched, monkeypatch):
    from pylate import scores

    Q, D, qm, dm = _inputs(seed=6)
    want = patched.originals["colbert_scores"](Q, D, qm, dm)
    for value, path in [("auto", "torch-chunked"), ("AUTO", "torch-chunked"), ("lik", "torch-chunked"), ("torch", "original")]:
        monkeypatch.setenv("PYLATE_SCORES_BACKEND", value)
        reset_routing_counts()
        torch.testing.assert_close(scores.colbert_scores(Q, D, qm, dm), want, atol=1e-5, rtol=1e-5)
        assert routing_counts()["pylate.colbert_scores"] == {path: 1}, value
        monkeypatch.delenv("PYLATE_SCORES_BACKEND")
        reset_routing_counts()
        torch.testing.assert_close(scores.colbert_scores(Q, D, qm, dm, backend=value), want, atol=1e-5, rtol=1e-5)
        assert routing_counts()["pylate.colbert_scores"] == {path: 1}, value
    # flash is PyLate's own (CUDA-only) path: PyLate's error on CPU
    with pytest.raises(RuntimeError, match="flash"):
        scores.colbert_scores(Q, D, qm, dm, backend="flash")


@pytest.mark.parametrize("value", ["bogus", ""])
def test_rejected_backend_values_keep_pylates_error(patched, monkeypatch, value):
    from pylate import scores

    Q, D, qm, dm = _inputs(seed=7)
    with pytest.raises(ValueError) as ours:
        scores.colbert_scores(Q, D, qm, dm, backend=value)
    unpatch_pylate()
    with pytest.raises(ValueError) as theirs:
        scores.colbert_scores(Q, D, qm, dm, backend=value)
    assert str(ours.value) == str(theirs.value)
    patch_pylate()
    monkeypatch.setenv("PYLATE_SCORES_BACKEND", value)
    with pytest.raises(ValueError):
        scores.colbert_scores(Q, D, qm, dm)


def test_strict_lik(patched, monkeypatch):
    from pylate import scores

    monkeypatch.setenv("PYLATE_SCORES_BACKEND", "lik")
    Q, D, qm, dm = _inputs(seed=8)
    scores.colbert_scores(Q, D, qm, dm)  # CPU is served (PyLate's native lik would raise here)
    scores.colbert_scores_pairwise(list(Q), list(D[:3]))  # ragged-capable list input is served too
    assert set(routing_counts()) >= {"pylate.colbert_scores", "pylate.colbert_scores_pairwise"}
    assert all(set(p) <= OURS for e, p in routing_counts().items())
    with pytest.raises(RuntimeError, match="lik_plugins cannot serve"):
        scores.colbert_scores(Q.double(), D.double(), qm, dm)
    with pytest.raises(RuntimeError, match="lik_plugins cannot serve"):
        scores.colbert_kd_scores(Q, D, qm, dm)  # 3-D documents in the KD layout


def _outcome(call):
    """A call's result or its exception (type and message), for test-for-test comparison."""
    try:
        return ("ok", call())
    except Exception as exc:  # noqa: BLE001 -- the host's own error is the expected outcome
        return ("raised", type(exc), str(exc))


def _same_outcome(ours, theirs):
    assert ours[0] == theirs[0], (ours, theirs)
    if ours[0] == "ok":
        torch.testing.assert_close(ours[1], theirs[1], atol=0, rtol=0)
        assert ours[1].dtype == theirs[1].dtype
    else:
        assert ours[1:] == theirs[1:]


KILL_SWITCH_BACKENDS = [None, "lik", "LIK", "auto", "torch", "flash", "bogus"]


@pytest.mark.parametrize("value", KILL_SWITCH_BACKENDS)
@pytest.mark.parametrize("via", ["argument", "variable"])
def test_kill_switch_leaves_pylate_exactly_as_it_is(patched, monkeypatch, value, via):
    """``LIK_DISABLE=1``: every backend request -- ``lik`` included -- gets what PyLate alone
    gives (on CPU without late-interaction-kernels PyLate's own ``lik`` raises its own error;
    the patch must not turn it into ``torch``), routed "original"."""
    from pylate import scores

    Q, D, qm, dm = _inputs(seed=9)
    G = torch.stack([D, D.flip(0)], dim=1)  # [Nq, 2, Ld, H] per-query candidates
    Gm = torch.stack([dm, dm.flip(0)], dim=1)
    kwargs = {"backend": value} if via == "argument" and value is not None else {}
    if via == "variable" and value is not None:
        monkeypatch.setenv("PYLATE_SCORES_BACKEND", value)

    def calls():
        return {
            "colbert_scores": _outcome(lambda: scores.colbert_scores(Q, D, qm, dm, **kwargs)),
            "colbert_kd_scores": _outcome(lambda: scores.colbert_kd_scores(Q[:4], G[: Q.shape[0]], qm, Gm[: Q.shape[0]], **kwargs)),
            "colbert_scores_pairwise": _outcome(lambda: scores.colbert_scores_pairwise(Q, D[: Q.shape[0]], **kwargs)),
            "ColBERTScores": _outcome(lambda: scores.ColBERTScores()(Q, G[: Q.shape[0]], qm, Gm[: Q.shape[0]], **kwargs)),
        }

    monkeypatch.setenv("LIK_DISABLE", "1")
    ours = calls()
    assert all(set(paths) == {"original"} for paths in routing_counts().values()), routing_counts()
    unpatch_pylate()
    try:
        theirs = calls()
    finally:
        patch_pylate()
    for name in ours:
        _same_outcome(ours[name], theirs[name])
    if value is not None and value.lower() == "lik":
        assert ours["colbert_scores"][0] == "raised"  # PyLate's own lik on CPU, not a silent torch run


# ------------------------------------------------------------------------ patch / unpatch


def _snapshot():
    import pylate.losses as losses

    from support.host_state import module_globals

    mods = module_globals("pylate", ("colbert_scores", "colbert_kd_scores", "colbert_scores_pairwise"))
    classes = {c.__name__: dict(vars(c)) for c in (losses.Contrastive, losses.CachedContrastive, losses.Distillation)}
    defaults = {c.__name__: c.__init__.__defaults__ for c in (losses.Contrastive, losses.CachedContrastive, losses.Distillation)}
    return mods, classes, defaults


def test_patch_twice_then_unpatch_restores_everything(monkeypatch):
    monkeypatch.delenv("PYLATE_SCORES_BACKEND", raising=False)
    unpatch_pylate()
    from pylate import losses, models, scores

    from lik_plugins.pylate import _layout

    for name in _layout.MODULES:      # the modules the patch imports, so both snapshots see them
        _layout.import_optional(name)
    before = _snapshot()
    distillation_default = losses.Distillation.__init__.__defaults__[0]
    patch_pylate()
    patch_pylate()
    assert losses.Distillation.__init__.__defaults__[0] is not distillation_default
    Q, D, _, _ = _inputs(seed=10)
    routes = host_state.routes_of_one_call(lambda: scores.colbert_scores(Q, D))
    assert routes["pylate.colbert_scores"] == {"torch-chunked": 1}  # not wrapped twice
    unpatch_pylate()
    after = _snapshot()
    assert host_state.same_objects(before[0], after[0])
    assert before[1] == after[1] and before[2] == after[2]
    assert host_state.routes_of_one_call(lambda: scores.colbert_scores(Q, D)) == {}
    assert models.ColBERT.__dict__.get("_similarity") is None


def test_objects_built_during_the_patch_are_plain_pylate_after_unpatch(tmp_path):
    from support import pylate_tiny as tiny
    from pylate import losses

    unpatch_pylate()
    encoder = tiny.save_tiny_encoder(str(tmp_path / "enc"))
    layout = patch_pylate()
    model = tiny.load_colbert(encoder)
    loss = losses.Distillation(model=model)
    original = layout.originals["colbert_kd_scores"]
    # served by a lookalike adapter: PyLate's name, module, docstring and signature
    assert loss.score_metric is not original and loss.score_metric.__wrapped__ is original
    assert loss.score_metric.__module__ == original.__module__ and loss.score_metric.__doc__ == original.__doc__
    unpatch_pylate()
    assert loss.score_metric is original
    assert model._similarity is layout.originals["colbert_scores"]


# ------------------------------------------------------- the Triton kernels behind PyLate


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 (CPU) for the kernels")
def test_pylate_semantics_through_the_triton_kernels(patched, monkeypatch):
    pytest.importorskip("triton")
    from pylate import scores
    from pylate.scores import ColBERTScores

    monkeypatch.setenv("LIK_BACKEND", "triton")
    g = torch.Generator().manual_seed(12)
    Q = torch.randn(2, 5, 16, generator=g).requires_grad_()
    D = (torch.randn(3, 2, 7, 16, generator=g) - 0.3).requires_grad_()  # negatives: masked zeros win rows
    dm = torch.rand(3, 2, 7, generator=g) > 0.4
    dm[0, 1] = False
    got = ColBERTScores()(Q, D, queries_mask=None, documents_mask=dm)
    got.sum().backward()
    grads = Q.grad.clone(), D.grad.clone()
    Q.grad = D.grad = None
    want = patched.originals["colbert_scores"](Q, D.reshape(6, 7, 16), None, dm.reshape(6, 7))
    want.sum().backward()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(grads[0], Q.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(grads[1], D.grad, atol=1e-4, rtol=1e-4)
    kd = scores.colbert_kd_scores(Q.detach(), D[:2].detach(), None, dm[:2])
    torch.testing.assert_close(kd, patched.originals["colbert_kd_scores"](Q.detach(), D[:2].detach(), None, dm[:2]),
                               atol=1e-4, rtol=1e-4)
    assert routing_counts()["pylate.ColBERTScores"] == {"triton": 1}
    assert routing_counts()["pylate.colbert_kd_scores"] == {"triton": 1}
