"""One-query ``maxsim`` latency under ``triton.testing.do_bench``, against flash-maxsim and
late-interaction-kernels, with the GPU timeline of our call.

    python benchmarks/bench_latency.py OUT [--sizes 1000,100000] [--variants default,jit] [--profile]

``do_bench`` clears the L2 with a 256 MB memset before every call and keeps the GPU queue
full, so whatever our call adds to the GPU timeline -- a synchronisation, an extra launch, a
zero-fill, a one-off stall such as a compile or a self-check inside a timed call -- is in its
numbers.  Cases: 1 query of 32 tokens against ``N`` documents of 300 tokens, bf16, d 128
(unit-norm random tokens).

Per implementation and size, each group (ours per variant, the peers) in a process of its own:
* ``first``: do_bench's default mean, with the implementation's first call of the process
  inside it (what a fresh benchmark script measures; a one-off stall moves the mean);
* ``median``: a second do_bench, its median;
* for ours, ``launcher``: the Triton launcher alone (``kernels/triton/launch.forward``),
  without the op layers above it; ``--config-ab``: the launcher with forced tile configs;
* ``gpu only`` (up to 10k documents): the call captured in a CUDA graph and replayed after
  the same L2 clear, its median -- the kernels' own time, whatever the host's speed:
  do_bench reads the host's time instead where one call's host work outlasts the clear.
  (At 100k documents this column read ~10 % above do_bench for every implementation on an
  H200, so it is not taken there);
* ``host``: wall time per call over calls back to back (the host's work where it outlasts
  the GPU's);
* the copy bandwidth of this GPU (a 1 GiB device-to-device copy, bytes read + written) and
  the floor ``bytes of D / bandwidth``;
* with ``--profile``: the GPU timeline of a few do_bench-like iterations (every kernel and
  memset on the device, in order) and the runtime calls made per call.

``--repeats N`` runs every group's process N times (rows carry ``repeat``); the Markdown
ends with each implementation's median and range over them.  Writes ``latency.json`` and
``latency.md`` under OUT.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, "src")  # this checkout's lik_plugins

LQ, LD, DIM = 32, 300, 128
# variant -> environment of its process
VARIANTS = {
    "default": {},
    "jit": {"LIK_DIRECT_LAUNCH": "0"},
}
# runtime API calls that wait for the device or allocate (counted per call in the profile)
WATCH = ("Synchronize", "Memcpy", "Malloc", "Free", "ModuleLoad", "LaunchKernel", "Memset", "EventQuery")


def _inputs(n_docs: int):
    g = torch.Generator(device="cuda").manual_seed(n_docs)
    Q = torch.nn.functional.normalize(torch.randn(1, LQ, DIM, device="cuda", generator=g), dim=-1)
    D = torch.empty(n_docs, LD, DIM, device="cuda", dtype=torch.bfloat16)
    for start in range(0, n_docs, 10_000):     # normalised in slices: no full fp32 copy
        part = torch.randn(min(10_000, n_docs - start), LD, DIM, device="cuda", generator=g)
        D[start:start + part.shape[0]] = torch.nn.functional.normalize(part, dim=-1)
    return Q.bfloat16(), D


def _impls(group: str):
    if group == "lik_plugins":
        import lik_plugins as lik
        from lik_plugins.kernels.triton import launch

        return {
            "lik_plugins": lambda Q, D: lik.maxsim(Q, D),
            "lik_plugins launcher": lambda Q, D: launch.forward(Q, D, None, None, cross=True, normalize=False,
                                                                zero_mode=False, save_argmax=False)[0],
        }
    import flash_maxsim
    import late_interaction_kernels

    return {
        # its one-query entry and its batched one (which pads queries): the faster counts
        "flash-maxsim": lambda Q, D: flash_maxsim.flash_maxsim(Q[0], D),
        "flash-maxsim batched": lambda Q, D: flash_maxsim.flash_maxsim_batched(Q, D, shared_docs=True),
        "late-interaction-kernels": lambda Q, D: late_interaction_kernels.maxsim(Q, D),
    }


# forward configs (BLOCK_N, num_warps, num_stages) forced on our kernel with --config-ab; the
# first was the config table's 1-query entry before its 2-warp one (docs/performance-notes.md)
CONFIGS = [(64, 4, 3), (128, 4, 4)]


def _forced_configs(Q, D, rep):
    """do_bench of our launcher with each of CONFIGS forced (the config table's A/B)."""
    from triton.testing import do_bench

    from lik_plugins.kernels.triton import launch
    from lik_plugins.kernels.triton.forward import maxsim_fwd_kernel

    pick = launch.forward_kernel_and_meta
    rows = []
    for n, w, st in CONFIGS:
        def forced(**kwargs):
            kernel, meta, _ = pick(**kwargs)
            return maxsim_fwd_kernel, {**meta, "BLOCK_N": n, "num_warps": w, "num_stages": st}, None

        launch.forward_kernel_and_meta = forced
        launch.clear_plans()
        try:
            fn = lambda: launch.forward(Q, D, None, None, cross=True, normalize=False, zero_mode=False,  # noqa: E731
                                        save_argmax=False)
            fn()
            ms = do_bench(fn, warmup=25, rep=rep, return_mode="median")
            rows.append(dict(impl=f"lik_plugins launcher N{n}w{w}s{st}", median_ms=ms))
        except Exception as exc:  # noqa: BLE001 - a config that does not fit: say so
            rows.append(dict(impl=f"lik_plugins launcher N{n}w{w}s{st}", error=repr(exc)[:200]))
        finally:
            launch.forward_kernel_and_meta = pick
            launch.clear_plans()
    return rows


def _copy_bandwidth() -> float:
    """Bytes read + written per second of a 1 GiB device-to-device copy."""
    from triton.testing import do_bench

    x = torch.empty(1 << 29, device="cuda", dtype=torch.bfloat16).normal_()
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), warmup=25, rep=200, return_mode="median")
    return 2 * x.numel() * x.element_size() / (ms * 1e-3)


def _graph_gpu_ms(fn, reps=200) -> float:
    """Median GPU time of ``fn`` replayed from a CUDA graph, each replay after do_bench's L2
    clear (a 256 MB memset)."""
    cache = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    events = []
    for _ in range(reps):
        cache.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in events)
    return times[len(times) // 2]


def _host_us(fn, calls=500) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    wall = time.perf_counter() - t0
    torch.cuda.synchronize()
    return wall / calls * 1e6


def _timeline(fn, iters=6) -> dict:
    """The device's work in do_bench-like iterations (cache clear, call), in order, and the
    runtime calls of interest per call."""
    from torch.profiler import ProfilerActivity, profile

    cache = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            cache.zero_()
            fn()
        torch.cuda.synchronize()
    device_events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                           key=lambda e: e.time_range.start)
    tail = device_events[-8:]
    t0 = tail[0].time_range.start if tail else 0
    timeline = [(e.name[:60], round(e.time_range.start - t0, 1), round(e.time_range.elapsed_us(), 1)) for e in tail]
    calls = {}
    for e in prof.key_averages():
        if any(w in e.key for w in WATCH) and e.device_type != torch.autograd.DeviceType.CUDA:
            calls[e.key] = round(e.count / iters, 2)
    return {"timeline": timeline, "runtime_calls_per_iter": calls}


def child(group: str, sizes: list[int], profile: bool, config_ab: bool = False) -> list[dict]:
    from triton.testing import do_bench

    rows = []
    bandwidth = _copy_bandwidth()
    for n in sizes:
        Q, D = _inputs(n)
        floor_ms = D.numel() * D.element_size() / bandwidth * 1e3
        rep = 100 if n <= 10_000 else 300
        for name, impl in _impls(group).items():
            with torch.no_grad():
                fn = lambda: impl(Q, D)  # noqa: E731
                first = do_bench(fn, warmup=25, rep=rep)        # the first call of fn is do_bench's own
                median = do_bench(fn, warmup=25, rep=rep, return_mode="median")
                row = dict(impl=name, n_docs=n, first_mean_ms=first, median_ms=median, floor_ms=floor_ms,
                           floor_fraction=floor_ms / median, copy_tb_s=bandwidth / 1e12,
                           checksum=float(fn().float().sum()), variant=os.environ.get("LATENCY_VARIANT", "default"),
                           repeat=int(os.environ.get("LATENCY_REPEAT", "0")), host_us=_host_us(fn))
                try:
                    if n <= 10_000:
                        row["gpu_only_ms"] = _graph_gpu_ms(fn)
                except Exception as exc:  # noqa: BLE001 - a call that cannot be captured: say so
                    row["gpu_only_error"] = repr(exc)[:200]
                if profile and n <= 10_000:
                    with warnings_as_rows(row):
                        torch.cuda.set_sync_debug_mode("warn")
                        fn()
                        torch.cuda.set_sync_debug_mode(0)
                    try:
                        row.update(_timeline(fn))
                    except Exception as exc:  # noqa: BLE001 - the numbers above still count
                        row["timeline_error"] = repr(exc)
            print(json.dumps(row), flush=True)
            rows.append(row)
        if config_ab and group == "lik_plugins":
            with torch.no_grad():
                for row in _forced_configs(Q, D, rep):
                    row.update(n_docs=n, first_mean_ms=float("nan"), floor_ms=floor_ms, copy_tb_s=bandwidth / 1e12,
                               repeat=int(os.environ.get("LATENCY_REPEAT", "0")),
                               floor_fraction=floor_ms / row["median_ms"] if "median_ms" in row else 0.0,
                               variant=os.environ.get("LATENCY_VARIANT", "default"))
                    row.setdefault("median_ms", float("nan"))
                    print(json.dumps(row), flush=True)
                    rows.append(row)
        del Q, D
        torch.cuda.empty_cache()
    return rows


class warnings_as_rows:
    """Collect the warnings of a block (torch's sync debug mode) into ``row["sync_warnings"]``."""

    def __init__(self, row):
        import warnings

        self.row, self.ctx = row, warnings.catch_warnings(record=True)

    def __enter__(self):
        import warnings

        self.caught = self.ctx.__enter__()
        warnings.simplefilter("always")

    def __exit__(self, *exc):
        self.row["sync_warnings"] = sorted({str(w.message)[:120] for w in self.caught})
        return self.ctx.__exit__(*exc)


def _summary(rows) -> list[str]:
    """Per size and implementation: the median and range of the do_bench medians and of the
    GPU-only times over the repeats."""
    import statistics

    groups: dict = {}
    for r in rows:
        if "host_us" in r:
            groups.setdefault((r["n_docs"], r["impl"], r["variant"]), []).append(r)
    out = ["", "Over the runs (median [min, max]):", "",
           "| docs | implementation | variant | runs | do_bench median ms | gpu only ms |", "|---:|---|---|---:|---:|---:|"]
    for (n, impl, variant), rs in sorted(groups.items()):
        cells = []
        for field in ("median_ms", "gpu_only_ms"):
            values = [r[field] for r in rs if field in r]
            cells.append(f"{statistics.median(values):.4f} [{min(values):.4f}, {max(values):.4f}]" if values else "n/a")
        out.append(f"| {n} | {impl} | {variant} | {len(rs)} | {cells[0]} | {cells[1]} |")
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--sizes", default="1000,100000")
    p.add_argument("--variants", default="default")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--no-peers", action="store_true", help="ours only")
    p.add_argument("--config-ab", action="store_true", help="also our launcher with each of CONFIGS forced")
    p.add_argument("--repeats", type=int, default=1, help="fresh processes per group")
    p.add_argument("--child", help="internal: lik_plugins | peers")
    a = p.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    if a.child:
        child(a.child, sizes, a.profile, a.config_ab)
        return 0
    os.makedirs(a.out, exist_ok=True)
    runs = [] if a.no_peers else [("peers", "default")]
    runs += [("lik_plugins", v) for v in a.variants.split(",")]
    rows = []
    for repeat, (group, variant) in [(r, g) for r in range(a.repeats) for g in runs]:
        env = {**os.environ, **VARIANTS[variant], "LATENCY_VARIANT": variant, "LATENCY_REPEAT": str(repeat)}
        cmd = [sys.executable, __file__, a.out, "--child", group, "--sizes", a.sizes]
        if a.profile and variant == "default":
            cmd.append("--profile")
        if a.config_ab and variant == "default":
            cmd.append("--config-ab")
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                  timeout=int(os.environ.get("BENCH_CHILD_TIMEOUT_S", "300")))
            out, rc, err = proc.stdout, proc.returncode, proc.stderr
        except subprocess.TimeoutExpired as exc:     # keep the rows printed so far
            out, rc, err = exc.stdout or "", "timeout", str(exc.stderr or "")
            out = out.decode() if isinstance(out, bytes) else out
        for line in out.splitlines():
            if line.startswith("{"):
                rows.append(json.loads(line))
        if rc:
            print(f"[latency] {group}/{variant} exited {rc}: {err[-800:]}")
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "command": " ".join(["python", *sys.argv]),
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    for pkg in ("late-interaction-kernels", "flash-maxsim"):
        try:
            from importlib.metadata import version

            meta[pkg] = version(pkg)
        except Exception:  # noqa: BLE001
            meta[pkg] = None
    with open(os.path.join(a.out, "latency.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    lines = [f"# One-query maxsim latency under do_bench ({meta['device']})", "",
             f"`{meta['command']}` -- {meta['date']}; torch {meta['torch']}, triton {meta['triton']}, "
             f"late-interaction-kernels {meta['late-interaction-kernels']}, flash-maxsim {meta['flash-maxsim']}", "",
             "`triton.testing.do_bench` (L2 cleared before each call). first: its default mean, the implementation's "
             "first call of the process inside it; median: a second run's median. floor = bytes of D / measured copy "
             "bandwidth (read + write).", "",
             "| docs | implementation | variant | run | first (mean) ms | median ms | gpu only ms | host µs | floor ms | "
             "floor / median |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['n_docs']} | {r['impl']} | {r['variant']} | {r.get('repeat', 0)} | {r['first_mean_ms']:.4f} | "
                     f"{r['median_ms']:.4f} | {r.get('gpu_only_ms', float('nan')):.4f} | {r.get('host_us', float('nan')):.1f} | "
                     f"{r['floor_ms']:.4f} | {r['floor_fraction']:.0%} |")
    lines += _summary(rows)
    with open(os.path.join(a.out, "latency.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    for r in rows:
        if "timeline_error" in r:
            print(f"[timeline] {r['impl']} {r['n_docs']}: {r['timeline_error']}")
        if "timeline" in r:
            print(f"[timeline] {r['impl']} {r['n_docs']}: {r['timeline']}")
            print(f"[calls] {r['impl']} {r['n_docs']}: {r['runtime_calls_per_iter']} sync warnings: "
                  f"{r.get('sync_warnings')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
