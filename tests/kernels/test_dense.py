"""The dense layouts' Triton kernels on a CUDA device at realistic sizes (marker ``gpu``):
cross product, per-query candidates and pairs, both mask modes, both backward strategies,
odd shapes, CUDA graphs, the direct launches and the document tail tiles, against the float64
reference (``lik_plugins.kernels.reference``, autograd by torch).  The same kernels run on
tiny shapes under Triton's interpreter in ``test_triton_interpreter.py``."""
from __future__ import annotations

import pytest
import torch

import lik_plugins as lik
from lik_plugins.kernels import reference
from lik_plugins.kernels.triton import launch
from support.cuda_testlib import CUDA, TOL, cuda_generator, dense_inputs
from support.maxsim_testlib import expected_argmax, force_forward_block_n, reference_run, rel_err

pytestmark = CUDA


def _check(nq, nj, lq, ld, d, dtype, *, kd=False, mode="exclude", normalize=False, backward="lowmem", holes=True):
    Q, D, qm, dm = dense_inputs(nq, nj, lq, ld, d, dtype, kd, holes)
    Q.requires_grad_(); D.requires_grad_()
    out = lik.maxsim(Q, D, qm, dm, mask_mode=mode, normalize=normalize, backward=backward)
    grad = torch.randn_like(out)
    gq, gd = torch.autograd.grad(out, (Q, D), grad)
    ref, rq, rd = reference_run("kd" if kd else "cross", Q, D, qm, dm, grad, normalize=normalize, mask_mode=mode)
    fwd_tol, bwd_tol = TOL[dtype]
    assert out.dtype == torch.float32
    assert rel_err(out, ref) < fwd_tol
    assert rel_err(gq, rq) < bwd_tol
    assert rel_err(gd, rd) < bwd_tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", ["exclude", "zero"])
@pytest.mark.parametrize("backward", ["lowmem", "unified"])
def test_cross_realistic(dtype, mode, backward):
    _check(64, 48, 32, 180, 128, dtype, mode=mode, backward=backward)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backward", ["lowmem", "unified"])
def test_candidates_realistic(dtype, backward):
    _check(32, 8, 32, 300, 128, dtype, kd=True, backward=backward, mode="zero")


@pytest.mark.parametrize("shape", [(4, 6, 1, 1, 128), (3, 5, 300, 77, 96), (2, 3, 1030, 40, 128), (8, 8, 32, 50, 48),
                                   (2, 3, 17, 33, 768), (5, 7, 32, 64, 120)])
@pytest.mark.parametrize("normalize", [False, True])
def test_odd_shapes(shape, normalize):
    _check(*shape, torch.float32, normalize=normalize)
    _check(*shape, torch.bfloat16, normalize=normalize)


def test_long_query_colpali():
    _check(4, 16, 1024, 1030, 128, torch.bfloat16, holes=False)


def test_pairs_and_large_batch():
    Q, D, qm, dm = dense_inputs(512, 1, 32, 256, 128, torch.bfloat16, kd=True)
    out = lik.maxsim_pairs(Q, D[:, 0], qm, dm[:, 0])
    ref = reference.maxsim_pairs(Q.double(), D[:, 0].double(), qm, dm[:, 0])
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("nq,nj,ld,need_q", [(256, 200, 256, True), (48, 40, 1030, True), (96, 64, 256, False)])
def test_unified_default_is_right_every_run(normalize, nq, nj, ld, need_q):
    """The unified backward (one-pass fp32 buffer with atomics), five runs: every run right."""
    Q, D, qm, dm = dense_inputs(nq, nj, 32, ld, 128, torch.bfloat16, kd=False)
    Q.requires_grad_(need_q); D.requires_grad_()
    out = lik.maxsim(Q, D, qm, dm, normalize=normalize, backward="unified")
    grad = torch.randn_like(out)
    _, *want = reference_run("cross", Q, D, qm, dm, grad, normalize=normalize, mask_mode="exclude")
    for _ in range(5):
        got = torch.autograd.grad(out, (Q, D) if need_q else (D,), grad, retain_graph=True)
        for g, w in zip(got, want if need_q else want[1:]):
            assert rel_err(g, w) < TOL[torch.bfloat16][1]


def test_lowmem_is_bitwise_deterministic():
    Q, D, qm, dm = dense_inputs(128, 128, 32, 256, 128, torch.bfloat16, kd=False)
    grads = []
    for _ in range(3):
        q, d = Q.clone().requires_grad_(), D.clone().requires_grad_()
        out = lik.maxsim(q, d, qm, dm, backward="lowmem")
        grads.append(torch.autograd.grad(out.sum(), (q, d)))
    for gq, gd in grads[1:]:
        assert torch.equal(gq, grads[0][0]) and torch.equal(gd, grads[0][1])


def test_no_argmax_under_no_grad():
    Q, D, qm, dm = dense_inputs(64, 64, 32, 256, 128, torch.bfloat16, kd=False)
    Q.requires_grad_()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    with torch.no_grad():
        out = lik.maxsim(Q, D, qm, dm)
    assert out.grad_fn is None
    assert torch.cuda.memory_allocated() - base <= out.numel() * 4 + 4096


def test_cuda_graph_capture_forward_backward():
    Q, D, qm, dm = dense_inputs(64, 64, 32, 180, 128, torch.bfloat16, kd=False)
    Q.requires_grad_(); D.requires_grad_()
    # seeded: the replayed inputs are random normals, and an argmax that a near-tie sends to
    # another token than the float64 reference's moves a whole gradient row
    g = cuda_generator(1)
    grad = torch.randn(64, 64, device="cuda", generator=g)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm on a side stream: autotune + compile outside the capture
        for _ in range(2):
            torch.autograd.grad(lik.maxsim(Q, D, qm, dm), (Q, D), grad)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = lik.maxsim(Q, D, qm, dm)
        gq, gd = torch.autograd.grad(out, (Q, D), grad)
    with torch.no_grad():
        Q.copy_(torch.randn(Q.shape, device="cuda", generator=g))
        D.copy_(torch.randn(D.shape, device="cuda", generator=g))
    graph.replay()
    torch.cuda.synchronize()
    ref = reference.maxsim(Q.detach().double(), D.detach().double(), qm, dm)
    assert rel_err(out, ref) < 1e-2
    q64, d64 = Q.detach().double().requires_grad_(), D.detach().double().requires_grad_()
    rq, rd = torch.autograd.grad(reference.maxsim(q64, d64, qm, dm), (q64, d64), grad.double())
    assert rel_err(gq, rq) < 4e-2 and rel_err(gd, rd) < 4e-2


def test_non_finite_inputs_do_not_crash():
    Q, D, qm, dm = dense_inputs(8, 8, 32, 64, 128, torch.bfloat16, kd=False, holes=False)
    Q[0, 0, 0] = float("nan")
    D[1, 3, 5] = float("inf")
    out = lik.maxsim(Q, D, qm, dm)
    torch.cuda.synchronize()
    assert torch.isnan(out[0]).all()


# ------------------------------------------------------------------ direct launches
def _deterministic_step(Q, D, qm, dm, **kw):
    q, d = Q.detach().requires_grad_(), D.detach().requires_grad_()  # same memory, same alignment
    out = lik.maxsim(q, d, qm, dm, backward="lowmem", **kw)
    gq, gd = torch.autograd.grad(out, (q, d), torch.ones_like(out))
    return out, gq, gd


@pytest.mark.parametrize("case", [
    dict(nq=8, nj=8, lq=32, ld=256, kd=False),                      # the unit-test regime
    dict(nq=1, nj=1, lq=1, ld=1, kd=False),                         # ints equal to 1 are constants
    dict(nq=3, nj=17, lq=33, ld=70, kd=False, normalize=True),      # ragged, normalised
    dict(nq=4, nj=5, lq=130, ld=100, kd=True, mode="zero"),         # candidates, row chunks
    dict(nq=2, nj=300, lq=32, ld=64, kd=False, misaligned=True),    # views 2 bytes off
], ids=["small", "ones", "ragged", "kd", "misaligned"])
def test_direct_launch_replays_the_jit_bitwise(monkeypatch, case):
    """Every launch replayed through a plan equals the JIT's launch of the same call, bit
    for bit, across shapes whose specialisation differs (1, odd sizes, misaligned views)."""
    from lik_plugins.kernels.triton import direct

    Q, D, qm, dm = dense_inputs(case["nq"], case["nj"], case["lq"], case["ld"], 128, torch.bfloat16, case["kd"])
    if case.get("misaligned"):  # the same values 2 bytes past a 16-byte boundary
        D = torch.empty(D.numel() + 1, dtype=D.dtype, device="cuda")[1:].view(D.shape).copy_(D)
        assert D.data_ptr() % 16 != 0
    kw = dict(normalize=case.get("normalize", False), mask_mode=case.get("mode", "exclude"))
    monkeypatch.setenv("LIK_DIRECT_LAUNCH", "0")
    jit = _deterministic_step(Q, D, qm, dm, **kw)
    monkeypatch.setenv("LIK_DIRECT_LAUNCH", "1")
    _replay_checked()
    direct.clear()
    _deterministic_step(Q, D, qm, dm, **kw)          # through the JIT, plans recorded
    assert direct._plans
    replayed = _deterministic_step(Q, D, qm, dm, **kw)
    for a, b in zip(jit, replayed):
        assert torch.equal(a, b)


def _replay_checked():
    """Launches through the driver passed their self-check on this device (every later
    launch of a plan takes them)."""
    from lik_plugins.kernels.triton import binaries_loader

    assert binaries_loader._driver_launches_ok(torch.cuda.current_device()) is True


def test_the_driver_launch_self_check_passes_and_launches_only_its_own_kernel():
    """The self-check of launches through the driver, with the JIT's binary of its kernel,
    runs inside a user's step: it must pass and launch no PyTorch kernel (a first use loads
    that kernel's module: tens of ms)."""
    from torch.profiler import ProfilerActivity, profile

    from lik_plugins.kernels.triton import binaries_loader

    binaries_loader.reset()
    assert binaries_loader._driver_launches_ok(0) is True     # compiled and loaded: the profile sees launches only
    binaries_loader.reset()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        assert binaries_loader._driver_launches_ok(0) is True
    kernels = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()}
    assert kernels == {"self_check_kernel"}


@pytest.mark.parametrize("shape", [(256, 256, 32, 256, 128), (64, 64, 32, 1030, 128), (48, 40, 32, 1030, 96),
                                   (1024, 24, 32, 300, 128)],
                         ids=["colbert-256", "colpali-64", "odd", "16-bit-row-ids"])
def test_compact_and_dense_lowmem_agree(monkeypatch, shape):
    """lowmem's grad_D from per-tile row lists and from the dense one-hot walk: the same
    sums in another order (bf16 gradients: within one rounding of each other); at 32768
    query rows the row ids fill the int16 scratch."""
    from lik_plugins.kernels.common import COMPACT_MAX_ROWS
    from lik_plugins.kernels.triton import backward_launch

    nq, nj, lq, ld, d = shape
    assert nq * lq <= COMPACT_MAX_ROWS
    Q, D, qm, dm = dense_inputs(nq, nj, lq, ld, d, torch.bfloat16, kd=False)
    Q.requires_grad_(); D.requires_grad_()
    grads = []
    for compact in (True, False):
        monkeypatch.setattr(backward_launch, "COMPACT_MIN_WORK", 0 if compact else 1 << 62)
        launch.clear_plans()
        out = lik.maxsim(Q, D, qm, dm, backward="lowmem")
        grads.append(torch.autograd.grad(out, (Q, D), torch.ones_like(out)))
    launch.clear_plans()
    assert torch.equal(grads[0][0], grads[1][0])          # grad_Q: the same gather
    assert rel_err(grads[0][1], grads[1][1]) < 1e-2


# ------------------------------------------------------------------ document tails
@pytest.mark.parametrize("block_n,dtype", [
    (32, torch.bfloat16), (64, torch.bfloat16), (128, torch.bfloat16), (32, torch.float32), (64, torch.float32),
], ids=["bf16-32", "bf16-64", "bf16-128", "fp32-32", "fp32-64"])   # fp32 at 128: over shared memory, pruned
def test_tail_tiles_equal_the_masked_tile_bit_for_bit(monkeypatch, block_n, dtype):
    """Narrower tail tiles (``blocking.tail_tile``) give the same scores and winners, bit for
    bit, as a whole masked tile, at every BLOCK_N the autotuner may pick, on the tails that
    ColPali pages (1030), ColBERT documents (180, 300) and a second tail tile at BLOCK_N 128
    (200) leave; and both match fp64."""
    from lik_plugins.kernels.triton import blocking

    force_forward_block_n(monkeypatch, block_n)
    for ld in (1030, 300, 200, 180):
        Q, D, qm, dm = dense_inputs(16, 24, 32, ld, 128, dtype, kd=False)
        got = {}
        for tails in (True, False):
            monkeypatch.setattr(blocking, "TAIL_MIN_LD", 0 if tails else 1 << 62)
            launch.clear_plans()
            got[tails] = launch.forward(Q, D, qm, dm, cross=True, normalize=False, zero_mode=False, save_argmax=True)
        launch.clear_plans()
        assert torch.equal(got[True][0], got[False][0]), ld
        assert torch.equal(got[True][1], got[False][1]), ld
        ref = reference.maxsim(Q.double(), D.double(), qm, dm)
        assert rel_err(got[True][0], ref) < TOL[dtype][0], ld
        # winners may differ from fp64 only where two similarities are within rounding
        arg = expected_argmax(Q.cpu(), D.cpu(), qm.cpu(), dm.cpu(), "cross", "exclude")
        assert (got[True][1].long().cpu() == arg).float().mean() > 0.99, ld
