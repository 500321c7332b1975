"""The loops users run, from a cold start: first step, first 10 steps, steady steps.

    python benchmarks/real_loop.py OUT_DIR [--loops fixed,vary-colbert,vary-colpali,pylate] [--impls ...]
                                           [--steps 80] [--compile] [--warm] [--repeats N]

Every (loop, implementation, compile) cell runs in a fresh Python process with an empty
``TRITON_CACHE_DIR`` and ``TORCHINDUCTOR_CACHE_DIR``, so its first steps pay everything a new
node pays: imports, Triton and Inductor compiles, autotuning.  ``--warm`` runs each cell a
second time in another fresh process on the same (now filled) cache directories: what a second
job on the same node pays.  ``--sample-spikes MS`` samples every thread's stack during slow
steps (what a slow step waited on); compiled cells list Dynamo's recompiles.

Loops (bf16, d = 128, in-batch cross entropy over ``maxsim(Q, D, None, d_mask)``, AdamW-free:
the kernels are what is measured; ``pylate`` is the real training loop):

* ``fixed``        B = 64, Lq = 32, Ld = 300 every step;
* ``vary-colbert`` B = 64, Lq drawn in 8-32 and Ld in 60-300 every step (documents vary in
  sentence-transformers, evaluators and reranking);
* ``vary-colpali`` B = 32, Lq drawn in 8-32, Ld = 1030 (queries vary in colpali-engine);
* ``pylate``       PyLate ``Contrastive`` with one hard negative on a random ModernBERT-size
  ColBERT (``pylate_e2e.build_model``), AdamW, bf16, batch 128 -- ``lik_plugins`` is
  ``patch_pylate()``, the peers are PyLate's own ``PYLATE_SCORES_BACKEND`` choices.

Implementations: ``lik_plugins``, ``late-interaction-kernels``, ``flash-maxsim``, ``torch``
(eager einsum).  ``--precompiled`` also runs every ``lik_plugins`` cell on a cache that
``python -m lik_plugins.precompile`` filled first (in its own process, untimed: what a cluster
image or CI job would ship).  Per cell: first step, first 10 steps (sum), steady median / max after
step 10 and the count of steps above 20x the median.  Writes ``real_loop.json`` (long
format) and ``real_loop.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

LOOPS = ("fixed", "vary-colbert", "vary-colpali", "pylate")
IMPLS = ("lik_plugins", "late-interaction-kernels", "flash-maxsim", "torch")
# what ``--precompiled`` builds ahead for each loop (d 128): the kernel loops' calls are the ops', bf16;
# PyLate's step runs under CUDA autocast, whose normalisation returns fp32 embeddings
PRECOMPILE = {"pylate": ["--hosts", "pylate", "--dtypes", "bf16", "fp32"],
              "fixed": ["--hosts", "ops", "--dtypes", "bf16"], "vary-colbert": ["--hosts", "ops", "--dtypes", "bf16"],
              "vary-colpali": ["--hosts", "ops", "--dtypes", "bf16"]}
BULKY = ("variants", "compiles", "spike_samples", "recompiles")   # in the JSON, not in the progress lines


# ----------------------------------------------------------------------------- one cell
def _scorer(impl: str):
    """``score(Q, D, d_mask) -> [Nq, Nd]`` of an implementation (imports included in the
    first step's time: they are part of what a cold process pays)."""
    import torch

    if impl.startswith("lik_plugins"):
        import lik_plugins as lik

        return lambda Q, D, dm: lik.maxsim(Q, D, None, dm)
    if impl == "late-interaction-kernels":
        import late_interaction_kernels as m

        return lambda Q, D, dm: m.maxsim(Q, D, None, dm)
    if impl == "flash-maxsim":
        import flash_maxsim as m

        # flash-maxsim takes no document mask: padded tokens are zeroed (a zero token scores
        # 0, which a masked token would not) -- the same work, close to the same numbers
        return lambda Q, D, dm: m.flash_maxsim_batched_train(Q, D * dm.unsqueeze(-1), shared_docs=True)
    if impl == "torch":
        def eager(Q, D, dm):
            sim = torch.einsum("ash,bth->abst", Q, D)
            sim = sim.masked_fill(~dm[None, :, None, :], float("-inf"))
            return sim.amax(-1).clamp_min(-1e4).sum(-1).float()
        return eager
    raise ValueError(impl)


class _SpikeSampler:
    """``--sample-spikes``: while a step runs, a thread takes every thread's innermost frames
    every millisecond; a step slower than ``keep_ms`` keeps its samples, counted by (thread,
    stack) -- what the caller's thread was doing (or waiting in) while a background thread
    did what.  Sampling takes the GIL too, so it perturbs the steps it watches: a diagnosis,
    not a timing."""

    def __init__(self, keep_ms: float, depth: int = 6):
        import threading

        self.keep_ms, self.depth, self.samples, self.kept = keep_ms, depth, [], []
        self._on, self._main = threading.Event(), threading.main_thread().ident
        threading.Thread(target=self._run, name="real-loop-sampler", daemon=True).start()

    def _stack(self, frame) -> str:
        out = []
        while frame is not None and len(out) < self.depth:
            code = frame.f_code
            out.append(f"{os.path.basename(code.co_filename)}:{code.co_name}:{frame.f_lineno}")
            frame = frame.f_back
        return " < ".join(out)

    def _run(self):
        import threading

        names = {}
        while True:
            self._on.wait()
            frames = sys._current_frames()
            for t in threading.enumerate():
                names[t.ident] = t.name
            for ident, frame in frames.items():
                if names.get(ident) != "real-loop-sampler":
                    self.samples.append((names.get(ident, str(ident)), self._stack(frame)))
            time.sleep(0.001)

    def start(self):
        self.samples = []
        self._on.set()

    def stop(self, step: int, seconds: float):
        self._on.clear()
        if seconds * 1e3 > self.keep_ms and step >= 10:
            from collections import Counter

            top = Counter(self.samples).most_common(12)
            self.kept.append(dict(step=step, ms=round(seconds * 1e3, 2),
                                  samples=[[n, thread, stack] for (thread, stack), n in top]))


def _kernel_loop(args) -> list[float]:
    import torch
    import torch.nn.functional as F

    score = _scorer(args.impl)
    g = torch.Generator().manual_seed(0)
    batch = 32 if args.loop == "vary-colpali" else 64

    def lengths():
        if args.loop == "fixed":
            return 32, 300
        lq = int(torch.randint(8, 33, (1,), generator=g))
        return lq, (1030 if args.loop == "vary-colpali" else int(torch.randint(60, 301, (1,), generator=g)))

    def step(Q, D, dm):
        s = score(Q, D, dm)
        loss = F.cross_entropy(s / 0.05, torch.arange(s.shape[0], device=s.device))
        loss.backward()
        return loss

    recompiles = []
    if args.compile:
        step = torch.compile(step)
        _listen_to_recompiles(recompiles, lambda: len(times))
    sampler = _SpikeSampler(args.sample_spikes) if args.sample_spikes else None
    times, settled, settled_after_s, loop_start = [], None, None, time.perf_counter()
    while settled is None or len(times) - settled < args.steps - 10:
        if settled is None and len(times) >= 10 and time.perf_counter() - loop_start >= args.settle_s:
            settled = len(times)
            settled_after_s = time.perf_counter() - loop_start
            g.manual_seed(1)    # every implementation's steady window: the same lengths and data
            if args.impl.startswith("lik_plugins"):
                import lik_plugins

                lik_plugins.reset_routing_counts()    # the row reports the steady window's paths
        lq, ld = lengths()
        Q = torch.nn.functional.normalize(torch.randn(batch, lq, 128, generator=g), dim=-1).to("cuda", torch.bfloat16)
        D = torch.nn.functional.normalize(torch.randn(batch, ld, 128, generator=g), dim=-1).to("cuda", torch.bfloat16)
        dm = (torch.arange(ld)[None, :] < torch.randint(ld // 2, ld + 1, (batch, 1), generator=g)).to("cuda")
        Q.requires_grad_()
        D.requires_grad_()
        torch.cuda.synchronize()
        if sampler:
            sampler.start()
        t0 = time.perf_counter()
        _profiled(len(times), args, lambda: step(Q, D, dm), first_steady=len(times) == settled)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if sampler:
            sampler.stop(len(times) - 1, times[-1])
    if sampler:
        args.spike_samples = sampler.kept
    args.recompiles = recompiles
    return times, settled, settled_after_s


def _listen_to_recompiles(out: list, step_index) -> None:
    """Dynamo's recompiles of the compiled step, as (step, the guard that failed): a slow
    step after the first ones is either one of these or a kernel build."""
    import logging

    import torch

    class Recompiles(logging.Handler):
        def emit(self, record):
            text = record.getMessage()
            if "triggered by the following guard failure" in text or "Recompiling function" in text:
                root = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
                out.append([step_index(), " ".join(text.replace(root, "").split())[:400]])

    torch._logging.set_logs(recompiles=True)
    logging.getLogger("torch._dynamo").addHandler(Recompiles())


def _profiled(i: int, args, fn, first_steady: bool = False):
    """``fn()``; under cProfile where asked (``REAL_LOOP_PROFILE``: the folder its text goes
    to, top functions by own and total time; Python 3.12's profiler sees every thread): the
    cell's first step (``--profile-first-step``), its first steady step (``--profile-steady``)."""
    folder, asked = os.environ.get("REAL_LOOP_PROFILE"), os.environ.get("REAL_LOOP_PROFILE_WHICH", "").split(",")
    which = "first" if i == 0 and "first" in asked else "steady" if first_steady and "steady" in asked else None
    if which is None or not folder:
        return fn()
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    try:
        return prof.runcall(fn)
    finally:
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("tottime").print_stats(30)
        stats.sort_stats("cumulative").print_stats(40)
        # who built a launcher, loaded a module or hashed a kernel's source in this thread
        stats.print_callers("_init_handles|compile_module_from_src|cache_key|_self_check")
        name = f"{which}_step_{args.loop}_{args.impl}_{args.cache}{'_compiled' if args.compile else ''}.txt"
        with open(os.path.join(folder, name), "w") as f:
            f.write(text.getvalue())


def _pylate_loop(args) -> list[float]:
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import pylate_e2e

    if args.impl.startswith("lik_plugins"):
        import lik_plugins

        lik_plugins.patch_pylate()
    else:
        os.environ["PYLATE_SCORES_BACKEND"] = {"late-interaction-kernels": "lik", "flash-maxsim": "flash",
                                               "torch": "torch"}[args.impl]
    from pylate import losses

    with tempfile.TemporaryDirectory() as tmp:
        model = pylate_e2e.build_model(tmp)
    loss = losses.Contrastive(model=model)
    if args.compile:
        model[0].auto_model = torch.compile(model[0].auto_model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    times = []
    for i in range(args.steps):
        feats = pylate_e2e.features(model, 128, seed=i)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _profiled(i, args, lambda: pylate_e2e.train_step(loss, opt, feats))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times, 10, None


def _listen_to_compiles() -> list:
    """Every Triton compile of the cell (ours and the peers'): kernel, thread, seconds,
    whether it was a load from the on-disk cache, and when it finished (seconds since the
    listener was set: beside ``spike_steps`` it shows which compile a slow step waited on)."""
    import threading

    import triton

    events: list = []
    t0 = time.perf_counter()

    def listen(*, src, metadata, metadata_group, times, cache_hit):
        events.append([getattr(src, "name", str(src)), threading.current_thread().name, times.total / 1e6,
                       bool(cache_hit), round(time.perf_counter() - t0, 3)])

    if getattr(getattr(triton, "knobs", None), "compilation", None) is not None:
        triton.knobs.compilation.listener = listen
    return events


def run_cell(args) -> dict:
    t_start = time.perf_counter()
    compiles = _listen_to_compiles() if args.impl != "torch" else []
    times, settled, settled_after_s = _pylate_loop(args) if args.loop == "pylate" else _kernel_loop(args)
    steady = times[settled:] or times
    median = statistics.median(steady)
    after_10th = times[10:] or times
    row = dict(loop=args.loop, impl=args.impl, compile=bool(args.compile), cache=args.cache,
               first_step_s=times[0], first10_s=sum(times[:10]), steady_median_ms=median * 1e3,
               steady_max_ms=max(steady) * 1e3, steady_from_step=settled,
               steady_from_s=sum(times[:settled]) if settled_after_s is None else settled_after_s,
               # spikes: every step after the 10th, the settling ones included
               spikes_over_20x=sum(t > 20 * median for t in after_10th),
               # (step, ms, loop seconds up to the end of the step) of each spike
               spike_steps=[(i, round(t * 1e3, 2), round(sum(times[:i + 1]), 3)) for i, t in enumerate(times)
                            if i >= 10 and t > 20 * median],
               steps=len(times), steps_s=sum(times), cell_wall_s=time.perf_counter() - t_start, compiles=compiles,
               compile_s=sum(e[2] for e in compiles if not e[3]),
               compile_caller_s=sum(e[2] for e in compiles if not e[3] and e[1] == "MainThread"))
    if args.impl.startswith("lik_plugins"):
        from lik_plugins.kernels.triton import direct

        row["variants"] = direct.variants()
        import lik_plugins

        row["routing"] = lik_plugins.routing_counts()   # kernel loops: of the steady window
    if getattr(args, "recompiles", None):
        row["recompiles"] = args.recompiles
    if getattr(args, "spike_samples", None) is not None:
        row["spike_samples"] = args.spike_samples
    return row


# ----------------------------------------------------------------------------- driver
def _precompile(loop: str, cache_dir: str) -> float:
    """``python -m lik_plugins.precompile`` for ``loop``'s calls into ``cache_dir``; its seconds."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "lik_plugins.precompile", *PRECOMPILE[loop], "--dims", "128"],
                   env=dict(os.environ, TRITON_CACHE_DIR=cache_dir),
                   check=True, capture_output=True, timeout=600)
    return time.perf_counter() - t0


def _spawn(loop, impl, compile_, cache_dir, cache_label, steps, timeout, settle_s=0.0, sample_spikes=0.0):
    # Inductor's caches (its FX graphs and its own Triton kernels) live beside Triton's: a cold
    # cell compiles the user's graph from scratch too, and a warm one finds it (with one shared
    # directory, every compiled cell after the first ran on a warm Inductor cache: 2-5 s less)
    env = dict(os.environ, TRITON_CACHE_DIR=cache_dir, TORCHINDUCTOR_CACHE_DIR=os.path.join(cache_dir, "inductor"),
               PYTHONUNBUFFERED="1")
    env.pop("LIK_DISABLE", None)
    cmd = [sys.executable, os.path.abspath(__file__), "--cell", "--loop", loop, "--impl", impl,
           "--steps", str(steps), "--cache", cache_label, "--settle-s", str(settle_s),
           "--sample-spikes", str(sample_spikes)] + \
        (["--compile"] if compile_ else [])
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(loop=loop, impl=impl, compile=compile_, cache=cache_label, error=f"timeout {timeout}s")
    process_s = time.perf_counter() - t0
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            row = json.loads(line[7:])
            row["process_s"] = process_s
            return row
    return dict(loop=loop, impl=impl, compile=compile_, cache=cache_label,
                error=(done.stderr.strip().splitlines() or ["no output"])[-1][:300])


PRIME = """
import torch, triton, triton.language as tl
@triton.jit
def _double(x, n, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x + o, tl.load(x + o, mask=o < n) * 2, mask=o < n)
x = torch.ones(100, device="cuda")
_double[(1,)](x, 100, BLOCK=128)
torch.cuda.synchronize()
"""


def prime(loops: list[str], timeout: float) -> float:
    """Untimed processes before the cells: one compiles and runs a Triton kernel on a
    throwaway cache and, where the PyLate loop is asked for, two steps of it on PyLate's torch
    path.  On a fresh machine the first process to use Triton, or cuDNN's attention and the
    encoder's libraries, reads them from a cold disk: the first PyLate cell of a run, whichever
    implementation, took 2-4 s more on its first step than the same cell repeated (its
    attention calls 1.25 s against 0.13-0.17 s, cProfile), which would otherwise land on
    whichever cell runs first.  Returns their seconds."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as cache:
        subprocess.run([sys.executable, "-c", PRIME], env=dict(os.environ, TRITON_CACHE_DIR=cache),
                       capture_output=True, timeout=300)
        if "pylate" in loops:
            saved = {k: os.environ.pop(k) for k in ("REAL_LOOP_PROFILE", "REAL_LOOP_PROFILE_WHICH") if k in os.environ}
            _spawn("pylate", "torch", False, cache, "prime", 2, timeout)
            os.environ.update(saved)
    return time.perf_counter() - t0


def markdown(rows, meta) -> str:
    out = [f"# Real loops from a cold start ({meta['device']}, {meta['date']})", "",
           f"torch {meta['torch']}, triton {meta['triton']}; {meta.get('peers', '')}", "",
           f"Command: `{meta['command']}`", "",
           "Each cell: a fresh process; `cold` = empty Triton and Inductor caches, `warm` = a second process on "
           "those caches. "
           "`set-up`: the cell's seconds outside its steps (imports, patching, building the model, each step's data); "
           "`process`: the whole process, interpreter start to exit. Before the cells, one untimed process "
           f"ran a Triton kernel on a throwaway cache and, for the PyLate loop, two of its steps on PyLate's torch "
           f"path ({meta.get('prime_s', float('nan')):.1f} s; `nan`: not run), "
           "so no cell pays the machine's cold disk for the others.", "",
           *([f"Steady: the steps from {meta['settle_s']:g} s after the loop began (wall clock, and after the 10th "
              "step), column `steady from`: that step and the loop's seconds before it. Spikes count every step "
              "after the 10th.",
              ""] if meta.get("settle_s") else []),
           "Triton compiles: binaries built in this process (not loaded from the disk cache) and their "
           "seconds, of which in the caller's thread. `precompiled`: a cache filled by "
           "`python -m lik_plugins.precompile` first (its seconds in the `precompile` column).", "",
           "| loop | compile | cache | implementation | first step (s) | first 10 steps (s) | steady median (ms) "
           "| steady max (ms) | steady from: step (s) | steps > 20x median | set-up (s) | process (s) "
           "| Triton compiles: n, s (caller's) | precompile (s) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['loop']} | {r['compile']} | {r['cache']} | {r['impl']} | error: {r['error']} "
                       "| | | | | | | | | |")
            continue
        built = [e for e in r.get("compiles", []) if not e[3]]
        compiled = f"{len(built)}, {r.get('compile_s', 0):.1f} ({r.get('compile_caller_s', 0):.1f})" if built else ""
        precompiled = f"{r['precompile_s']:.1f}" if "precompile_s" in r else ""
        out.append(f"| {r['loop']} | {r['compile']} | {r['cache']} | {r['impl']} | {r['first_step_s']:.2f} | "
                   f"{r['first10_s']:.2f} | {r['steady_median_ms']:.3f} | {r['steady_max_ms']:.2f} | "
                   f"{r.get('steady_from_step', 10)} ({r.get('steady_from_s', r['first10_s']):.2f}) | "
                   f"{r['spikes_over_20x']} | {_setup_s(r):.2f} | {r.get('process_s', float('nan')):.2f} | "
                   f"{compiled} | {precompiled} |")
    return "\n".join(out + _spread(rows)) + "\n"


def _setup_s(row) -> float:
    # in-process seconds outside the steps (rows written before ``steps_s`` existed: nan)
    return row["cell_wall_s"] - row.get("steps_s", float("nan"))


def _spread(rows) -> list[str]:
    """Median [min-max] over the repeats of each cell (nothing when every cell ran once)."""
    cells: dict = {}
    for r in rows:
        if "error" not in r:
            cells.setdefault((r["loop"], r["compile"], r["cache"], r["impl"]), []).append(r)
    if all(len(v) < 2 for v in cells.values()):
        return []

    def spread(values, fmt):
        return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}-{max(values):{fmt}}]"

    out = ["", "Over the repeats: median [min-max].", "",
           "| loop | compile | cache | implementation | runs | first step (s) | first 10 steps (s) "
           "| steady median (ms) | steps > 20x median (total) | set-up (s) | process (s) |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (loop, compile_, cache, impl), rs in cells.items():
        out.append(f"| {loop} | {compile_} | {cache} | {impl} | {len(rs)} | "
                   f"{spread([r['first_step_s'] for r in rs], '.2f')} | {spread([r['first10_s'] for r in rs], '.2f')} | "
                   f"{spread([r['steady_median_ms'] for r in rs], '.3f')} | {sum(r['spikes_over_20x'] for r in rs)} | "
                   f"{spread([_setup_s(r) for r in rs], '.2f')} | {spread([r.get('process_s', float('nan')) for r in rs], '.2f')} |")
    return out


def environment() -> dict:
    import datetime

    import torch
    import triton

    meta = dict(device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                torch=torch.__version__, triton=triton.__version__, date=datetime.date.today().isoformat(),
                command="python " + " ".join(sys.argv))
    peers = []
    for dist in ("late_interaction_kernels", "flash_maxsim", "pylate"):
        try:
            from importlib.metadata import version

            peers.append(f"{dist} {version(dist)}")
        except Exception:
            peers.append(f"{dist} missing")
    meta["peers"] = ", ".join(peers)
    return meta


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", nargs="?")
    p.add_argument("--loops", default=",".join(LOOPS))
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--compile", action="store_true", help="also run every cell under torch.compile")
    p.add_argument("--compile-only", action="store_true", help="only the torch.compile cells")
    p.add_argument("--warm", action="store_true", help="also run every cell again on its filled Triton cache")
    p.add_argument("--precompiled", action="store_true",
                   help="also run every lik_plugins cell on a cache filled by python -m lik_plugins.precompile")
    p.add_argument("--timeout", type=float, default=240)
    p.add_argument("--repeats", type=int, default=1,
                   help="run every cell this many times (fresh caches); the Markdown adds median [min-max]")
    p.add_argument("--profile-first-step", action="store_true",
                   help="write each cell's first step under cProfile to OUT/first_step_<loop>_<impl>_<cache>.txt")
    p.add_argument("--profile-steady", action="store_true",
                   help="kernel loops: write each cell's first steady step under cProfile to "
                        "OUT/steady_step_<loop>_<impl>_<cache>.txt (with --profile-first-step: the first step too)")
    p.add_argument("--settle-s", type=float, default=0.0,
                   help="kernel loops: the steady window starts at the first step this many seconds after the "
                        "loop began (wall clock, making each step's data included; and after the 10th step); "
                        "--steps - 10 steady steps are measured from there")
    p.add_argument("--no-prime", action="store_true",
                   help="skip the untimed priming processes before the cells (a Triton kernel; two PyLate steps)")
    p.add_argument("--sample-spikes", type=float, default=0.0, metavar="MS",
                   help="kernel loops: sample every thread's stack each millisecond while a step runs and keep "
                        "the samples of steps after the 10th slower than MS (a diagnosis: sampling perturbs "
                        "the steps); rows carry them as spike_samples")
    p.add_argument("--cell", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--loop", choices=LOOPS)
    p.add_argument("--impl", choices=IMPLS)
    p.add_argument("--cache", default="cold")
    args = p.parse_args()
    if args.cell:
        print("RESULT " + json.dumps(run_cell(args)), flush=True)
        return 0
    os.makedirs(args.out_dir, exist_ok=True)
    if args.profile_first_step or args.profile_steady:
        os.environ["REAL_LOOP_PROFILE"] = os.path.abspath(args.out_dir)   # the cells inherit it
        os.environ["REAL_LOOP_PROFILE_WHICH"] = ",".join(
            w for w, on in (("first", args.profile_first_step), ("steady", args.profile_steady)) if on)
    meta = environment()
    if not args.no_prime:
        meta["prime_s"] = prime(args.loops.split(","), args.timeout)
    meta["settle_s"] = args.settle_s
    rows = []
    for loop in args.loops.split(","):
        for compile_ in ([True] if args.compile_only else [False, True] if args.compile else [False]):
            if compile_ and loop == "pylate":
                continue  # the encoder under torch.compile is the encoder's story, not ours
            # repeats interleave the implementations, so a drift of the host hits them alike, and
            # rotate their order, so none always runs first
            impls = args.impls.split(",")
            for repeat in range(args.repeats):
                for impl in impls[repeat % len(impls):] + impls[:repeat % len(impls)]:
                    labels = ["cold", "warm"] if args.warm else ["cold"]
                    if args.precompiled and impl == "lik_plugins":
                        labels.append("precompiled")
                    caches = []
                    for label in labels:
                        if label != "warm":     # warm: the cold cell's cache, now filled
                            caches.append(tempfile.TemporaryDirectory(prefix="real-loop-cache-"))
                        cache = caches[-1].name
                        precompile_s = _precompile(loop, cache) if label == "precompiled" else None
                        row = _spawn(loop, impl, compile_, cache, label, args.steps, args.timeout, args.settle_s,
                                     args.sample_spikes)
                        row["repeat"] = repeat
                        if precompile_s is not None:
                            row["precompile_s"] = precompile_s
                        rows.append(row)
                        print(json.dumps({k: v for k, v in row.items() if k not in BULKY}), flush=True)
                        with open(os.path.join(args.out_dir, "real_loop.json"), "w") as fh:
                            json.dump({"meta": meta, "rows": rows}, fh, indent=1)
                        with open(os.path.join(args.out_dir, "real_loop.md"), "w") as fh:
                            fh.write(markdown(rows, meta))
                    for c in caches:
                        c.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
