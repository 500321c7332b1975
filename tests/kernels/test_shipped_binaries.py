"""The shipped-binary loader without a GPU: the argument memory a launch hands the driver
(through a stand-in ``libcuda`` built from ``fake_libcuda.c``), the manifest a build writes
and the loader reads back, and the clean fallbacks (no driver, no binaries for the GPU, a
kernel edited since the build, a binary whose parameters differ).  That the binaries
compute what the JIT's do needs a GPU: the CUDA cases at the end of this file."""
from __future__ import annotations

import ctypes
import json
import os
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import lik_plugins as lik
from lik_plugins.kernels import dispatch, reference
from lik_plugins.kernels.triton import binaries_loader, direct, variants

pytestmark = pytest.mark.skipif(not dispatch.triton_available(), reason="needs triton")

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def stub(tmp_path_factory):
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler for the stand-in libcuda")
    so = tmp_path_factory.mktemp("stub") / "libcuda_stub.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O2", str(HERE / "fake_libcuda.c"), "-o", str(so)], check=True)
    return ctypes.CDLL(str(so))


def _set(lib, name, value, kind=ctypes.c_int):
    kind.in_dll(lib, name).value = value


def _get(lib, name, kind=ctypes.c_int):
    return kind.in_dll(lib, name).value


class _Ptr:
    """A tensor stand-in: only its device address matters to the packing."""

    def __init__(self, address):
        self.address = address

    def data_ptr(self):
        return self.address


def test_each_argument_lands_in_its_slot_with_its_width(stub):
    from lik_plugins.kernels.triton import binaries_cuda as cuda

    codes = "PiP-lfBQ-i"
    args = (_Ptr(0x7F0000001000), -5, _Ptr(0x7F0000002000), 1, 2**40 + 3, 0.1, True, 2**63 + 7, None, 2**31 - 1)
    driver = cuda.Driver(stub)
    layout = cuda.LaunchLayout(codes)
    assert layout.param_sizes() == [8, 4, 8, 8, 4, 1, 8, 4, 8, 8]      # 8 kept arguments, then two scratch pointers
    kernel = cuda.ShippedKernel("k", driver, 0x3000, 4, 1024, layout, 0)
    _set(stub, "n_copied", layout.slots)
    kernel((5, 2), 0xABC, args)
    raw = (ctypes.c_uint64 * layout.slots).in_dll(stub, "launched_params")
    # what each slot must hold, from the arguments alone (little-endian, value in the low bytes)
    want = [0x7F0000001000, struct.unpack("<I", struct.pack("<i", -5))[0], 0x7F0000002000, 2**40 + 3,
            struct.unpack("<I", struct.pack("<f", 0.1))[0], 1, 2**63 + 7, 2**31 - 1, 0, 0]
    assert list(raw) == want
    assert list((ctypes.c_uint * 3).in_dll(stub, "launched_grid")) == [5, 2, 1]
    assert list((ctypes.c_uint * 3).in_dll(stub, "launched_block")) == [128, 1, 1]
    assert _get(stub, "launched_shared", ctypes.c_uint) == 1024
    assert ctypes.c_void_p.in_dll(stub, "launched_stream").value == 0xABC
    # the next call's values replace the last ones; an empty grid launches nothing
    launches = _get(stub, "launches")
    kernel((1,), 0, (_Ptr(16), 7, _Ptr(32), 1, 0, -1.5, False, 0, None, 3))
    assert list(raw)[:2] == [16, 7] and list(raw)[4] == struct.unpack("<I", struct.pack("<f", -1.5))[0]
    kernel((0, 4), 0, args)
    assert _get(stub, "launches") == launches + 1
    with pytest.raises(TypeError):
        kernel((1,), 0, args[:-1])


def test_loading_opts_in_to_large_shared_memory_and_checks_limits(stub):
    from lik_plugins.kernels.triton import binaries_cuda as cuda

    driver = cuda.Driver(stub)
    _set(stub, "static_shared", 1024)
    _set(stub, "dynamic_shared_set", -1)
    driver.load(b"\0", "k", 40000, 128, 0)
    assert _get(stub, "dynamic_shared_set") == -1           # under 48 KiB: nothing to set
    driver.load(b"\0", "k", 100000, 128, 0)
    assert _get(stub, "dynamic_shared_set") == 232448 - 1024
    with pytest.raises(cuda.CudaError, match="shared memory"):
        driver.load(b"\0", "k", 232449, 128, 0)
    with pytest.raises(cuda.CudaError, match="threads"):
        driver.load(b"\0", "k", 0, 2048, 0)
    _set(stub, "fail_load", 1)
    try:
        with pytest.raises(cuda.CudaError, match="cuModuleLoadData: CUDA error 200"):
            driver.load(b"\0", "k", 0, 128, 0)
    finally:
        _set(stub, "fail_load", 0)


def test_param_codes_follow_triton_types():
    from lik_plugins.kernels.triton import binaries_cuda as cuda

    assert [cuda.param_code(t) for t in ("*bf16", "*fp32", "i32", "i64", "fp32", "i1", "constexpr")] == \
        ["P", "P", "i", "l", "f", "B", "-"]
    with pytest.raises(ValueError):
        cuda.param_code("fp16")          # Triton passes Python floats as fp32: anything else is unknown here


# ----------------------------------------------------------------------------- build + manifest
def _compile_env():
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """``precompile --ship`` for PyLate's bf16 calls on sm_90, offline, into a scratch
    folder (the real compiler, not the interpreter); the folder and the variant list."""
    out = tmp_path_factory.mktemp("binaries")
    command = [sys.executable, "-m", "lik_plugins.precompile", "--arch", "sm_90", "--hosts", "pylate",
               "--dtypes", "bf16"]
    listed = subprocess.run([*command, "--ship", "--list"], env=_compile_env(), capture_output=True, text=True, timeout=600)
    assert listed.returncode == 0, listed.stderr[-3000:]
    done = subprocess.run([*command, "--ship", "--out", str(out), "--jobs", "2"], env=_compile_env(),
                          capture_output=True, text=True, timeout=1800)
    if done.returncode != 0 and "ptxas" in done.stderr.lower():
        pytest.skip(f"no usable ptxas for sm_90 here: {done.stderr.strip().splitlines()[-1]}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"in {out / 'sm_90.zip'}" in done.stdout
    return out, listed.stdout.strip().splitlines()[:-1]


def test_manifest_round_trip(built):
    from lik_plugins.kernels.triton import binaries_loader as loader
    from lik_plugins.kernels.triton import direct, forward

    built, listed = built
    manifest = loader.read_manifest("sm_90", built)
    assert manifest["arch"] == "sm_90" and manifest["cuda_driver"] >= 12000
    # the kernels' source keys are the ones this process computes (interpreted or not)
    assert manifest["file_keys"]["self_check_kernel"] == loader.file_key(variants.self_check_kernel)
    assert manifest["file_keys"]["maxsim_fwd_kernel"] == loader.file_key(forward.maxsim_fwd_kernel)
    assert len(manifest["variants"]) == len(listed)           # every variant --list names
    assert sorted(e["kernel"] for e in manifest["variants"].values()) == sorted(line.split()[0] for line in listed)
    x = torch.zeros(100)
    key = loader.variant_key(variants.variant(variants.self_check_kernel, (x, x, 91, 3.0), variants.CHECK_META))
    entry = manifest["variants"][key]
    # X, OUT pointers, n (not specialised: int32), scale (fp32); BLOCK is a constexpr after them
    assert entry["params"] == "PPif" and entry["function"] == "self_check_kernel"
    assert entry["num_warps"] == 4 and entry["shared"] >= 0
    with zipfile.ZipFile(built / "sm_90.zip") as archive:
        assert archive.read(entry["file"])[:4] == b"\x7fELF"
        assert all(m.compress_type == zipfile.ZIP_DEFLATED for m in archive.infolist())
        members = sorted(archive.namelist())
    # the manifest and the cubins its entries name, nothing else
    assert members == sorted({"manifest.json", *(e["file"] for e in manifest["variants"].values())})
    # every group of the listed variants has a binary without hints (serves any launch of the group)
    groups = {e["group"] for e in manifest["variants"].values()}
    assert groups == {e["group"] for e in manifest["variants"].values() if set(e["hints"]) <= {".", "-"}}
    # an integer is compiled in (no parameter) exactly where the binary was built for the value 1
    assert all((c == "-") == (h == "1") for e in manifest["variants"].values()
               for h, c in zip(e["hints"], e["params"]) if h != "-")
    fwd = next(e for e in manifest["variants"].values() if e["kernel"] == "maxsim_fwd_kernel" and "1" in e["hints"])
    # integers specialised to 1 (unit strides) are compiled in, not passed
    assert "-" in fwd["params"] and set(fwd["params"]) <= set("PilfB-")


def test_blanking_the_ptx_text_leaves_the_code_and_the_layout(tmp_path):
    """The build zeroes the PTX source ``-lineinfo`` embeds: the disassembled SASS, the
    section table and every other byte stay as ptxas wrote them."""
    code = ("import torch, pathlib; from lik_plugins.kernels.triton import variants as v; "
            "from lik_plugins.precompile import compiling_for; "
            "from lik_plugins.kernels.triton.binaries_build import without_ptx_text; "
            "x = torch.empty(100, device='meta'); out = pathlib.Path(%r)\n"
            "with compiling_for('sm_90'):\n"
            "    c = v.self_check_kernel.warmup(x, x, 37, 2.0, grid=(1,), **v.CHECK_META)\n"
            "(out / 'a.cubin').write_bytes(c.asm['cubin']); (out / 'b.cubin').write_bytes(without_ptx_text(c.asm['cubin']))"
            % str(tmp_path))
    done = subprocess.run([sys.executable, "-c", code], env=_compile_env(), capture_output=True, text=True, timeout=600)
    if done.returncode != 0 and "ptxas" in done.stderr.lower():
        pytest.skip(f"no usable ptxas for sm_90 here: {done.stderr.strip().splitlines()[-1]}")
    assert done.returncode == 0, done.stderr[-3000:]
    original, blanked = (tmp_path / "a.cubin").read_bytes(), (tmp_path / "b.cubin").read_bytes()
    assert len(blanked) == len(original) and blanked != original
    # the PTX text is in there, and only its bytes changed: one zeroed run containing it
    ptx = original.index(b".visible .entry self_check_kernel")
    changed = [i for i, (a, b) in enumerate(zip(original, blanked)) if a != b]
    assert changed[0] <= ptx <= changed[-1] and not any(blanked[changed[0]:changed[-1] + 1])
    import triton

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cuobjdump.exists():
        pytest.skip("no cuobjdump beside Triton's ptxas")
    sass = [subprocess.run([str(cuobjdump), "-sass", str(tmp_path / f)], capture_output=True, text=True, check=True).stdout
            for f in ("a.cubin", "b.cubin")]
    assert "self_check_kernel" in sass[0] and sass[0] == sass[1]


def test_ptx_parameter_sizes_are_read_from_the_entry():
    from lik_plugins.kernels.triton.binaries_cuda import ptx_param_sizes

    ptx = """
.visible .entry k(
\t.param .u64 .ptr .global .align 1 k_param_0,
\t.param .u32 k_param_1,
\t.param .f32 k_param_2,
\t.param .u8 k_param_3,
\t.param .u64 .ptr .global .align 1 k_param_4
)
{ ld.param.b32 %r1, [k_param_1]; }"""
    assert ptx_param_sizes(ptx, "k") == [8, 4, 4, 1, 8]


# ----------------------------------------------------------------------------- lookup
def test_a_signature_splits_into_what_must_match_and_what_a_binary_may_leave_out():
    # bf16 tensor aligned, an int equal to 1, an int divisible by 16, an int neither,
    # a tensor at an odd address, a do-not-specialise int, a float, None, a bool
    sig = ((torch.bfloat16, True), (True, False, True), (False, True, True), (False, False, False),
           (torch.float32, False), True, (float,), (type(None), None), (bool, True))
    shape, hints = variants.split(sig)
    assert hints == "D1D..----"
    assert shape == (torch.bfloat16, ("int", True), ("int", True), ("int", False), torch.float32, True, (float,),
                     (type(None), None), (bool, True))
    x = torch.zeros(100)
    launched = variants.variant(variants.self_check_kernel, (x, x[1:], 37, 2.0), variants.CHECK_META)
    assert variants.group(launched)[1] == "D.--"       # n is not specialised, scale is a float


_K, _META = "k", (("BLOCK", 64), ("num_warps", 4))
# the group every binary below belongs to, written out: a bf16 tensor, two specialised
# int32 integers, one integer Triton does not specialise (its width only)
_GROUP = repr((_K, _META, (torch.bfloat16, ("int", True), ("int", True), True)))


def _hand_manifest(extra=()) -> dict:
    """Binaries of one group, by hints: which one a launch gets is the test's expectation."""
    rows = [("exact", "D1D-", "P-ii"), ("stride-hint", "D.D-", "Piii"), ("unit-stride", ".1.-", "P-ii"),
            ("generic", "...-", "Piii"), *extra]
    return {"format": binaries_loader.FORMAT, "arch": "sm_90", "cuda_driver": 12000, "file_keys": {_K: "key"},
            "variants": {f"key-{name}": {"kernel": _K, "function": _K, "file": f"{name}.cubin", "num_warps": 4,
                                         "shared": 0, "params": params, "group": _GROUP, "hints": hints}
                         for name, hints, params in rows}}


def _launch(tensor_aligned, first, second, dtype=torch.bfloat16, fits=True):
    """A launch's variant written out: ``first`` / ``second`` are (is 1, divisible by 16)."""
    return (_K, _META, ((dtype, tensor_aligned), (*first, fits), (*second, True), True))


ONE_, DIV_, PLAIN_ = (True, False), (False, True), (False, False)


@pytest.mark.parametrize("launch, served_by", [
    (_launch(True, ONE_, DIV_), "exact"),                 # its own binary
    (_launch(True, PLAIN_, DIV_), "stride-hint"),
    (_launch(True, DIV_, DIV_), "stride-hint"),           # compiled without the %16 hint: valid for 32
    (_launch(False, ONE_, DIV_), "unit-stride"),          # unaligned: only binaries without the alignment hint
    (_launch(False, ONE_, PLAIN_), "unit-stride"),
    (_launch(True, DIV_, ONE_), "generic"),               # 1 where every other binary assumes %16 or 1
    (_launch(False, PLAIN_, PLAIN_), "generic"),
    (_launch(True, ONE_, DIV_, dtype=torch.float32), None),   # another dtype: another group
    (_launch(True, ONE_, DIV_, fits=False), None),            # a 64-bit integer: another group
])
def test_a_launch_gets_its_own_binary_else_the_most_specialised_one_valid_for_it(launch, served_by):
    device = binaries_loader._Device(None, 0, "sm_90", _hand_manifest(), None)
    want = None if served_by is None else f"key-{served_by}"
    assert device.key_for(launch) == want
    assert device.chosen[launch] == want                  # decided once per variant
    assert device.key_for(launch) == want


def test_an_integer_passed_as_1_needs_a_binary_that_takes_it_as_a_parameter():
    # a hand-made manifest where the generic binary compiled the second integer in (a Triton
    # that made it a constant for another reason): its param code decides, not its hint
    rows = (("generic", "...-", "Pi-i"),)
    manifest = _hand_manifest()
    manifest["variants"] = {k: v for k, v in manifest["variants"].items() if k != "key-generic"}
    manifest["variants"].update(_hand_manifest(rows)["variants"])
    device = binaries_loader._Device(None, 0, "sm_90", manifest, None)
    assert device.key_for(_launch(True, DIV_, ONE_)) is None
    assert device.key_for(_launch(True, DIV_, PLAIN_)) == "key-generic"


# ----------------------------------------------------------------------------- fallbacks
@pytest.fixture
def fresh_loader():
    from lik_plugins.kernels.triton import binaries_loader as loader

    loader.reset()
    yield loader
    loader.reset()


def test_no_driver_library_is_a_reason_not_an_error(fresh_loader, monkeypatch):
    from lik_plugins.kernels.triton import binaries_cuda as cuda
    from lik_plugins.kernels.triton import direct

    def no_library(cls):
        raise OSError("libcuda.so.1: cannot open shared object file")

    monkeypatch.setattr(cuda.Driver, "open", classmethod(no_library))
    x = torch.zeros(100)
    needed = variants.variant(variants.self_check_kernel, (x, x, 37, 2.0), variants.CHECK_META)
    assert fresh_loader.find(variants.self_check_kernel, needed, 0) is None
    reason = fresh_loader.diagnostics()["devices"][0]
    assert "no usable CUDA driver library" in reason and "libcuda.so.1" in reason


def _with_stub(loader, stub, monkeypatch, major, minor):
    from lik_plugins.kernels.triton import binaries_cuda as cuda

    _set(stub, "capability_major", major)
    _set(stub, "capability_minor", minor)
    monkeypatch.setattr(cuda.Driver, "open", classmethod(lambda cls: cls(stub)))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)


def test_a_gpu_without_shipped_binaries_falls_back_with_its_arch(fresh_loader, stub, monkeypatch, built):
    from lik_plugins.kernels.triton import direct

    _with_stub(fresh_loader, stub, monkeypatch, 8, 6)
    monkeypatch.setattr(fresh_loader, "BINARIES_DIR", built[0])
    x = torch.zeros(100)
    needed = variants.variant(variants.self_check_kernel, (x, x, 37, 2.0), variants.CHECK_META)
    assert fresh_loader.find(variants.self_check_kernel, needed, 0) is None
    assert fresh_loader.diagnostics()["devices"][0] == "no shipped binaries for sm_86"


def test_an_old_driver_and_a_failed_self_check_fall_back(fresh_loader, stub, monkeypatch, built):
    from lik_plugins.kernels.triton import direct

    _with_stub(fresh_loader, stub, monkeypatch, 9, 0)
    monkeypatch.setattr(fresh_loader, "BINARIES_DIR", built[0])
    x = torch.zeros(100)
    needed = variants.variant(variants.self_check_kernel, (x, x, 37, 2.0), variants.CHECK_META)
    _set(stub, "driver_version", 11080)
    try:
        assert fresh_loader.find(variants.self_check_kernel, needed, 0) is None
        assert "older than the binaries need" in fresh_loader.diagnostics()["devices"][0]
    finally:
        _set(stub, "driver_version", 12080)
    fresh_loader.reset()
    monkeypatch.setattr(fresh_loader, "_self_check", lambda ordinal, binary_for: False)
    assert fresh_loader.find(variants.self_check_kernel, needed, 0) is None
    assert "self-check kernel wrote other values" in fresh_loader.diagnostics()["devices"][0]


def test_found_variants_load_once_and_stale_or_mismatched_ones_fall_back(fresh_loader, stub, monkeypatch, built):
    from lik_plugins.kernels.triton import binaries_cuda as cuda
    from lik_plugins.kernels.triton import direct

    _with_stub(fresh_loader, stub, monkeypatch, 9, 0)
    monkeypatch.setattr(fresh_loader, "BINARIES_DIR", built[0])
    monkeypatch.setattr(fresh_loader, "_self_check", lambda ordinal, binary_for: True)
    x = torch.zeros(100)
    needed = variants.variant(variants.self_check_kernel, (x, x, 37, 2.0), variants.CHECK_META)
    _set(stub, "n_declared", 6)                      # 2 pointers, n, scale, 2 scratch pointers
    for i, size in enumerate((8, 8, 4, 4, 8, 8)):
        (ctypes.c_size_t * 64).in_dll(stub, "declared_sizes")[i] = size
    shipped = fresh_loader.find(variants.self_check_kernel, needed, 0)
    assert isinstance(shipped, cuda.ShippedKernel) and shipped.layout.codes == "PPif"
    assert fresh_loader.find(variants.self_check_kernel, needed, 0) is shipped
    assert fresh_loader.diagnostics()["devices"][0] == {"arch": "sm_90", "shipped": len(built[1]), "loaded": 1}
    # a launch the build did not see (an unaligned output): its group's binary without hints
    unaligned = variants.variant(variants.self_check_kernel, (x, x[1:], 37, 2.0), variants.CHECK_META)
    generic = fresh_loader.find(variants.self_check_kernel, unaligned, 0)
    assert isinstance(generic, cuda.ShippedKernel) and generic is not shipped and generic.layout.codes == "PPif"
    assert fresh_loader._devices[0].chosen[unaligned] in fresh_loader._devices[0].loaded
    # a launch of a group the build did not reach (other constexprs): the JIT, counted
    other = variants.variant(variants.self_check_kernel, (x, x, 37, 2.0), {"BLOCK": 32})
    assert fresh_loader.find(variants.self_check_kernel, other, 0) is None
    assert fresh_loader.diagnostics()["missing"] == {"self_check_kernel": 1}
    assert fresh_loader.diagnostics()["unserved"] == {"self_check_kernel": [fresh_loader.variant_key(other)]}
    assert fresh_loader._file_keys[id(variants.self_check_kernel)] == \
        fresh_loader.read_manifest("sm_90", built[0])["file_keys"]["self_check_kernel"]
    # a kernel whose source files are not the ones the binaries were built from
    fresh_loader._file_keys[id(variants.self_check_kernel)] = "edited"
    fresh_loader._devices[0].loaded.clear()
    fresh_loader._devices[0].served.clear()
    assert fresh_loader.find(variants.self_check_kernel, needed, 0) is None
    assert "source differs" in fresh_loader.diagnostics()["kernels"]["self_check_kernel"]
    # or whose source cannot be read: no check, no binary
    fresh_loader._stale.clear()
    fresh_loader._file_keys.clear()

    def unreadable(filename):
        raise OSError(f"{filename}: not installed")

    monkeypatch.setattr(fresh_loader, "_file_sha", unreadable)
    assert fresh_loader.find(variants.self_check_kernel, needed, 0) is None
    assert "cannot be read" in fresh_loader.diagnostics()["kernels"]["self_check_kernel"]


def test_a_binary_declaring_other_parameters_is_not_launched(fresh_loader, stub, monkeypatch, built):
    from lik_plugins.kernels.triton import direct

    _with_stub(fresh_loader, stub, monkeypatch, 9, 0)
    monkeypatch.setattr(fresh_loader, "BINARIES_DIR", built[0])
    monkeypatch.setattr(fresh_loader, "_self_check", lambda ordinal, binary_for: True)
    _set(stub, "n_declared", 5)                      # one scratch pointer short: another kernel ABI
    for i, size in enumerate((8, 8, 4, 4, 8)):
        (ctypes.c_size_t * 64).in_dll(stub, "declared_sizes")[i] = size
    x = torch.zeros(100)
    needed = variants.variant(variants.self_check_kernel, (x, x, 37, 2.0), variants.CHECK_META)
    assert fresh_loader.find(variants.self_check_kernel, needed, 0) is None
    assert "the binary takes parameters of" in fresh_loader.diagnostics()["kernels"]["self_check_kernel"]


def _jit_compiled(ptx_sizes, name="self_check_kernel", **metadata):
    """What the loader reads of a Triton ``CompiledKernel``: metadata, signature, PTX, handle."""
    from types import SimpleNamespace

    fields = {**dict(name=name, num_warps=4, shared=0, global_scratch_size=0, profile_scratch_size=0, num_ctas=1,
                     launch_pdl=False, launch_cooperative_grid=False), **metadata}
    kinds = {1: "u8", 4: "u32", 8: "u64"}
    ptx = f".visible .entry {name}(\n" + ",\n".join(
        f"\t.param .{kinds[size]} {name}_param_{i}" for i, size in enumerate(ptx_sizes)) + "\n)\n{}"
    signature = {"X": "*fp32", "OUT": "*fp32", "n": "i32", "scale": "fp32", "BLOCK": "constexpr"}
    return SimpleNamespace(metadata=SimpleNamespace(**fields), src=SimpleNamespace(signature=signature),
                           asm={"ptx": ptx}, function=1234, run=None)


def test_the_jits_binaries_launch_through_the_driver_once_checked(fresh_loader, stub, monkeypatch):
    """``from_jit``: a JIT-compiled kernel becomes a driver launch with the parameter codes its
    signature gives, once the driver path passed its self-check on the device; a PTX entry
    that declares other parameters (another Triton ABI), a kernel needing scratch memory, or
    a failed self-check leave its launches on the JIT, with the reason."""
    from lik_plugins.kernels.triton import binaries_cuda as cuda

    _with_stub(fresh_loader, stub, monkeypatch, 8, 6)
    checks = []
    monkeypatch.setattr(fresh_loader, "_self_check", lambda ordinal, binary_for: checks.append(ordinal) or True)
    monkeypatch.setattr(variants.self_check_kernel, "warmup", lambda *a, **k: _jit_compiled([8, 8, 4, 4, 8, 8]))
    monkeypatch.setattr(torch, "empty", lambda *a, **k: None)          # the check's warm-up tensor: no GPU here
    wrapped = fresh_loader.from_jit(_jit_compiled([8, 8, 4, 4, 8, 8]), 4, 0)
    assert isinstance(wrapped, cuda.ShippedKernel) and wrapped.layout.codes == "PPif" and wrapped.function == 1234
    assert fresh_loader.from_jit(_jit_compiled([8, 8, 4, 4, 8, 8]), 4, 0) is not None and checks == [0]
    assert fresh_loader.diagnostics()["driver_launch"] == {0: True}
    assert fresh_loader.from_jit(_jit_compiled([8, 8, 4, 4, 8]), 4, 0) is None     # one scratch pointer short
    assert "the PTX declares parameters" in fresh_loader.diagnostics()["jit_only"]["self_check_kernel"]
    assert "self_check_kernel" not in fresh_loader.diagnostics()["kernels"]     # its shipped binaries stay usable
    scratch = _jit_compiled([8, 8, 4, 4, 8, 8], name="k2", global_scratch_size=64)
    assert fresh_loader.from_jit(scratch, 4, 0) is None
    assert "global scratch memory" in fresh_loader.diagnostics()["jit_only"]["k2"]
    fresh_loader.reset()
    monkeypatch.setattr(fresh_loader, "_self_check", lambda ordinal, binary_for: False)
    assert fresh_loader.from_jit(_jit_compiled([8, 8, 4, 4, 8, 8]), 4, 0) is None
    assert "wrote other values" in fresh_loader.diagnostics()["driver_launch"][0]


def test_the_environment_switch_is_on_unless_turned_off(monkeypatch):
    from lik_plugins._config import shipped_binaries_enabled

    monkeypatch.delenv("LIK_SHIPPED_BINARIES", raising=False)
    assert shipped_binaries_enabled()
    monkeypatch.setenv("LIK_SHIPPED_BINARIES", "1")
    assert shipped_binaries_enabled()
    monkeypatch.setenv("LIK_SHIPPED_BINARIES", "0")
    assert not shipped_binaries_enabled()


_REBUILD = "rebuild them: python -m lik_plugins.precompile --ship --arch {arch} --dtypes bf16 fp32"


def test_shipped_manifests_in_the_package_match_the_kernels():
    """Binaries committed with the package must be built from the kernels' current source:
    a kernel edited without ``precompile --ship`` would serve its launches through the JIT."""
    from lik_plugins.kernels.triton import binaries_loader as loader

    manifests = loader.shipped_manifests()
    if not manifests:
        pytest.skip("no binaries shipped in this checkout")
    kernels = _package_kernels()
    for arch, manifest in manifests.items():
        for name, key in manifest["file_keys"].items():
            assert loader.file_key(kernels[name]) == key, \
                f"{arch}: {name}'s source files changed since the build; " + _REBUILD.format(arch=arch)
        with zipfile.ZipFile(loader.archive_path(arch)) as archive:
            members = set(archive.namelist())
        assert members == {"manifest.json", *(e["file"] for e in manifest["variants"].values())}
        # every binary fits the shared memory of its architecture's GPUs
        from lik_plugins.precompile import TARGETS

        assert max(e["shared"] for e in manifest["variants"].values()) <= TARGETS[arch][1]


def test_shipped_manifests_hold_the_variants_the_launchers_reach_now():
    """The launchers' choices (configs, blockings, argument specialisation) decide the keys:
    the variants precompile lists today for the build's workload are the ones shipped."""
    from lik_plugins.kernels.triton import binaries_loader as loader

    manifests = loader.shipped_manifests()
    if not manifests:
        pytest.skip("no binaries shipped in this checkout")
    for manifest in manifests.values():
        work = manifest["workload"]
        code = ("import json, torch; from lik_plugins import precompile as p; "
                "from lik_plugins.kernels.triton import binaries_loader as b, variants; "
                f"todo = p.variants({work['hosts']!r}, [p.DTYPES[d] for d in {work['dtypes']!r}], {work['dims']!r}, "
                f"{manifest['arch']!r}, generic=True); print(json.dumps(sorted(b.variant_key(variants.variant(*v)) for v in todo)))")
        done = subprocess.run([sys.executable, "-c", code], env=_compile_env(), capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        now = set(json.loads(done.stdout))
        assert now == set(manifest["variants"]), (
            f"{manifest['arch']}: {len(now - set(manifest['variants']))} variants not shipped, "
            f"{len(set(manifest['variants']) - now)} no longer reached; " + _REBUILD.format(arch=manifest["arch"]))


def _package_kernels() -> dict:
    """Every Triton kernel the package defines, by name (wherever a refactor puts it)."""
    import importlib
    import pkgutil

    import lik_plugins.kernels as package

    found = {}
    for info in pkgutil.walk_packages(package.__path__, prefix=package.__name__ + "."):
        if ".metal" in info.name:
            continue
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            fn = getattr(value, "fn", None)
            if callable(value) and getattr(fn, "__module__", None) == module.__name__:
                found[fn.__name__] = value
    return found


# --------------------------------------------------------------------------- CUDA
# On a GPU, the binaries shipped with the package (``LIK_SHIPPED_BINARIES=1``). Every binary of this GPU's architecture loads with the parameters its manifest declares;
# the hosts' calls (shapes from ``lik_plugins.precompile``'s grid, forward and backward) run
# on the shipped binaries with no JIT launch of a shipped variant, and give what the JIT's
# binaries give and what the fp64 reference gives.  Skipped without CUDA or without binaries
# for this GPU.


def cuda_only(test):
    """The CUDA cases: marked ``gpu`` and skipped without a CUDA device."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(test))

CUDA_TOL = {torch.float32: 1e-4, torch.bfloat16: 4e-2}


def _cuda_arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


@pytest.fixture(scope="module")
def cuda_manifest():
    if not binaries_loader.archive_path(_cuda_arch()).is_file():
        pytest.skip(f"no shipped binaries for {_cuda_arch()}")
    return binaries_loader.read_manifest(_cuda_arch())


def _cuda_mode(monkeypatch, shipped: bool) -> None:
    monkeypatch.setenv("LIK_SHIPPED_BINARIES", "1" if shipped else "0")
    monkeypatch.setenv("LIK_BACKEND", "triton")
    direct.clear()
    binaries_loader.reset()


@cuda_only
def test_every_shipped_binary_loads_with_its_declared_parameters(cuda_manifest, monkeypatch):
    _cuda_mode(monkeypatch, True)
    device = binaries_loader._open_device(torch.cuda.current_device())
    assert not isinstance(device, str), device                  # the driver opened and the self-check passed
    for key, entry in cuda_manifest["variants"].items():
        shipped = device.kernel(key)
        assert shipped.name == entry["function"] and shipped.layout.codes == entry["params"]


def _rel(x, y) -> float:
    return ((x.double() - y.double()).abs().max() / y.double().abs().max().clamp_min(1e-12)).item()


# (name, score function, Q shape, D shape, masks) -- the hosts' calls at sizes of the precompile grid
def _cases():
    def pylate(Q, D, dm, qm):
        return lik.maxsim(Q, D, None, dm, mask_mode="zero")

    def st(Q, D, dm, qm):
        return lik.maxsim(Q, D, qm, dm)

    def ops(Q, D, dm, qm):
        return lik.maxsim(Q, D, None, dm)

    def colpali(Q, D, dm, qm):
        return lik.maxsim(Q, D)

    def smooth(layout):
        return lambda Q, D, dm, qm: lik.smooth_maxsim(Q, D, tau=0.1, layout=layout)

    return [
        ("pylate-contrastive", pylate, (32, 32), (64, 180)),
        ("pylate-kd", pylate, (16, 32), (16, 32, 180)),
        ("st", st, (16, 32), (16, 128)),
        ("ops", ops, (32, 16), (32, 300)),
        ("colpali-inbatch", colpali, (8, 16), (8, 1030)),
        ("colpali-hardneg", colpali, (8, 16), (8, 2, 1030)),
        ("colpali-smooth-cross", smooth("cross"), (8, 16), (8, 1030)),
        ("colpali-smooth-pairs", smooth("pairs"), (8, 16), (8, 1030)),
    ]


def _reference(name, Q, D, dm, qm):
    Q64, D64 = Q.double(), D.double()
    if name.startswith("colpali-smooth"):
        return reference.smooth_maxsim(Q64, D64, tau=0.1, layout=name.rsplit("-", 1)[1])
    if name.startswith("colpali"):
        return reference.maxsim(Q64, D64)
    if name.startswith("pylate"):
        return reference.maxsim(Q64, D64, None, dm, mask_mode="zero")
    return reference.maxsim(Q64, D64, qm if name == "st" else None, dm)


def _case_inputs(q_shape, d_shape, dtype, dim=128):
    """Unit-norm queries and documents of a case, with token masks, seeded."""
    g = torch.Generator(device="cuda").manual_seed(0)
    Q0 = torch.nn.functional.normalize(torch.randn(*q_shape, dim, device="cuda", generator=g), dim=-1).to(dtype)
    D0 = torch.nn.functional.normalize(torch.randn(*d_shape, dim, device="cuda", generator=g), dim=-1).to(dtype)
    dm = torch.rand(d_shape, device="cuda", generator=g) > 0.2
    qm = torch.rand(q_shape, device="cuda", generator=g) > 0.1
    return Q0, D0, dm, qm


def _run(fn, Q0, D0, dm, qm, grad_seed=1):
    Q, D = Q0.detach().requires_grad_(), D0.detach().requires_grad_()
    out = fn(Q, D, dm, qm)
    g = torch.randn(out.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(grad_seed))
    out.backward(g.to(out.dtype))
    return out.detach(), Q.grad, D.grad, g


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", _cases(), ids=[c[0] for c in _cases()])
@cuda_only
def test_host_calls_run_on_shipped_binaries_as_on_the_jit(case, dtype, cuda_manifest, monkeypatch):
    name, fn, q_shape, d_shape = case
    Q0, D0, dm, qm = _case_inputs(q_shape, d_shape, dtype)

    _cuda_mode(monkeypatch, True)
    direct.reset_variants()
    shipped = _run(fn, Q0, D0, dm, qm)
    launched = set(direct._VARIANTS)
    report = binaries_loader.diagnostics()
    device = report["devices"][torch.cuda.current_device()]
    assert isinstance(device, dict), device
    assert report["kernels"] == {}, report["kernels"]            # no kernel edited since the build
    served = {binaries_loader.variant_key(k) for k in launched} & set(cuda_manifest["variants"])
    assert served, "the call reached no shipped variant"
    assert served <= set(binaries_loader._devices[torch.cuda.current_device()].loaded)
    _cuda_mode(monkeypatch, False)
    jit = _run(fn, Q0, D0, dm, qm)

    out_ref = _reference(name, Q0, D0, dm, qm)
    Qr, Dr = Q0.double().requires_grad_(), D0.double().requires_grad_()
    _reference(name, Qr, Dr, dm, qm).backward(shipped[3].double())
    tol = CUDA_TOL[dtype]
    for got, want, ref in ((shipped[0], jit[0], out_ref), (shipped[1], jit[1], Qr.grad), (shipped[2], jit[2], Dr.grad)):
        assert _rel(got, ref) < tol and _rel(want, ref) < tol
        # the same kernel source compiled by two Triton releases: within rounding of each other
        assert _rel(got, want) < tol


def _generic_only(monkeypatch) -> None:
    """Every launch served by its group's binary without hints, as a launch the build did not
    see is (the loader's self-check still launches its own binary)."""
    def generic_key(device, variant):
        group = variants.group(variant)[0]
        return next((key for key, e in device.entries.items()
                     if e["group"] == group and variants.specialisation(e["hints"]) == 0), None)

    monkeypatch.setattr(binaries_loader._Device, "key_for", generic_key)


def _loaded_hints(manifest, device) -> set:
    return {manifest["variants"][k]["hints"] for k in device.loaded
            if manifest["variants"][k]["kernel"] != "self_check_kernel"}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", _cases(), ids=[c[0] for c in _cases()])
@cuda_only
def test_the_generic_binaries_compute_bit_for_bit_what_the_specialised_ones_do(case, dtype, cuda_manifest,
                                                                                monkeypatch):
    """The claim behind serving unseen launches with a group's generic binary: the hints
    change how operands are loaded (vector widths, constants), not the order of any sum."""
    name, fn, q_shape, d_shape = case
    Q0, D0, dm, qm = _case_inputs(q_shape, d_shape, dtype)

    _cuda_mode(monkeypatch, True)
    specialised = _run(fn, Q0, D0, dm, qm)
    again = _run(fn, Q0, D0, dm, qm)          # what repeats bit for bit (the unified backward's atomics need not)
    ordinal = torch.cuda.current_device()
    assert any(variants.specialisation(h) for h in _loaded_hints(cuda_manifest, binaries_loader._devices[ordinal]))

    with monkeypatch.context() as patched:
        _generic_only(patched)
        _cuda_mode(patched, True)
        generic = _run(fn, Q0, D0, dm, qm)
        served = _loaded_hints(cuda_manifest, binaries_loader._devices[ordinal])
        report = binaries_loader.diagnostics()
    assert served and all(variants.specialisation(h) == 0 for h in served), served
    assert report["missing"] == {} and report["kernels"] == {}, report
    # the smooth max's grad_Q adds one partial per document split with fp32 atomics, in no fixed
    # order (more than two splits here): two runs may agree by chance and a third differ
    atomic = {1} if name.startswith("colpali-smooth") else set()
    for i, (got, want, repeat) in enumerate(zip(generic[:3], specialised[:3], again[:3])):
        if i not in atomic and torch.equal(want, repeat):
            assert torch.equal(got, want)
        else:
            assert _rel(got, want) < CUDA_TOL[dtype]
    assert torch.equal(generic[0], specialised[0])          # the forward has no atomics: always bitwise
