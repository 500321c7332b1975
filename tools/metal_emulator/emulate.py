"""Run the shipped Metal kernels on the CPU: compile the .metal source as C++ and check it.

``python tools/metal_emulator/emulate.py`` (from a checkout, with lik_plugins installed)
runs every shipped kernel over a set of cases (three layouts, both mask modes,
normalisation, fp32 / fp16 / bf16, holes and fully masked rows, odd sizes) through the real
launchers of :mod:`lik_plugins.kernels.metal.launch`, compares with
:mod:`lik_plugins.kernels.reference` (and the smooth-max reference), prints a per-case and
a per-kernel summary and exits 1 on any mismatch (2 if no C++ compiler can be found).

How the source becomes C++ -- what is rewritten, exactly:

* **Nothing in the .metal text.**  The library source (``launch.library_source``:
  a three-line prelude and the shipped files, byte for byte) is compiled as C++17 with
  ``include/`` beside this file on the include path, so ``#include <metal_stdlib>`` includes
  the emulation header ``include/metal_stdlib`` (address spaces, vector types, ``half`` /
  ``bfloat``, barriers, simd functions, simdgroup matrices; see its top comment).
  ``[[buffer(i)]]`` and the thread-position attributes are standard C++ attribute syntax
  that the compiler ignores.
* **Appended after it**: one generated ``extern "C"`` driver per kernel, which calls the
  kernel with the buffers in ``[[buffer(i)]]`` order and the thread-position values its
  attributes name (parsed from the signature by :func:`parse_kernels`).

Launching mirrors ``torch.mps.compile_shader``: ``lib.kernel(*args, threads=...,
group_size=...)``, tensors as buffers, ``int`` as int64, ``float`` as fp32, lists as
arrays, ``threads`` counting threads (not threadgroups).  Every tensor is copied into a
buffer with 16 KiB guards of ``0xFF`` bytes on both sides (NaN for floats, -1 for ints), so
an out-of-bounds read poisons the result and an out-of-bounds write fails the launch.

The compiler is ``$CXX``, else ``g++`` / ``clang++`` / ``c++`` on ``PATH``, else the
``ziglang`` package's ``python -m ziglang c++``.

It lives in the repository, not in the package: CI and kernel authors need it, users of the
wheel do not (on a Mac, ``python -m lik_plugins.kernels.metal.selftest`` runs the real thing).
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lik_plugins.kernels.metal import launch
from lik_plugins.kernels.metal.checks import DTYPES, Case, Result, check, default_cases, judge, report

INCLUDE_DIR = Path(__file__).with_name("include")
GUARD_BYTES = 1 << 14
_SCALAR_ATTRS = {
    "thread_index_in_threadgroup", "thread_index_in_simdgroup", "simdgroup_index_in_threadgroup",
    "simdgroups_per_threadgroup", "threads_per_simdgroup",
}
_VECTOR_ATTRS = {
    "thread_position_in_grid", "threadgroup_position_in_grid", "thread_position_in_threadgroup",
    "threads_per_threadgroup", "threadgroups_per_grid", "threads_per_grid",
}


class EmulatorError(RuntimeError):
    """A kernel failed under emulation (barrier divergence, out-of-bounds write, ...)."""


class NoCompiler(RuntimeError):
    """No C++ compiler could be found."""


# --------------------------------------------------------------------------- compiler
def find_compiler() -> list[str]:
    """The command that runs a C++17 compiler, or raise :class:`NoCompiler` with the reason."""
    env = os.environ.get("CXX")
    if env:
        return env.split()
    for name in ("g++", "clang++", "c++"):
        path = shutil.which(name)
        if path:
            return [path]
    if importlib.util.find_spec("ziglang") is not None:
        return [sys.executable, "-m", "ziglang", "c++"]
    raise NoCompiler("no C++ compiler: set CXX, install g++ or clang++, or `pip install ziglang`")


# --------------------------------------------------------------------------- signatures
@dataclass
class Param:
    type: str       # as written, e.g. "device const elem_t*"
    name: str
    attr: str       # "buffer" or a thread-position attribute
    index: int = -1  # buffer index


@dataclass
class KernelSig:
    name: str
    params: list[Param] = field(default_factory=list)

    @property
    def buffers(self) -> list[Param]:
        return [p for p in self.params if p.attr == "buffer"]


_KERNEL_RE = re.compile(r"\bkernel\s+void\s+(\w+)\s*\(")
_PARAM_RE = re.compile(r"^(?P<type>.*?)(?P<name>\w+)\s*\[\[\s*(?P<attr>\w+)\s*(?:\(\s*(?P<index>\d+)\s*\))?\s*\]\]$", re.S)


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", " ", text)


def parse_kernels(source: str) -> list[KernelSig]:
    """Every ``kernel void name(...)`` in ``source`` with its parameters.  Each parameter
    must carry one attribute; buffer indices must be 0, 1, 2, ... in order (torch binds
    call argument ``i`` to ``buffer(i)``)."""
    clean = _strip_comments(source)
    kernels = []
    for m in _KERNEL_RE.finditer(clean):
        depth, i = 1, m.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(clean[i], 0)
            i += 1
        params_text = clean[m.end(): i - 1]
        sig = KernelSig(m.group(1))
        for raw in _split_top_level(params_text):
            pm = _PARAM_RE.match(raw.strip())
            if pm is None:
                raise EmulatorError(f"kernel {sig.name}: cannot parse parameter {raw.strip()!r}")
            attr = pm.group("attr")
            if attr != "buffer" and attr not in _SCALAR_ATTRS | _VECTOR_ATTRS:
                raise EmulatorError(f"kernel {sig.name}: attribute [[{attr}]] is not emulated")
            index = int(pm.group("index")) if pm.group("index") else -1
            sig.params.append(Param(" ".join(pm.group("type").split()), pm.group("name"), attr, index))
        indices = [p.index for p in sig.buffers]
        if indices != list(range(len(indices))):
            raise EmulatorError(f"kernel {sig.name}: buffer indices {indices} are not 0..n-1 in argument order")
        kernels.append(sig)
    return kernels


def _split_top_level(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([<":
            depth += 1
        elif ch in ")]>":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if text[start:].strip():
        parts.append(text[start:])
    return parts


def driver_source(kernels: list[KernelSig]) -> str:
    """The C++ appended after the kernel source: one ``extern "C"`` launcher per kernel."""
    out = ["\n// ---- generated by tools/metal_emulator/emulate.py (not part of the shader)\n"]
    for k in kernels:
        args = []
        for p in k.params:
            if p.attr == "buffer":
                args.append(f"lik_emu::Arg<{p.type}>::get(args[{p.index}])")
            elif p.attr in _SCALAR_ATTRS:
                args.append(f"lik_emu::attr<{p.type}>(lik_emu::scalar3(p.{p.attr}))")
            else:
                args.append(f"lik_emu::attr<{p.type}>(p.{p.attr})")
        call = ",\n            ".join(args)
        out.append(
            f'extern "C" const char* lik_emu_{k.name}(void** args, const unsigned* groups, const unsigned* tg) {{\n'
            f"    static thread_local std::string error;\n"
            f"    error = lik_emu::run_grid(groups, tg, [&](const lik_emu::Pos& p) {{\n"
            f"        {k.name}(\n            {call});\n"
            f"    }});\n"
            f"    return error.empty() ? nullptr : error.c_str();\n"
            f"}}\n"
        )
    return "".join(out)


def _cache_dir() -> Path:
    root = os.environ.get("LIK_METAL_EMU_CACHE") or os.path.join(tempfile.gettempdir(), f"lik_metal_emu_{os.getuid()}")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def build(source: str) -> tuple[Path, list[KernelSig]]:
    """Compile ``source`` (a full library source) plus its drivers into a shared object,
    cached by content hash.  Returns its path and the parsed kernels."""
    kernels = parse_kernels(source)
    if not kernels:
        raise EmulatorError("no `kernel void` function in the source")
    cpp = source + driver_source(kernels)
    compiler = find_compiler()
    header = (INCLUDE_DIR / "metal_stdlib").read_bytes()
    key = hashlib.sha256(cpp.encode() + header + " ".join(compiler).encode()).hexdigest()[:20]
    out = _cache_dir() / f"lib_{key}.so"
    if out.exists():
        return out, kernels
    with tempfile.TemporaryDirectory(dir=_cache_dir()) as tmp:
        src = Path(tmp) / "library.cpp"
        src.write_text(cpp, encoding="utf-8")
        tmp_out = Path(tmp) / "library.so"
        cmd = [*compiler, "-std=c++17", "-O1", "-fPIC", "-shared", "-pthread", "-w",
               f"-I{INCLUDE_DIR}", "-x", "c++", str(src), "-o", str(tmp_out)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise EmulatorError(f"compiling the Metal source as C++ failed ({' '.join(compiler)}):\n{proc.stderr[-6000:]}")
        os.replace(tmp_out, out)   # atomic: concurrent builders agree on the result
    return out, kernels


# --------------------------------------------------------------------------- library
class EmulatedKernel:
    def __init__(self, lib: "EmulatedLibrary", sig: KernelSig, fn):
        self._lib, self.sig, self._fn = lib, sig, fn

    def __call__(self, *args, threads, group_size):
        n_buffers = len(self.sig.buffers)
        if len(args) != n_buffers:
            raise EmulatorError(f"{self.sig.name}: {len(args)} arguments for {n_buffers} buffers")
        threads3 = _three(threads)
        group3 = _three(group_size)
        for t, g in zip(threads3, group3):
            if g <= 0 or t % g:
                raise EmulatorError(f"{self.sig.name}: threads {threads3} is not a multiple of group_size {group3}")
        groups = [t // g for t, g in zip(threads3, group3)]
        keep, guarded = [], []
        pointers = (ctypes.c_void_p * n_buffers)()
        for i, value in enumerate(args):
            if isinstance(value, torch.Tensor):
                g = _Guarded(value, i)
                guarded.append(g)
                pointers[i] = g.pointer
            else:
                storage = _scalar_storage(value)
                keep.append(storage)
                pointers[i] = ctypes.cast(storage, ctypes.c_void_p)
        self._lib.calls[self.sig.name] = self._lib.calls.get(self.sig.name, 0) + 1
        if 0 in groups:
            return
        error = self._fn(pointers, (ctypes.c_uint * 3)(*groups), (ctypes.c_uint * 3)(*group3))
        if error:
            raise EmulatorError(f"{self.sig.name}: {error.decode()}")
        for g in guarded:
            g.finish(self.sig.name)


def _three(v) -> list[int]:
    v = [int(v)] if isinstance(v, int) else [int(x) for x in v]
    return v + [1] * (3 - len(v))


def _scalar_storage(value):
    if isinstance(value, bool) or isinstance(value, int):
        return ctypes.pointer(ctypes.c_int64(int(value)))
    if isinstance(value, float):
        return ctypes.pointer(ctypes.c_float(value))
    if isinstance(value, (list, tuple)) and value:
        if all(isinstance(x, int) for x in value):
            return (ctypes.c_int64 * len(value))(*value)
        return (ctypes.c_float * len(value))(*[float(x) for x in value])
    raise EmulatorError(f"unsupported kernel argument {value!r}")


class _Guarded:
    """A tensor copied between two guard regions; copied back (and the guards checked)
    after the launch."""

    def __init__(self, t: torch.Tensor, index: int):
        if t.device.type != "cpu":
            raise EmulatorError(f"argument {index}: the emulator takes CPU tensors, got {t.device}")
        if not t.is_contiguous():
            raise EmulatorError(f"argument {index}: not contiguous (a Metal buffer is flat)")
        self.t, self.index = t, index
        self.nbytes = t.numel() * t.element_size()
        self.buf = torch.full((2 * GUARD_BYTES + self.nbytes,), 0xFF, dtype=torch.uint8)
        self.before = t.detach().reshape(-1).view(torch.uint8).clone() if self.nbytes else None
        if self.nbytes:
            self.buf[GUARD_BYTES: GUARD_BYTES + self.nbytes] = self.before
        self.pointer = self.buf.data_ptr() + GUARD_BYTES

    def finish(self, kernel: str) -> None:
        ok = bool((self.buf[:GUARD_BYTES] == 0xFF).all()) and bool((self.buf[GUARD_BYTES + self.nbytes:] == 0xFF).all())
        if not ok:
            raise EmulatorError(f"{kernel}: wrote outside buffer {self.index}")
        if self.nbytes:
            after = self.buf[GUARD_BYTES: GUARD_BYTES + self.nbytes]
            if not torch.equal(after, self.before):
                with torch.no_grad():
                    self.t.reshape(-1).view(torch.uint8).copy_(after)


class EmulatedLibrary:
    """The CPU stand-in for ``torch.mps.compile_shader(source)``: kernels are attributes,
    called as ``lib.name(*args, threads=..., group_size=...)``; ``calls`` counts launches."""

    def __init__(self, source: str):
        path, kernels = build(source)
        self._dll = ctypes.CDLL(str(path))
        self.calls: dict[str, int] = {}
        self._kernels = {}
        for sig in kernels:
            fn = getattr(self._dll, f"lik_emu_{sig.name}")
            fn.restype = ctypes.c_char_p
            fn.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_uint), ctypes.POINTER(ctypes.c_uint)]
            self._kernels[sig.name] = EmulatedKernel(self, sig, fn)

    def __getattr__(self, name):
        kernels = self.__dict__.get("_kernels", {})
        if name in kernels:
            return kernels[name]
        raise AttributeError(f"no kernel {name!r} in the library")

    def __dir__(self):
        return list(self._kernels)


def run_cases(cases: list[Case] | None = None, dtypes=None, shader_dir: Path | str | None = None) -> list[Result]:
    """Run every case in every dtype through the launchers on the emulator; one
    :class:`Result` per (case, dtype).  A launch error (compile failure, divergent
    barrier, out-of-bounds write) is a failed result, not an exception -- except
    :class:`NoCompiler`."""
    cases = default_cases() if cases is None else cases
    dtypes = list(DTYPES.values()) if dtypes is None else list(dtypes)
    results = []
    libraries: dict = {}

    def compile_fn(source: str) -> EmulatedLibrary:
        lib = libraries.get(source)
        if lib is None:
            lib = libraries[source] = EmulatedLibrary(source)
        return lib

    with launch.using_compiler(compile_fn, shader_dir):
        for dtype in dtypes:
            for case in cases:
                before = {k: dict(v.calls) for k, v in libraries.items()}
                try:
                    errors = check(case, dtype)
                    failure = judge(errors, dtype)
                except NoCompiler:
                    raise
                except Exception as exc:  # the kernel broke: report it as a failed case
                    errors, failure = {}, f"{type(exc).__name__}: {str(exc)[:2000]}"
                used = sorted({name for key, lib in libraries.items() for name, n in lib.calls.items()
                               if n > before.get(key, {}).get(name, 0)})
                results.append(Result(case, dtype, errors, used, failure))
    return results


def shipped_kernels(shader_dir: Path | str | None = None) -> list[str]:
    """Names of every kernel in the shipped source."""
    return [k.name for k in parse_kernels(launch.library_source(torch.float32, shader_dir))]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/metal_emulator/emulate.py", description=__doc__.split("\n")[0])
    parser.add_argument("--shader-dir", help="emulate the .metal files of this folder instead of the shipped ones")
    parser.add_argument("--dtype", action="append", choices=sorted(DTYPES), help="only this dtype (repeatable)")
    parser.add_argument("--quick", action="store_true", help="a subset of the cases")
    args = parser.parse_args(argv)
    dtypes = [DTYPES[d] for d in args.dtype] if args.dtype else None
    try:
        results = run_cases(default_cases(args.quick), dtypes, args.shader_dir)
    except NoCompiler as exc:
        print(f"metal emulator: {exc}", file=sys.stderr)
        return 2
    print(report(results))
    ran = {k for r in results for k in r.kernels}
    missing = sorted(set(shipped_kernels(args.shader_dir)) - ran)
    failed = sum(not r.ok for r in results)
    if missing:
        print(f"\nkernels never launched: {', '.join(missing)}")
    print(f"\n{len(results) - failed}/{len(results)} cases passed")
    return 1 if failed or missing else 0


if __name__ == "__main__":
    sys.exit(main())
