"""Compile ahead on a GPU: in a fresh process on an empty Triton cache, a training step's
kernels are built in the background -- by compiler processes (default; the process then
loads them from the disk cache, in its background threads) or by background threads
(``LIK_COMPILE_AHEAD=thread``) -- while that first step runs on the chunked path; no binary
is built in the caller's or autograd's thread, none twice.  The next step runs on the
kernels, with the gradients of the same step with compile-ahead off (which compiles in the
caller's thread and serves every step from the kernels).  The same for a ``torch.compile``d
step (no binary built twice although Inductor changes Triton's environment) and for the
smooth-max and packed training ops."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

STEP = textwrap.dedent("""
    import json, sys, threading
    import torch, torch.nn.functional as F, triton
    events = []
    def listen(*, src, metadata, metadata_group, times, cache_hit):
        events.append([getattr(src, "name", str(src)), threading.current_thread().name, bool(cache_hit)])
    triton.knobs.compilation.listener = listen
    import lik_plugins as lik
    if len(sys.argv) > 2:       # what the host patchers start, first (lik.warm_up)
        from triton.runtime.cache import triton_key
        from triton.runtime.driver import driver
        from lik_plugins.kernels.triton import ahead
        lik.warm_up()
        ahead.settle()
        print("WARM " + json.dumps([torch.cuda.is_initialized(), driver._default is not None,
                                    triton_key.cache_info().currsize, sum(p.alive() for p in ahead._spare)]))
    g = torch.Generator(device="cuda").manual_seed(0)
    Q = F.normalize(torch.randn(64, 32, 128, device="cuda", generator=g), dim=-1).bfloat16().requires_grad_()
    D = F.normalize(torch.randn(64, 300, 128, device="cuda", generator=g), dim=-1).bfloat16().requires_grad_()
    dm = torch.rand(64, 300, device="cuda", generator=g) > 0.3
    from lik_plugins.kernels.triton import ahead
    grads, served = [], []
    for step in range(2):
        Q.grad = D.grad = None
        F.cross_entropy(lik.maxsim(Q, D, None, dm) / 0.05, torch.arange(64, device="cuda")).backward()
        grads.append((Q.grad.cpu(), D.grad.cpu()))
        served.append(dict(lik.routing_counts()["maxsim"]))
        lik.reset_routing_counts()
        for future in list(ahead._pending.values()):   # every background build done before step 2
            future.result()
    torch.save(grads, sys.argv[1])
    print("EVENTS " + json.dumps(events))
    print("PROCESS " + json.dumps(ahead.process_compiles()))
    print("SERVED " + json.dumps(served))
""")


def _fresh_step(mode: str, grads_path: str, warm_up: bool = False) -> tuple[list, list, list, list]:
    """Compiles in this process (not cache hits), loads from the disk cache, the binaries
    built by compiler processes, and the path that served each of the two steps; with
    ``warm_up``, ``lik.warm_up()`` first (checked: no CUDA context, Triton's driver binding
    and hash done, a live compiler process per compile thread in process mode)."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=cache, LIK_COMPILE_AHEAD=mode, LIK_SERVE_WHILE_COMPILING="1")
        env.pop("TRITON_INTERPRET", None)
        done = subprocess.run([sys.executable, "-c", STEP, grads_path] + (["warm"] if warm_up else []), env=env,
                              capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    if warm_up:
        from lik_plugins.kernels.triton.ahead import WORKERS

        warm = json.loads(next(l for l in done.stdout.splitlines() if l.startswith("WARM "))[5:])
        assert warm == [False, True, 1, WORKERS + 1 if mode == "process" else 0], warm
    lines = dict(l.split(" ", 1) for l in done.stdout.splitlines() if l.startswith(("EVENTS ", "PROCESS ", "SERVED ")))
    events, process, served = (json.loads(lines[k]) for k in ("EVENTS", "PROCESS", "SERVED"))
    return [e for e in events if not e[2]], [e for e in events if e[2]], process, served


@pytest.mark.parametrize("mode,warm_up", [("process", False), ("thread", False), ("process", True)])
def test_a_cold_step_runs_chunked_while_every_kernel_builds_in_the_background(tmp_path, mode, warm_up):
    events, loads, process, served = _fresh_step(mode, str(tmp_path / "ahead.pt"), warm_up)
    assert served == [{"torch-chunked": 1}, {"triton": 1}], served
    # no binary built in the caller's or autograd's thread: the forward's neither
    elsewhere = [(name, thread) for name, thread, _ in events if not thread.startswith("lik-compile")]
    assert not elsewhere, events
    if mode == "thread":
        behind = [name for name, thread, _ in events if thread.startswith("lik-compile")]
        assert not process, process
    else:
        # built by the compiler processes, every one of them; loaded by the background threads
        assert process and all(ok for _, _, ok, _ in process), process
        behind = [name for name, _, ok, _ in process]
        assert not events, events                                        # no compile in this process
        assert sorted(name for name, thread, _ in loads if thread.startswith("lik-compile")) == sorted(behind), loads
    assert "maxsim_fwd_kernel" in behind and any("bwd" in name for name in behind), behind
    assert len(behind) == len(set(behind)), behind                       # nothing built twice

    plain_events, _, _, plain_served = _fresh_step("0", str(tmp_path / "plain.pt"))
    assert plain_served == [{"triton": 1}, {"triton": 1}], plain_served
    # (the direct launcher's self-check kernel compiles in the background either way)
    assert sorted(n for n, _, _ in plain_events if n != "self_check_kernel") == \
        sorted(n for n in behind if n != "self_check_kernel")
    ahead_grads, plain_grads = torch.load(tmp_path / "ahead.pt"), torch.load(tmp_path / "plain.pt")
    for got, want in zip(ahead_grads[0], plain_grads[0]):               # chunked against the kernels
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-3)
    for got, want in zip(ahead_grads[1], plain_grads[1]):               # the kernels, lowmem: deterministic
        assert torch.equal(got, want)


# Both step scripts below: each step's loss and gradients against a float32 reference (bf16 inputs).
MISMATCHES = textwrap.dedent("""
    import torch

    def mismatches(step, got, want):
        found = []
        for a, b in zip(got, want):
            try:
                torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-3)
            except AssertionError as exc:
                found.append(f"step {step}: {exc}"[:300])
        return found
""")

COMPILED = MISMATCHES + textwrap.dedent("""
    import json, sys, threading
    import torch, torch.nn.functional as F, triton
    built_here = []
    def listen(*, src, metadata, metadata_group, times, cache_hit):
        name = getattr(src, "name", str(src))
        if not cache_hit and name.startswith("maxsim"):
            built_here.append([name, threading.current_thread().name])
    triton.knobs.compilation.listener = listen
    import lik_plugins as lik
    from lik_plugins.kernels.triton import ahead

    def cross(Q, D, dm):
        return F.cross_entropy(lik.maxsim(Q, D, None, dm) / 0.05, torch.arange(32, device="cuda"))

    def reference(Q, D, dm):
        sim = torch.einsum("ash,bth->abst", Q.float(), D.float()).masked_fill(~dm[None, :, None, :], float("-inf"))
        return F.cross_entropy(sim.amax(-1).sum(-1) / 0.05, torch.arange(32, device="cuda"))

    compiled = torch.compile(cross, mode=sys.argv[1] if sys.argv[1] != "default" else None)
    served, errors = [], []
    for step in range(6):
        g = torch.Generator(device="cuda").manual_seed(step)
        Q = F.normalize(torch.randn(32, 24, 128, device="cuda", generator=g), dim=-1).bfloat16().requires_grad_()
        D = F.normalize(torch.randn(32, 180, 128, device="cuda", generator=g), dim=-1).bfloat16().requires_grad_()
        dm = torch.rand(32, 180, device="cuda", generator=g) > 0.2
        dm[:, 0] = True
        lik.reset_routing_counts()
        loss = compiled(Q, D, dm)
        got = (loss.detach().clone(), *[t.clone() for t in torch.autograd.grad(loss, (Q, D))])
        served.append(dict(lik.routing_counts().get("maxsim", {})))
        want_loss = reference(Q, D, dm)
        want = (want_loss.detach(), *torch.autograd.grad(want_loss, (Q, D)))
        errors += mismatches(step, got, want)
        if step == 1:
            for future in list(ahead._pending.values()):   # every background build done: the kernels next
                future.result()
    print("RESULT " + json.dumps(dict(served=served, errors=errors, built_here=built_here,
                                      process=ahead.process_compiles())))
""")


def _run_cold(script: str, *args: str) -> dict:
    """``script`` in a fresh process on an empty Triton cache, serving while compiling, compile
    ahead at its default: the JSON of its ``RESULT`` line."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=cache, LIK_SERVE_WHILE_COMPILING="1")
        env.pop("TRITON_INTERPRET", None)
        env.pop("LIK_COMPILE_AHEAD", None)
        done = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                              timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(next(l for l in done.stdout.splitlines() if l.startswith("RESULT "))[7:])


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_a_compiled_cold_step_serves_while_its_kernels_build(mode):
    """A ``torch.compile``d training step in a fresh process on an empty cache: its graph's
    ops expect the backward and serve chunked while the kernels build in the background (the
    first step), then run on the kernels; every step's loss and gradients match a float32
    einsum reference.  Under ``reduce-overhead`` the CUDA graph's capture waits for its
    binaries (no chunked call is captured) and replays run no Python (no routing counted)."""
    result = _run_cold(COMPILED, mode)
    assert not result["errors"], result["errors"]
    served = result["served"]
    assert served[0] == {"torch-chunked": 1}, served
    assert any(s.get("triton") for s in served[1:]), served             # (replays count nothing)
    assert not any(s.get("torch-chunked") for s in served[2:]), served
    # Inductor points TRITON_PTXAS_PATH at PyTorch's ptxas after the compiler processes
    # started: they must still build under this process's keys, or it builds every binary again
    assert result["process"] and all(ok for _, _, ok, _ in result["process"]), result["process"]
    assert not result["built_here"], result["built_here"]


SERVED_FAMILY = MISMATCHES + textwrap.dedent("""
    import json, sys
    import torch, torch.nn.functional as F
    import lik_plugins as lik
    from lik_plugins.kernels.triton import ahead

    family = sys.argv[1]
    n, lq, ld = 16, 24, 120
    lengths = [ld - 5 * i for i in range(n)]

    def scores(Q, D):
        if family == "smooth":
            return lik.smooth_maxsim(Q, D, tau=0.1)
        qp, cu_q, mq = lik.pack(list(Q.unbind(0)))
        dp, cu_d, md = lik.pack([t[:k] for t, k in zip(D.unbind(0), lengths)])
        return lik.maxsim_varlen(qp, dp, cu_q, cu_d, mq, md)

    def reference(Q, D):
        sim = torch.einsum("ash,bth->abst", Q.float(), D.float())
        if family == "smooth":
            return (torch.logsumexp(sim / 0.1, dim=-1) * 0.1).sum(-1)
        valid = torch.arange(ld, device="cuda")[None, :] < torch.tensor(lengths, device="cuda")[:, None]
        return sim.masked_fill(~valid[None, :, None, :], float("-inf")).amax(-1).sum(-1)

    served, errors = [], []
    for step in range(4):
        g = torch.Generator(device="cuda").manual_seed(step)
        Q = F.normalize(torch.randn(n, lq, 128, device="cuda", generator=g), dim=-1).bfloat16().requires_grad_()
        D = F.normalize(torch.randn(n, ld, 128, device="cuda", generator=g), dim=-1).bfloat16().requires_grad_()
        lik.reset_routing_counts()
        loss = F.cross_entropy(scores(Q, D) / 0.05, torch.arange(n, device="cuda"))
        got = (loss.detach(), *torch.autograd.grad(loss, (Q, D)))
        served.append(dict(lik.routing_counts().get(sys.argv[2], {})))
        want_loss = F.cross_entropy(reference(Q, D) / 0.05, torch.arange(n, device="cuda"))
        want = (want_loss.detach(), *torch.autograd.grad(want_loss, (Q, D)))
        errors += mismatches(step, got, want)
        for future in list(ahead._pending.values()):   # every background build done: the kernels next
            future.result()
    print("RESULT " + json.dumps(dict(served=served, errors=errors, process=ahead.process_compiles())))
""")


@pytest.mark.parametrize("family,entry", [("smooth", "smooth_maxsim"), ("packed", "maxsim_varlen")])
def test_smooth_and_packed_cold_steps_serve_while_their_kernels_build(family, entry):
    """The smooth-max and packed training ops in a fresh process on an empty cache: the first
    step on the chunked path while compiler processes build the kernels, the next ones on the
    kernels; every step's loss and gradients match a float32 einsum reference."""
    result = _run_cold(SERVED_FAMILY, family, entry)
    assert not result["errors"], result["errors"]
    assert result["served"][0] == {"torch-chunked": 1}, result["served"]
    assert all(s == {"triton": 1} for s in result["served"][1:]), result["served"]
    assert result["process"] and all(ok for _, _, ok, _ in result["process"]), result["process"]
