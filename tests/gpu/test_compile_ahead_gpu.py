"""Compile ahead on a GPU: in a fresh process on an empty Triton cache, a training step's
backward kernels are built in the background while the forward compiles -- by compiler
processes (default; the process then loads them from the disk cache, in its background
threads) or by background threads (``LIK_COMPILE_AHEAD=thread``).  The caller's thread
compiles only the forward and autograd's backward thread nothing (no binary twice); the
gradients are those of the same step with compile-ahead off."""
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
    g = torch.Generator(device="cuda").manual_seed(0)
    Q = F.normalize(torch.randn(64, 32, 128, device="cuda", generator=g), dim=-1).bfloat16().requires_grad_()
    D = F.normalize(torch.randn(64, 300, 128, device="cuda", generator=g), dim=-1).bfloat16().requires_grad_()
    dm = torch.rand(64, 300, device="cuda", generator=g) > 0.3
    F.cross_entropy(lik.maxsim(Q, D, None, dm) / 0.05, torch.arange(64, device="cuda")).backward()
    torch.save((Q.grad.cpu(), D.grad.cpu()), sys.argv[1])
    from lik_plugins.kernels.triton import ahead
    print("EVENTS " + json.dumps(events))
    print("PROCESS " + json.dumps(ahead.process_compiles()))
""")


def _fresh_step(mode: str, grads_path: str) -> tuple[list, list, list]:
    """Compiles in this process (not cache hits), loads from the disk cache, and the
    binaries built by compiler processes."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=cache, LIK_COMPILE_AHEAD=mode)
        env.pop("TRITON_INTERPRET", None)
        done = subprocess.run([sys.executable, "-c", STEP, grads_path], env=env, capture_output=True, text=True,
                              timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(l.split(" ", 1) for l in done.stdout.splitlines() if l.startswith(("EVENTS ", "PROCESS ")))
    events, process = json.loads(lines["EVENTS"]), json.loads(lines["PROCESS"])
    return [e for e in events if not e[2]], [e for e in events if e[2]], process


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_backward_kernels_compile_beside_the_forward(tmp_path, mode):
    events, loads, process = _fresh_step(mode, str(tmp_path / "ahead.pt"))
    elsewhere = [(name, thread) for name, thread, _ in events if not thread.startswith("lik-compile")]
    assert ("maxsim_fwd_kernel", "MainThread") in elsewhere
    if mode == "thread":
        behind = [name for name, thread, _ in events if thread.startswith("lik-compile")]
        assert not process, process
    else:
        # built by the compiler processes, every one of them; loaded by the background threads
        assert process and all(ok for _, _, ok, _ in process), process
        behind = [name for name, _, ok, _ in process]
        assert not any(thread.startswith("lik-compile") for _, thread, _ in events), events   # no compile here
        assert sorted(name for name, thread, _ in loads if thread.startswith("lik-compile")) == sorted(behind), loads
    assert any("bwd" in name for name in behind), behind
    # autograd's backward thread found every binary ready: it compiled nothing, and
    # nothing was compiled twice
    assert all(thread == "MainThread" for _, thread in elsewhere), events
    assert not {name for name, _ in elsewhere} & set(behind), events

    plain, _, _ = _fresh_step("0", str(tmp_path / "plain.pt"))
    # (the direct launcher's self-check kernel compiles in the background either way)
    assert not any(thread.startswith("lik-compile") for name, thread, _ in plain if name != "self_check_kernel"), \
        plain
    assert sorted(n for n, _, _ in plain) == sorted([n for n, _, _ in events] + (behind if mode == "process" else []))
    (gq, gd), (pq, pd) = torch.load(tmp_path / "ahead.pt"), torch.load(tmp_path / "plain.pt")
    assert torch.equal(gq, pq) and torch.equal(gd, pd)             # lowmem: deterministic
