"""Build the Triton binaries a workload needs, ahead of time.

    python -m lik_plugins.precompile [--hosts pylate colpali sentence_transformers ops]
                                     [--dtypes bf16 fp16 fp32] [--dims 128 96] [--arch sm_90]
                                     [--list] [--jobs N] [--ship [--out DIR]]

For a cluster image or a CI job: a process that later runs the same calls finds every binary
in ``TRITON_CACHE_DIR`` (default ``~/.triton/cache``) and compiles nothing.  The entries are
keyed by Triton's version, the kernels' sources, the ``ptxas`` in use and Triton's
cache-relevant environment, so build them with the Triton (and PyTorch, whose ``ptxas``
``torch.compile`` selects) the jobs will run.

Which binaries: each distinct launch the hosts' calls make -- their adapters' layouts, masks
and options over a grid of batch sizes and lengths that covers the launchers' length buckets,
forward and backward -- run on ``meta`` tensors planned for the target GPU and compiled
through the JIT's own ``warmup``, so each cache key is the one the runtime call computes
(docs/internals.md, "Launches, plans and configs").  ``--arch`` may name another architecture
than the GPU at hand's; no GPU is needed (:func:`compiling_for`).  On a GPU of the target
architecture each binary is also loaded once, so a Triton that compiles a C launcher per
argument signature at the first launch (3.6) builds it into the cache here.

``--ship`` writes them into the archive the package ships instead of Triton's cache
(``kernels/triton/binaries/<arch>.zip``, or under ``--out``), with, per group of variants
that differ only in specialisation hints, one built with none: it serves a launch of the group
the grid did not see (:mod:`.kernels.triton.binaries_loader`; ``LIK_SHIPPED_BINARIES=0`` turns
the shipped binaries off).

Shapes outside the grid still run: a length in a bucket the grid did not reach (other
constexprs) compiles its binary on first use (the call waits for it), as does, in Triton's
cache, a batch whose size changes an integer's divisibility or an unaligned view -- never
another code path.
"""
from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import sys
import tempfile
import time
import traceback
import types
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from itertools import product
from pathlib import Path

import torch

from . import ops

HOSTS = ("pylate", "colpali", "sentence_transformers", "ops")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# per architecture: (streaming multiprocessors, shared memory per block with opt-in) of the
# GPU the launchers plan for; both decide blockings (grad_D splits, pipeline stages)
TARGETS = {"sm_80": (108, 166912), "sm_90": (132, 232448)}


# ----------------------------------------------------------------------------- workloads
def _mask(*shape):
    return torch.ones(shape, dtype=torch.bool, device="meta")


def _tokens(dtype, *shape, grad=True):
    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=grad)


def _train(score):
    # a dense incoming gradient, as a loss gives (``sum()``'s expanded one has stride 0: other
    # integer specialisations than any real step's)
    score.backward(torch.empty_like(score))


def _pylate(dtype, dim):
    """``colbert_scores`` (``Contrastive``: in-batch with hard negatives; ``Distillation``:
    per-query candidates) and ``rerank`` (inference): PyLate's multiplicative mask."""
    for batch, negatives, ld in product((16, 32, 64, 128, 256), (0, 1), (64, 128, 180, 256, 300)):
        nd = batch * (1 + negatives)
        _train(ops.maxsim(_tokens(dtype, batch, 32, dim), _tokens(dtype, nd, ld, dim), None, _mask(nd, ld),
                          mask_mode="zero"))
    for (batch, k), ld in product(((16, 32), (32, 32), (64, 16)), (180, 300)):
        _train(ops.maxsim(_tokens(dtype, batch, 32, dim), _tokens(dtype, batch, k, ld, dim), None,
                          _mask(batch, k, ld), mask_mode="zero"))
    with torch.no_grad():
        for k in (100, 1000):
            ops.maxsim(_tokens(dtype, 1, 32, dim), _tokens(dtype, 1, k, 300, dim), None, _mask(1, k, 300),
                       mask_mode="zero")


def _colpali(dtype, dim):
    """colpali-engine's losses: in-batch and hard-negative MaxSim over page tokens (no masks:
    padding tokens are zero) and their smooth-max variants."""
    for batch, lq in product((8, 16, 32, 64), (16, 32)):
        Q = _tokens(dtype, batch, lq, dim)
        _train(ops.maxsim(Q, _tokens(dtype, batch, 1030, dim)))
        _train(ops.maxsim(Q, _tokens(dtype, batch, 2, 1030, dim)))
        _train(ops.smooth_maxsim(Q, _tokens(dtype, batch, 1030, dim), tau=0.1, layout="cross"))
        _train(ops.smooth_maxsim(Q, _tokens(dtype, batch, 1030, dim), tau=0.1, layout="pairs"))


def _sentence_transformers(dtype, dim):
    """sentence-transformers 6's multi-vector similarity: both sides masked, masked tokens
    excluded."""
    for batch, lq, ld in product((16, 32, 64, 128), (16, 32), (64, 128, 256)):
        _train(ops.maxsim(_tokens(dtype, batch, lq, dim), _tokens(dtype, batch, ld, dim), _mask(batch, lq),
                          _mask(batch, ld)))


def _ops(dtype, dim):
    """The public op as hand-written loops call it: in-batch with a document mask, queries
    of 8-32 tokens, documents up to 1030; and a launch-bound call without autograd (a couple
    of queries against a few short documents: a REPL, a smoke test, a host-cost benchmark)."""
    for batch, lq, ld in product((32, 64, 128, 256), (8, 16, 32), (64, 128, 180, 256, 300, 1030)):
        _train(ops.maxsim(_tokens(dtype, batch, lq, dim), _tokens(dtype, batch, ld, dim), None, _mask(batch, ld)))
    with torch.no_grad():
        for lq in (8, 16, 32):
            ops.maxsim(_tokens(dtype, 2, lq, dim, grad=False), _tokens(dtype, 4, 16, dim, grad=False))
    _unmasked(dtype, dim)


def _unmasked(dtype, dim):
    """Calls without masks, as scoring code and kernel benchmarks make them: one to a few
    hundred queries scored against a corpus (reranking, search, long visual queries), and
    training steps in-batch, per-query candidates and pairs."""
    queries = ((1, 32), (8, 32), (16, 32), (64, 32), (256, 32), (64, 128), (16, 512), (1, 1024))
    with torch.no_grad():
        for (nq, lq), ld, nd in product(queries, (256, 300, 1030), (8, 256, 1000, 2000, 4096, 100_000)):
            ops.maxsim(_tokens(dtype, nq, lq, dim, grad=False), _tokens(dtype, nd, ld, dim, grad=False))
    for batch, ld in product((8, 64, 256, 1024), (180, 256, 300, 1030)):
        _train(ops.maxsim(_tokens(dtype, batch, 32, dim), _tokens(dtype, batch, ld, dim)))
        _train(ops.maxsim_pairs(_tokens(dtype, batch, 32, dim), _tokens(dtype, batch, ld, dim)))
        _train(ops.maxsim(_tokens(dtype, batch, 32, dim), _tokens(dtype, batch, 16, ld, dim)))


def _lists(dim):
    """The hosts' list entry points (PyLate ``rank.rerank``, colpali-engine
    ``score_multi_vector``, sentence-transformers' list scoring), whose candidates the listed
    kernel reads where they lie: per-query candidate lists with the host's zero padding, and
    every query against every candidate, with and without padding.  Every dtype, whatever
    ``--dtypes`` says: retrieval embeddings come in fp16 as often as in bf16 or fp32, and a
    process's first rerank is what a user who tries a reranker times."""
    from .kernels.triton.listed import score_listed

    def table(n, dtype, pad):
        lengths = torch.empty(n, dtype=torch.int64, device="meta")
        return (_tokens(dtype, 1, dim, grad=False), torch.empty(n, dtype=torch.int64, device="meta"), lengths,
                torch.empty(n, dtype=torch.bool, device="meta") if pad else None)

    with torch.no_grad():
        for dtype, lq, pad in product(DTYPES.values(), (8, 16, 32, 64, 128, 256, 512, 1024), (True, False)):
            doc, addresses, lengths, padded = table(1000, dtype, pad)
            for nq in (1, 2, 4, 8, 16, 32, 64, 128):
                cu_q = torch.empty(nq + 1, dtype=torch.int64, device="meta")
                Q = _tokens(dtype, nq * lq, dim, grad=False)
                score_listed(Q, cu_q, lq, doc, addresses, lengths, None, padded, round_maxima=True)
                per_query = torch.empty(1000, dtype=torch.int64, device="meta")
                score_listed(Q, cu_q, lq, doc, addresses, lengths, per_query, padded, round_maxima=True)


WORKLOADS = {"pylate": _pylate, "colpali": _colpali, "sentence_transformers": _sentence_transformers, "ops": _ops}
LIST_HOSTS = ("pylate", "colpali", "sentence_transformers")


# ----------------------------------------------------------------------------- the target
def device_arch() -> str | None:
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


@contextlib.contextmanager
def compiling_for(arch: str):
    """Triton compiles for ``arch`` (``sm_90``) inside the block: the device's own target
    where the GPU is that architecture, else a stand-in active driver that only names the
    target, and a device and stream nothing is launched on (``warmup`` compiles and returns:
    Triton lowers to PTX and runs ``ptxas`` without a GPU)."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    if device_arch() == arch:
        yield
        return
    target = GPUTarget("cuda", int(arch[3:]), 32)
    driver.set_active(types.SimpleNamespace(
        get_current_target=lambda: target, get_current_device=lambda: 0,
        get_current_stream=lambda device=None: 0, get_active_torch_device=lambda: torch.device("cpu")))
    try:
        yield
    finally:
        # back to the default, built on its next use (``reset_active`` would build it now,
        # and fails where no GPU driver is installed)
        driver.set_active(None)


def _facts(arch: str) -> tuple[int, int]:
    """(SMs, shared memory per block) the launchers plan with for ``arch``: the device's own
    where it is that architecture, else the table's."""
    if device_arch() == arch:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return props.multi_processor_count, props.shared_memory_per_block_optin
    if arch not in TARGETS:
        raise SystemExit(f"precompile: no device facts for {arch} (known: {', '.join(TARGETS)}); "
                         "run it on such a GPU")
    return TARGETS[arch]


@contextlib.contextmanager
def _planning_for(arch: str):
    """The op layer routes ``meta`` tensors to the Triton launchers, which plan for ``arch``
    (its committed config table, SMs and shared memory) and note their launches."""
    from .kernels import dispatch as library  # the chooser: served_by is patched there
    from .kernels import device
    from .kernels.triton import direct, launch, tuning

    name = arch.replace("_", "")
    if tuning._table(name) is None:
        raise SystemExit(f"precompile: no committed config table for {arch} (kernels/triton/configs/{name}.json): "
                         "its first calls sweep configs on the GPU; build the table there first "
                         "(bash benchmarks/run_gpu.sh tune)")
    sms, smem = _facts(arch)
    saved = (library.served_by, tuning.architecture, tuning._smem_budget, tuning._chosen, device.DEFAULT_SM_COUNT)
    library.served_by = lambda t, op="maxsim": "triton"
    tuning.architecture = lambda: name
    tuning._smem_budget = lambda: smem
    tuning._chosen = {}               # configs picked for another architecture are not this one's
    device.DEFAULT_SM_COUNT = sms     # what sm_count() answers for a non-CUDA (here: meta) device
    launch.clear_plans()              # nor are the launch plans (blocking and config) made before
    try:
        with direct.recording() as launches:
            yield launches
    finally:
        (library.served_by, tuning.architecture, tuning._smem_budget, tuning._chosen,
         device.DEFAULT_SM_COUNT) = saved
        launch.clear_plans()


def variants(hosts, dtypes, dims, arch: str, generic: bool = False) -> list[tuple]:
    """Every distinct launch ``(kernel, args, meta)`` the hosts' calls make on ``arch``, in a
    stable order.  ``generic``: also, per group of those (kernel, meta, dtypes: the binaries
    that differ only in specialisation hints, ``variants.group``), the launch with no hints
    (``variants.generic_args``), whose binary the shipped-binary loader gives any launch of
    the group the build did not see (another batch size, length, stride or an unaligned view)."""
    from .kernels.triton import variants

    found = {}
    torch.manual_seed(0)
    with _planning_for(arch) as launches:
        launches.append((variants.self_check_kernel, (_tokens(torch.float32, 100, grad=False),
                                                    _tokens(torch.float32, 100, grad=False),
                                                    *variants.CHECK_CALLS[0]), dict(variants.CHECK_META)))
        for host in hosts:
            for dtype in dtypes:
                for dim in dims:
                    WORKLOADS[host](dtype, dim)
        if any(host in LIST_HOSTS for host in hosts):
            for dim in dims:
                _lists(dim)
    for kernel, args, meta in launches:
        found.setdefault(variants.variant(kernel, args, meta), (kernel, args, meta))
    if generic:
        for kernel, args, meta in list(found.values()):
            plain = variants.generic_args(kernel, args)
            found.setdefault(variants.variant(kernel, plain, meta), (kernel, plain, meta))
    return [found[k] for k in sorted(found, key=repr)]


def describe(kernel, args, meta) -> str:
    from .kernels.triton import variants

    dtypes = sorted({str(a.dtype).replace("torch.", "") for a in args if isinstance(a, torch.Tensor)})
    settings = " ".join(f"{k}={v}" for k, v in sorted(meta.items()))
    hints = variants.group(variants.variant(kernel, args, meta))[1]
    return f"{variants.kernel_name(kernel)} [{','.join(dtypes)}] {settings} hints={hints}"


def _require_jit(todo: list[tuple]) -> None:
    import triton

    for kernel, _, _ in todo:
        if type(kernel) is not triton.runtime.JITFunction:
            raise SystemExit(f"precompile: {kernel!r} is not a Triton JIT function (the interpreter is on: "
                             "unset TRITON_INTERPRET)")


def compile_all(todo: list[tuple], arch: str, load: bool = True) -> list:
    """Compile each launch of ``todo`` for ``arch`` through the JIT's own ``warmup`` (into
    Triton's cache); the compiled kernels.  ``load``: on a GPU of that architecture, also
    load each, as a first launch does."""
    _require_jit(todo)
    with compiling_for(arch):
        compiled = [kernel.warmup(*args, grid=(1,), **meta) for kernel, args, meta in todo]
    if load and device_arch() == arch:
        for binary in compiled:
            # the launcher too: Triton releases that build a C launcher per signature
            # (3.6) compile it with the C compiler at the first launch and cache it
            # beside the binary; ``run`` builds it (and loads the binary) now
            binary.run
    return compiled


def _compile_share(workload: dict, arch: str, ship: bool, stage_dir: str, share: slice) -> dict | None:
    """A compiler process: its ``share`` of the variants into Triton's cache, or with ``ship``
    their cubins into ``stage_dir`` and their manifest entries returned; ``None`` where it
    failed, the traceback on stderr (not every Triton error pickles back to the parent).  It
    lists the variants again: their JIT functions do not pickle."""
    try:
        todo = variants(workload["hosts"], [DTYPES[d] for d in workload["dtypes"]], workload["dims"], arch,
                        generic=ship)[share]
        compiled = compile_all(todo, arch, load=not ship)
        if not ship:
            return {}
        from .kernels.triton import binaries_build

        return binaries_build.stage(todo, compiled, arch, Path(stage_dir), shared_limit=_facts(arch)[1])
    except Exception:
        traceback.print_exc()
        return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m lik_plugins.precompile", description=__doc__.splitlines()[0])
    p.add_argument("--hosts", nargs="+", choices=HOSTS, default=list(HOSTS))
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=["bf16"])
    p.add_argument("--dims", nargs="+", type=int, default=[128])
    p.add_argument("--arch", default=None, help="target GPU architecture, e.g. sm_90 (default: this GPU's)")
    p.add_argument("--list", action="store_true", help="print the variants, compile nothing")
    p.add_argument("--jobs", type=int, default=min(os.cpu_count() or 1, 16),
                   help="compiler processes (Triton's compiler holds the GIL for much of its work)")
    p.add_argument("--ship", action="store_true",
                   help="build the binaries the package ships (an archive of cubins + manifest), not Triton's cache")
    p.add_argument("--out", default=None,
                   help="with --ship: the binaries folder (default: the package's kernels/triton/binaries)")
    args = p.parse_args(argv)
    arch = args.arch or device_arch()
    if arch is None:
        p.error("no CUDA device here: name the target with --arch (e.g. sm_90)")
    workload = {"hosts": args.hosts, "dtypes": args.dtypes, "dims": args.dims}
    todo = variants(args.hosts, [DTYPES[d] for d in args.dtypes], args.dims, arch, generic=args.ship)
    if args.list:
        for v in todo:
            print(describe(*v))
        print(f"{len(todo)} variants for {arch}")
        return 0
    _require_jit(todo)
    t0 = time.perf_counter()
    jobs = max(1, min(args.jobs, len(todo)))
    with tempfile.TemporaryDirectory() as scratch:
        # spawned, not forked: the parent may hold a CUDA context
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            share = partial(_compile_share, workload, arch, args.ship, scratch)
            parts = list(pool.map(share, [slice(i, None, jobs) for i in range(jobs)]))
        failed = parts.count(None)
        print(f"{len(todo)} variants for {arch} in {time.perf_counter() - t0:.1f} s ({jobs} processes)"
              + (f"; {failed} failed" if failed else ""))
        if args.ship and not failed:
            from .kernels.triton import binaries_build

            entries = {key: entry for part in parts for key, entry in part.items()}
            out = Path(args.out) if args.out else None
            path = binaries_build.write_archive(todo, entries, arch, Path(scratch), out, workload)
            print(f"shipped {len(entries)} binaries in {path} ({path.stat().st_size / 2**20:.1f} MiB)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
