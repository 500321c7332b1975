"""Compile ahead (``kernels/triton/ahead.py``): the dry run of a backward predicts exactly
the binaries the real backward then launches, launches nothing and changes nothing.

The background compiles themselves need a GPU (``tests/gpu/test_compile_ahead_gpu.py``);
here the interpreter runs the real backward and the variant counter (``direct.variants``)
says which binaries it needed.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lik_plugins as lik
from lik_plugins import library
from lik_plugins.kernels.triton import ahead, direct, launch

pytestmark = pytest.mark.skipif(
    not __import__("lik_plugins._config", fromlist=["x"]).triton_interpret(), reason="needs TRITON_INTERPRET=1"
)


def _predicted(fn, *args) -> set:
    return {direct.variant(kernel, a, meta) for kernel, _, a, meta in ahead.dry_run(fn, *args)}


def _launched_by(step) -> set:
    direct.reset_variants()
    step()
    return set(direct._VARIANTS)


def _inputs(gen, nq, lq, nj, ld, d=16, grad_d=True):
    Q = torch.randn(nq, lq, d, generator=gen, requires_grad=True)
    D = torch.randn(nj, ld, d, generator=gen, requires_grad=grad_d)
    dm = torch.rand(nj, ld, generator=gen) > 0.3
    dm[:, 0] = True
    return Q, D, dm


CASES = {
    # name: (nq, lq, nj, ld, layout, normalize, grad of D)
    "in-batch, short documents": (6, 9, 6, 40, library.CROSS, False, True),
    "in-batch, normalised": (4, 5, 5, 70, library.CROSS, True, True),
    "in-batch, queries only": (3, 12, 4, 33, library.CROSS, False, False),
    "per-query candidates": (3, 7, 4, 21, library.CANDIDATES, False, True),
    "pairs": (5, 8, 5, 30, library.PAIRS, False, True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_dry_run_predicts_the_backward_binaries(monkeypatch, name):
    monkeypatch.setenv("LIK_BACKEND", "triton")
    nq, lq, nj, ld, layout, normalize, grad_d = CASES[name]
    gen = torch.Generator().manual_seed(len(name))
    Q, D, dm = _inputs(gen, nq, lq, nj, ld, grad_d=grad_d)
    if layout == library.CANDIDATES:
        D = torch.randn(nq, nj, ld, 16, generator=gen, requires_grad=True)
        dm = torch.ones(nq, nj, ld, dtype=torch.bool)
    elif layout == library.PAIRS:
        D = torch.randn(nq, ld, 16, generator=gen, requires_grad=True)
        dm = torch.ones(nq, ld, dtype=torch.bool)
    predicted = _predicted(library._maxsim_backward_ahead, Q, D, None, dm, layout, normalize, False, "auto",
                           True, grad_d)
    assert predicted, "the dry run launched nothing"
    scores = library.maxsim(Q, D, None, dm, layout=layout, normalize=normalize, zero_mode=False, strategy="auto",
                            entry="")
    weights = torch.randn(scores.shape, generator=gen)        # a contiguous incoming gradient
    assert _launched_by(lambda: (scores * weights).sum().backward()) == predicted


def test_dry_run_predicts_the_smooth_backward(monkeypatch):
    monkeypatch.setenv("LIK_BACKEND", "triton")
    gen = torch.Generator().manual_seed(3)
    Q, D, _ = _inputs(gen, 4, 6, 4, 24)
    predicted = _predicted(library._smooth_backward_ahead, Q, D, 0.1, library.CROSS, True, True)
    assert predicted
    scores = library.smooth_maxsim(Q, D, tau=0.1, layout=library.CROSS, entry="")
    assert _launched_by(lambda: F.cross_entropy(scores, torch.arange(4)).backward()) == predicted


def test_a_dry_run_launches_nothing_and_imports_no_compiler(monkeypatch):
    import os
    import subprocess
    import sys

    monkeypatch.setenv("LIK_BACKEND", "triton")
    gen = torch.Generator().manual_seed(5)
    Q, D, dm = _inputs(gen, 3, 4, 3, 20)
    before = (Q.detach().clone(), D.detach().clone())
    direct.reset_variants()
    launches = ahead.dry_run(library._maxsim_backward_ahead, Q, D, None, dm, library.CROSS, True, False, "auto",
                             True, True)
    assert launches and direct.variants() == {}              # recorded, not launched
    assert torch.equal(Q, before[0]) and torch.equal(D, before[1])
    out = lik.maxsim(Q, D, None, dm, normalize=True)
    out.sum().backward()
    assert torch.isfinite(Q.grad).all() and torch.isfinite(D.grad).all()
    # meta or fake tensors would import torch._dynamo on first use (seconds of a first step)
    probe = ("import sys, torch; from lik_plugins import library; from lik_plugins.kernels.triton import ahead; "
             "Q = torch.randn(2, 3, 16); D = torch.randn(2, 5, 16); "
             "ahead.dry_run(library._maxsim_backward_ahead, Q, D, None, None, 0, True, False, 'auto', True, True); "
             "print('torch._dynamo' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "LIK_BACKEND": "triton"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("False")


def test_the_expectation_is_taken_once_and_only_inside_its_forward():
    from lik_plugins.kernels.expected import expect, forget, take

    assert take() is None
    token = expect(print, (1, 2))
    assert take() == (print, (1, 2), None)
    assert take() is None                # a second compile in the same forward fires nothing
    forget(token)
    assert take() is None


def test_guesses_straddle_every_length_bucket():
    guessed = ahead.guesses({(12, 100), (25, 250)})
    lqs, lds = sorted({q for q, _ in guessed}), sorted({d for _, d in guessed})
    assert lqs == [4, 5, 8, 9, 16, 17, 32]                     # powers of two around 12 and 25, one below
    # powers of two and multiples of 64 from half the power of two below 100 to one step past 256
    assert lds == [32, 33, 64, 65, 128, 129, 192, 193, 256, 257, 320]
    # nearest to a seen length first: the edges next to (25, 250), then the ones around (12, 100)
    assert guessed[:2] == [(32, 256), (32, 257)]
    assert ahead.guesses({(32, 100)}) == [(32, 100)]           # nothing changed: nothing guessed
    assert {q for q, _ in ahead.guesses({(32, 100), (32, 180)})} == {32}


@pytest.mark.parametrize("layout", [library.CROSS, library.CANDIDATES])
def test_guessed_lengths_cover_every_binary_of_a_sweep(monkeypatch, layout):
    """Two calls' lengths are enough to guess every binary a sweep of query lengths 8-32 and
    document lengths 60-300 needs (forward and backward), at this machine's constants."""
    monkeypatch.setenv("LIK_BACKEND", "triton")
    Q = torch.empty(16, 1, 64)
    D = torch.empty((16, 1, 64) if layout == library.CROSS else (16, 4, 1, 64))
    dm = torch.ones(D.shape[:-1], dtype=torch.bool)
    args = (Q, D, None, dm, layout, False, False, "auto", True, True)

    def binaries(lq, ld):
        launches = ahead.dry_run(library._maxsim_step_ahead, *ahead._resized(args, lq, ld))
        return {direct.variant(k, a, m) for k, _, a, m in launches}

    needed = set().union(*(binaries(lq, ld) for lq in range(8, 33, 3) for ld in range(60, 301, 11)))
    guessed = set().union(*(binaries(lq, ld) for lq, ld in ahead.guesses({(12, 100), (25, 250)})))
    assert len(needed) >= 3 and needed <= guessed


@pytest.mark.parametrize("seen", [{(20, 254), (21, 70)}, {(12, 100), (25, 250)}, {(9, 290), (30, 75)}])
def test_guesses_cover_the_sweep_on_the_h100_planning(monkeypatch, seen):
    """The same on the H100's planning -- the sm90 config table and 132 SMs, where block sizes
    follow the size class of each document length (the interpreter's fixed configs hide
    that) -- emulated on CPU: the dry run plans as on the GPU and launches nothing.  Two
    calls' lengths whose span sits inside the sweep (Lq 8-32 x Ld 60-300, the changing-length
    loop of ``benchmarks/real_loop.py``) guess every binary of it; the shortest lengths sit
    below both calls' (before guesses reached one bucket below, a 60-token batch met late in
    the H100 run still compiled)."""
    from lik_plugins.kernels.triton import launch, tuning

    monkeypatch.setenv("LIK_BACKEND", "triton")
    monkeypatch.setenv("LIK_AUTOTUNE", "auto")
    monkeypatch.setattr(tuning, "_INTERPRETED", False)
    monkeypatch.setattr(tuning, "architecture", lambda: "sm90")
    # plans made under the interpreter's configs must not serve these calls
    monkeypatch.setattr(launch, "_FORWARD_PLANS", {})
    monkeypatch.setattr(launch, "_LOWMEM_PLANS", {})
    monkeypatch.setattr(tuning, "_chosen", {})

    def binaries(lq, ld):
        Q = torch.empty(64, lq, 128, dtype=torch.bfloat16)
        D = torch.empty(64, ld, 128, dtype=torch.bfloat16)
        args = (Q, D, None, torch.ones(64, ld, dtype=torch.bool), library.CROSS, False, False, "auto", True, True)
        return {direct.variant(k, a, m) for k, _, a, m in ahead.dry_run(library._maxsim_step_ahead, *args)}

    needed = set().union(*(binaries(lq, ld) for lq in range(8, 33) for ld in range(60, 301, 7)))
    guessed = set().union(*(binaries(lq, ld) for lq, ld in ahead.guesses(seen) + sorted(seen)))
    block_sizes = {dict(v[1]).get("BLOCK_T") for v in needed if v[0] == "maxsim_bwd_doc_kernel"}
    assert len(block_sizes) > 1                 # the table's size classes are in play
    assert needed <= guessed, needed - guessed


def test_a_foreseen_binary_notes_its_lengths_without_guessing_again(monkeypatch):
    """Guessing dry-runs every new bucket on the caller's thread (~90 at once on the H100: a
    0.4-0.5 s step).  A launch whose binary was guessed or expected earlier only notes its
    lengths; the next unforeseen one guesses around all of them."""
    monkeypatch.setattr(ahead, "_seen", {})
    monkeypatch.setattr(ahead, "_guessed", {})
    dry_runs = []
    monkeypatch.setattr(ahead, "dry_run", lambda step, *args: dry_runs.append(args[0].shape[1]) or [])
    monkeypatch.setattr(ahead, "start", lambda *a, **k: None)

    def call(lq, ld, guess):
        before = len(dry_runs)
        ahead._speculate("step", (torch.empty(4, lq, 16), torch.empty(4, ld, 16)), torch.device("cpu"), guess)
        return len(dry_runs) - before

    assert call(12, 100, True) == 0                      # one length seen: nothing to guess yet
    first = call(25, 250, True)
    assert first == len(ahead.guesses({(12, 100), (25, 250)})) > 0
    assert call(30, 40, False) == 0                     # foreseen: noted only
    # unforeseen: guesses the buckets the noted lengths add too (Ld 40 reaches down to 16)
    assert call(20, 200, True) > 0
    assert 16 in {d for _, d in next(iter(ahead._guessed.values()))}


def test_queued_compiles_do_not_hold_up_the_exit(tmp_path):
    """A short script that queued many background compiles ends after the running one, not
    after the whole queue (the executors' exit hook runs every queued item)."""
    import os
    import subprocess
    import sys
    import time

    script = tmp_path / "many_compiles.py"
    script.write_text(
        "import time\n"
        "from lik_plugins.kernels.triton import ahead\n"
        "ahead._compile = lambda *args: time.sleep(1.0)\n"
        "class Kernel:\n"
        "    device_caches = {0: None}\n"
        "futures = [ahead.compile_later(Kernel(), 0, (), {}, guessed=True) for _ in range(12)]\n"
        "time.sleep(0.2)\n"
        "print('queued', sum(not f.done() for f in futures))\n")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ))
    elapsed = time.perf_counter() - start
    assert done.returncode == 0, done.stderr[-2000:]
    assert "queued 12" in done.stdout
    assert elapsed < 8, elapsed          # twelve queued seconds would be > 12


def _pretend_building(monkeypatch, n: int, note=lambda needed: needed[0]) -> dict:
    """The first ``n`` launches inside training ops find their binary building: they raise
    ``NotReady`` as ``direct._defer_if_building`` does on a GPU (which also starts the build).
    ``state["deferred"]``: ``note(needed)`` of each."""
    from lik_plugins.kernels.expected import NotReady, deferring

    state = {"left": n, "deferred": []}

    def defer_if_building(kernel, args, meta, needed):
        if deferring() and state["left"] > 0:
            state["left"] -= 1
            state["deferred"].append(note(needed))
            raise NotReady(needed[0])

    monkeypatch.setattr(direct, "_defer_if_building", defer_if_building)
    monkeypatch.setattr(direct, "_VARIANTS", set())
    return state


def test_a_training_step_runs_chunked_while_its_binaries_build(monkeypatch):
    """Serving while compiling: inside the training ops a launch whose binary is not built
    raises ``NotReady`` (on a GPU: ``direct._defer_if_building``, which also starts the
    build); the op then serves that call on the chunked path -- the same scores and, through
    the same winners' contract, the same gradients -- and counts it so.  Once built, the
    kernels serve.  An inference call never defers (it waits for its binary)."""
    from lik_plugins._routing import reset_routing_counts, routing_counts

    monkeypatch.setenv("LIK_BACKEND", "triton")
    building = _pretend_building(monkeypatch, 2)    # the forward's and the backward's first binaries
    deferred = building["deferred"]
    gen = torch.Generator().manual_seed(3)
    Q, D, dm = _inputs(gen, 4, 6, 5, 30)

    def step(backend):
        monkeypatch.setenv("LIK_BACKEND", backend)
        q, d = Q.detach().clone().requires_grad_(), D.detach().clone().requires_grad_()
        scores = lik.maxsim(q, d, None, dm)
        F.cross_entropy(scores, torch.arange(4)).backward()
        return scores.detach(), q.grad, d.grad

    chunked = step("torch-chunked")
    reset_routing_counts()
    first = step("triton")
    assert routing_counts()["maxsim"] == {"torch-chunked": 1}
    assert deferred[0] == "maxsim_fwd_kernel" and len(deferred) == 2
    for got, want in zip(first, chunked):
        torch.testing.assert_close(got, want, rtol=0, atol=0)     # the chunked path itself, bit for bit
    second = step("triton")
    assert routing_counts()["maxsim"] == {"torch-chunked": 1, "triton": 1}
    for got, want in zip(second, chunked):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    building["left"] = 1
    with torch.no_grad():
        lik.maxsim(Q, D, None, dm)
    assert building["left"] == 1 and routing_counts()["maxsim"]["triton"] == 2


@pytest.mark.parametrize("family", ["smooth", "packed"])
@pytest.mark.parametrize("building", [2, 1], ids=["both-building", "forward-building"])
def test_smooth_and_packed_steps_run_chunked_while_their_binaries_build(monkeypatch, family, building):
    """The smooth-max and packed training ops serve a binary still building on the chunked
    path too, forward and backward each on its own: with both building, the step is the
    chunked path's bit for bit; with only the forward's binary building, the chunked
    forward's saved log-sum-exp / winners feed the kernels' backward, which must agree with
    the chunked backward (the two paths' shared contract)."""
    from lik_plugins._routing import reset_routing_counts, routing_counts

    left = _pretend_building(monkeypatch, building)
    gen = torch.Generator().manual_seed(7)
    Q, D, _ = _inputs(gen, 4, 6, 4, 24)

    def loss_of(q, d):
        if family == "smooth":
            return F.cross_entropy(lik.smooth_maxsim(q, d, tau=0.1), torch.arange(4))
        qp, cu_q, mq = lik.pack(list(q.unbind(0)))
        dp, cu_d, md = lik.pack([t[:5 + 4 * i] for i, t in enumerate(d.unbind(0))])
        return F.cross_entropy(lik.maxsim_varlen(qp, dp, cu_q, cu_d, mq, md), torch.arange(4))

    def step(backend):
        monkeypatch.setenv("LIK_BACKEND", backend)
        q, d = Q.detach().clone().requires_grad_(), D.detach().clone().requires_grad_()
        loss = loss_of(q, d)
        loss.backward()
        return loss.detach(), q.grad, d.grad

    op = "smooth_maxsim" if family == "smooth" else "maxsim_varlen"   # the public entries, as routing counts them
    chunked = step("torch-chunked")
    reset_routing_counts()
    first = step("triton")
    assert len(left["deferred"]) == building and left["left"] == 0, left
    assert routing_counts()[op] == {"torch-chunked": 1}, routing_counts()
    exact = building == 2
    for got, want in zip(first, chunked):
        torch.testing.assert_close(got, want, rtol=0 if exact else 1e-4, atol=0 if exact else 1e-5)
    second = step("triton")
    assert routing_counts()[op] == {"torch-chunked": 1, "triton": 1}
    for got, want in zip(second, chunked):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_a_compiled_training_step_expects_its_backward_and_serves_while_building(monkeypatch):
    """Under ``torch.compile`` the graph calls the registered ops, and they expect the
    backward and serve a binary not built yet on the chunked path themselves, as in eager
    code: the forward's launch finds the backward expected (with the gradients the step
    needs), the backward's finds nothing left to expect; both calls chunked, the results
    the chunked path's; once built, the kernels serve the compiled step."""
    from lik_plugins._routing import reset_routing_counts, routing_counts
    from lik_plugins.kernels.expected import take

    def note(needed):
        taken = take()
        return needed[0], None if taken is None else (taken[0].__name__, taken[1][-2:])

    monkeypatch.setenv("LIK_BACKEND", "triton")
    seen = _pretend_building(monkeypatch, 2, note)["deferred"]
    gen = torch.Generator().manual_seed(5)
    Q, D, dm = _inputs(gen, 4, 6, 5, 30)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def loss_of(q, d):
        return F.cross_entropy(lik.maxsim(q, d, None, dm), torch.arange(4))

    def step(backend, fn):
        monkeypatch.setenv("LIK_BACKEND", backend)
        q, d = Q.detach().clone().requires_grad_(), D.detach().clone().requires_grad_()
        loss = fn(q, d)
        loss.backward()
        return loss.detach(), q.grad, d.grad

    chunked = step("torch-chunked", lambda q, d: F.cross_entropy(lik.maxsim(q, d, None, dm), torch.arange(4)))
    reset_routing_counts()
    first = step("triton", loss_of)
    assert routing_counts()["maxsim"] == {"torch-chunked": 1}
    assert seen[0] == ("maxsim_fwd_kernel", ("_maxsim_backward_ahead", (True, True))), seen
    assert len(seen) == 2 and seen[1][1] is None, seen
    for got, want in zip(first, chunked):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    second = step("triton", loss_of)
    assert routing_counts()["maxsim"] == {"torch-chunked": 1, "triton": 1}
    for got, want in zip(second, chunked):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", ["maxsim", "smooth", "packed"])
def test_a_compiled_graph_s_forward_expects_its_backward(monkeypatch, family):
    """Every training op expects its backward itself, so a ``torch.compile``d step's first
    forward launch fires it as eager code's does (named, with the gradients the step needs)
    and the backward's launches find nothing left to expect."""
    from lik_plugins.kernels.expected import take

    monkeypatch.setenv("LIK_BACKEND", "triton")
    monkeypatch.setattr(direct, "_VARIANTS", set())
    fired = []
    monkeypatch.setattr(ahead, "fire", lambda needed, guess=None: fired.append((needed[0], take())))
    gen = torch.Generator().manual_seed(11)
    Q, D, dm = _inputs(gen, 4, 6, 4, 24)

    if family == "maxsim":
        def loss_of(q, d):
            return F.cross_entropy(lik.maxsim(q, d, None, dm), torch.arange(4))
        want = "_maxsim_backward_ahead"
    elif family == "smooth":
        def loss_of(q, d):
            return F.cross_entropy(lik.smooth_maxsim(q, d, tau=0.1), torch.arange(4))
        want = "_smooth_backward_ahead"
    else:
        def loss_of(q, d):
            qp, cu_q, mq = lik.pack(list(q.unbind(0)))
            dp, cu_d, md = lik.pack([t[:12] for t in d.unbind(0)])
            return F.cross_entropy(lik.maxsim_varlen(qp, dp, cu_q, cu_d, mq, md), torch.arange(4))
        want = "_varlen_backward_ahead"

    q, d = Q.detach().clone().requires_grad_(), D.detach().clone().requires_grad_()
    torch.compile(loss_of, backend="aot_eager")(q, d).backward()
    assert fired, family
    name, expected = fired[0]
    assert expected is not None and expected[0].__name__ == want, fired
    assert tuple(expected[1][-2:]) == (True, True), expected[1][-2:]
    assert all(e is None for _, e in fired[1:]), fired


def test_defer_builds_each_binary_once_and_moves_a_queued_guess_to_the_front(monkeypatch):
    """``ahead.defer`` (a training launch that will not wait): a binary never asked for is
    sent to the main compile pool; one still queued behind other guesses is cancelled there
    and sent to the main pool; one already building (a guess running, or in the main pool)
    is left alone.  Each time the forward's expectation fires, guessing only for a binary
    no guess foresaw."""
    from concurrent.futures import Future

    for name, value in (("_asked", set()), ("_pending", {}), ("_guess_queue", set())):
        monkeypatch.setattr(ahead, name, value)
    submitted, fired = [], []

    def compile_later(kernel, index, args, meta, guessed=False):
        submitted.append((kernel, guessed))
        return Future()

    monkeypatch.setattr(ahead, "compile_later", compile_later)
    monkeypatch.setattr(ahead, "fire", lambda needed, guess=None: fired.append((needed, guess)))
    monkeypatch.setattr(ahead, "_device_index", lambda device: 0)
    args = (torch.empty(2, 3),)

    ahead.defer("fwd", args, {}, ("fwd",))                       # never asked
    assert submitted == [("fwd", False)] and fired == [(("fwd",), True)]
    ahead.defer("fwd", args, {}, ("fwd",))                       # building in the main pool
    assert len(submitted) == 1 and fired[-1] == (("fwd",), False)

    ahead._submit("guess", args, {}, ("guess",), 0, guessed=True)   # a guess, queued
    assert ahead._guess_queue == {("guess",)}
    queued = ahead._pending[("guess",)]
    ahead.defer("guess", args, {}, ("guess",))
    assert queued.cancelled() and submitted[-1] == ("guess", False) and ahead._guess_queue == set()
    assert fired[-1] == (("guess",), False)                      # foreseen: no new guesses

    ahead._submit("running", args, {}, ("running",), 0, guessed=True)
    ahead._pending[("running",)].set_running_or_notify_cancel()  # the guesses' thread took it
    count = len(submitted)
    ahead.defer("running", args, {}, ("running",))
    assert len(submitted) == count and not ahead._pending[("running",)].cancelled()
