"""Every loss head of every release 0.3.10 - 0.3.18 against that release's own code.

Each release's wheel is loaded side by side (see ``tests/support/colpali_releases.py``); the heads are called
in the convention that release's trainer uses (positional on 0.3.10, ``offset=`` keyword
on 0.3.11-12, all keywords from 0.3.13), plus the multi-GPU shape (gathered documents,
``offset = rank * B``) where the release supports it.  Losses and the gradients w.r.t.
the raw embeddings must match the unpatched run; the patched run must be routed to our
path; ``LIK_DISABLE=1`` must give colpali's own numbers bit for bit, routed "original".
"""
from __future__ import annotations

import pytest
import torch

# The releases are loaded from their wheels, not installed, but their loss modules import
# transformers and PIL.
pytest.importorskip("transformers", reason="colpali-engine's loss modules need transformers (docs/install.md: colpali-engine beside your torch)")
pytest.importorskip("PIL", reason="colpali-engine's loss modules need pillow (docs/install.md: colpali-engine beside your torch)")

import lik_plugins  # noqa: E402
from lik_plugins.ops import served_by  # noqa: E402

from support.colpali_helpers import delta, env, loss_and_grads, padded, routed  # noqa: E402
from support.colpali_releases import RELEASES, release  # noqa: E402

B, LQ, LD, DIM, NNEG = 4, 6, 9, 16, 3
IN_BATCH = ("ColbertLoss", "ColbertPairwiseCELoss", "ColbertSigmoidLoss")
NEGATIVE = ("ColbertNegativeCELoss", "ColbertPairwiseNegativeCELoss")


def _minor(version: str) -> int:
    return int(version.split(".")[2])


def _variants(version: str, head: str):
    """(variant id, constructor kwargs, offset case) this release supports."""
    minor = _minor(version)
    if minor == 10:
        if head in ("ColbertSigmoidLoss",):
            return []
        out = [("default", {}, False)]
        if head in NEGATIVE:
            out.append(("in_batch_term", {"in_batch_term": True}, False))
        return out
    if head == "ColbertSigmoidLoss" and minor < 13:
        return []
    out = [
        ("default", {}, False),
        ("smooth", {"use_smooth_max": True}, False),
        ("filter_raw", {"pos_aware_negative_filtering": True, "normalize_scores": False}, False),
    ]
    if head in NEGATIVE:
        out.append(("no_in_batch", {"in_batch_term_weight": 0.0}, False))
        out.append(("smooth_filter", {"use_smooth_max": True, "pos_aware_negative_filtering": True}, False))
    if (head in IN_BATCH and head != "ColbertSigmoidLoss") or (head in NEGATIVE and minor >= 13):
        out.append(("offset", {}, True))
        out.append(("smooth_offset", {"use_smooth_max": True}, True))
    return out


CASES = [
    pytest.param(v, h, vid, kw, off, id=f"{v}-{h}-{vid}")
    for v in RELEASES
    for h in IN_BATCH + NEGATIVE
    for vid, kw, off in _variants(v, h)
]


def _inputs(version: str, head: str, offset_case: bool, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    n_docs = 2 * B if offset_case else B
    q = padded((B, LQ, DIM), 2, g, dtype)
    d = padded((n_docs, LD, DIM), 3, g, dtype)
    if head not in NEGATIVE:
        return [q, d, None]
    shape = (B, NNEG, LD + 2, DIM) if _minor(version) >= 13 else (B, LD + 2, DIM)
    return [q, d, padded(shape, 3, g, dtype)]


def _caller(version: str, head: str, offset_case: bool):
    minor, offset = _minor(version), (B if offset_case else 0)
    negative = head in NEGATIVE
    if minor == 10:
        return (lambda h, q, d, n: h(q, d, n)) if negative else (lambda h, q, d, n: h(q, d))
    if minor <= 12:
        return (lambda h, q, d, n: h(q, d, n)) if negative else (lambda h, q, d, n: h(q, d, offset=offset))
    if negative:
        return lambda h, q, d, n: h(query_embeddings=q, doc_embeddings=d, neg_doc_embeddings=n, offset=offset)
    return lambda h, q, d, n: h(query_embeddings=q, doc_embeddings=d, offset=offset)


def _assert_close(a, b, atol, rtol=1e-5):
    la, ga = a
    lb, gb = b
    torch.testing.assert_close(lb, la, atol=atol, rtol=rtol)
    for x, y in zip(ga, gb):
        if x is not None:
            torch.testing.assert_close(y, x, atol=atol, rtol=rtol)


@pytest.mark.parametrize("version,head,variant,kwargs,offset_case", CASES)
def test_head_matches_release(version, head, variant, kwargs, offset_case):
    rel = release(version)
    with rel.activate():
        cls = getattr(rel.losses, head)
        loss = cls(**kwargs)
        raw = _inputs(version, head, offset_case, seed=hash((version, head, variant)) % 2**31)
        call = _caller(version, head, offset_case)

        expected = loss_and_grads(loss, raw, call)
        assert torch.isfinite(expected[0])

        lik_plugins.patch_colpali_engine()
        entry = f"colpali.{head}"
        before = routed(entry)
        got = loss_and_grads(loss, raw, call)
        path = served_by(raw[0][0])
        assert delta(before, routed(entry)) == {path: 1}
        _assert_close(expected, got, atol=2e-5)

        with env(LIK_DISABLE="1"):
            before = routed(entry)
            disabled = loss_and_grads(loss, raw, call)
            assert set(delta(before, routed(entry))) == {"original"}
        assert torch.equal(disabled[0], expected[0])
        for x, y in zip(expected[1], disabled[1]):
            assert x is None or torch.equal(x, y)

        lik_plugins.unpatch_colpali_engine()
        assert "lik" not in type(loss).forward.__module__


@pytest.mark.parametrize("version", ["0.3.10", "0.3.13", "0.3.18"])
def test_bf16_heads_within_twice_host_error(version):
    """bf16: our distance to an fp64 oracle is at most twice colpali's own bf16 distance."""
    rel = release(version)
    with rel.activate():
        for head in ("ColbertLoss", "ColbertNegativeCELoss"):
            cls = getattr(rel.losses, head)
            loss = cls()
            raw32 = _inputs(version, head, False, seed=7)
            raw16 = [None if r is None else (r[0].bfloat16(), r[1].bfloat16()) for r in raw32]
            raw64 = [None if r is None else (r[0].double(), r[1].double()) for r in raw32]
            call = _caller(version, head, False)
            oracle = loss_and_grads(cls().double(), raw64, call)
            host = loss_and_grads(loss, raw16, call)
            lik_plugins.patch_colpali_engine()
            ours = loss_and_grads(loss, raw16, call)
            lik_plugins.unpatch_colpali_engine()
            assert ours[0].dtype == host[0].dtype

            def err(x, y):
                return (x.double() - y.double()).abs().max().item()

            assert err(ours[0], oracle[0]) <= 2 * err(host[0], oracle[0]) + 1e-2
            for o, h, r in zip(ours[1], host[1], oracle[1]):
                if r is not None:
                    assert err(o, r) <= 2 * err(h, r) + 1e-3


@pytest.mark.parametrize("version", ["0.3.13", "0.3.18"])
def test_sigmoid_with_offset_raises_like_colpali(version):
    rel = release(version)
    with rel.activate():
        head = rel.losses.ColbertSigmoidLoss()
        g = torch.Generator().manual_seed(0)
        q = torch.randn(B, LQ, DIM, generator=g)
        d = torch.randn(2 * B, LD, DIM, generator=g)
        with pytest.raises(Exception) as original:
            head(q, d, offset=B)
        lik_plugins.patch_colpali_engine()
        with pytest.raises(type(original.value)):
            head(q, d, offset=B)


def test_generations_detected():
    names = {}
    for version in RELEASES:
        rel = release(version)
        with rel.activate():
            names[version] = lik_plugins.patch_colpali_engine()
            lik_plugins.unpatch_colpali_engine()
    assert names == {
        "0.3.10": "0.3.10", "0.3.11": "0.3.11-0.3.12", "0.3.12": "0.3.11-0.3.12", "0.3.13": "0.3.13",
        "0.3.14": "0.3.14-0.3.16", "0.3.15": "0.3.14-0.3.16", "0.3.16": "0.3.14-0.3.16",
        "0.3.17": "0.3.17+", "0.3.18": "0.3.17+",
    }
