"""Launch a compiled Triton kernel without the JIT's per-call argument handling.

``kernel[grid](*args, **meta)`` spends several times the host time of the compiled kernel's
own launcher (binding, specialising every argument, the cache key, the launch metadata;
figures in ``docs/performance-notes.md``, Host path).  On
launch-bound shapes (rerank of a thousand documents, the unit-test sizes, small training
steps with three launches) that is most of the call.  So the first launch of a *plan* goes through the JIT (which compiles or
finds the kernel), and later launches of the same plan call the compiled launcher
directly with the new arguments.

A plan is keyed by what decides Triton's specialisation, conservatively: the kernel, the
device, the meta-parameters (constexprs, warps, stages) and, per argument, its type; for
tensors the dtype and whether the address is 16-byte aligned; for integers whether the
value is 1, divisible by 16, and fits in 32 bits -- except the kernel's ``do_not_specialize``
arguments (lengths, and strides that follow them), of which only the 32-bit fit counts.  Two
calls with the same key get the same compiled binary from the JIT too, so replaying it is
what the JIT would have launched; and a length the plan has not seen yet replays it too.

Unless ``LIK_SHIPPED_BINARIES=0``, a plan's first launch looks for the variant among the
binaries shipped with the package first (``binaries_loader``): found, the plan launches it
through the CUDA driver and the JIT never runs for it; not found (another GPU, an unusual
specialisation, a kernel edited since the build), the plan goes through the JIT as below.

The JIT path stays wherever replaying could differ from it: the interpreter, an
autotuner (it launches its own choice), profiler launch hooks, a Triton other than the
versions this was verified with (:data:`VERIFIED_TRITON`), or one whose replay failed the
self-check made at first use (:func:`replay_ok`); ``LIK_DIRECT_LAUNCH=0`` forces it as well.

Every launch (JIT, replayed or interpreted) is also counted by its specialisation in
:func:`variants`: the number of binaries a kernel needs over a run, which the tests bound.
Switches that change the JIT's own cache key at run time (Triton's debug and
instrumentation knobs) are not part of a plan: call :func:`clear` after flipping them.
"""
from __future__ import annotations

import contextlib
import inspect
import warnings

import torch
import triton

from ..._config import direct_launch_enabled, shipped_binaries_enabled
from . import binaries_loader
from .variants import CHECK_CALLS, CHECK_META, self_check_kernel, signature, variant

# Triton releases (major, minor) whose compiled-launcher layout the replay was checked
# against on a GPU; others launch through the JIT.
VERIFIED_TRITON = ((3, 6),)

# Plans are cheap (a reference to the compiled kernel and a tuple of constants), but
# shapes that change every call would add one each: past this many, start over.
MAX_PLANS = 4096

_plans: dict = {}


# (kernel name, meta, argument signature) of every launch: the binaries the calls needed.
_VARIANTS: set = set()


def variants() -> dict[str, int]:
    """Distinct specialisations launched so far, per kernel name (an autotuned launch counts
    once per autotuner key: its sweep compiles more, once)."""
    counts: dict[str, int] = {}
    for name, _, _ in _VARIANTS:
        counts[name] = counts.get(name, 0) + 1
    return counts


def reset_variants() -> None:
    _VARIANTS.clear()


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
    """``kernel[grid](*args, **meta)``, replayed straight into the compiled launcher once the
    plan has been launched through the JIT.  ``grid`` is a tuple or a function of ``meta``.

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
            shipped = binaries_loader.find(kernel, needed, device) if shipped_binaries_enabled() else None
            if shipped is None:
                if not replay_ok():
                    return kernel[grid](*args, **meta)
                compiled = kernel[grid](*args, **meta)     # the JIT: a compile, or a load from the disk cache
                _plans[key] = _plans[generic] = (compiled, _tail(kernel, len(args), meta))
                return compiled
            plan = _plans[generic] = (shipped, None)
        _plans[key] = plan
    compiled, tail = plan
    if tail is None:                                   # a shipped binary (``binaries_cuda.ShippedKernel``)
        compiled(grid, torch._C._cuda_getCurrentRawStream(device), args)
        return None
    compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                 torch._C._cuda_getCurrentRawStream(device), compiled.function, compiled.packed_metadata,
                 None, None, None, *args, *tail)
    return compiled


def clear() -> None:
    """Forget every plan (the next launch of each goes through the JIT again)."""
    _plans.clear()


_REPLAY_OK: list = []


def replay_ok() -> bool:
    """The replay is verified for this Triton (:data:`VERIFIED_TRITON`) and passed its
    self-check: a small kernel launched through the JIT and then replayed with other
    arguments (lengths not specialised, another scalar, another output) must write what
    the JIT computes.  Checked once per process, on the first CUDA launch outside a CUDA
    graph's capture (the check copies its results to the host); a failure warns once and
    leaves every launch on the JIT path."""
    if _REPLAY_OK:
        return _REPLAY_OK[0]
    if torch.cuda.is_current_stream_capturing():
        return False
    version = tuple(int(p) for p in triton.__version__.split(".")[:2] if p.isdigit())
    ok, why = version in VERIFIED_TRITON, f"Triton {triton.__version__} is not one of the verified releases"
    if ok:
        try:
            ok, why = _self_check(), "the replayed launch wrote other values than the JIT's"
        except Exception as exc:  # a changed launcher layout shows up as a TypeError or a fault
            ok, why = False, f"the replayed launch failed ({type(exc).__name__}: {exc})"
        if not ok:
            warnings.warn(f"lik_plugins: launching Triton kernels through the JIT: {why}", RuntimeWarning,
                          stacklevel=3)
    _REPLAY_OK.append(ok)
    return ok


def _self_check() -> bool:
    """Runs on a user's step (the first CUDA launch), so it launches nothing but its own
    kernel: inputs go up and results come down as copies and are compared on the host.
    Comparing on the GPU (``torch.equal``, ``torch.where``) made the first use of those
    PyTorch kernels load their modules there: one step tens of times slower than the others
    in cold loops (``benchmarks/real_loop.py --sample-spikes``)."""
    x_host = torch.arange(100, dtype=torch.float32)
    x = x_host.to("cuda")
    outs = [torch.full((100,), -1.0).to("cuda") for _ in range(2)]
    (n_first, k_first), (n_second, k_second) = CHECK_CALLS
    compiled = self_check_kernel[(2,)](x, outs[0], n_first, k_first, **CHECK_META)
    tail = _tail(self_check_kernel, 4, CHECK_META)
    compiled.run(2, 1, 1, torch._C._cuda_getCurrentRawStream(torch.cuda.current_device()), compiled.function,
                 compiled.packed_metadata, None, None, None, x, outs[1], n_second, k_second, *tail)
    got = [o.cpu() for o in outs]       # waits for this stream's work, the check's included
    want = [torch.where(torch.arange(100) < n, x_host * k, -1.0) for n, k in CHECK_CALLS]
    return all(torch.equal(o, w) for o, w in zip(got, want))
