"""A cold process on the kernels from its first call: routing, do_bench fresh against warm,
``backward="lowmem"`` bitwise across fresh processes, and precompile -> zero compiles.

    python benchmarks/coldstart.py OUT_DIR
    python benchmarks/coldstart.py OUT_DIR --table [--only a,b]

Every cell is a fresh Python process.  The step: ColBERT in-batch 256 (Q ``[256, 32, 128]``,
D ``[256, 180, 128]`` with ragged document masks, bf16), ``maxsim`` -> cross entropy ->
backward, ``backward`` as asked.

* ``fresh-1`` and ``fresh-2``, each on its own empty ``TRITON_CACHE_DIR``: ``do_bench`` of the
  step as the process's first call (its warm-up compiles), then ``do_bench`` again (warm, same
  process); ``routing_counts()`` over all of it; the first ``backward="lowmem"`` step's
  gradients hashed (sha256 of their bytes) -- the two processes must agree bit for bit.
* ``precompiled``: ``python -m lik_plugins.precompile --hosts ops`` fills an empty cache in its
  own processes, then a fresh process runs the same calls on it, counting the binaries
  Triton builds (its compile listener: cache misses) and the cache's files before and after.

``--table``: every row of the side-by-side table (``bench_kernels.ALL_SHAPES``; ``--only``
picks rows by name) in a fresh process on its own empty ``TRITON_CACHE_DIR``: ``do_bench`` of
the row's call (forward + backward for the training rows, as ``bench_kernels`` times it) as
the process's first call, then again, the binaries Triton built and ``routing_counts()``.

Writes ``coldstart.json`` and ``coldstart.md`` (``coldstart_table.{json,md}`` with ``--table``).
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time

BATCH, LQ, LD, DIM = 256, 32, 180, 128


def _compiles_seen() -> list:
    """The names of the kernels Triton compiles from here on in this process (its compile
    listener: cache misses), appended as they happen."""
    import triton

    misses: list = []

    def listen(*, src, metadata, metadata_group, times, cache_hit):
        if not cache_hit:
            misses.append(getattr(src, "name", str(src)))

    triton.knobs.compilation.listener = listen
    return misses


def _cell() -> dict:
    import torch
    import torch.nn.functional as F
    from triton.testing import do_bench

    misses = _compiles_seen()
    import lik_plugins

    g = torch.Generator().manual_seed(0)
    Q0 = F.normalize(torch.randn(BATCH, LQ, DIM, generator=g), dim=-1).to("cuda", torch.bfloat16)
    D0 = F.normalize(torch.randn(BATCH, LD, DIM, generator=g), dim=-1).to("cuda", torch.bfloat16)
    dm = (torch.arange(LD)[None, :] < torch.randint(LD // 2, LD + 1, (BATCH, 1), generator=g)).to("cuda")
    target = torch.arange(BATCH, device="cuda")

    def step(backward="auto"):
        Q, D = Q0.detach().requires_grad_(), D0.detach().requires_grad_()
        s = lik_plugins.maxsim(Q, D, None, dm, backward=backward)
        F.cross_entropy(s / 0.05, target).backward()
        return Q.grad, D.grad

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fresh_ms = do_bench(step, warmup=50, rep=300)
    fresh_wall_s = time.perf_counter() - t0
    warm_ms = do_bench(step, warmup=50, rep=300)
    gq, gd = step("lowmem")
    digest = hashlib.sha256(gq.float().cpu().numpy().tobytes() + gd.float().cpu().numpy().tobytes()).hexdigest()
    return dict(fresh_ms=fresh_ms, warm_ms=warm_ms, fresh_over_warm=fresh_ms / warm_ms, fresh_wall_s=fresh_wall_s,
                routing=lik_plugins.routing_counts(), lowmem_sha256=digest, compiles=len(misses),
                compiled=sorted(set(misses)))


def _table_cell(name: str) -> dict:
    """One side-by-side row, fresh: do_bench first, then again (``--table``)."""
    import torch
    from triton.testing import do_bench

    misses = _compiles_seen()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_kernels
    import lik_plugins

    shape = next(s for s in bench_kernels.ALL_SHAPES if s.name == name)
    Q0, D0 = bench_kernels.make_inputs(shape)
    train = shape.kind == "train"
    if train:
        Q0.requires_grad_()
        D0.requires_grad_()
        grad = None

    def call():
        nonlocal grad
        if not train:
            with torch.no_grad():
                return bench_kernels.ours(Q0, D0, shape.layout)
        Q0.grad = D0.grad = None
        out = bench_kernels.ours(Q0, D0, shape.layout)
        if grad is None:
            grad = torch.randn(out.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
        out.backward(grad)
        return out

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fresh_ms = do_bench(call, warmup=50, rep=300)
    fresh_wall_s = time.perf_counter() - t0
    warm_ms = do_bench(call, warmup=50, rep=300)
    return dict(fresh_ms=fresh_ms, warm_ms=warm_ms, fresh_over_warm=fresh_ms / warm_ms, fresh_wall_s=fresh_wall_s,
                routing=lik_plugins.routing_counts(), compiles=len(misses), compiled=sorted(set(misses)))


def _table(out_dir: str, meta: dict, only: str | None) -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_kernels

    rows = {}
    for shape in bench_kernels.ALL_SHAPES:
        if only and not any(part in shape.name for part in only.split(",")):
            continue
        with tempfile.TemporaryDirectory() as cache:
            rows[shape.name] = _spawn(cache, ["--table-cell", shape.name])
        print(shape.name, json.dumps(rows[shape.name]), flush=True)
    with open(os.path.join(out_dir, "coldstart_table.json"), "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    out = [f"# Every side-by-side row from a fresh process ({meta['device']}, {meta['date']})", "",
           f"torch {meta['torch']}, triton {meta['triton']}. Command: `{meta['command']}`", "",
           "Each row its own process on an empty Triton cache (default settings): `do_bench` (warm-up 50 ms, "
           "300 ms timed) of the row's lik_plugins call as the process's first call, then again in the same "
           "process; training rows time forward + backward.", "",
           "| row | do_bench first (ms) | do_bench again (ms) | first / again | binaries compiled | paths |",
           "|---|---|---|---|---|---|"]
    out += _timing_rows(rows, lambda r: [str(r["compiles"]), json.dumps(r["routing"])])
    with open(os.path.join(out_dir, "coldstart_table.md"), "w") as fh:
        fh.write("\n".join(out) + "\n")
    return 0


def _timing_rows(rows: dict, cells) -> list[str]:
    """Markdown rows: name, do_bench first / again / their ratio, then ``cells(row)``; an errored
    row says its error."""
    lines = []
    for name, r in rows.items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error']} |")
            continue
        timing = [f"{r['fresh_ms']:.3f}", f"{r['warm_ms']:.3f}", f"{r['fresh_over_warm']:.3f}"]
        lines.append("| " + " | ".join([name, *timing, *cells(r)]) + " |")
    return lines


def _files(cache: str) -> int:
    return sum(len(names) for _, _, names in os.walk(cache))


def _spawn(cache: str, cell=("--cell",)) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=cache, PYTHONUNBUFFERED="1")
    done = subprocess.run([sys.executable, os.path.abspath(__file__), *cell], env=env, capture_output=True,
                          text=True, timeout=300)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return dict(error=(done.stderr.strip().splitlines() or ["no output"])[-1][:400])


def main() -> int:
    if sys.argv[1:] == ["--cell"]:
        print("RESULT " + json.dumps(_cell()), flush=True)
        return 0
    if sys.argv[1:2] == ["--table-cell"]:
        print("RESULT " + json.dumps(_table_cell(sys.argv[2])), flush=True)
        return 0
    out_dir = sys.argv[1]
    table = "--table" in sys.argv[2:]
    only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else None
    os.makedirs(out_dir, exist_ok=True)
    import torch
    import triton

    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                command="python benchmarks/coldstart.py " + " ".join(sys.argv[1:]), date=time.strftime("%Y-%m-%d"))
    if table:
        return _table(out_dir, meta, only)
    rows = {}
    for name in ("fresh-1", "fresh-2"):
        with tempfile.TemporaryDirectory() as cache:
            rows[name] = _spawn(cache)
        print(name, json.dumps(rows[name]), flush=True)
    with tempfile.TemporaryDirectory() as cache:
        t0 = time.perf_counter()
        pre = subprocess.run([sys.executable, "-m", "lik_plugins.precompile", "--hosts", "ops", "--dtypes", "bf16",
                              "--dims", "128"], env=dict(os.environ, TRITON_CACHE_DIR=cache), capture_output=True,
                             text=True, timeout=400)
        precompile_s = time.perf_counter() - t0
        before = _files(cache)
        row = _spawn(cache)
        row.update(precompile_s=precompile_s, precompile_rc=pre.returncode,
                   precompile_out=(pre.stdout + pre.stderr).strip()[-600:], files_before=before,
                   files_after=_files(cache))
        rows["precompiled"] = row
        print("precompiled", json.dumps(row), flush=True)
    with open(os.path.join(out_dir, "coldstart.json"), "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    with open(os.path.join(out_dir, "coldstart.md"), "w") as fh:
        fh.write(markdown(rows, meta))
    return 0


def markdown(rows: dict, meta: dict) -> str:
    out = [f"# A cold process on the kernels ({meta['device']}, {meta['date']})", "",
           f"torch {meta['torch']}, triton {meta['triton']}. Command: `{meta['command']}`", "",
           f"Step: ColBERT in-batch {BATCH} (Lq {LQ}, Ld {LD}, d {DIM}, bf16, ragged document masks), maxsim -> "
           "cross entropy -> backward. Each row a fresh process; `fresh`: an empty Triton cache; `precompiled`: "
           "a cache filled by `python -m lik_plugins.precompile --hosts ops --dtypes bf16 --dims 128` first. "
           "`do_bench` (warm-up 50 ms, 300 ms timed): the process's first call, then again in the same process.", "",
           "| process | do_bench first (ms) | do_bench again (ms) | first / again | paths (routing_counts) "
           "| binaries compiled | lowmem first step: sha256 of grads |",
           "|---|---|---|---|---|---|---|"]
    out += _timing_rows(rows, lambda r: [json.dumps(r["routing"]), str(r["compiles"]), f"`{r['lowmem_sha256'][:16]}`"])
    pre = rows.get("precompiled", {})
    if "files_before" in pre:
        out += ["", f"Precompile: {pre['precompile_s']:.1f} s (exit {pre['precompile_rc']}): "
                f"`{pre['precompile_out'].splitlines()[-1] if pre['precompile_out'] else ''}`; cache files "
                f"{pre['files_before']} before the fresh process, {pre['files_after']} after."]
    same = len({r.get("lowmem_sha256") for r in rows.values()}) == 1
    out += ["", f"lowmem gradients identical across the processes: {same}."]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())
