"""The compiler process of compile ahead (``kernels/triton/compile_worker.py``), on the real
Triton compiler without a GPU (PTX + ptxas for an H100, as ``test_gpu_compile_offline.py``).

What the parent's JIT then needs is a disk-cache *hit*: a binary this process built under
the key the JIT computes from the same signature, constants, attributes and options.  The
JIT's side is reproduced here as Triton's JIT compiles: ``triton.compile(ASTSource(...),
target, options=backend.parse_options(launch options).__dict__)``; the process's side
receives the options through Triton's JSON form of them, as the JIT's cache hook hands
them over.  Also: a refused request (another source) is reported and leaves the process
serving; the process ends when its input closes; it imports no torch for our kernels."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import json, sys, time
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from lik_plugins.kernels.triton.forward import maxsim_fwd_kernel
    from lik_plugins.kernels.triton.launcher_check import self_check_kernel
    from lik_plugins.kernels.triton.compile_worker import CompilerProcess
    from lik_plugins.kernels.triton.ahead import options_from_json
    sys.path.insert(0, sys.argv[1])
    from sm90_compile import META, POINTERS, specialisation

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    hits = []
    triton.knobs.compilation.listener = lambda *, src, metadata, metadata_group, times, cache_hit: hits.append(cache_hit)

    def spec_of(fn, meta, pointers):
        attrs = {(0,): [("tt.divisibility", 16)], (1,): [("tt.divisibility", 16)]}
        return (*specialisation(fn, meta, pointers), attrs)

    cases = [(self_check_kernel, {"BLOCK": 64}, {"X": "*fp32", "OUT": "*fp32", "scale": "fp32"}, {"num_warps": 4}),
             (maxsim_fwd_kernel, META, POINTERS, {"num_warps": 8, "num_stages": 3})]
    process = CompilerProcess()
    report = {}
    for fn, meta, pointers, launch in cases:
        signature, constants, attrs = spec_of(fn, meta, pointers)
        jit_options = backend.parse_options(launch)              # what the JIT compiles with
        sent = options_from_json(json.loads(json.dumps(jit_options.__dict__)))
        ok, seconds, error = process.compile((fn.fn.__module__, fn.fn.__name__, fn.cache_key, signature, constants,
                                              attrs, sent, target))
        hits.clear()
        t0 = time.perf_counter()
        triton.compile(ASTSource(fn, signature, constants, attrs), target=target, options=jit_options.__dict__)
        report[fn.fn.__name__] = dict(ok=ok, error=error, process_s=seconds, hit=hits == [True],
                                      load_s=time.perf_counter() - t0)
    refused = process.compile((self_check_kernel.fn.__module__, "self_check_kernel", "another source", {}, {}, {}, {},
                               target))
    report["refused"] = [refused[0], refused[2]]
    report["alive_after_refusal"] = process.alive()
    process.close()
    report["exit_code"] = process.process.wait(timeout=30)
    print("REPORT " + json.dumps(report))
""")


def _run(cache_dir):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}   # the real compiler
    env["TRITON_CACHE_DIR"] = str(cache_dir)                                 # empty: the process compiles
    here = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run([sys.executable, "-c", SCRIPT, here], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    return json.loads(next(l for l in done.stdout.splitlines() if l.startswith("REPORT "))[7:])


def test_a_binary_built_in_the_process_is_a_cache_hit_for_the_jit(tmp_path):
    report = _run(tmp_path)
    for name in ("self_check_kernel", "maxsim_fwd_kernel"):
        assert report[name]["ok"], report[name]
        assert report[name]["hit"], report[name]          # the JIT's compile found the process's binary
    assert report["refused"][0] is False and "source differs" in report["refused"][1]
    assert report["alive_after_refusal"]
    assert report["exit_code"] == 0                       # input closed: the process ended by itself


def test_the_process_imports_no_torch_for_the_training_kernels():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import sys, lik_plugins.kernels.triton.compile_worker, lik_plugins.kernels.triton.forward, "
            "lik_plugins.kernels.triton.backward, lik_plugins.kernels.triton.launcher_check; "
            "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"


WARM_UP = textwrap.dedent("""
    import json, sys, threading
    from lik_plugins.kernels.triton import ahead
    from lik_plugins.kernels.triton.launcher_check import self_check_kernel
    from triton.backends.compiler import GPUTarget
    sys.path.insert(0, sys.argv[1])
    from sm90_compile import specialisation

    ahead.warm_up()
    ahead.warm_up()
    threads = [t.name for t in threading.enumerate() if t.name == "lik-warm-up"]
    ahead.settle()
    report = dict(threads=threads, alive_after_settle=ahead._warm_up[0].is_alive(), spare=len(ahead._spare),
                  spare_alive=sum(p.alive() for p in ahead._spare), workers=ahead.WORKERS)
    dead = ahead._spare[-1]
    dead.process.kill()
    dead.process.wait()                     # a spare that died is skipped
    taken = ahead._compiler_process()
    report["took_a_live_spare"] = taken is not dead and taken.alive()
    report["spare_left"] = len(ahead._spare)
    signature, constants = specialisation(self_check_kernel, {"BLOCK": 64}, {"X": "*fp32", "OUT": "*fp32", "scale": "fp32"})
    attrs = {(0,): [("tt.divisibility", 16)], (1,): [("tt.divisibility", 16)]}
    report["compiled"] = list(taken.compile((self_check_kernel.fn.__module__, "self_check_kernel",
                                             self_check_kernel.cache_key, signature, constants, attrs,
                                             {"num_warps": 4}, GPUTarget("cuda", 90, 32))))[::2]
    print("REPORT " + json.dumps(report))
""")


def test_warm_up_starts_the_compiler_processes_once_and_a_thread_takes_a_live_one(tmp_path):
    """``ahead.warm_up`` (what the host patchers start): one background thread per process,
    one compiler process per compile thread started ahead; a compile thread takes a live one
    (a dead one is skipped) and it compiles.  Triton's driver binding fails here (no GPU):
    swallowed, the thread ends."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), LIK_COMPILE_AHEAD="process")
    here = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run([sys.executable, "-c", WARM_UP, here], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    report = json.loads(next(l for l in done.stdout.splitlines() if l.startswith("REPORT "))[7:])
    assert report["threads"] == ["lik-warm-up"]
    assert not report["alive_after_settle"]
    assert report["spare"] == report["spare_alive"] == report["workers"] + 1
    assert report["took_a_live_spare"]
    assert report["spare_left"] == report["workers"] - 1       # the dead one dropped, the live one taken
    assert report["compiled"] == [True, None], report["compiled"]


def test_a_compiler_process_preloads_the_training_kernels_without_torch():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import sys; from lik_plugins.kernels.triton import compile_worker as w; w.preload(); "
            "print(all(m in sys.modules for m in w.PRELOADED), 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "False"]


def test_the_public_warm_up_starts_nothing_without_a_cuda_device():
    code = ("import lik_plugins; lik_plugins.warm_up(); from lik_plugins.kernels.triton import ahead; "
            "print(len(ahead._warm_up), len(ahead._spare))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["0", "0"]


CHANGED_ENVIRONMENT = textwrap.dedent("""
    import json, os, shutil, stat, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from lik_plugins.kernels.triton.launcher_check import self_check_kernel
    from lik_plugins.kernels.triton.compile_worker import CompilerProcess, backend_hash, compile_environment
    from lik_plugins.kernels.triton.ahead import options_from_json
    sys.path.insert(0, sys.argv[1])
    from sm90_compile import specialisation

    here, now, stale = sys.argv[1], sys.argv[2], sys.argv[3] == "stale"
    target = GPUTarget("cuda", 90, 32)
    # each case has a process started in the environment the parent had then
    processes = {"without": CompilerProcess(), "with": CompilerProcess()}
    if stale:
        backend_hash(target)                          # the parent hashed its ptxas before the change
    # what torch.compile does once Inductor compiles: another ptxas, a cache directory of its own
    # (the other ptxas: the same compiler behind a script whose version string differs)
    real = triton.knobs.nvidia.ptxas.path
    wrapper = os.path.join(now, "..", "ptxas")
    with open(wrapper, "w") as f:
        f.write(f'#!/bin/sh\\nif [ "$1" = "--version" ]; then echo another toolkit; fi\\nexec "{real}" "$@"\\n')
    os.chmod(wrapper, stat.S_IRWXU)
    os.environ["TRITON_PTXAS_PATH"] = wrapper
    os.environ["TRITON_CACHE_DIR"] = now
    hits = []
    triton.knobs.compilation.listener = lambda *, src, metadata, metadata_group, times, cache_hit: hits.append(cache_hit)
    signature, constants = specialisation(self_check_kernel, {"BLOCK": 64}, {"X": "*fp32", "OUT": "*fp32", "scale": "fp32"})
    attrs = {(0,): [("tt.divisibility", 16)], (1,): [("tt.divisibility", 16)]}
    options = make_backend(target).parse_options({"num_warps": 4})
    request = (self_check_kernel.fn.__module__, "self_check_kernel", self_check_kernel.cache_key, signature,
               constants, attrs, options_from_json(json.loads(json.dumps(options.__dict__))), target)
    report = {"parent_hash_has_the_new_version": "another toolkit" in backend_hash(target)}
    for label, extra in (("without", ()), ("with", (backend_hash(target), compile_environment()))):
        process = processes[label]
        ok, _, error = process.compile(request + extra)
        hits.clear()
        triton.compile(ASTSource(self_check_kernel, signature, constants, attrs), target=target,
                       options=options.__dict__)
        report[label] = dict(ok=ok, error=error, hit=hits == [True])
        shutil.rmtree(now)
        os.makedirs(now)
    report["other_hash"] = list(process.compile(request + ("a hash no ptxas gives", compile_environment())))[::2]
    for process in processes.values():
        process.close()
    print("REPORT " + json.dumps(report))
""")


@pytest.mark.parametrize("parent", ["fresh", "stale"])
def test_the_process_compiles_as_the_parent_s_jit_would_at_the_request(tmp_path, parent):
    """torch.compile changes the parent's Triton environment after the compiler processes
    started (``TRITON_PTXAS_PATH``, ``TRITON_CACHE_DIR``).  A request carries the parent's
    environment and backend hash and the process adopts them, so the JIT finds the binary --
    whether the parent hashed its ptxas after the change (``fresh``) or before it (``stale``:
    Triton keeps the version it read first).  A request without them (as before) builds under
    another key in another directory: a miss.  A hash the process cannot reproduce is refused,
    not built under another key."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "at-start")
    (tmp_path / "now").mkdir()
    here = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run([sys.executable, "-c", CHANGED_ENVIRONMENT, here, str(tmp_path / "now"), parent], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    report = json.loads(next(l for l in done.stdout.splitlines() if l.startswith("REPORT "))[7:])
    assert report["parent_hash_has_the_new_version"] == (parent == "fresh")
    assert report["without"]["ok"] and not report["without"]["hit"], report
    assert report["with"]["ok"] and report["with"]["hit"], report
    assert report["other_hash"][0] is False and "hash differs" in report["other_hash"][1], report
