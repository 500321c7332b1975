"""Plans of the direct launcher: what they are keyed on, and that the interpreter (CI)
never replays a compiled launcher (it has none).  The replay itself is checked on a GPU
against the JIT path, bit for bit (the gpu-marked cases of tests/kernels/test_dense.py)."""
from __future__ import annotations

import pytest
import torch

from lik_plugins.kernels import dispatch

pytestmark = pytest.mark.skipif(not dispatch.triton_available(), reason="needs triton")


def test_plan_key_separates_what_triton_specialises_on():
    from lik_plugins.kernels.triton.variants import _feature

    # integers: equal to 1, divisible by 16, 32 or 64 bits -- each changes the compiled code
    assert _feature(1) != _feature(3)
    assert _feature(16) != _feature(17)
    assert _feature(16) == _feature(4096)           # same specialisation: one plan serves both
    assert _feature(2**31) != _feature(2**31 - 16)
    # tensors: dtype and 16-byte alignment of the address
    x = torch.zeros(64, dtype=torch.float32)
    assert _feature(x) == _feature(x[4:])           # 16 bytes in: still aligned
    assert _feature(x) != _feature(x[1:])           # 4 bytes in: not
    assert _feature(x) != _feature(x.to(torch.float16))
    assert _feature(True) != _feature(False) and _feature(None) != _feature(False)


def test_interpreter_launches_through_the_jit_and_keeps_no_plans(monkeypatch):
    from lik_plugins._config import triton_interpret

    if not triton_interpret():
        pytest.skip("needs TRITON_INTERPRET=1")
    import lik_plugins as lik
    from lik_plugins.kernels.triton import direct

    monkeypatch.setenv("LIK_BACKEND", "triton")
    direct.clear()
    Q, D = torch.randn(2, 5, 16), torch.randn(3, 7, 16)
    assert dispatch.served_by(Q) == "triton"
    with torch.no_grad():
        out = lik.maxsim(Q, D)
    ref = (Q.double() @ D.double().reshape(-1, 16).T).reshape(2, 5, 3, 7).amax(-1).sum(1)
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert direct._plans == {}


def test_forward_plans_are_reused_per_geometry_and_stay_exact(monkeypatch):
    from lik_plugins._config import triton_interpret

    if not triton_interpret():
        pytest.skip("needs TRITON_INTERPRET=1")
    import lik_plugins as lik
    from lik_plugins.kernels.triton import launch

    monkeypatch.setenv("LIK_BACKEND", "triton")
    launch.clear_plans()
    g = torch.Generator().manual_seed(0)
    Q, D = torch.randn(2, 5, 16, generator=g), torch.randn(3, 7, 16, generator=g)
    dm = torch.rand(3, 7, generator=g) > 0.3
    with torch.no_grad():
        first = lik.maxsim(Q, D, d_mask=dm)
        assert len(launch._FORWARD_PLANS) == 1
        again = lik.maxsim(Q.clone(), D.clone(), d_mask=dm.clone())      # same geometry: same plan
        assert len(launch._FORWARD_PLANS) == 1 and torch.equal(first, again)
        # a strided mask (a column view) and a transposed D change the strides: new plans, same scores
        wide = torch.zeros(3, 14, dtype=torch.bool)
        wide[:, ::2] = dm
        strided = lik.maxsim(Q, D, d_mask=wide[:, ::2])
        D_t = D.transpose(1, 2).contiguous().transpose(1, 2)
        transposed = lik.maxsim(Q, D_t, d_mask=dm)
        assert len(launch._FORWARD_PLANS) == 3
        assert torch.equal(strided, first) and torch.allclose(transposed, first, rtol=1e-6, atol=1e-6)
    launch.clear_plans()
    assert launch._FORWARD_PLANS == {}


def test_profiler_hooks_send_launches_through_the_jit(monkeypatch):
    """A launch hook (a profiler's) must see every launch: replaying skips it, so any hook
    in Triton's hook chains (or a plain callable on older releases) turns replay off."""
    import triton

    from lik_plugins.kernels.triton import direct

    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None:
        pytest.skip("this Triton has no knobs: replay is off anyway")

    class Chain:  # the shape of triton.knobs.HookChain
        def __init__(self, calls):
            self.calls = calls

    monkeypatch.setattr(runtime, "launch_enter_hook", Chain([]))
    monkeypatch.setattr(runtime, "launch_exit_hook", Chain([]))
    assert not direct._hooks_set()
    monkeypatch.setattr(runtime, "launch_enter_hook", Chain([lambda *a: None]))
    assert direct._hooks_set()
    monkeypatch.setattr(runtime, "launch_enter_hook", None)
    monkeypatch.setattr(runtime, "launch_exit_hook", lambda *a: None)
    assert direct._hooks_set()


def _gradients(lik, Q, D, pairs=False, specification=False):
    from lik_plugins.kernels import reference

    Q, D = Q.clone().requires_grad_(), D.clone().requires_grad_()
    if specification:
        scores = reference.maxsim(Q, D.unsqueeze(1) if pairs else D)
        scores = scores.squeeze(1) if pairs else scores
    else:
        scores = (lik.maxsim_pairs if pairs else lik.maxsim)(Q, D, backward="lowmem")
    scores.backward(torch.linspace(-1, 1, scores.numel()).reshape(scores.shape))
    return scores.detach(), Q.grad, D.grad


@pytest.mark.parametrize("route", ["compact", "dense", "winners", "split-gather"])
def test_backward_plans_are_reused_per_geometry_and_stay_exact(monkeypatch, route):
    """A repeated lowmem backward replays its plan (one per geometry and route) and gives
    the same gradients, bit for bit, as the call that made the plan; after a blocking
    constant changes and the plans are cleared, the next call plans with the new blocking."""
    from lik_plugins._config import triton_interpret

    if not triton_interpret():
        pytest.skip("needs TRITON_INTERPRET=1")
    import lik_plugins as lik
    from lik_plugins.kernels.triton import backward_launch, blocking, launch

    monkeypatch.setenv("LIK_BACKEND", "triton")
    g = torch.Generator().manual_seed(1)
    pairs = route == "winners"
    Q = torch.randn(3, 6, 16, generator=g)
    D = torch.randn(3 if pairs else 4, 9, 16, generator=g)
    if route == "compact":
        monkeypatch.setattr(backward_launch, "COMPACT_MIN_WORK", 1)   # list the rows even at this size
    if route == "split-gather":
        Q, D = torch.randn(1, 4, 16, generator=g), torch.randn(40, 5, 16, generator=g)
        monkeypatch.setattr(blocking, "GATHER_STEP_ELEMS", 64)       # one document a step: 40 steps
        monkeypatch.setattr(blocking, "GATHER_SPLIT_MIN_STEPS", 2)   # split them over programs
    nq, lq, nj, ld = Q.shape[0], Q.shape[1], D.shape[0], D.shape[1]
    block_s, block_j, n_gather, n_split, _ = blocking.gather_blocking(nq, nj, lq, 16, 132)
    kind, gather = backward_launch._lowmem_route(nq, lq, nj, ld, cross=not pairs, need_q=True, n_gather=n_gather,
                                                 n_split=n_split, sms=132)
    assert (kind, gather) == {"compact": ("compact", "ride"), "dense": ("dense", "ride"),
                              "winners": ("winners", "ride"), "split-gather": ("dense", "alone")}[route]
    launch.clear_plans()
    first = _gradients(lik, Q, D, pairs)
    assert len(backward_launch._LOWMEM_PLANS) == 1
    again = _gradients(lik, Q, D, pairs)
    assert len(backward_launch._LOWMEM_PLANS) == 1
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    # the plan-made gradients are the specification's
    ref = _gradients(lik, Q.double(), D.double(), pairs, specification=True)
    for a, b in zip(first, ref):
        assert torch.allclose(a.double(), b, rtol=1e-5, atol=1e-5)
    plan = next(iter(backward_launch._LOWMEM_PLANS.values()))
    monkeypatch.setattr(blocking, "GATHER_MAX_BLOCK_S", 2)
    launch.clear_plans()                        # plans do not key on the module's constants
    changed = _gradients(lik, Q, D, pairs)
    assert len(backward_launch._LOWMEM_PLANS) == 1
    assert next(iter(backward_launch._LOWMEM_PLANS.values())) is not plan
    for a, b in zip(first, changed):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    launch.clear_plans()
    assert backward_launch._LOWMEM_PLANS == {}


def test_compact_row_lists_are_freed_before_a_separate_gather(monkeypatch):
    """The peak of a compact lowmem backward whose gather runs alone: the int16 row lists
    (the argmax's size) must be gone when grad_Q is allocated and gathered."""
    import gc

    from lik_plugins._config import triton_interpret

    if not triton_interpret():
        pytest.skip("needs TRITON_INTERPRET=1")
    import lik_plugins as lik
    from lik_plugins.kernels.triton import backward_launch, launch

    monkeypatch.setenv("LIK_BACKEND", "triton")
    monkeypatch.setattr(backward_launch, "COMPACT_MIN_WORK", 1)
    monkeypatch.setattr(backward_launch, "GATHER_ALONE_MIN_WAVES", 0)   # the gather never rides
    nq, lq, nj = 3, 6, 4
    live_lists = []
    real_gather = backward_launch._gather_pass

    def gather(*args, **kw):
        gc.collect()
        # type(), not isinstance(): some module proxies warn when their __class__ is read
        live_lists.append(sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor)
                              and o.dtype == torch.int16 and tuple(o.shape) == (nj, nq * lq)))
        return real_gather(*args, **kw)

    monkeypatch.setattr(backward_launch, "_gather_pass", gather)
    g = torch.Generator().manual_seed(2)
    Q = torch.randn(nq, lq, 16, generator=g, requires_grad=True)
    D = torch.randn(nj, 9, 16, generator=g, requires_grad=True)
    launch.clear_plans()
    for _ in range(2):  # the call that makes the plan and the one that replays it
        lik.maxsim(Q, D, backward="lowmem").sum().backward()
    launch.clear_plans()
    assert live_lists == [0, 0]


def _plain_jit_kernel():
    """A real ``JITFunction`` even under the interpreter (what the GPU path launches)."""
    import triton
    import triton.language as tl

    def scale_kernel(X, n, BLOCK: tl.constexpr):
        o = tl.arange(0, BLOCK)
        tl.store(X + o, tl.load(X + o, mask=o < n) * 2, mask=o < n)

    return triton.runtime.JITFunction(scale_kernel)


def test_a_shipped_binary_serves_the_plan_without_the_jit(monkeypatch):
    """``LIK_SHIPPED_BINARIES=1``: the plan's first launch asks the loader once, and every
    launch of the plan goes to the shipped binary with its grid, PyTorch's stream and the
    call's arguments; unset, the loader is not asked and the JIT launches."""
    from lik_plugins.kernels.triton import binaries_loader, direct, variants

    kernel = _plain_jit_kernel()
    asked, launched, jit = [], [], []

    def shipped(grid, stream, args):
        launched.append((grid, stream, args))

    monkeypatch.setattr(binaries_loader, "find", lambda k, needed, device: asked.append(needed) or shipped)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 77, raising=False)
    monkeypatch.setattr(kernel, "run", lambda *a, **k: jit.append((a, k)))
    monkeypatch.setattr(binaries_loader, "from_jit", lambda compiled, n_args, device: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)   # a CPU torch raises here
    monkeypatch.setenv("LIK_SHIPPED_BINARIES", "1")
    direct.clear()
    x = torch.zeros(64)
    direct.launch(kernel, (3,), (x, 5), {"BLOCK": 16})
    direct.launch(kernel, lambda meta: (meta["BLOCK"] // 8, 2), (x[16:], 9), {"BLOCK": 16})
    assert len(asked) == 1 and asked[0] == variants.variant(kernel, (x, 5), {"BLOCK": 16})
    assert [(grid, stream) for grid, stream, _ in launched] == [((3,), 77), ((2, 2), 77)]
    assert launched[1][2][0].data_ptr() == x[16:].data_ptr() and launched[1][2][1] == 9
    assert jit == []
    # another specialisation (an address off 16 bytes) is another variant: asked again
    direct.launch(kernel, (1,), (x[1:], 5), {"BLOCK": 16})
    assert len(asked) == 2 and len(launched) == 3

    monkeypatch.setenv("LIK_SHIPPED_BINARIES", "0")
    direct.clear()
    direct.launch(kernel, (3,), (x, 5), {"BLOCK": 16})
    assert len(asked) == 2 and len(launched) == 3 and len(jit) == 1
    # on, but no binary for this launch (another GPU, no driver, a variant not shipped): the JIT
    monkeypatch.setenv("LIK_SHIPPED_BINARIES", "1")
    monkeypatch.setattr(binaries_loader, "find", lambda k, needed, device: asked.append(needed))
    direct.clear()
    direct.launch(kernel, (3,), (x, 5), {"BLOCK": 16})
    assert len(asked) == 3 and len(launched) == 3 and len(jit) == 2


def test_the_jits_binary_serves_the_plan_after_its_first_launch(monkeypatch):
    """No shipped binary: the first launch goes through the JIT and its compiled kernel,
    wrapped for the driver (``binaries_loader.from_jit``), serves every later launch of the
    plan with the new arguments; where it cannot be wrapped, every launch takes the JIT."""
    from lik_plugins.kernels.triton import binaries_loader, direct

    kernel = _plain_jit_kernel()
    jit, wrapped, launched = [], [], []
    compiled = object()

    def driver_launch(grid, stream, args):
        launched.append((grid, stream, args))

    monkeypatch.setattr(binaries_loader, "find", lambda k, needed, device: None)
    monkeypatch.setattr(binaries_loader, "from_jit",
                        lambda c, n_args, device: wrapped.append((c, n_args)) or driver_launch)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 5, raising=False)
    monkeypatch.setattr(kernel, "run", lambda *a, **k: jit.append(a) or compiled)
    direct.clear()
    x = torch.zeros(64)
    assert direct.launch(kernel, (3,), (x, 5), {"BLOCK": 16}) is compiled
    direct.launch(kernel, (4,), (x, 7), {"BLOCK": 16})
    assert len(jit) == 1 and wrapped == [(compiled, 2)]
    assert launched == [((4,), 5, (x, 7))]
    refusals = []
    monkeypatch.setattr(binaries_loader, "from_jit", lambda c, n_args, device: refusals.append(c))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)   # a CPU torch raises here
    direct.clear()
    for _ in range(2):
        direct.launch(kernel, (3,), (x, 5), {"BLOCK": 16})
    assert len(jit) == 3 and len(launched) == 1 and len(refusals) == 1
    # refused inside a CUDA graph's capture (the driver path's self-check cannot run there):
    # no plan is kept, the next launch asks again
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    direct.clear()
    for _ in range(2):
        direct.launch(kernel, (3,), (x, 5), {"BLOCK": 16})
    assert len(jit) == 5 and len(refusals) == 3
