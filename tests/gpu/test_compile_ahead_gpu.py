"""Compile ahead on a GPU: in a fresh process on an empty Triton cache, a training step's
backward kernels are compiled by the background threads while the forward compiles, the
caller's thread compiles only the forward and autograd's backward thread nothing (no
binary twice); the gradients are those of the same step with compile-ahead off."""
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
    print("EVENTS " + json.dumps(events))
""")


def _fresh_step(ahead: bool, grads_path: str) -> list:
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=cache, LIK_COMPILE_AHEAD="1" if ahead else "0")
        env.pop("TRITON_INTERPRET", None)
        done = subprocess.run([sys.executable, "-c", STEP, grads_path], env=env, capture_output=True, text=True,
                              timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(l for l in done.stdout.splitlines() if l.startswith("EVENTS "))
    return [e for e in json.loads(line[7:]) if not e[2]]          # compiles, not cache hits


def test_backward_kernels_compile_beside_the_forward(tmp_path):
    events = _fresh_step(True, str(tmp_path / "ahead.pt"))
    behind = [name for name, thread, _ in events if thread.startswith("lik-compile")]
    elsewhere = [(name, thread) for name, thread, _ in events if not thread.startswith("lik-compile")]
    assert ("maxsim_fwd_kernel", "MainThread") in elsewhere
    assert behind, events                                          # the backward compiled in the background
    # autograd's backward thread found every binary ready: it compiled nothing, and
    # nothing was compiled twice
    assert all(thread == "MainThread" for _, thread in elsewhere), events
    assert not {name for name, _ in elsewhere} & set(behind), events

    plain = _fresh_step(False, str(tmp_path / "plain.pt"))
    # (the direct launcher's self-check kernel compiles in the background either way)
    assert not any(thread.startswith("lik-compile") for name, thread, _ in plain if name != "self_check_kernel"), \
        plain
    assert sorted(n for n, _, _ in plain) == sorted(n for n, _, _ in events)   # the same binaries
    (gq, gd), (pq, pd) = torch.load(tmp_path / "ahead.pt"), torch.load(tmp_path / "plain.pt")
    assert torch.equal(gq, pq) and torch.equal(gd, pd)             # lowmem: deterministic
