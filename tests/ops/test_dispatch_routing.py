"""Public ops: what is saved for the backward, which gradients are computed, which path
serves each call (``routing_counts``), the kill switch and ``LIK_BACKEND`` — all
observed on real calls, never by checking that an attribute was set."""
from __future__ import annotations

import pytest
import torch

import lik_plugins as lik
from lik_plugins.autograd.dense import choose_backward
from lik_plugins.kernels import reference
from lik_plugins.kernels.dispatch import served_by, why_not
from support.maxsim_testlib import backend_params, check_against_reference, make_inputs, rel_err

BACKENDS = backend_params()


def _launcher(backend):
    if backend == "triton":
        from lik_plugins.kernels.triton import launch

        return launch
    from lik_plugins.kernels import chunked

    return chunked


@pytest.fixture
def spy(monkeypatch, request):
    """Record ``save_argmax`` of every forward and (need_q, need_d, strategy) of every
    backward of the launcher that serves the test's backend."""
    backend = request.getfixturevalue("backend")
    monkeypatch.setenv("LIK_BACKEND", backend)
    module = _launcher(backend)
    calls = {"forward": [], "backward": []}
    real_forward, real_backward = module.forward, module.backward

    def forward(*args, **kwargs):
        scores, argmax = real_forward(*args, **kwargs)
        calls["forward"].append((kwargs["save_argmax"], argmax is not None))
        return scores, argmax

    def backward(*args, **kwargs):
        calls["backward"].append((kwargs["need_q"], kwargs["need_d"], kwargs["strategy"]))
        return real_backward(*args, **kwargs)

    monkeypatch.setattr(module, "forward", forward)
    monkeypatch.setattr(module, "backward", backward)
    return calls


def _small(gen, layout="cross", dtype=torch.float32):
    return make_inputs(gen, layout, 2, 3, 4, 9, 16, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_argmax_under_no_grad(gen, backend, spy):
    Q, D, qm, dm = _small(gen)
    Q.requires_grad_()
    D.requires_grad_()
    with torch.no_grad():
        out = lik.maxsim(Q, D, qm, dm)
    assert out.grad_fn is None and not out.requires_grad
    with torch.inference_mode():
        out = lik.maxsim_pairs(Q, D[:2], qm, dm[:2])
    assert out.grad_fn is None
    assert spy["forward"] == [(False, False), (False, False)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_argmax_when_no_input_requires_grad(gen, backend, spy):
    Q, D, qm, dm = _small(gen)
    out = lik.maxsim(Q, D, qm, dm)
    assert out.grad_fn is None and not out.requires_grad
    assert spy["forward"] == [(False, False)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_argmax_saved_when_a_gradient_is_needed(gen, backend, spy):
    Q, D, qm, dm = _small(gen)
    Q.requires_grad_()
    D.requires_grad_()
    out = lik.maxsim(Q, D, qm, dm)
    assert out.grad_fn is not None
    out.sum().backward()
    assert spy["forward"] == [(True, True)]
    shape = (Q.shape[0], Q.shape[1], D.shape[0], D.shape[1], Q.shape[2])
    assert spy["backward"] == [(True, True, choose_backward("auto", cross=True, shape=shape))]
    assert Q.grad is not None and D.grad is not None


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["cross", "kd", "pairs"])
def test_gradients_only_for_inputs_that_require_them(gen, backend, spy, layout):
    Q, D, qm, dm = make_inputs(gen, layout, 2, 2, 4, 9, 16)
    check_against_reference(layout, Q, D, qm, dm, gen=gen, need_q=True, need_d=False)
    check_against_reference(layout, Q, D, qm, dm, gen=gen, need_q=False, need_d=True)
    assert [c[:2] for c in spy["backward"]] == [(True, False), (False, True)]
    # through .backward(): the frozen input gets no .grad at all
    Qr, Dr = Q.clone().requires_grad_(), D.clone()
    op = lik.maxsim_pairs if layout == "pairs" else lik.maxsim
    op(Qr, Dr, qm, dm).sum().backward()
    assert Qr.grad is not None and Dr.grad is None


# what ``backward="auto"`` resolves to for the small shapes below, as documented in
# choose_backward / maxsim (a cross product this small has too few query programs for unified)
AUTO = {"cross": "lowmem", "kd": "lowmem", "pairs": "lowmem"}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["cross", "kd", "pairs"])
@pytest.mark.parametrize("strategy", ["auto", "lowmem", "unified"])
def test_backward_strategy_reaches_the_launcher(gen, backend, spy, strategy, layout):
    Q, D, qm, dm = make_inputs(gen, layout, 2, 2, 4, 9, 16)
    check_against_reference(layout, Q, D, qm, dm, gen=gen, backward=strategy)
    resolved = AUTO[layout] if strategy == "auto" else strategy
    assert spy["backward"] == [(True, True, resolved)]


def test_choose_backward():
    assert choose_backward("auto", cross=True) == "unified"          # no shape: the cross-product default
    assert choose_backward("auto", cross=False) == AUTO["kd"]
    # (Nq, Lq, Nd, Ld, d) of the benchmark's in-batch training shapes
    assert choose_backward("auto", cross=True, shape=(2, 4, 2, 9, 16)) == AUTO["cross"]
    assert choose_backward("auto", cross=True, shape=(64, 32, 64, 1030, 128)) == "lowmem"     # 64 programs
    assert choose_backward("auto", cross=True, shape=(256, 32, 256, 256, 128)) == "lowmem"    # short documents
    assert choose_backward("auto", cross=True, shape=(1024, 32, 1024, 256, 128)) == "lowmem"  # 32768 query rows
    assert choose_backward("auto", cross=True, shape=(1025, 32, 1024, 256, 128)) == "unified"  # one query more
    assert choose_backward("auto", cross=True, shape=(256, 32, 256, 1030, 128)) == "unified"  # long documents
    assert choose_backward("auto", cross=True, shape=(66, 64, 66, 1030, 128)) == "unified"    # 132 programs
    for strategy in ("lowmem", "unified"):
        assert choose_backward(strategy, cross=True) == choose_backward(strategy, cross=False) == strategy
    with pytest.raises(ValueError, match=r"backward must be one of 'auto', 'unified', 'lowmem'; got 'fast'"):
        choose_backward("fast", cross=True)


# ------------------------------------------------------------------ routing counts
def test_routing_counts_per_entry(gen):
    lik.reset_routing_counts()
    assert lik.routing_counts() == {}
    Q, D, qm, dm = _small(gen)
    lik.maxsim(Q, D, qm, dm)
    lik.maxsim(Q, D)
    lik.maxsim_pairs(Q, D[:2])
    lik.retrieve(Q, D, 2, chunk=1)  # three chunks, one call
    assert lik.routing_counts() == {
        "maxsim": {"torch-chunked": 2},
        "maxsim_pairs": {"torch-chunked": 1},
        "retrieve": {"torch-chunked": 1},
    }


def test_routing_counts_is_a_snapshot_and_reset_clears(gen):
    lik.reset_routing_counts()
    Q, D, _, _ = _small(gen)
    lik.maxsim(Q, D)
    snap = lik.routing_counts()
    snap["maxsim"]["torch-chunked"] = 99
    snap["other"] = {}
    assert lik.routing_counts() == {"maxsim": {"torch-chunked": 1}}
    lik.reset_routing_counts()
    assert lik.routing_counts() == {}
    lik.maxsim(Q, D)
    assert lik.routing_counts() == {"maxsim": {"torch-chunked": 1}}


def test_unknown_routing_path_is_rejected():
    from lik_plugins import _routing

    with pytest.raises(ValueError, match=r"unknown routing path 'gpu'"):
        _routing.record("maxsim", "gpu")


@pytest.mark.parametrize(
    "env,expected",
    [
        ({}, "torch-chunked"),
        ({"LIK_BACKEND": "auto"}, "torch-chunked"),
        ({"LIK_BACKEND": "torch-chunked"}, "torch-chunked"),
        ({"LIK_BACKEND": "reference"}, "reference"),
        ({"LIK_BACKEND": " Reference "}, "reference"),
        ({"LIK_DISABLE": "1"}, "reference"),
        ({"LIK_DISABLE": "true", "LIK_BACKEND": "torch-chunked"}, "reference"),
        ({"LIK_DISABLE": "0"}, "torch-chunked"),
        ({"LIK_DISABLE": ""}, "torch-chunked"),
    ],
)
def test_served_by_and_routing_agree(gen, monkeypatch, env, expected):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    Q, D, qm, dm = _small(gen)
    assert served_by(Q) == expected
    lik.reset_routing_counts()
    out = lik.maxsim(Q, D, qm, dm)
    assert lik.routing_counts() == {"maxsim": {expected: 1}}
    assert rel_err(out, reference.maxsim(Q.double(), D.double(), qm, dm)) < 2e-5


@pytest.mark.parametrize("backend", [p for p in BACKENDS if p.id == "triton"])
def test_served_by_triton_under_the_interpreter(gen, monkeypatch, backend):
    monkeypatch.setenv("LIK_BACKEND", backend)
    Q, _, _, _ = _small(gen)
    assert served_by(Q) == "triton"
    assert served_by(Q.bfloat16()) == "triton"


def test_forced_triton_without_interpreter_says_why(gen, monkeypatch):
    monkeypatch.setenv("LIK_BACKEND", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    Q, _, _, _ = _small(gen)
    with pytest.raises(RuntimeError, match=r"LIK_BACKEND=triton, but .*set TRITON_INTERPRET=1"):
        served_by(Q)


def test_each_backend_says_why_it_does_not_serve(monkeypatch):
    """The chooser's reasons: CPU tensors under the default settings, then the reference
    requested, then the Triton kernels asked for with embeddings too wide for a built
    document (served by the chunked path, the reason named) but not for the smooth max."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    t, wide = torch.zeros(2, 3, 8), torch.zeros(2, 3, 384)
    assert served_by(t) == "torch-chunked" and why_not("torch-chunked", t) == ""
    assert "LIK_DISABLE=1 or LIK_BACKEND=reference" in why_not("reference", t)
    assert "take MPS tensors" in why_not("metal", t)
    assert "only with LIK_BACKEND=triton" in why_not("triton", t) or "not installed" in why_not("triton", t)
    monkeypatch.setenv("LIK_DISABLE", "1")
    assert served_by(t) == "reference" and why_not("reference", t) == ""
    monkeypatch.delenv("LIK_DISABLE")
    from lik_plugins.kernels.device import triton_available

    if not triton_available():
        return
    monkeypatch.setenv("LIK_BACKEND", "triton")
    assert why_not("triton", t, "residual") == "" and served_by(t, "residual") == "triton"
    assert "wider than 256" in why_not("triton", wide, "residual")
    assert served_by(wide, "residual") == served_by(wide, "hidden") == "torch-chunked"
    assert served_by(wide, "smooth") == "triton"     # asked for: the smooth kernel takes any width
    monkeypatch.setenv("LIK_BACKEND", "auto")
    assert served_by(wide, "smooth") == "torch-chunked" and served_by(t, "fp8") == "triton"


def test_invalid_lik_backend(gen, monkeypatch):
    monkeypatch.setenv("LIK_BACKEND", "cuda")
    Q, D, _, _ = _small(gen)
    with pytest.raises(ValueError, match=r"LIK_BACKEND='cuda' is not one of auto, triton, torch-chunked, reference"):
        lik.maxsim(Q, D)
    with pytest.raises(ValueError, match=r"LIK_BACKEND='cuda'"):
        lik.maxsim_pairs(Q, D[:2])
    with pytest.raises(ValueError, match=r"LIK_BACKEND='cuda'"):
        lik.retrieve(Q, D, 1)


# ------------------------------------------------------------------ kill switch
@pytest.mark.parametrize("layout", ["cross", "kd", "pairs"])
def test_kill_switch_runs_the_reference_with_correct_values_and_grads(gen, monkeypatch, layout):
    monkeypatch.setenv("LIK_DISABLE", "1")
    lik.reset_routing_counts()
    Q, D, qm, dm = make_inputs(gen, layout, 3, 2, 5, 9, 24)
    check_against_reference(layout, Q, D, qm, dm, gen=gen, mask_mode="zero", normalize=True)
    entry = "maxsim_pairs" if layout == "pairs" else "maxsim"
    assert lik.routing_counts() == {entry: {"reference": 1}}


def test_kill_switch_is_read_at_call_time(gen, monkeypatch):
    Q, D, qm, dm = _small(gen)
    lik.reset_routing_counts()
    lik.maxsim(Q, D, qm, dm)
    monkeypatch.setenv("LIK_DISABLE", "1")
    disabled = lik.maxsim(Q, D, qm, dm)
    lik.retrieve(Q, D, 2)
    monkeypatch.delenv("LIK_DISABLE")
    enabled = lik.maxsim(Q, D, qm, dm)
    assert lik.routing_counts() == {
        "maxsim": {"torch-chunked": 2, "reference": 1},
        "retrieve": {"reference": 1},
    }
    assert rel_err(disabled, enabled) < 1e-6


def test_environment_reads_see_every_way_of_changing_it(monkeypatch):
    """Our variables are read at call time: assignment, update, pop, ``del`` and pytest's
    monkeypatch must all be visible on the next call."""
    import os

    from lik_plugins import _config

    monkeypatch.delenv("LIK_DISABLE", raising=False)
    monkeypatch.delenv("LIK_BACKEND", raising=False)
    assert not _config.disabled() and _config.forced_backend() == "auto"
    monkeypatch.setenv("LIK_DISABLE", "Yes")
    assert _config.disabled()
    os.environ["LIK_DISABLE"] = "0"
    assert not _config.disabled()
    os.environ.update(LIK_BACKEND=" Torch-Chunked ", LIK_CHUNK_ELEMENTS="4096")
    assert _config.forced_backend() == "torch-chunked" and _config.chunk_elements() == 4096
    os.environ.pop("LIK_BACKEND")
    del os.environ["LIK_CHUNK_ELEMENTS"]
    assert _config.forced_backend() == "auto" and _config.chunk_elements() == 1 << 24
    monkeypatch.setenv("LIK_DIRECT_LAUNCH", "off")
    assert not _config.direct_launch_enabled()
    monkeypatch.setenv("PYLATE_SCORES_BACKEND", "LIK")
    assert _config.scores_backend("PYLATE_SCORES_BACKEND") == "lik"


def test_kill_switch_output_dtype(gen, monkeypatch):
    """The plain formulation returns float32 scores for half inputs (float64 for float64),
    like every other path."""
    monkeypatch.setenv("LIK_DISABLE", "1")
    for dtype, out_dtype in ((torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                             (torch.float32, torch.float32), (torch.float64, torch.float64)):
        Q, D, qm, dm = _small(gen, dtype=dtype)
        assert lik.maxsim(Q, D, qm, dm).dtype == out_dtype
