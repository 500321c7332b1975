"""Flatten a results folder's JSON files into one long-format CSV.

Usage: python benchmarks/collect_results.py benchmarks/results/h100 benchmarks/results/h100_2026-11.csv

One row per measured number, keyed by device, versions, benchmark, shape, implementation
and metric, so results of different machines, library versions and dates can be stacked and
compared with any dataframe tool.  Columns:

    device, date, torch, triton, host, benchmark, shape, implementation, run, metric, value, unit, source

* ``host``: the host library the number went through (``pylate 1.6.0``), empty for kernels.
* ``run``: the repetition index for the kernel benchmark (its table takes each
  implementation's best run), empty where the script stored one number.
* ``source``: the JSON file inside the folder that holds the number (with its command line).

Reads ``kernels.json`` (benchmarks/bench_kernels.py), ``real_loop*.json`` (benchmarks/real_loop.py), ``pylate_e2e*.json``
(benchmarks/pylate_e2e.py), ``colpali_e2e.json``, ``colpali_heads.json`` and
``fp8_fidelity.json`` (recipes/fp8_fidelity.py), ``packed.json`` (benchmarks/bench_packed.py) and
``compressed.json`` (benchmarks/bench_compressed.py) where present; others are ignored.
"""
from __future__ import annotations

import csv
import json
import re
import sys
from pathlib import Path

COLUMNS = ("device", "date", "torch", "triton", "host", "benchmark", "shape", "implementation",
           "run", "metric", "value", "unit", "source")


def _device_txt(folder: Path) -> dict:
    """Fallback versions from run_gpu.sh's device.txt ("torch X triton Y" on its last line)."""
    path = folder / "device.txt"
    if not path.is_file():
        return {}
    found = re.search(r"torch (\S+) triton (\S+)", path.read_text())
    return {"torch": found.group(1), "triton": found.group(2)} if found else {}


def _base(meta: dict, fallback: dict, date: str, source: str, benchmark: str, host: str = "") -> dict:
    return {
        "device": meta.get("device", ""),
        "date": str(meta.get("date", date))[:10],
        "torch": meta.get("torch", fallback.get("torch", "")),
        "triton": meta.get("triton", fallback.get("triton", "")),
        "host": host,
        "benchmark": benchmark,
        "source": source,
    }


def _row(base: dict, shape: str, impl: str, metric: str, value, unit: str, run="") -> dict:
    return {**base, "shape": shape, "implementation": impl, "run": run, "metric": metric,
            "value": "" if value is None else value, "unit": unit}


def kernels(path: Path, fallback: dict, date: str):
    data = json.loads(path.read_text())
    meta = data["meta"]
    base = _base(meta, fallback, date, path.name, "kernels")
    peers = {"late-interaction-kernels": meta.get("late_interaction_kernels"), "flash-maxsim": meta.get("flash_maxsim")}
    for r in data["rows"]:
        shape = r["shape"]["name"]
        if "ms" not in r:  # a failed or skipped implementation
            continue
        impl = f"{r['impl']} {peers[r['impl']]}" if peers.get(r["impl"]) else r["impl"]
        yield _row(base, shape, impl, "time", r["ms"], "ms", r["run"])
        yield _row(base, shape, impl, "peak_memory", r.get("peak_mb"), "MiB", r["run"])
        yield _row(base, shape, impl, "relative_error_vs_fp32", r.get("rel_err"), "", r["run"])
        yield _row(base, shape, impl, "fraction_of_roofline", r.get("roofline"), "", r["run"])


def pylate_e2e(path: Path, fallback: dict, date: str):
    data = json.loads(path.read_text())
    meta = data["meta"]
    base = _base(meta, fallback, date, path.name, "pylate_e2e", f"pylate {meta.get('pylate', '')}".strip())
    for r in data["rows"]:
        shape = f"{r['loss']} batch {r.get('batch', '')} gc {'on' if r['gc'] else 'off'}"
        if r.get("mode") == "ab":  # both variants interleaved in one process
            shape += " interleaved"
            yield _row(base, shape, "pylate", "step_time", r["vanilla_ms"], "ms")
            yield _row(base, shape, "lik_plugins", "step_time", r["patched_ms"], "ms")
            continue
        if "batch" not in r:  # the routing record of a run
            continue
        impl = "lik_plugins" if r["variant"] == "patched" else "pylate"
        if r["status"] != "ok":
            yield _row(base, shape, impl, "status", r["status"], "")
            continue
        yield _row(base, shape, impl, "step_time", r["step_ms"], "ms")
        yield _row(base, shape, impl, "peak_memory", r["step_peak_gib"] * 1024, "MiB")


def colpali_e2e(path: Path, fallback: dict, date: str):
    data = json.loads(path.read_text())
    meta = data["meta"]
    base = _base(meta, fallback, date, path.name, "colpali_e2e", f"colpali-engine {meta.get('colpali_engine', '')}")
    for r in data["rows"]:
        impl = "lik_plugins" if r["variant"] == "patched" else "colpali-engine"
        shape = f"ColQwen2 2B LoRA batch {r['batch']}"
        if r["status"] != "ok":
            yield _row(base, shape, impl, "status", r["status"], "")
            continue
        yield _row(base, shape, impl, "step_time", r["step_ms_median"], "ms")
        yield _row(base, shape, impl, "peak_memory", r["peak_mib"], "MiB")


def colpali_heads(path: Path, fallback: dict, date: str):
    data = json.loads(path.read_text())
    base = _base(data["meta"], fallback, date, path.name, "colpali_heads", "colpali-engine")
    names = {"vanilla": "colpali-engine", "lik-native": "colpali-engine lik backend", "patched": "lik_plugins"}
    for r in data["rows"]:
        smooth = " smooth-max" if r["kind"] == "smooth-max" else ""
        shape = f"{r['head']}{smooth} B {r['B']} neg {r['n_neg']} Lq {r['Lq']} Ld {r['Ld']} {r['dtype']}"
        for key, impl in names.items():
            if key in r and r[key].get("ms") is not None:
                yield _row(base, shape, impl, "time_fwd_bwd", r[key]["ms"], "ms")
                yield _row(base, shape, impl, "peak_memory", r[key].get("peak_mib"), "MiB")


def fp8_fidelity(path: Path, fallback: dict, date: str):
    data = json.loads(path.read_text())
    base = _base(data["meta"], fallback, date, path.name, "fp8_fidelity")
    shape = f"{data['queries']} queries x {data['passages']} passages, vs {data['baseline']}"
    for precision, metrics in data["precisions"].items():
        for metric, value in metrics.items():
            yield _row(base, shape, f"lik_plugins {precision}", metric, value, "")


def real_loop(path: Path, fallback: dict, date: str):
    """benchmarks/real_loop.py: one row per (loop, implementation, compile, cache) cell and metric."""
    data = json.loads(path.read_text())
    base = _base(data["meta"], fallback, date, path.name, "real_loop")
    for r in data["rows"]:
        if "error" in r:
            continue
        shape = f"{r['loop']}{' compiled' if r['compile'] else ''} {r['cache']} cache"
        for metric, unit in (("first_step_s", "s"), ("first10_s", "s"), ("steady_median_ms", "ms"),
                             ("steady_max_ms", "ms"), ("spikes_over_20x", "steps")):
            yield _row(base, shape, r["impl"], metric, r.get(metric), unit)


def packed(path: Path, fallback: dict, date: str):
    """benchmarks/bench_packed.py: time, spread and peak memory per (case, implementation)."""
    data = json.loads(path.read_text())
    base = _base(data["meta"], fallback, date, path.name, "packed")
    for r in data["rows"]:
        if r.get("ms") is None:  # an error or a skipped peer: its reason is in packed.md
            continue
        yield _row(base, r["case"], r["impl"], "time", r["ms"], "ms")
        yield _row(base, r["case"], r["impl"], "time_iqr", r.get("iqr_ms"), "ms")
        yield _row(base, r["case"], r["impl"], "peak_memory", r.get("peak_mib"), "MiB")


def compressed(path: Path, fallback: dict, date: str):
    """benchmarks/bench_compressed.py: time (median, p10, p90), peak memory, error and the
    fraction of the bandwidth floor per (case, implementation)."""
    data = json.loads(path.read_text())
    base = _base(data["meta"], fallback, date, path.name, "compressed")
    for r in data["rows"]:
        if r.get("ms") is None:
            continue
        for metric, key, unit in (("time", "ms", "ms"), ("time_p10", "p10_ms", "ms"), ("time_p90", "p90_ms", "ms"),
                                  ("time_back_to_back", "pipelined_ms", "ms"),
                                  ("relative_error_vs_fp32", "rel_err", ""),
                                  ("fraction_of_bandwidth_floor", "fraction_of_bandwidth_floor", "")):
            if r.get(key) is not None:
                yield _row(base, r["group"], r["impl"], metric, r[key], unit)
        if r.get("peak_bytes") is not None:
            yield _row(base, r["group"], r["impl"], "peak_memory", r["peak_bytes"] / 2**20, "MiB")


READERS = (
    ("kernels.json", kernels),
    ("real_loop*.json", real_loop),
    ("pylate_e2e*.json", pylate_e2e),
    ("colpali_e2e.json", colpali_e2e),
    ("colpali_heads.json", colpali_heads),
    ("fp8_fidelity.json", fp8_fidelity),
    ("packed.json", packed),
    ("compressed.json", compressed),
)


def collect(folder: Path) -> list[dict]:
    """Every number of the folder's known JSON files as long-format rows (see module doc),
    and of its dated sub-folders (``2026-11-25/``)."""
    rows = [row for sub in sorted(folder.iterdir()) if sub.is_dir() and re.fullmatch(r"\d{4}-\d{2}-\d{2}", sub.name)
            for row in collect(sub)]
    fallback = _device_txt(folder)
    date = ""
    kernels_json = folder / "kernels.json"
    if kernels_json.is_file():  # the other scripts do not stamp a date; the kernel run does
        date = str(json.loads(kernels_json.read_text())["meta"].get("date", ""))[:10]
    for pattern, reader in READERS:
        for path in sorted(folder.glob(pattern)):
            rows.extend(reader(path, fallback, date))
    return rows


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    folder, out = Path(argv[0]), Path(argv[1])
    rows = collect(folder)
    if not rows:
        print(f"no known result JSON in {folder}", file=sys.stderr)
        return 1
    with out.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    print(f"{len(rows)} rows -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
