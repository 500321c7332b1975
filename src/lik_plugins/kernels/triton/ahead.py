"""Compile ahead: a training step's backward kernels compile in the background (compiler
processes, or threads) while its forward kernel compiles.

A cold process pays Triton's compiler once per binary (1.5-2.5 s each for our kernels on the
H100 machine's CPU), and a training step needs two to four binaries: the forward, then the
backward's.  One after another that is most of a cold loop's first step
(``docs/performance-notes.md``).  Triton's compiler releases the GIL for most of its work
(MLIR and LLVM passes, ptxas), so the binaries can be built side by side.

How: around a forward that will need a gradient, the op layer names the backward call to
expect (``kernels/expected.py``).  If the forward launch finds no binary for itself
(``direct.launch``'s compile path: a new process, or lengths in a new bucket), that launch
first *fires* the expectation: the backward's launch code runs once -- its allocations and
small torch operations on the device, the call's own tensors as inputs -- with every
Triton launch *recorded* instead of made; each recorded launch is handed to a thread that
compiles it (``JITFunction.warmup``: the JIT's own specialisation and cache, nothing
launched).  By default (``LIK_COMPILE_AHEAD=process``) the thread only captures what the
JIT would compile (its ``jit_cache_hook``), a compiler process of its own builds that into
Triton's on-disk cache (``compile_worker.py``: the compiler does not share the training
loop's GIL), and the thread loads it into the JIT's cache (a disk-cache hit); where no
compiler process can be started, the thread compiles (``LIK_COMPILE_AHEAD=thread``: always).
Processes are the default because the loop's steps meanwhile stall less: in the H100
machine's changing-length loops, steps over 20x the median after the 10th were 10 with
threads against 2 with processes over two runs of each, first 10 steps equal
(``docs/performance-notes.md``).  The real backward's launch then waits for that thread
(:func:`wait`) instead of compiling the same binary again, and finds it in the JIT's cache.

The training ops set the expectation themselves (``library.maxsim_forward`` saving its winners,
the smooth-max and packed forwards asked for their backward's gradients), so a
``torch.compile``d step gets it when its graph runs them, as eager code does; they also serve
while compiling (``library._serve``), below.

Serving while compiling: inside the op layer's training ops (``expected.defer_compiles``) a
launch whose binary is not built does not wait for it: :func:`defer` starts its build (and
fires the forward's expectation) and the launch raises ``expected.NotReady``; the op serves that
call on the chunked path.  A cold PyLate loop's first ten steps on the H200 machine: 4.8-5.3 s
with the patchers' :func:`warm_up` (PyLate's own torch path 4.8-5.2) against 8.9-12.2 s waiting
(``docs/performance-notes.md``).  ``LIK_SERVE_WHILE_COMPILING=0`` waits.

Nothing here can change a result: a prediction that misses (a gradient with other strides
than the one expected, an unaligned tensor) only means the real launch compiles its own
binary, as it would have without this module; a failed dry run or background compile is
ignored the same way.  ``LIK_COMPILE_AHEAD=0`` turns it off.  The dry run costs about a
millisecond of host time and happens only on a forward compile, never on a warm call; it
allocates what the backward will allocate (the caching allocator then hands the same
blocks to the real backward) and writes only into those.

Why not on ``meta`` or fake tensors, which would need no memory: their first use imports
the Python meta registrations (sympy) and, for a norm or ``FakeTensorMode``,
``torch._dynamo`` -- 2.5-3.5 s of a first step on the H100 machine, measured, more than
the compiles this saves.
"""
from __future__ import annotations

import contextlib
import contextvars
import json
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import triton

from ..._config import compile_ahead_enabled, compile_ahead_mode
from ..expected import take
from . import compile_worker

# Enough threads for a backward's two or three kernels beside the forward compiling in
# the caller's thread; more would contend for the GIL's Python parts of the compiler.
# Guessed lengths (:func:`_speculate`) compile one at a time in a thread of their own:
# never ahead of a binary a call is waiting for, and with less of the GIL taken from the
# training loop meanwhile.
WORKERS = 3
# Document lengths are bucketed on multiples of this (tile widths, the tuner's size
# classes); the guesses of :func:`_speculate` sit on both sides of each boundary.
LD_STEP = 64

_recorded: contextvars.ContextVar = contextvars.ContextVar("lik_recorded_launches", default=None)

_pools: dict = {}
_pool_lock = threading.Lock()
# variant (direct.variant) -> the future of its background compile, until waited for
_pending: dict = {}
# every variant asked for: each is compiled once per process
_asked: set = set()
# family (the call without its lengths) -> the (Lq, Ld) its compiles were fired at, and
# the (Lq, Ld) already guessed
_seen: dict = {}
_guessed: dict = {}
# variants sent to the guesses' thread (``defer`` may move one to the front)
_guess_queue: set = set()


def recording() -> list | None:
    """The list launches are recorded into while a dry run is active, else None."""
    return _recorded.get()


@contextlib.contextmanager
def _recording_launches():
    """Record Triton launches instead of making them."""
    launches: list = []
    token = _recorded.set(launches)
    try:
        yield launches
    finally:
        _recorded.reset(token)


def _device_of(args) -> torch.device:
    return next(a.device for a in args if isinstance(a, torch.Tensor))


def dry_run(fn, *args) -> list:
    """``fn(*args)`` with every Triton launch recorded instead of made: the ``(kernel, grid,
    args, meta)`` of each, in order."""
    with _recording_launches() as launches:
        fn(*args)
    return launches


def fire(needed: tuple, guess: bool | None = None) -> None:
    """Called by ``direct.launch`` before the first launch of binary ``needed``
    (``direct.variant``) in this process: dry-run the backward the running forward expects
    (``kernels/expected.py``; at most once per forward) and start compiling its kernels;
    where the caller's lengths have been seen to change and ``needed`` was not foreseen
    (guessed or expected earlier), also the steps at the other length buckets
    (:func:`_speculate`)."""
    expected = take()
    if expected is None or not compile_ahead_enabled():
        return
    backward, args, step = expected
    device = _device_of(args)
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return      # nothing to compile (interpreter), or a CUDA graph would capture the dry run
    try:
        start(dry_run(backward, *args), device)
        if step is not None:
            _speculate(step, args, device, guess=needed not in _asked if guess is None else guess)
    except Exception:   # out of memory, say: the real calls compile what they need themselves
        return


def _bucket_edges(lo: int, hi: int, steps: list[int]) -> list[int]:
    """Lengths on both sides of every boundary in ``steps`` within ``[lo, hi]``, and the ends."""
    out = {lo, hi}
    for edge in steps:
        out.update(v for v in (edge, edge + 1) if lo <= v <= hi)
    return sorted(out)


def _pow2_floor(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def _pow2_ceil(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def guesses(seen: set) -> list[tuple[int, int]]:
    """The (Lq, Ld) worth compiling for once lengths ``seen`` have changed: every length
    bucket around the seen ones, and one beyond them below (shorter queries or documents
    than the first two calls had are common; on the H100's planning, two calls' lengths
    alone left a later bucket uncompiled in most random draws from a sweep).  Query lengths
    bucket on powers of two (rows per program): guesses from half the power of two below
    the shortest to the power of two above the longest.  Document lengths bucket on powers
    of two and multiples of :data:`LD_STEP`: guesses from half the power of two below the
    shortest to one :data:`LD_STEP` past the multiple above the longest.  One length that
    never changed guesses nothing along its axis.  Nearest to a seen length first: the
    guesses compile one at a time, in this order."""
    lqs, lds = {q for q, _ in seen}, {d for _, d in seen}
    if len(lqs) > 1:
        lo, hi = max(1, _pow2_floor(min(lqs)) // 2), _pow2_ceil(max(lqs))
        lqs = _bucket_edges(lo, hi, [1 << k for k in range(hi.bit_length())])
    if len(lds) > 1:
        # up to one step past the next multiple of LD_STEP only: a guess allocates documents of its length
        lo, hi = max(1, _pow2_floor(min(lds)) // 2), -(-max(lds) // LD_STEP) * LD_STEP + LD_STEP
        lds = _bucket_edges(lo, hi, sorted({1 << k for k in range(hi.bit_length())} | set(range(LD_STEP, hi + 1,
                                                                                              LD_STEP))))

    def distance(guess):
        q, d = guess
        return min(abs((q - sq) / max(sq, 1)) + abs(d - sd) / LD_STEP for sq, sd in seen)

    return sorted(((q, d) for q in sorted(lqs) for d in sorted(lds)), key=lambda g: (distance(g), g))


def _resized(args: tuple, lq: int, ld: int) -> tuple:
    """``args`` -- queries ``[.., Lq, d]`` first, documents ``[.., Ld, d]`` second, then, where
    they are tensors, the query mask ``[.., Lq]`` and the document mask ``[.., Ld]`` -- with
    query length ``lq`` and document length ``ld`` (new, uninitialised tensors)."""
    out = list(args)
    for i, (dim, length) in enumerate(((-2, lq), (-2, ld), (-1, lq), (-1, ld))):
        a = args[i] if i < len(args) else None
        if isinstance(a, torch.Tensor):
            shape = list(a.shape)
            shape[dim] = length
            out[i] = torch.empty(shape, dtype=a.dtype, device=a.device)
    return tuple(out)


def _speculate(step, args, device: torch.device, guess: bool = True) -> None:
    """Lengths that change from call to call (documents padded to each batch's longest,
    queries of varying length) reach a new bucket now and then, and its compile stalls that
    step for a second or two -- late in a run, when nothing else does.  So once a family's
    compiles have fired at two different lengths, every bucket around them (:func:`guesses`)
    is dry-run (``step``: forward and backward, on new tensors of those lengths; ~2 ms each)
    and compiled in the background, after the binaries the caller needs now.

    ``guess=False`` (the launch found a binary guessed or expected earlier): only the lengths
    are noted.  Guessing again there dry-ran every new bucket around them on the caller's
    thread -- up to ~90 dry runs, a 0.4-0.5 s step at the same step of every changing-length
    run on the H100 (``benchmarks/real_loop.py``, docs/performance-notes.md) -- for binaries
    the first guesses had mostly built; a length no guess foresaw still guesses anew."""
    Q, D = args[0], args[1]
    if not (isinstance(Q, torch.Tensor) and isinstance(D, torch.Tensor)) or Q.dim() != 3:
        return
    family = (step, Q.shape[0], Q.shape[2], Q.dtype, device, tuple(D.shape[:-2]), D.shape[-1], D.dtype,
              tuple((a.dtype, a.dim()) if isinstance(a, torch.Tensor) else a for a in args[2:]))
    seen = _seen.setdefault(family, set())
    seen.add((Q.shape[1], D.shape[-2]))
    if len(seen) < 2 or not guess:
        return
    guessed = _guessed.setdefault(family, set())
    todo = [g for g in guesses(seen) if g not in guessed and g not in seen]
    guessed.update(todo)
    launches: list = []
    for lq, ld in todo:
        launches += dry_run(step, *_resized(args, lq, ld))
    start(launches, device, guessed=True)


def ready(needed: tuple) -> bool:
    """Binary ``needed`` (``direct.variant``) was compiled in the background (or failed to:
    the launch then compiles it and reports the error itself)."""
    future = _pending.get(needed)
    return future is not None and future.done()


def defer(kernel, args: tuple, meta: dict, needed: tuple) -> None:
    """Instead of compiling binary ``needed`` in the caller's thread (the caller serves the
    call on the chunked path: ``expected.NotReady``): compile it in the background, first in
    line -- a guess of it still queued behind other guesses is moved to the front -- and,
    as its compile would, fire the running forward's expectation (``fire``)."""
    unforeseen = needed not in _asked
    future = _pending.get(needed)
    if future is None or (needed in _guess_queue and future.cancel()):   # never asked, or queued behind guesses
        _submit(kernel, args, meta, needed, _device_index(_device_of(args)))
    fire(needed, guess=unforeseen)


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _submit(kernel, args: tuple, meta: dict, key: tuple, index: int, guessed: bool = False) -> None:
    """Compile binary ``key`` of ``kernel`` in the background (the guesses' thread where
    ``guessed``), noted as asked and pending."""
    _asked.add(key)
    _pending[key] = compile_later(kernel, index, tuple(_mock(a) for a in args), dict(meta), guessed)
    if guessed:
        _guess_queue.add(key)
    else:
        _guess_queue.discard(key)


def _mock(arg):
    # a tensor as Triton's warm-up takes it: its dtype (an aligned mock pointer; an
    # unaligned real tensor makes its own binary, in the caller's thread)
    return arg.dtype if isinstance(arg, torch.Tensor) else arg


def start(launches: list, device: torch.device, guessed: bool = False) -> None:
    """Compile every recorded launch's binary in the background for ``device`` (each one
    once per process); ``guessed``: in the guesses' own thread."""
    from .direct import launched, variant

    if device.type != "cuda":
        return
    index = _device_index(device)
    for kernel, _, args, meta in launches:
        if type(kernel) is not triton.runtime.JITFunction:   # interpreter, autotuner: nothing to warm
            continue
        key = variant(kernel, args, meta)
        if key in _asked or key in launched():
            continue
        _submit(kernel, args, meta, key, index, guessed)


def compile_later(kernel, device_index: int, args: tuple, meta: dict, guessed: bool = False) -> Future:
    """Compile ``kernel`` for ``args`` as Triton's warm-up takes them (tensors as dtypes) in
    a background thread; the binary lands in the JIT's cache for device ``device_index``."""
    settle()
    # the JIT's per-device cache is created lazily by a defaultdict: create it here, in
    # one thread, so a worker's binary lands in the table the caller will look in
    kernel.device_caches[device_index]
    pool = _pools.get(guessed)
    if pool is None:
        with _pool_lock:
            pool = _pools.get(guessed)
            if pool is None:
                if not _pools:
                    _cancel_at_exit()
                pool = _pools[guessed] = ThreadPoolExecutor(
                    1 if guessed else WORKERS, thread_name_prefix="lik-compile-guess" if guessed else "lik-compile")
    return pool.submit(_compile, kernel, device_index, args, meta)


# ------------------------------------------------------------------------- warm-up
_warm_up: list = []             # [the warm-up thread], once started
_spare: list = []               # compiler processes started ahead, not yet taken by a compile thread
_spare_lock = threading.Lock()


def warm_up() -> None:
    """Start a process's one-time Triton set-up in a background thread, before the first
    call needs it: the compiler processes (``LIK_COMPILE_AHEAD=process``; each imports
    Triton and our kernels as it starts), Triton's CUDA driver binding (on a cold cache
    Triton builds a small C module with the system compiler) and the hash of Triton itself
    that every binary's cache key includes.  On a cold PyLate step on the H200 machine the
    last two took 0.8 s of the first step's main thread, and each compiler process's start
    delayed its first binary (``benchmarks/real_loop.py --profile-first-step``).  The host
    patchers call this, so it overlaps loading the model.  Touches no CUDA context (a process
    that forks later keeps working); at most once per process; never raises."""
    if _warm_up:
        return
    thread = threading.Thread(target=_warm, name="lik-warm-up", daemon=True)
    _warm_up.append(thread)
    thread.start()


def _warm() -> None:
    try:
        if compile_ahead_mode() == "process":
            from .compile_worker import CompilerProcess

            # one per compile thread (the guesses' thread included); started first, they
            # import while this thread builds the driver binding and hashes Triton
            with _spare_lock:
                while len(_spare) < WORKERS + 1:
                    _spare.append(CompilerProcess())
        from triton.runtime.driver import driver

        driver.active.utils         # the driver's C module, built or loaded
        from triton.runtime.cache import triton_key

        triton_key()                # cached by Triton for the process
    except Exception:   # another Triton layout, no driver here: the first compile does it instead
        return


def settle() -> None:
    """Wait for a warm-up in progress (:func:`warm_up`): what it does, a first compile would
    otherwise do a second time beside it (Triton's driver binding is not built under a lock)."""
    if _warm_up and _warm_up[0].is_alive():
        _warm_up[0].join()


def _compiler_process():
    """A compiler process for this compile thread: one started ahead, else a new one."""
    from .compile_worker import CompilerProcess

    with _spare_lock:
        while _spare:
            process = _spare.pop()
            if process.alive():
                return process
            process.close()
    return CompilerProcess()


def _cancel_at_exit() -> None:
    """At interpreter exit, drop the compiles not started yet: the executors' own exit hook
    would otherwise run every queued guess before the process could end (seconds each).
    Registered after ``concurrent.futures``' hook, so it runs before it (they run in reverse).
    The compiler processes are told to end (each finishes the binary in hand)."""
    def cancel():
        for pool in list(_pools.values()):
            pool.shutdown(wait=False, cancel_futures=True)
        for process in list(_processes) + _spare:
            process.close()

    register = getattr(threading, "_register_atexit", None)   # CPython 3.9+: before thread joins
    if register is not None:
        try:
            register(cancel)
            return
        except RuntimeError:   # already shutting down
            return
    import atexit

    atexit.register(cancel)


def _compile(kernel, device_index, args, meta):
    with torch.cuda.device(device_index):
        if compile_ahead_mode() == "process":
            _compile_in_process(kernel, device_index, args, meta)
        # a load from the disk cache where the compiler process built the binary; else the compile
        compiled = kernel.warmup(*args, grid=(1,), **meta)
        # and the module's load onto the GPU, which Triton defers to a binary's first launch:
        # done here, the loop's first launch of a guessed binary only finds it (a 58 ms step
        # of the H200's changing-length loop was such a first launch, after the guesses' fix)
        load = getattr(compiled, "_init_handles", None)
        if load is not None:
            load()


# ---------------------------------------------------------------- compiler processes
_local = threading.local()      # per compile thread: its compiler process, and a capture in progress
_processes: list = []           # every compiler process started (closed at exit)
_process_log: list = []         # (kernel, seconds, ok, error) of every compile sent to a process
_hook_lock = threading.Lock()
_hook: list = []                # [the jit_cache_hook in place before ours], once installed
# compiler processes that died: past this many, compile in threads for the rest of the run
MAX_DEAD_PROCESSES = 2
_dead: list = []


def process_compiles() -> list:
    """``(kernel, seconds, ok, error)`` of every binary sent to a compiler process so far."""
    return list(_process_log)


def _capture_hook(**kwargs):
    box = getattr(_local, "capture", None)
    if box is not None:          # this thread asked what the JIT would compile: note it, compile nothing
        box.append(kwargs["compile"])
        return True
    previous = _hook[0]
    return previous(**kwargs) if previous else None


def _install_hook() -> bool:
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_cache_hook"):
        return False
    with _hook_lock:
        if not _hook:
            _hook.append(runtime.jit_cache_hook)
            runtime.jit_cache_hook = _capture_hook
    return runtime.jit_cache_hook is _capture_hook


def _request(kernel, device_index, args, meta) -> tuple | None:
    """What the JIT would compile for this launch, as a compiler process takes it; None when
    the JIT would compile nothing (the binary is in its cache) or the kernel cannot be
    found by name in its module."""
    fn = kernel.fn
    if getattr(sys.modules.get(fn.__module__), fn.__name__, None) is not kernel or not _install_hook():
        return None
    _local.capture = box = []
    try:
        kernel.warmup(*args, grid=(1,), **meta)
    finally:
        _local.capture = None
    if not box:
        return None
    spec = box[0]
    target = kernel.device_caches[device_index][2]
    return (fn.__module__, fn.__name__, kernel.cache_key, spec["signature"], spec["constants"],
            spec["configs"][0], options_from_json(json.loads(spec["specialization_data"])["options"]), target,
            compile_worker.backend_hash(target), compile_worker.compile_environment())


def options_from_json(options: dict) -> dict:
    """The JIT's compile options from Triton's JSON serialisation of them (the hook's
    ``specialization_data``): JSON turned tuples into lists, turned back here as Triton's own
    ``preload`` does; the compiler parses the rest."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}


def _compile_in_process(kernel, device_index, args, meta) -> None:
    """Have this thread's compiler process build the binary into the disk cache.  Any
    failure leaves the compile to the caller's ``warmup``, in this thread."""
    if len(_dead) >= MAX_DEAD_PROCESSES:
        return
    try:
        request = _request(kernel, device_index, args, meta)
        if request is None:
            return
        process = getattr(_local, "process", None)
        if process is None or not process.alive():
            if process is not None:
                _dead.append(process)
            process = _local.process = _compiler_process()
            _processes.append(process)
        ok, seconds, error = process.compile(request)
        _process_log.append((kernel.fn.__name__, seconds, ok, error))
    except Exception as exc:    # could not start, or send: the thread compiles
        _process_log.append((kernel.fn.__name__, 0.0, False, f"{type(exc).__name__}: {exc}"))


def wait(key) -> None:
    """Before compiling variant ``key`` (``direct.variant``) in the caller's thread: take it
    from its background compile -- waiting if that has started, else cancelling it (the
    caller compiles it now rather than wait behind the queue)."""
    future: Future | None = _pending.pop(key, None)
    if future is None or future.cancel():
        return
    try:
        future.result()
    except Exception:   # the caller's own compile reports any real error
        pass
