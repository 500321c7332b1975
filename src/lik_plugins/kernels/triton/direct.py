"""Launch a compiled Triton kernel without the JIT's per-call argument handling.

``kernel[grid](*args, **meta)`` spends several times the host time of the launch itself
(binding, specialising every argument, the cache key, the launch metadata; figures in
``docs/performance-notes.md``, Host path).  On launch-bound shapes (rerank of a thousand
documents, the unit-test sizes, small training steps with three launches) that is most of
the call.  So a *plan* -- a binary and how to pass it the arguments -- is found on the first
launch of its specialisation, and later launches pack the new arguments and call
``cuLaunchKernel`` through :mod:`binaries_cuda`.

A plan is keyed by what decides Triton's specialisation, conservatively: the kernel, the
device, the meta-parameters (constexprs, warps, stages) and, per argument, its type; for
tensors the dtype and whether the address is 16-byte aligned; for integers whether the
value is 1, divisible by 16, and fits in 32 bits -- except the kernel's ``do_not_specialize``
arguments (lengths, and strides that follow them), of which only the 32-bit fit counts.  Two
calls with the same key get the same compiled binary from the JIT too, so launching it is
what the JIT would have launched; and a length the plan has not seen yet launches it too.

The binary: unless ``LIK_SHIPPED_BINARIES=0``, the variant among the binaries shipped with
the package (``binaries_loader``), and the JIT never runs for it; else (another GPU, an
unusual specialisation, a kernel edited since the build) the first launch goes through the
JIT, which compiles or finds the binary, and the plan launches that binary
(``binaries_loader.from_jit``).

The JIT launches every call wherever a plan could differ from it: the interpreter, an
autotuner (it launches its own choice), profiler launch hooks, a kernel that needs more than
a plain driver launch, a device where the driver path failed its self-check;
``LIK_DIRECT_LAUNCH=0`` forces it as well.

Every launch (planned, JIT or interpreted) is also counted by its specialisation in
:func:`variants`: the number of binaries a kernel needs over a run, which the tests bound.
Switches that change the JIT's own cache key at run time (Triton's debug and
instrumentation knobs) are not part of a plan: call :func:`clear` after flipping them.
"""
from __future__ import annotations

import contextlib
from collections import Counter

import torch
import triton

from ..._config import direct_launch_enabled, shipped_binaries_enabled
from . import binaries_loader
from .variants import signature, variant

# Plans are cheap (a function handle and a parameter buffer), but
# shapes that change every call would add one each: past this many, start over.
MAX_PLANS = 4096

_plans: dict = {}


# (kernel name, meta, argument signature) of every launch: the binaries the calls needed.
_VARIANTS: set = set()


def variants() -> dict[str, int]:
    """Distinct specialisations launched so far, per kernel name (an autotuned launch counts
    once per autotuner key: its sweep compiles more, once)."""
    return dict(Counter(name for name, _, _ in _VARIANTS))


def reset_variants() -> None:
    _VARIANTS.clear()


def _active(hook) -> bool:
    # Triton 3.5+ keeps a HookChain (empty unless a profiler added a hook); earlier, None
    calls = getattr(hook, "calls", None)
    return hook is not None and (calls is None or bool(calls))


def _hooks_set() -> bool:
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None:  # a Triton without knobs: its hooks unknown, every launch through the JIT
        return True
    return _active(runtime.launch_enter_hook) or _active(runtime.launch_exit_hook)


# a plan whose launches stay on the JIT (its binary needs more than a driver launch sets up)
_JIT = object()


# ``lik_plugins.precompile``: while a list, launches are noted in it instead of made
_recorded: list | None = None


@contextlib.contextmanager
def recording():
    """Note every launch as ``(kernel, args, meta)`` instead of making it (the launchers run
    on ``meta`` tensors: what a workload would compile, without a GPU)."""
    global _recorded
    _recorded, outer = [], _recorded
    try:
        yield _recorded
    finally:
        _recorded = outer


def launch(kernel, grid, args: tuple, meta: dict, static_key=None, caller_tensors=None):
    """``kernel[grid](*args, **meta)``, launched through the plan's binary (see the module
    docstring).  ``grid`` is a tuple or a function of ``meta``.

    ``static_key``: a key of the caller's own plan cache that fixes every non-tensor
    argument, every tensor's dtype and ``meta``; the plan is then keyed by it and the
    tensors' alignment only (a few microseconds less than featurising every argument).
    ``caller_tensors``: with a static key, the tensors whose address the caller does not
    control (the user's inputs and views of them); the others must be fresh allocations of
    PyTorch's CUDA allocator, which starts every block on a 512-byte boundary, so their
    alignment needs no check (a few microseconds less per launch)."""
    if _recorded is not None:
        _recorded.append((kernel, args, meta))
        return None
    # an Autotuner or the interpreter's function (TRITON_INTERPRET=1 at import) is not a JITFunction
    if type(kernel) is not triton.runtime.JITFunction or not direct_launch_enabled() or _hooks_set():
        _VARIANTS.add(variant(kernel, args, meta))
        return kernel[grid](*args, **meta)
    if callable(grid):
        grid = grid(meta)
    device = torch.cuda.current_device()
    generic = None
    if static_key is None:
        key = generic = (id(kernel), device, tuple(meta.items()), *signature(kernel, args))
    else:
        checked = args if caller_tensors is None else caller_tensors
        key = (id(kernel), device, static_key,
               *[a.data_ptr() % 16 == 0 for a in checked if isinstance(a, torch.Tensor)])
    plan = _plans.get(key)
    if plan is None:
        if generic is None:
            # a static key not seen yet (a new length, say): the binary may well be known
            generic = (id(kernel), device, tuple(meta.items()), *signature(kernel, args))
            plan = _plans.get(generic)
        if len(_plans) >= MAX_PLANS:
            _plans.clear()
        if plan is None:
            needed = variant(kernel, args, meta)
            _VARIANTS.add(needed)
            plan = binaries_loader.find(kernel, needed, device) if shipped_binaries_enabled() else None
            if plan is None:
                compiled = kernel[grid](*args, **meta)     # the JIT: a compile, or a load from the disk cache
                wrapped = binaries_loader.from_jit(compiled, len(args), device)
                # a refusal inside a CUDA graph's capture may only mean the driver path's
                # self-check (it copies to the host) has not run yet: ask again after it
                if wrapped is not None or not torch.cuda.is_current_stream_capturing():
                    _plans[key] = _plans[generic] = wrapped or _JIT
                return compiled
            _plans[generic] = plan
        _plans[key] = plan
    if plan is _JIT:
        return kernel[grid](*args, **meta)
    plan(grid, torch._C._cuda_getCurrentRawStream(device), args)
    return None


def clear() -> None:
    """Forget every plan (the next launch of each goes through the JIT again)."""
    _plans.clear()
