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
