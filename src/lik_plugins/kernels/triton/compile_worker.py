"""Triton's compiler in a process of its own, for compile ahead (``ahead.py``) in its default
mode, ``LIK_COMPILE_AHEAD=process``.

Compile ahead builds the binaries a training step will need while the step runs.  In a
thread of the training process the compiler shares the loop's GIL: its Python stages hold
it, and a step made of many short torch calls (a PyLate step: the encoder's hundreds of ops)
waits at every hand-off.  On the H100 machine the same binaries took 30-50 % longer beside
PyLate's step than beside a kernel loop.  A compiler process has a GIL of its own.

The parent captures what Triton's JIT would compile -- the signature, constants and
attributes of the specialisation, the options and the target, exactly as the JIT's
``jit_cache_hook`` receives them -- and sends them here.  This process builds the binary
into Triton's on-disk cache under the key the parent's JIT computes from the same inputs.
The parent then loads it from the disk cache, a cache hit of milliseconds.

Nothing here can change a result.  The parent's JIT compiles from the kernel's source as it
always does; this process only fills its cache.  A binary built here under another key
(another Triton, a changed source, a cache directory set in code) is simply not found, and
the parent compiles the binary itself.

The key also holds the backend's hash (for CUDA, the version string of the ``ptxas`` in use)
and the cache directory decides where the binary goes; both come from the environment, which
the parent's may change after this process started: ``torch.compile`` points
``TRITON_PTXAS_PATH`` at PyTorch's own ``ptxas`` (and sets ``TRITON_CACHE_DIR`` where none is
set) when Inductor first compiles.  Each request therefore carries the parent's Triton
environment and backend hash, and this process adopts both before compiling
(:func:`adopt_environment`).  Without that, every binary of a compiled training step was built
twice on the H200 machine -- here, then again in a thread of the parent, whose compiler holds
the GIL: steps of 60-300 ms in the first seconds of a ``torch.compile``d loop.

Protocol: length-prefixed pickles over the process's stdin and stdout.  Both ends are this
module, on the same interpreter and the same Triton, started by the parent.
Request: ``(module, name, cache_key, signature, constants, attrs, options, target[, backend_hash,
environment])``.
Reply: ``(ok, seconds, error)``.  The process ends when its input closes.

    python -m lik_plugins.kernels.triton.compile_worker     # started by CompilerProcess only
"""
from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
import time

_HEADER = struct.Struct("<Q")


def _send(stream, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _receive(stream):
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None     # the other end closed
    size = _HEADER.unpack(head)[0]
    data = stream.read(size)
    if len(data) < size:
        return None
    return pickle.loads(data)


def compile_environment() -> dict[str, str]:
    """The parent's side: the environment variables that decide how and where Triton compiles
    (every ``TRITON_*`` but the interpreter switch, and any other variable Triton's cache key
    reads), as they are now."""
    names = {n for n in os.environ if n.startswith("TRITON_") and n != "TRITON_INTERPRET"}
    try:
        from triton._C.libtriton import get_cache_invalidating_env_vars

        names |= set(get_cache_invalidating_env_vars())
    except (ImportError, AttributeError):
        pass
    return {n: os.environ[n] for n in sorted(names) if n in os.environ}


def backend_hash(target) -> str:
    """The backend's part of Triton's cache key for ``target``, as this process computes it."""
    from triton.compiler import make_backend

    return make_backend(target).hash()


def _forget_tool_versions() -> None:
    """Drop what Triton's backends read once per process (tool versions, such as ``ptxas
    --version`` behind the CUDA backend's hash)."""
    import triton.backends

    for backend in triton.backends.backends.values():
        module = sys.modules.get(backend.compiler.__module__)
        for value in vars(module).values() if module is not None else ():
            if callable(getattr(value, "cache_clear", None)):
                value.cache_clear()


def adopt_environment(environment: dict[str, str] | None, parent_hash: str | None, target) -> None:
    """Compile as the parent's JIT would now: in its Triton environment (the ``ptxas`` it would
    run, the cache directory it would look in) and under its key.

    The key's backend part can lag the environment: Triton reads ``ptxas --version`` once per
    process, so a parent that hashed before ``torch.compile`` changed ``TRITON_PTXAS_PATH``
    keeps the old version string in its keys while compiling with the new ``ptxas`` (seen on
    the H200 machine: every request refused until this).  So: the environment first; if the
    hashes differ, tool versions read again; if they still differ on CUDA, this process takes
    the parent's version string as its own (Triton's ``mock_ptx_version`` knob: the string
    enters the key only) -- the parent's binary exactly, built with the same ``ptxas`` under
    the same key.  Any other difference is an error: the parent then compiles the binary itself."""
    if environment is not None:
        for name in [n for n in os.environ if n.startswith("TRITON_") and n not in environment]:
            del os.environ[name]
        os.environ.update(environment)
    if parent_hash is None or backend_hash(target) == parent_hash:
        return
    _forget_tool_versions()
    suffix = f"-{target.arch}"
    if backend_hash(target) != parent_hash and target.backend == "cuda" and parent_hash.endswith(suffix):
        import triton

        triton.knobs.nvidia.mock_ptx_version = parent_hash[:-len(suffix)]
        _forget_tool_versions()
    if backend_hash(target) != parent_hash:
        raise RuntimeError("the backend's hash differs from the parent's: its key would not match")


def compile_one(module: str, name: str, cache_key: str, signature: dict, constants: dict, attrs: dict,
                options: dict, target, parent_hash: str | None = None, environment: dict | None = None) -> None:
    """Build one binary into the on-disk cache, as the parent's JIT would build it."""
    import importlib

    import triton
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(module), name)
    if fn.cache_key != cache_key:   # another source than the parent's: its key would not match
        raise RuntimeError(f"{module}.{name}: the kernel's source differs from the parent's")
    adopt_environment(environment, parent_hash, target)
    triton.compile(ASTSource(fn, signature, constants, attrs), target=target, options=options)


# Imported as a process starts (before its first request): the kernels of a training step
# and Triton's compiler, and Triton's own hash computed -- none of them import torch.  Other
# kernels' modules are imported by their first request.
PRELOADED = ("lik_plugins.kernels.triton.forward", "lik_plugins.kernels.triton.backward",
             "lik_plugins.kernels.triton.launcher_check")


def preload() -> None:
    """Import what most requests need while the parent has not sent one yet (a compiler
    process started ahead by ``ahead.warm_up``); a failure is left to the request's own import."""
    import importlib

    try:
        import triton.compiler  # noqa: F401
        from triton.runtime.cache import triton_key

        for module in PRELOADED:
            importlib.import_module(module)
        triton_key()
    except Exception:
        return


def serve(requests, replies) -> int:
    while True:
        request = _receive(requests)
        if request is None:
            return 0
        start = time.perf_counter()
        try:
            compile_one(*request)
            reply = (True, time.perf_counter() - start, None)
        except Exception as exc:   # reported to the parent, which then compiles the binary itself
            reply = (False, time.perf_counter() - start, f"{type(exc).__name__}: {exc}")
        _send(replies, reply)


class CompilerProcess:
    """One compiler process, used by one thread of the parent at a time.

    The child imports what the parent imports, from the same places: its ``PYTHONPATH`` is
    the parent's ``sys.path``."""

    def __init__(self):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        env.pop("TRITON_INTERPRET", None)
        self.process = subprocess.Popen(
            [sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, env=env)

    def compile(self, request: tuple) -> tuple[bool, float, str | None]:
        """Send one request, wait for its reply (the GIL is free meanwhile)."""
        try:
            _send(self.process.stdin, request)
            reply = _receive(self.process.stdout)
        except (OSError, ValueError) as exc:
            return False, 0.0, f"compiler process: {exc}"
        return reply if reply is not None else (False, 0.0, "compiler process exited")

    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self) -> None:
        """End the process: its input closes, it finishes the binary in hand and exits."""
        try:
            self.process.stdin.close()
        except OSError:
            pass


if __name__ == "__main__":
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    sys.stdout = sys.stderr     # nothing but replies on the reply channel
    preload()
    sys.exit(serve(sys.stdin.buffer, replies))
