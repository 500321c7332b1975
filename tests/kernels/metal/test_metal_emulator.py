"""The shipped .metal kernels, compiled as C++ and run on the CPU, against the reference;
and the emulator itself: a broken kernel, a divergent barrier and an out-of-bounds write
must fail, and the simd / simdgroup-matrix emulation must compute what Metal defines."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lik_plugins.kernels.metal import checks, launch
from metal_emulator import emulate


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_every_kernel_matches_the_reference(compiler, dtype):
    results = emulate.run_cases(checks.default_cases(), [checks.DTYPES[dtype]])
    failures = [f"{r.case.name}: {r.failure}" for r in results if not r.ok]
    assert not failures, "\n".join(failures)
    ran = {k for r in results for k in r.kernels}
    assert ran == set(emulate.shipped_kernels()), "every shipped kernel must be exercised"


# (file, original text, mutated text): a flipped comparison, an off-by-one bound, a wrong formula
MUTATIONS = {
    "max becomes min": ("maxsim.metal", "v > best ||", "v < best ||"),
    "off-by-one token bound": ("maxsim.metal", "d_state[tid] = (t >= ld)", "d_state[tid] = (t > ld)"),
    "grad_d skips the last owned token": ("maxsim.metal", "w < t0 + GD_TOKENS", "w < t0 + GD_TOKENS - 1"),
    "smooth weights use lse / 2": ("smoothmax.metal", "- lse[pair * lq + s]", "- 0.5f * lse[pair * lq + s]"),
}


def _mutated_shaders(tmp_path: Path, name: str) -> Path:
    file, old, new = MUTATIONS[name]
    for src in launch.SHADER_DIR.glob("*.metal"):
        text = src.read_text()
        if src.name == file:
            assert text.count(old) == 1, f"mutation anchor {old!r} not found once in {file}"
            text = text.replace(old, new)
        (tmp_path / src.name).write_text(text)
    return tmp_path


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_a_mutated_kernel_fails(compiler, tmp_path, name):
    shaders = _mutated_shaders(tmp_path, name)
    cases = [c for c in checks.default_cases() if c.name in ("cross exclude masks", "candidates zero masks", "smooth cross")]
    results = emulate.run_cases(cases, [torch.float32], shaders)
    assert any(not r.ok for r in results), f"the emulator did not notice: {name}"


def test_cli_exit_status(compiler, tmp_path):
    cmd = [sys.executable, emulate.__file__, "--quick", "--dtype", "fp32"]
    good = subprocess.run(cmd, capture_output=True, text=True)
    assert good.returncode == 0, good.stdout + good.stderr
    for kernel in emulate.shipped_kernels():
        assert kernel in good.stdout   # the per-kernel summary
    bad = subprocess.run(cmd + ["--shader-dir", str(_mutated_shaders(tmp_path, "max becomes min"))],
                         capture_output=True, text=True)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "FAIL" in bad.stdout


def test_divergent_barrier_is_reported(compiler, tmp_path, monkeypatch):
    monkeypatch.setenv("LIK_METAL_EMU_BARRIER_TIMEOUT", "1")
    for src in launch.SHADER_DIR.glob("*.metal"):
        text = src.read_text()
        if src.name == "maxsim.metal":
            old = "            threadgroup_barrier(mem_flags::mem_threadgroup);   // s_tile is rewritten next tile"
            assert text.count(old) == 1
            text = text.replace(old, "            if (tid < 64) threadgroup_barrier(mem_flags::mem_threadgroup);")
        (tmp_path / src.name).write_text(text)
    case = [c for c in checks.default_cases() if c.name == "cross Ld=1 d=13"]
    (result,) = emulate.run_cases(case, [torch.float32], tmp_path)
    assert "divergent barrier" in result.failure


# A small kernel with known answers for the emulation of simd functions, simdgroup
# matrices, threadgroup memory and the guards.
PROBE = """#include <metal_stdlib>
using namespace metal;
kernel void probe(
    device const float* x       [[buffer(0)]],   // [128]
    device float* out           [[buffer(1)]],   // [128 * 4]
    device const float* a       [[buffer(2)]],   // [8, 8]
    device const float* b       [[buffer(3)]],   // [8, 8]
    device float* c             [[buffer(4)]],   // [8, 8]
    constant long* shape        [[buffer(5)]],   // {write_past_end}
    uint tid                    [[thread_index_in_threadgroup]],
    uint lane                   [[thread_index_in_simdgroup]],
    uint sg                     [[simdgroup_index_in_threadgroup]],
    uint3 group                 [[threadgroup_position_in_grid]])
{
    threadgroup float reversed[128];
    reversed[127 - tid] = x[tid];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const float v = x[tid];
    out[tid * 4 + 0] = simd_sum(v);
    out[tid * 4 + 1] = simd_max(v);
    out[tid * 4 + 2] = simd_shuffle_xor(v, 1) + 1000.0f * reversed[tid];
    out[tid * 4 + 3] = simd_shuffle(v, (lane + 5) % 32);
    if (sg == 0) {
        simdgroup_float8x8 ma, mb, mc;
        simdgroup_load(ma, a, 8);
        simdgroup_load(mb, b, 8);
        mc = make_filled_simdgroup_matrix<float, 8, 8>(1.0f);
        simdgroup_multiply_accumulate(mc, ma, mb, mc);
        simdgroup_store(mc, c, 8);
    }
    if (shape[0] != 0 && tid == 0) {
        c[64] = 1.0f;   // one past the end
    }
}
"""


def test_emulated_simd_and_matrix_semantics(compiler):
    lib = emulate.EmulatedLibrary(PROBE)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(128, generator=g)
    a, b = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
    out, c = torch.zeros(128 * 4), torch.zeros(8, 8)
    lib.probe(x, out, a, b, c, [0], threads=[128], group_size=[128])
    out = out.view(128, 4)
    lanes = x.view(4, 32)
    assert torch.allclose(out[:, 0], lanes.sum(1).repeat_interleave(32), atol=1e-5)
    assert torch.equal(out[:, 1], lanes.max(1).values.repeat_interleave(32))
    idx = torch.arange(128)
    assert torch.allclose(out[:, 2], x[idx ^ 1] + 1000.0 * x.flip(0), atol=1e-3)
    assert torch.equal(out[:, 3], x[(idx // 32) * 32 + (idx % 32 + 5) % 32])
    assert torch.allclose(c, a @ b + 1.0, atol=1e-5)


def test_out_of_bounds_write_fails_the_launch(compiler):
    lib = emulate.EmulatedLibrary(PROBE)
    args = (torch.randn(128), torch.zeros(512), torch.randn(8, 8), torch.randn(8, 8), torch.zeros(8, 8))
    with pytest.raises(emulate.EmulatorError, match="wrote outside buffer 4"):
        lib.probe(*args, [1], threads=[128], group_size=[128])


def test_signature_rules_are_enforced():
    bad = "kernel void f(device float* x [[buffer(1)]], uint i [[thread_position_in_grid]]) { x[i] = 0; }"
    with pytest.raises(emulate.EmulatorError, match="not 0..n-1"):
        emulate.parse_kernels(bad)
    with pytest.raises(emulate.EmulatorError, match="not emulated"):
        emulate.parse_kernels("kernel void f(device float* x [[buffer(0)]], uint i [[grid_origin]]) {}")


def test_no_compiler_is_an_explicit_error(monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(emulate.shutil, "which", lambda name: None)
    monkeypatch.setattr(emulate.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(emulate.NoCompiler, match="ziglang"):
        emulate.find_compiler()
    monkeypatch.setenv("CXX", "my-c++ -O0")
    assert emulate.find_compiler() == ["my-c++", "-O0"]
