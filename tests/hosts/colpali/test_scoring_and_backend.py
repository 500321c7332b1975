"""``score_multi_vector``, the ``COLPALI_SCORES_BACKEND`` variable, the ``lik`` backend
slots, zero-code activation, and unpatching."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("colpali_engine", reason="colpali-engine is not installed (docs/install.md: colpali-engine beside your torch)")

import lik_plugins  # noqa: E402
from colpali_engine.loss import late_interaction_losses as L  # noqa: E402
from colpali_engine.utils import maxsim as colpali_maxsim  # noqa: E402
from colpali_engine.utils.processing_utils import BaseVisualRetrieverProcessor as Base  # noqa: E402

from support.colpali_helpers import delta, env, routed  # noqa: E402
from support.colpali_releases import release  # noqa: E402


def _ragged(n, lo, hi, d, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.nn.functional.normalize(torch.randn(L_, d, generator=g), dim=-1).to(dtype) for L_ in lengths]


def _score_both(qs, ps, **kw):
    expected = Base.score_multi_vector(qs, ps, **kw)
    lik_plugins.patch_colpali_engine()
    before = routed("colpali.score_multi_vector")
    got = Base.score_multi_vector(qs, ps, **kw)
    d = delta(before, routed("colpali.score_multi_vector"))
    lik_plugins.unpatch_colpali_engine()
    return expected, got, d


@pytest.mark.parametrize("batch_size", [1, 2, 3, 128])
def test_score_multi_vector_ragged_lists(batch_size):
    qs, ps = _ragged(5, 2, 9, 24, 0), _ragged(7, 3, 15, 24, 1)
    # unnormalised negatives make the zero padding matter (a pad row wins a negative max)
    ps = [p - 0.3 for p in ps]
    expected, got, routing = _score_both(qs, ps, batch_size=batch_size, device="cpu")
    assert routing == {"original": 1}        # a plain CPU: colpali's own loop
    assert got.dtype == torch.float32 and got.device.type == "cpu" and got.shape == (5, 7)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch_size", [1, 3, 128])
def test_score_multi_vector_lists_read_in_place_by_the_kernels(monkeypatch, batch_size, dtype):
    from lik_plugins._config import triton_interpret

    if not triton_interpret():
        pytest.skip("the Triton kernels on CPU need TRITON_INTERPRET=1")
    monkeypatch.setenv("LIK_BACKEND", "triton")
    qs = _ragged(3, 2, 9, 24, 10, dtype)
    # negatives make colpali's per-chunk zero padding win rows; split views of one buffer too
    ps = [p - 0.3 for p in _ragged(4, 1, 15, 24, 11, dtype)] + list(torch.split(torch.randn(30, 24).to(dtype), [7, 23]))
    expected, got, routing = _score_both(qs, ps, batch_size=batch_size, device="cpu")
    assert routing == {"triton": 1}
    assert got.dtype == torch.float32 and got.device.type == "cpu" and got.shape == (3, 6)
    if dtype == torch.float32:       # sums in another order
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    else:  # colpali rounds every similarity to bf16, we round the scores only: the host's bar
        oracle = Base.score_multi_vector([q.double() for q in qs], [p.double() for p in ps], batch_size=batch_size,
                                         device="cpu")
        assert (got.double() - oracle).abs().max() <= 2 * (expected.double() - oracle).abs().max() + 1e-3


def test_score_multi_vector_depends_on_batch_size_like_colpali():
    qs, ps = _ragged(4, 2, 6, 16, 2), [p - 0.5 for p in _ragged(6, 2, 12, 16, 3)]
    lik_plugins.patch_colpali_engine()
    a = Base.score_multi_vector(qs, ps, batch_size=1)
    b = Base.score_multi_vector(qs, ps, batch_size=6)
    assert not torch.allclose(a, b)  # per-chunk right padding takes part in the max
    lik_plugins.unpatch_colpali_engine()
    torch.testing.assert_close(b, Base.score_multi_vector(qs, ps, batch_size=6), atol=1e-5, rtol=1e-5)


def test_score_multi_vector_padded_tensors_bf16_and_errors():
    qs = torch.nn.utils.rnn.pad_sequence(_ragged(3, 2, 5, 16, 4), batch_first=True)
    ps = torch.nn.utils.rnn.pad_sequence(_ragged(4, 2, 8, 16, 5), batch_first=True)
    expected, got, routing = _score_both(qs, ps, batch_size=2)
    assert routing == {"original": 1}
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)

    q16, p16 = qs.bfloat16(), ps.bfloat16()
    oracle = Base.score_multi_vector(qs.double(), ps.double())
    expected, got, _ = _score_both(q16, p16)
    assert got.dtype == torch.float32
    assert (got.double() - oracle).abs().max() <= 2 * (expected.double() - oracle).abs().max() + 1e-3

    lik_plugins.patch_colpali_engine()
    with pytest.raises(ValueError, match="No queries provided"):
        Base.score_multi_vector([], list(ps))
    with pytest.raises(ValueError, match="No passages provided"):
        Base.score_multi_vector(list(qs), [])


def test_processor_score_goes_through_the_patch():
    class Proc(Base):  # the processors' ``score`` forwards to score_multi_vector
        def process_images(self, *a, **k): ...
        def process_texts(self, *a, **k): ...
        def process_queries(self, *a, **k): ...
        def score(self, qs, ps, device=None, **kwargs):
            return self.score_multi_vector(qs, ps, device=device, **kwargs)
        def get_n_patches(self, *a, **k): ...

    Proc.__abstractmethods__ = frozenset()
    qs, ps = _ragged(2, 2, 4, 8, 6), _ragged(3, 2, 5, 8, 7)
    lik_plugins.patch_colpali_engine()
    before = routed("colpali.score_multi_vector")
    Proc().score(qs, ps, batch_size=2)
    assert delta(before, routed("colpali.score_multi_vector")) == {"original": 1}


def test_backend_variable_on_patched_heads():
    g = torch.Generator().manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(3, 4, 16, generator=g), dim=-1)
    d = torch.nn.functional.normalize(torch.randn(3, 7, 16, generator=g), dim=-1)
    head = L.ColbertPairwiseCELoss()
    expected = head(q, d)
    lik_plugins.patch_colpali_engine()
    for value, path in (("torch", "original"), ("lik", "torch-chunked"), ("auto", "torch-chunked"), ("LIK", "torch-chunked")):
        with env(COLPALI_SCORES_BACKEND=value):
            before = routed("colpali.ColbertPairwiseCELoss")
            torch.testing.assert_close(head(q, d), expected)
            assert delta(before, routed("colpali.ColbertPairwiseCELoss")) == {path: 1}, value
    with env(COLPALI_SCORES_BACKEND="triton"), pytest.raises(ValueError, match="must be one of"):
        head(q, d)


def test_lik_backend_serves_cpu_without_late_interaction_kernels():
    """colpali's own dispatcher: ``lik`` raises on CPU unpatched; patched, it is served
    by us (CPU included); ``torch`` bypasses us; LIK_DISABLE restores colpali's error."""
    g = torch.Generator().manual_seed(1)
    q, d = torch.randn(2, 3, 16, generator=g), torch.randn(4, 5, 16, generator=g)
    n = torch.randn(2, 3, 5, 16, generator=g)
    with env(COLPALI_SCORES_BACKEND="lik"):
        with pytest.raises(Exception, match="late-interaction-kernels|CUDA"):
            colpali_maxsim.maxsim_inbatch(q, d)
        lik_plugins.patch_colpali_engine()
        before_i, before_k = routed("colpali.maxsim_inbatch_lik"), routed("colpali.maxsim_kd_lik")
        torch.testing.assert_close(colpali_maxsim.maxsim_inbatch(q, d), colpali_maxsim._torch_maxsim(q, d))
        torch.testing.assert_close(colpali_maxsim.maxsim_kd(q, n), colpali_maxsim._torch_maxsim_kd(q, n))
        assert delta(before_i, routed("colpali.maxsim_inbatch_lik")) == {"torch-chunked": 1}
        assert delta(before_k, routed("colpali.maxsim_kd_lik")) == {"torch-chunked": 1}
        with pytest.raises(Exception, match="different devices|4-D|KD"):
            colpali_maxsim.maxsim_kd(q, d)  # ineligible: strict ``lik`` re-raises LIKUnsupportedError
        with env(LIK_DISABLE="1"), pytest.raises(Exception, match="late-interaction-kernels|CUDA"):
            colpali_maxsim.maxsim_inbatch(q, d)
    with env(COLPALI_SCORES_BACKEND="torch"):
        before = routed("colpali.maxsim_inbatch_lik")
        colpali_maxsim.maxsim_inbatch(q, d)
        assert delta(before, routed("colpali.maxsim_inbatch_lik")) == {}


def test_older_release_honours_the_variable_after_patch():
    rel = release("0.3.14")
    with rel.activate():
        head = rel.losses.ColbertLoss()
        g = torch.Generator().manual_seed(2)
        q = torch.nn.functional.normalize(torch.randn(3, 4, 16, generator=g), dim=-1)
        d = torch.nn.functional.normalize(torch.randn(3, 6, 16, generator=g), dim=-1)
        lik_plugins.patch_colpali_engine()
        with env(COLPALI_SCORES_BACKEND="torch"):
            before = routed("colpali.ColbertLoss")
            head(q, d)
            assert delta(before, routed("colpali.ColbertLoss")) == {"original": 1}
        with env(COLPALI_SCORES_BACKEND="bogus"), pytest.raises(ValueError, match="must be one of"):
            head(q, d)


def test_unpatch_restores_everything_and_patch_twice_is_harmless():
    from colpali_engine.utils import _lik_backend

    raw_smv = vars(Base)["score_multi_vector"]
    forwards = {n: vars(getattr(L, n))["forward"] for n in ("ColbertLoss", "ColbertSigmoidLoss", "ColbertNegativeCELoss")}
    inbatch = vars(L.ColbertModule)["_inbatch_scores"]
    slots = (_lik_backend.maxsim_inbatch_lik, _lik_backend.maxsim_kd_lik)
    assert lik_plugins.patch_colpali_engine() == "0.3.17+"
    assert lik_plugins.patch_colpali_engine() == "0.3.17+"
    assert isinstance(vars(Base)["score_multi_vector"], staticmethod)
    assert vars(L.ColbertLoss)["forward"] is not forwards["ColbertLoss"]
    lik_plugins.unpatch_colpali_engine()
    assert vars(Base)["score_multi_vector"] is raw_smv and isinstance(raw_smv, staticmethod)
    assert all(vars(getattr(L, n))["forward"] is f for n, f in forwards.items())
    assert vars(L.ColbertModule)["_inbatch_scores"] is inbatch
    assert (_lik_backend.maxsim_inbatch_lik, _lik_backend.maxsim_kd_lik) == slots
    before = dict(lik_plugins.routing_counts())
    L.ColbertLoss()(torch.rand(2, 3, 8), torch.rand(2, 4, 8))
    Base.score_multi_vector([torch.rand(3, 8)], [torch.rand(4, 8)])
    assert lik_plugins.routing_counts() == before  # nothing of ours runs after unpatch
    lik_plugins.unpatch_colpali_engine()  # unpatching twice is harmless too


SCRIPT = textwrap.dedent(
    """
    import sys, torch
    assert "lik_plugins" not in sys.modules or "{value}" != "", "imported before colpali"
    from colpali_engine.loss import ColbertLoss
    q = torch.nn.functional.normalize(torch.randn(2, 3, 16), dim=-1)
    d = torch.nn.functional.normalize(torch.randn(2, 5, 16), dim=-1)
    ColbertLoss()(q, d)
    mod = sys.modules.get("lik_plugins")
    counts = mod.routing_counts() if mod else {{}}
    print("IMPORTED", mod is not None, "COUNTS", counts.get("colpali.ColbertLoss", {{}}))
    """
)


@pytest.mark.parametrize("value", ["lik", ""])
def test_zero_code_activation_in_a_fresh_process(value):
    environ = {k: v for k, v in os.environ.items() if not k.endswith("_SCORES_BACKEND") and k != "LIK_DISABLE"}
    if value:
        environ["COLPALI_SCORES_BACKEND"] = value
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(value=value)], env=environ, capture_output=True, text=True, timeout=300,
        cwd="/",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("IMPORTED")][-1]
    if value:
        assert "IMPORTED True" in line and "'original'" not in line and "torch-chunked" in line, line
    else:
        assert line == "IMPORTED False COUNTS {}", line
