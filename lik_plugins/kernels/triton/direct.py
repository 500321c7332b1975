"""Launch a compiled Triton kernel without the JIT's per-call argument handling.

``kernel[grid](*args, **meta)`` costs 45-65 us of host time per call on the H100 machine's
CPU (binding, specialising every argument, the cache key, the launch metadata), against
12-14 us for the compiled kernel's own launcher (``benchmarks/probe_host.py``,
``results/h100/probe_host.json``).  On launch-bound shapes (rerank of a thousand
documents, the unit-test sizes, small training steps with three launches) that is most
of the call.  So the first launch of a *plan* goes through the JIT (which compiles or
finds the kernel), and later launches of the same plan call the compiled launcher
directly with the new arguments.

A plan is keyed by what decides Triton's specialisation, conservatively: the kernel, the
device, the meta-parameters (constexprs, warps, stages) and, per argument, its type; for
tensors the dtype and whether the address is 16-byte aligned; for integers whether the
value is 1, divisible by 16, and fits in 32 bits.  Two calls with the same key get the same
compiled binary from the JIT too, so replaying it is what the JIT would have launched.

The JIT path stays wherever replaying could differ from it: the interpreter, an
autotuner (it launches its own choice), profiler launch hooks, a Triton without the
launcher layout this was written for (``LIK_DIRECT_LAUNCH=0`` forces it as well).
Switches that change the JIT's own cache key at run time (Triton's debug and
instrumentation knobs) are not part of a plan: call :func:`clear` after flipping them.
"""
from __future__ import annotations

import inspect

import torch
import triton

from ..._config import direct_launch_enabled

# Plans are cheap (a reference to the compiled kernel and a tuple of constants), but
# shapes that change every call would add one each: past this many, start over.
MAX_PLANS = 4096

_plans: dict = {}


def _feature(arg):
    kind = type(arg)
    if kind is int:
        return (arg == 1, arg % 16 == 0, -0x80000000 <= arg <= 0x7FFFFFFF)
    if kind is bool or arg is None:
        return (kind, arg)
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    return (kind,)


def _active(hook) -> bool:
    # Triton 3.5+ keeps a HookChain (empty unless a profiler added a hook); earlier, None
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return True if calls is None else bool(calls)


def _hooks_set() -> bool:
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None:  # a Triton without knobs: launcher layout unknown, replay nothing
        return True
    return _active(runtime.launch_enter_hook) or _active(runtime.launch_exit_hook)


def _tail(kernel, n_positional: int, meta: dict) -> tuple:
    """Values of the parameters after the positional ones, in the kernel's order: the
    constexprs in ``meta`` or their defaults (the compiled launcher takes every parameter,
    as the JIT passes them)."""
    params = list(inspect.signature(kernel.fn).parameters.values())[n_positional:]
    return tuple(meta[p.name] if p.name in meta else p.default for p in params)


def launch(kernel, grid, args: tuple, meta: dict, static_key=None, caller_tensors=None):
    """``kernel[grid](*args, **meta)``, replayed straight into the compiled launcher once the
    plan has been launched through the JIT.  ``grid`` is a tuple or a function of ``meta``.

    ``static_key``: a key of the caller's own plan cache that fixes every non-tensor
    argument, every tensor's dtype and ``meta``; the plan is then keyed by it and the
    tensors' alignment only (a few microseconds less than featurising every argument).
    ``caller_tensors``: with a static key, the tensors whose address the caller does not
    control (the user's inputs and views of them); the others must be fresh allocations of
    PyTorch's CUDA allocator, which starts every block on a 512-byte boundary, so their
    alignment needs no check (~3 us less per launch on the device machine's CPU)."""
    # an Autotuner or the interpreter's function (TRITON_INTERPRET=1 at import) is not a JITFunction
    if type(kernel) is not triton.runtime.JITFunction or not direct_launch_enabled() or _hooks_set():
        return kernel[grid](*args, **meta)
    if callable(grid):
        grid = grid(meta)
    device = torch.cuda.current_device()
    if static_key is None:
        key = (id(kernel), device, tuple(meta.items()), *map(_feature, args))
    else:
        checked = args if caller_tensors is None else caller_tensors
        key = (id(kernel), device, static_key,
               *[a.data_ptr() % 16 == 0 for a in checked if isinstance(a, torch.Tensor)])
    plan = _plans.get(key)
    if plan is None:
        compiled = kernel[grid](*args, **meta)
        if len(_plans) >= MAX_PLANS:
            _plans.clear()
        _plans[key] = (compiled, _tail(kernel, len(args), meta))
        return compiled
    compiled, tail = plan
    compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                 torch._C._cuda_getCurrentRawStream(device), compiled.function, compiled.packed_metadata,
                 None, None, None, *args, *tail)
    return compiled


def clear() -> None:
    """Forget every plan (the next launch of each goes through the JIT again)."""
    _plans.clear()
