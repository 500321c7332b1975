"""Metal launchers without an Apple GPU: grids, constants, availability, the fallback
helper, degenerate sizes, and the launchers end to end on the emulator."""
import re
import warnings

import pytest
import torch

from lik_plugins.kernels import chunked, reference
from lik_plugins.kernels.metal import launch
from metal_emulator import emulate


def _defines() -> dict[str, int]:
    text = "".join(p.read_text() for p in launch.SHADER_DIR.glob("*.metal"))
    found = {}
    for name, value in re.findall(r"^#define (\w+) \(?(\d+)\)?\b", text, flags=re.M):
        found[name] = int(value)
    return found


def test_launcher_constants_match_the_shaders():
    d = _defines()
    assert (d["LIK_THREADS"], d["LIK_SIMDGROUPS"]) == (launch.THREADS, launch.SIMDGROUPS)
    assert d["LIK_THREADS"] == 32 * d["LIK_SIMDGROUPS"]
    assert (d["FWD_BM"], d["GD_TOKENS"], d["SM_DMAX"]) == (launch.BLOCK_ROWS, launch.GRAD_D_TOKENS, launch.SMOOTH_MAX_DIM)
    assert (d["MODE_MAX"], d["MODE_SMOOTH"]) == (launch.MODE_MAX, launch.MODE_SMOOTH)
    assert d["FWD_BM"] == 8 * d["LIK_SIMDGROUPS"]   # one 8-row simdgroup matrix per simdgroup


@pytest.mark.parametrize("lq, cross, want", [(32, True, 1), (5, True, 6), (1, True, 32), (33, True, 1), (5, False, 1)])
def test_queries_per_group(lq, cross, want):
    assert launch.queries_per_group(lq, cross) == want
    assert want * lq <= launch.BLOCK_ROWS or want == 1


def test_grids():
    # 7 queries of 5 tokens: 6 per group -> 2 groups; one column of groups per document
    assert launch.query_grid(7, 5, 3, cross=True) == ([2 * 128, 3], [128, 1])
    assert launch.query_grid(7, 5, 3, cross=False) == ([7 * 128, 3], [128, 1])
    assert launch.token_grid(4, 3, 65, cross=True, block=32) == ([3 * 128, 3], [128, 1])
    assert launch.token_grid(4, 3, 65, cross=False, block=32) == ([3 * 128, 12], [128, 1])
    assert launch.row_grid(9) == ([3 * 128], [128])
    for threads, group in (launch.query_grid(3, 40, 2, True), launch.token_grid(2, 2, 1, False, 32)):
        assert all(t % g == 0 for t, g in zip(threads, group))   # whole threadgroups only


def test_library_source_prelude():
    for dtype, name in ((torch.float16, "half"), (torch.bfloat16, "bfloat"), (torch.float32, "float")):
        src = launch.library_source(dtype)
        assert src.startswith("#include <metal_stdlib>\nusing namespace metal;\n")
        assert f"typedef {name} elem_t;" in src
        for f in launch.SHADER_FILES:
            assert (launch.SHADER_DIR / f).read_text() in src   # the shipped text, unmodified
    with pytest.raises(TypeError, match="fp16/bf16/fp32"):
        launch.library_source(torch.float64)


def test_serves_explains_why_not():
    ok, why = launch.serves(torch.zeros(2, 3, 4))
    assert not ok and "MPS" in why and "cpu" in why
    ok, why = launch.serves(torch.zeros(2, 3, 4, device="meta"))
    assert not ok and "meta" in why


@pytest.fixture
def clean_failures():
    launch.reset_failures()
    yield
    launch.reset_failures()


def test_guarded_falls_back_once_with_a_warning(clean_failures):
    calls = []

    def broken():
        calls.append("metal")
        raise RuntimeError("command buffer faulted")

    with pytest.warns(RuntimeWarning, match="command buffer faulted"):
        assert launch.guarded(torch.float16, broken, lambda: "chunked") == "chunked"
    assert launch.failure_reason(torch.float16) == "RuntimeError: command buffer faulted"
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no second warning, and Metal is not tried again
        assert launch.guarded(torch.float16, broken, lambda: "chunked") == "chunked"
    assert calls == ["metal"]
    assert launch.guarded(torch.float32, lambda: "metal", lambda: "chunked") == "metal"   # other dtypes unaffected


def test_guarded_lets_bad_input_through(clean_failures):
    def bad():
        raise ValueError("embedding dims differ")

    with pytest.raises(ValueError):
        launch.guarded(torch.float32, bad, lambda: "chunked")
    assert launch.failure_reason(torch.float32) is None


def test_compile_or_reason_reports_a_compile_error(clean_failures):
    def failing_compiler(source):
        raise RuntimeError("program_source:12: error: unknown type name 'bfloat'")

    with launch.using_compiler(failing_compiler):
        with pytest.warns(RuntimeWarning, match="bfloat"):
            reason = launch.compile_or_reason(torch.bfloat16)
    assert "unknown type name" in reason
    assert launch.compile_or_reason(torch.bfloat16) == reason   # remembered, not recompiled


def test_degenerate_sizes_need_no_launch():
    def no_compiler(source):
        raise AssertionError("nothing should be compiled for empty work")

    with launch.using_compiler(no_compiler):
        Q, D = torch.randn(2, 3, 8), torch.randn(4, 0, 8)
        scores, argmax = launch.forward(Q, D, None, None, cross=True, normalize=False, zero_mode=False, save_argmax=True)
        assert torch.equal(scores, torch.zeros(2, 4)) and bool((argmax == -1).all())
        gq, gd = launch.backward(torch.randn(2, 4), Q, D, argmax, cross=True, normalize=False, need_q=True, need_d=True)
        assert torch.equal(gq, torch.zeros_like(Q)) and gd.shape == D.shape
        scores, lse = launch.smooth_forward(Q, D, 0.1, True)
        assert bool(torch.isneginf(lse).all()) and scores.shape == (2, 4)


def test_bad_inputs_are_rejected():
    Q = torch.randn(2, 3, 8)
    with pytest.raises(TypeError, match="share a dtype"):
        launch.forward(Q, torch.randn(4, 5, 8, dtype=torch.float16), None, None, cross=True, normalize=False,
                       zero_mode=False, save_argmax=False)
    with pytest.raises(ValueError, match="embedding dims"):
        launch.forward(Q, torch.randn(4, 5, 7), None, None, cross=True, normalize=False, zero_mode=False, save_argmax=False)
    with pytest.raises(ValueError, match="mask of shape"):
        launch.forward(Q, torch.randn(4, 5, 8), None, torch.ones(4, 6, dtype=torch.bool), cross=True, normalize=False,
                       zero_mode=False, save_argmax=False)


def test_launchers_on_the_emulator_match_chunked(compiler):
    """int64 argmax accepted, 0/1 float masks, grads only where asked, cast to the input dtype."""
    g = torch.Generator().manual_seed(3)
    Q, D = torch.randn(3, 4, 12, generator=g), torch.randn(3, 2, 6, 12, generator=g)
    q_mask = (torch.rand(3, 4, generator=g) > 0.3).float()
    d_mask = torch.rand(3, 2, 6, generator=g) > 0.3
    grad = torch.randn(3, 2, generator=g)
    kw = dict(cross=False, normalize=True, zero_mode=True)
    with launch.using_compiler(emulate.EmulatedLibrary):
        scores, argmax = launch.forward(Q, D, q_mask, d_mask, save_argmax=True, **kw)
        gq, gd = launch.backward(grad, Q, D, argmax.long(), cross=False, normalize=True, need_q=False, need_d=True)
    want, want_arg = chunked.forward(Q, D, q_mask.bool(), d_mask, save_argmax=True, **kw)
    assert argmax.dtype == want_arg.dtype == torch.int16 and torch.equal(argmax, want_arg)   # one dtype on every path
    assert torch.allclose(scores, want, atol=1e-5)
    assert torch.allclose(scores, reference.maxsim(Q, D, q_mask, d_mask, normalize=True, mask_mode="zero"), atol=1e-5)
    # the argmax is what a fallback to chunked.backward receives after a Metal forward
    _, want_gd = chunked.backward(grad, Q, D, argmax, cross=False, normalize=True, need_q=False, need_d=True)
    assert gq is None and gd.dtype == D.dtype and torch.allclose(gd, want_gd, atol=1e-5)


def test_smooth_backward_wide_embeddings_use_the_chunked_path():
    from lik_plugins.kernels.reference import smooth_maxsim as smooth_maxsim_reference

    g = torch.Generator().manual_seed(4)
    Q, D = torch.randn(2, 3, 130, generator=g, dtype=torch.float64), torch.randn(2, 5, 130, generator=g, dtype=torch.float64)
    Q.requires_grad_()
    D.requires_grad_()
    grad = torch.randn(2, 2, generator=g, dtype=torch.float64)
    want_gq, want_gd = torch.autograd.grad(smooth_maxsim_reference(Q, D, tau=0.3), (Q, D), grad)
    sim = torch.einsum("ash,bth->abst", Q.detach(), D.detach())
    lse = torch.logsumexp(sim / 0.3, dim=-1)

    def no_compiler(source):
        raise AssertionError("d > SMOOTH_MAX_DIM must not reach the Metal kernel")

    with launch.using_compiler(no_compiler):
        gq, gd = launch.smooth_backward(Q.detach().float(), D.detach().float(), lse.float(), grad.float(), 0.3, True, True, True)
    assert torch.allclose(gq.double(), want_gq, atol=1e-3) and torch.allclose(gd.double(), want_gd, atol=1e-3)


def test_the_dispatcher_serves_metal_through_the_guarded_launchers(compiler, clean_failures, monkeypatch):
    """The one dispatcher's "metal" implementation: the emulated kernels through the same
    guarded launchers MPS tensors get (scores, winners and gradients as the chunked path),
    and a device fault falls back to the chunked path with a warning."""
    from lik_plugins.kernels import dispatch

    impl = dispatch.implementation("metal")
    g = torch.Generator().manual_seed(6)
    Q, D = torch.randn(2, 5, 12, generator=g), torch.randn(4, 7, 12, generator=g)
    d_mask = torch.rand(4, 7, generator=g) > 0.3
    kw = dict(cross=True, normalize=False, zero_mode=False, save_argmax=True)
    want, want_arg = chunked.forward(Q, D, None, d_mask, **kw)
    with launch.using_compiler(emulate.EmulatedLibrary):
        scores, argmax = impl.maxsim.forward(Q, D, None, d_mask, **kw)
        grads = impl.maxsim.backward(torch.ones(2, 4), Q, D, argmax, cross=True, normalize=False, need_q=True,
                                     need_d=True, strategy="auto")
    assert torch.allclose(scores, want, atol=1e-5) and torch.equal(argmax, want_arg)
    for got, ref in zip(grads, chunked.backward(torch.ones(2, 4), Q, D, want_arg, cross=True, normalize=False,
                                                need_q=True, need_d=True)):
        assert torch.allclose(got, ref, atol=1e-5)

    def faulting(source):
        raise RuntimeError("command buffer faulted")

    with launch.using_compiler(faulting), pytest.warns(RuntimeWarning, match="faulted"):
        scores, _ = impl.maxsim.forward(Q, D, None, d_mask, **kw)
    assert torch.allclose(scores, want, atol=1e-5)
