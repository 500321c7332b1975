"""Flatten every result JSON under ``benchmarks/results/<device>/`` into one long-format CSV
per device folder: ``benchmarks/results/<device>.csv`` (``h100.csv``, ``h200.csv``, ``cpu.csv``,
``h100x2.csv``).

Usage: ``python benchmarks/collect_results.py [RESULTS_DIR]`` (default ``benchmarks/results``).

One row per measured number, so runs of different machines, library versions and dates stack
and compare with any dataframe tool.  Columns:

    date, device, torch, triton, host, benchmark, case, implementation, metric, value, unit,
    spread, command, source_file

* ``date``: the run's, else its dated folder's, else the day git first recorded the file.
* ``host``: the host library the number went through (``pylate 1.6.0``), empty for kernels.
* ``benchmark``: the result file's stem (``kernels``, ``real_loop_final_pylate``, ...): one
  run of one script, so two numbers are comparable when they share it (and ``source_file``).
* ``spread``: how much the number moved, in words (``5 runs 0.170-0.174 ms``, ``IQR 0.002 ms``,
  ``p10-p90 ...``), empty where the script kept one number.
* ``command``: the command line the JSON records; ``source_file``: the JSON, relative to the
  repository.  Most result files have left the tree (git history keeps them under the same
  path: ``git log --diff-filter=D -1 -- PATH`` names the commit that removed one); a re-run
  keeps the rows of removed files as they are and rebuilds the rest from the JSON present.

The reader is chosen by the JSON's layout, not its name; a JSON no reader knows is listed on
stderr (and none of its numbers is invented).
"""
from __future__ import annotations

import csv
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

COLUMNS = ("date", "device", "torch", "triton", "host", "benchmark", "case", "implementation", "metric", "value",
           "unit", "spread", "command", "source_file")
ROOT = Path(__file__).resolve().parent.parent
DATE_DIR = re.compile(r"\d{4}-\d{2}-\d{2}")


class Source:
    """One JSON file: its data and the fields every row of it shares."""

    def __init__(self, path: Path, benchmark: str, data, context: dict):
        self.path, self.data = path, data
        meta = data.get("meta", data) if isinstance(data, dict) else {}
        meta = meta if isinstance(meta, dict) else {}
        self.base = {
            "date": str(meta.get("date", context.get("date", "")) or _committed(path))[:10],
            "device": meta.get("device", context.get("device", "")),
            "torch": meta.get("torch", context.get("torch", "")),
            "triton": meta.get("triton", context.get("triton", "")),
            "host": "",
            "benchmark": benchmark,
            "command": meta.get("command", ""),
            "source_file": _relative(path),
        }

    def row(self, case, impl, metric, value, unit="", spread="", host=None, command=None) -> dict | None:
        if value is None or isinstance(value, (dict, list)):
            return None
        if isinstance(value, float):
            value = float(f"{value:.6g}")
        row = {**self.base, "case": case, "implementation": impl, "metric": metric, "value": value, "unit": unit,
               "spread": spread}
        if host is not None:
            row["host"] = host
        if command is not None:
            row["command"] = command
        return row


def _committed(path: Path) -> str:
    """The day git first recorded ``path``: the date of a result whose JSON does not stamp one."""
    try:
        out = subprocess.run(["git", "log", "--diff-filter=A", "--format=%as", "--", str(path)], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return ""
    return out[-1] if out else ""


def _relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def _g(v) -> str:
    return f"{v:.4g}"


# --------------------------------------------------------------------------- readers
def kernels(src: Source):
    """bench_kernels.py: each implementation's best run per shape (what its table shows),
    the spread over runs."""
    peers = {"late-interaction-kernels": src.data["meta"].get("late_interaction_kernels"),
             "flash-maxsim": src.data["meta"].get("flash_maxsim")}
    best: dict = {}
    for r in src.data["rows"]:
        if r.get("ms") is not None:
            best.setdefault((r["shape"]["name"], r["impl"]), []).append(r)
    for (shape, impl), runs in best.items():
        times = [r["ms"] for r in runs]
        top = min(runs, key=lambda r: r["ms"])
        name = f"{impl} {peers[impl]}" if peers.get(impl) else impl
        spread = f"{len(runs)} runs {_g(min(times))}-{_g(max(times))} ms" if len(runs) > 1 else ""
        yield src.row(shape, name, "time", top["ms"], "ms", spread)
        yield src.row(shape, name, "peak_memory", top.get("peak_mb"), "MiB")
        yield src.row(shape, name, "relative_error_vs_fp32", top.get("rel_err"))
        yield src.row(shape, name, "fraction_of_roofline", top.get("roofline"))


def compressed(src: Source):
    """bench_compressed.py: time (median, p10-p90), back-to-back time, peak memory, error and the
    fraction of the bandwidth floor per (case, implementation)."""
    for r in src.data["rows"]:
        if r.get("ms") is None:
            continue
        case, impl = r["group"], r["impl"]
        spread = f"p10-p90 {_g(r['p10_ms'])}-{_g(r['p90_ms'])} ms" if r.get("p10_ms") is not None else ""
        yield src.row(case, impl, "time", r["ms"], "ms", spread)
        yield src.row(case, impl, "time_back_to_back", r.get("pipelined_ms"), "ms")
        yield src.row(case, impl, "relative_error_vs_fp32", r.get("rel_err"))
        yield src.row(case, impl, "fraction_of_bandwidth_floor", r.get("fraction_of_bandwidth_floor"))
        if r.get("peak_bytes") is not None:
            yield src.row(case, impl, "peak_memory", r["peak_bytes"] / 2**20, "MiB")


def packed(src: Source):
    """bench_packed.py: time with its IQR, peak memory, host time per (case, implementation)."""
    for r in src.data["rows"]:
        if r.get("ms") is None:  # an error or a skipped peer: its reason is in the .md
            continue
        spread = f"IQR {_g(r['iqr_ms'])} ms" if r.get("iqr_ms") is not None else ""
        yield src.row(r["case"], r["impl"], "time", r["ms"], "ms", spread)
        yield src.row(r["case"], r["impl"], "peak_memory", r.get("peak_mib"), "MiB")
        yield src.row(r["case"], r["impl"], "max_abs_diff", r.get("max_abs_diff"))
        yield src.row(r["case"], r["impl"], "host_time", r.get("host_us"), "us")


def real_loop(src: Source):
    """real_loop.py: one case per (loop, compile, cache) cell."""
    for r in src.data["rows"]:
        if "error" in r:
            continue
        case = f"{r['loop']}{' compiled' if r.get('compile') else ''} {r['cache']} cache"
        if r.get("repeat") not in (None, 0):
            case += f" repeat {r['repeat']}"
        for metric, unit in (("first_step_s", "s"), ("first10_s", "s"), ("steady_median_ms", "ms"),
                             ("steady_max_ms", "ms"), ("spikes_over_20x", "steps"), ("compiles", ""),
                             ("compile_s", "s"), ("process_s", "s")):
            yield src.row(case, r["impl"], metric, r.get(metric), unit)


def latency(src: Source):
    """bench_latency.py: one-query latency per (documents, implementation, config variant)."""
    for r in src.data["rows"]:
        case = f"1 query x {r['n_docs']} docs" + (f" ({r['variant']})" if r.get("variant", "default") != "default" else "")
        case += f", fresh process {r['repeat'] + 1}" if "repeat" in r else ""
        for metric, key, unit in (("time_median", "median_ms", "ms"), ("time_first_mean", "first_mean_ms", "ms"),
                                  ("time_cold", "cold_ms", "ms"), ("time_settled", "settled_ms", "ms"),
                                  ("time_gpu_only", "gpu_only_ms", "ms"), ("host_time", "host_us", "us"),
                                  ("fraction_of_copy_floor", "floor_fraction", "")):
            yield src.row(case, r["impl"], metric, r.get(key), unit)


def host_overhead(src: Source):
    """host_overhead.py: host-side microseconds per call, with the GPU time beside it."""
    for r in src.data["rows"]:
        spread = f"p90 {_g(r['host_p90_us'])} us" if r.get("host_p90_us") is not None else ""
        yield src.row(r["call"], "lik_plugins", "host_time", r["host_us"], "us", spread)
        yield src.row(r["call"], "lik_plugins", "gpu_time", r.get("gpu_us"), "us")
        yield src.row(r["call"], "lik_plugins", "back_to_back_time", r.get("back_to_back_us"), "us")


def pylate_e2e(src: Source):
    host = f"pylate {src.data['meta'].get('pylate', '')}".strip()
    for r in src.data["rows"]:
        case = f"{r['loss']} batch {r.get('batch', '')} gc {'on' if r['gc'] else 'off'}"
        if r.get("mode") == "ab":  # both variants interleaved in one process
            case += " interleaved"
            yield src.row(case, "pylate", "step_time", r["vanilla_ms"], "ms", host=host)
            yield src.row(case, "lik_plugins", "step_time", r["patched_ms"], "ms", host=host)
            continue
        if "batch" not in r:  # the routing record of a run
            continue
        impl = "lik_plugins" if r["variant"] == "patched" else "pylate"
        if r["status"] != "ok":
            yield src.row(case, impl, "status", r["status"], host=host)
            continue
        yield src.row(case, impl, "step_time", r["step_ms"], "ms", host=host)
        yield src.row(case, impl, "peak_memory", r["step_peak_gib"] * 1024, "MiB", host=host)


def colpali_e2e(src: Source):
    host = f"colpali-engine {src.data['meta'].get('colpali_engine', '')}".strip()
    for r in src.data["rows"]:
        impl = "lik_plugins" if r["variant"] == "patched" else "colpali-engine"
        case = f"ColQwen2 2B LoRA batch {r['batch']}"
        if r["status"] != "ok":
            yield src.row(case, impl, "status", r["status"], host=host)
            continue
        yield src.row(case, impl, "step_time", r["step_ms_median"], "ms", host=host)
        yield src.row(case, impl, "peak_memory", r["peak_mib"], "MiB", host=host)


def colpali_heads(src: Source):
    names = {"vanilla": "colpali-engine", "lik-native": "colpali-engine lik backend", "patched": "lik_plugins"}
    for r in src.data["rows"]:
        smooth = " smooth-max" if r["kind"] == "smooth-max" else ""
        case = f"{r['head']}{smooth} B {r['B']} neg {r['n_neg']} Lq {r['Lq']} Ld {r['Ld']} {r['dtype']}"
        for key, impl in names.items():
            if key in r and r[key].get("ms") is not None:
                yield src.row(case, impl, "time_fwd_bwd", r[key]["ms"], "ms", host="colpali-engine")
                yield src.row(case, impl, "peak_memory", r[key].get("peak_mib"), "MiB", host="colpali-engine")


def retrieval_quality(src: Source):
    """fp8_fidelity.py and plaid_rerank.py: retrieval metrics per precision / index."""
    d = src.data
    table = d["precisions"] if "precisions" in d else d["rows"]
    case = f"{d['queries']} queries x {d['passages']} passages"
    for impl, metrics in table.items():
        for metric, value in metrics.items():
            unit = "s" if metric.endswith("_s") else "bytes" if metric.endswith("_bytes") else ""
            yield src.row(case, f"lik_plugins {impl}", metric, value, unit)


def fast_plaid_parity(src: Source):
    for r in src.data["rows"]:
        for metric in ("max_diff", "max_diff_other_bit_order", "tolerance", "max_diff_to_original"):
            yield src.row(f"nbits {r['nbits']}, {r['tokens']} tokens", "lik_plugins vs fast-plaid", metric, r.get(metric))


def st_scoring(src: Source):
    host = f"sentence-transformers {src.data['meta'].get('sentence_transformers', '')}".strip()
    for r in src.data["rows"]:
        for impl, key in (("sentence-transformers", "st"), ("lik_plugins", "lik")):
            yield src.row(r["case"], impl, "time", r.get(f"{key}_ms"), "ms", host=host)
            yield src.row(r["case"], impl, "peak_memory", r.get(f"{key}_peak_mb"), "MiB", host=host)
        yield src.row(r["case"], "lik_plugins", "max_abs_diff", r.get("max_abs_diff"), host=host)


def multi_gpu(src: Source):
    """multi_gpu.py: step time and peak memory per (model, batch per rank, variant)."""
    world = src.data["meta"].get("world_size", "")
    for model, m in src.data["models"].items():
        for r in m.get("scaling", []):
            case = f"{model} world {world} batch/rank {r['batch_per_rank']}"
            impl = "lik_plugins" if r["variant"] == "patched" else "host"
            if r["status"] != "ok":
                yield src.row(case, impl, "status", r["status"])
                continue
            rounds = r.get("round_ms") or []
            spread = f"{len(rounds)} rounds {_g(min(rounds))}-{_g(max(rounds))} ms" if len(rounds) > 1 else ""
            yield src.row(case, impl, "step_time", r["step_ms"], "ms", spread)
            yield src.row(case, impl, "peak_memory", r["peak_gib"] * 1024, "MiB")


def plaid_search(src: Source):
    """recipes/plaid_search.py: fast-plaid against patch_pylate per corpus."""
    for r in src.data["rows"]:
        case = f"{r['corpus']} {r['docs']} docs nbits {r['nbits']}"
        for impl in ("fast_plaid", "lik_plugins"):
            for metric, unit in (("qps", "1/s"), ("p50_ms", "ms"), ("p99_ms", "ms"), ("search_p50_ms", "ms"),
                                 ("peak_allocated_mib", "MiB")):
                yield src.row(case, impl.replace("_", "-") if impl == "fast_plaid" else impl, metric,
                              r[impl].get(metric), unit)
        for metric in ("top10_list_identical", "top10_set_identical", "top10_identical_up_to_near_ties",
                       "score_abs_diff_max", "recall10_vs_exact_bf16"):
            yield src.row(case, "lik_plugins vs fast-plaid", metric, r.get(metric))


def coldstart(src: Source):
    """coldstart.py: a fresh process's first timed call against a warm one, per process kind."""
    for case, r in src.data["rows"].items():
        for metric, unit in (("fresh_ms", "ms"), ("warm_ms", "ms"), ("fresh_over_warm", ""), ("fresh_wall_s", "s"),
                             ("compiles", ""), ("precompile_s", "s")):
            yield src.row(case, "lik_plugins", metric, r.get(metric), unit)


def parity(src: Source):
    """GPU parity records (pylate_gpu_parity.py / colpali gpu_parity.py): the loss and gradient
    distances to the float64 oracle, per case."""
    d = src.data
    if "cases" in d:
        for c in d["cases"]:
            case = f"{c['loss']} {c['dtype']}"
            for metric, value in c.get("patched_vs_oracle", {}).items():
                yield src.row(case, "lik_plugins", f"{metric}_vs_oracle", value, host="pylate")
            for metric, value in c.get("vanilla_bf16_vs_oracle", {}).items():
                yield src.row(case, "pylate", f"{metric}_vs_oracle", value, host="pylate")
    for h in d.get("heads", []):
        case = f"{h['head']}{' smooth-max' if h.get('smooth_max') else ''} {h['dtype']}"
        for quantity, by_impl in h.get("errors", {}).items():
            for impl, value in by_impl.items():
                yield src.row(case, "lik_plugins" if impl == "ours" else "colpali-engine", f"{quantity}_error_vs_oracle",
                              value, host="colpali-engine")


def rerank(src: Source):
    """bench_rerank.py: candidate lists scored through each host, per (host, case, variant)."""
    for r in src.data["rows"]:
        if "error" in r:      # a variant that failed measured nothing
            continue
        case = f"{r['case']} {r['queries']} queries x {r['candidates_per_query']} candidates"
        runs = r.get("all_seconds") or []
        spread = f"{len(runs)} runs {_g(min(runs))}-{_g(max(runs))} s" if len(runs) > 1 else ""
        host = r.get("host", "")
        yield src.row(case, r["variant"], "time", r.get("seconds"), "s", spread, host=host)
        yield src.row(case, r["variant"], "queries_per_s", r.get("queries_per_s"), "1/s", host=host)
        if r.get("peak_gpu_bytes"):
            yield src.row(case, r["variant"], "peak_memory", r["peak_gpu_bytes"] / 2**20, "MiB", host=host)
        for metric in ("identical_ranking_share", "identical_top10_share", "speedup_vs_fastest_host_backend",
                       "worst_case_speedup"):
            yield src.row(case, r["variant"], metric, r.get(metric), host=host)


def test_runs(src: Source):
    """A GPU test record (``{"runs": [{"summary": "7 failed, 4 passed", ...}]}``): the counts."""
    for name, version in re.findall(r"(torch|triton) (\S+)", src.data.get("versions", "")):
        src.base[name] = src.base[name] or version
    for run in src.data["runs"]:
        for n, what in re.findall(r"(\d+) (passed|failed|skipped|errors?)", run.get("summary", "")):
            yield src.row(run.get("code", ""), "lik_plugins", f"tests_{what}", int(n), command=run.get("command"))


def shipped_check(src: Source):
    """shipped_binaries_check.py: per mode (shipped binaries, the JIT on an empty or a filled
    cache) the first pass over the hosts' cases, the launches through Triton, host cost."""
    for mode, r in src.data["modes"].items():
        if "error" in r:
            continue
        src.base["device"] = src.base["device"] or r.get("device", "")
        src.base["torch"] = src.base["torch"] or r.get("torch", "")
        src.base["triton"] = src.base["triton"] or r.get("triton", "")
        for metric, unit in (("first_pass_s", "s"), ("second_pass_s", "s"), ("jit_launches_first_pass", ""),
                             ("launch_host_us_median", "us"), ("call_host_us", "us"), ("process_s", "s")):
            yield src.row("hosts' cases, fresh process", mode, metric, r.get(metric), unit)
    equal = [r.get("bitwise_jit-warm", False) for r in src.data.get("correctness", {}).values()]
    if equal:
        yield src.row("hosts' cases, fresh process", "shipped", "cases_bitwise_equal_to_jit", sum(equal), "",
                      f"of {len(equal)}")


def first_call(src: Source):
    """first_call.py: the first scoring call of each fresh process (forward, backward) and the
    median of its later calls; profiled processes measured under cProfile, so left out."""
    for n, r in enumerate(src.data["rows"]):
        if "error" in r or r.get("profiled"):
            continue
        case = f"PyLate Contrastive scoring call, batch 128, fresh process {n + 1}"
        yield src.row(case, r["impl"], "first_forward_time", r["calls"][0]["forward_ms"], "ms")
        yield src.row(case, r["impl"], "first_backward_time", r["calls"][0]["backward_ms"], "ms")
        later = [c["forward_ms"] + c["backward_ms"] for c in r["calls"][1:]]
        if later:
            yield src.row(case, r["impl"], "later_forward_backward_time", statistics.median(later), "ms",
                          f"{len(later)} calls {_g(min(later))}-{_g(max(later))} ms")


def first_rerank(src: Source):
    """first_rerank.py: PyLate's first ``rank.rerank`` of each fresh process and its later calls."""
    for n, r in enumerate(src.data["rows"]):
        if "error" in r:
            continue
        case = f"PyLate rank.rerank 100 x 1000, {r['where']}, fresh process {n + 1}"
        yield src.row(case, r["impl"], "first_call_time", r["first_s"], "s", host="pylate 1.6.0")
        later = r["steady_s"]
        yield src.row(case, r["impl"], "later_call_time", statistics.median(later), "s",
                      f"{len(later)} calls {_g(min(later))}-{_g(max(later))} s", host="pylate 1.6.0")


def _rows0(d) -> dict:
    rows = d.get("rows") if isinstance(d, dict) else None
    return rows[0] if isinstance(rows, list) and rows and isinstance(rows[0], dict) else {}


# (test on the JSON, reader): the first match reads the file
READERS = (
    (lambda d: "roofline" in _rows0(d), kernels),
    (lambda d: "group" in _rows0(d) and "nbits" in _rows0(d), compressed),
    (lambda d: "iqr_ms" in _rows0(d), packed),
    (lambda d: "loop" in _rows0(d), real_loop),
    (lambda d: "calls" in _rows0(d) and "impl" in _rows0(d), first_call),
    (lambda d: "first_s" in _rows0(d) and "where" in _rows0(d), first_rerank),
    (lambda d: "n_docs" in _rows0(d), latency),
    (lambda d: "call" in _rows0(d), host_overhead),
    (lambda d: "loss" in _rows0(d) and "pylate" in d.get("meta", {}), pylate_e2e),
    (lambda d: "step_ms_median" in _rows0(d), colpali_e2e),
    (lambda d: "head" in _rows0(d), colpali_heads),
    (lambda d: "precisions" in d or ("candidates" in d and isinstance(d.get("rows"), dict)), retrieval_quality),
    (lambda d: "max_diff_other_bit_order" in _rows0(d), fast_plaid_parity),
    (lambda d: "st_ms" in _rows0(d), st_scoring),
    (lambda d: "models" in d, multi_gpu),
    (lambda d: "corpus" in _rows0(d), plaid_search),
    (lambda d: isinstance(d.get("rows"), dict) and all("fresh_ms" in r for r in d["rows"].values()), coldstart),
    (lambda d: "cases" in d or "heads" in d, parity),
    (lambda d: "candidates_per_query" in _rows0(d), rerank),
    (lambda d: isinstance(d.get("runs"), list) and all("summary" in r for r in d["runs"]), test_runs),
    (lambda d: isinstance(d.get("modes"), dict) and "correctness" in d, shipped_check),
)


def _context(folder: Path, inherited: dict) -> dict:
    """Date, device and versions a folder's files fall back on: the dated folder's name and
    run_gpu.sh's device.txt (nvidia-smi's CSV, then "torch X triton Y")."""
    context = dict(inherited)
    if DATE_DIR.fullmatch(folder.name):
        context["date"] = folder.name
    device_txt = folder / "device.txt"
    if device_txt.is_file():
        text = device_txt.read_text()
        found = re.search(r"torch (\S+) triton (\S+)", text)
        if found:
            context.update(torch=found.group(1), triton=found.group(2))
        gpus = [line for line in text.splitlines()[1:] if "," in line]   # under nvidia-smi's header
        if gpus:
            context["device"] = gpus[0].split(",")[0].strip()
    return context


def _documents(path: Path, data) -> list[tuple[str, object]]:
    """A JSON holding several runs under named keys (``{"coldstart": {...}, "real_loop_pylate":
    {...}}``) reads as one document per key, each named ``<file stem>/<key>``."""
    if isinstance(data, dict) and "meta" not in data and "rows" not in data and data and all(
            isinstance(v, dict) and "meta" in v for v in data.values()):
        return [(f"{path.stem}/{key}", v) for key, v in data.items()]
    return [(path.stem, data)]


def collect(folder: Path, inherited: dict | None = None, unknown: list | None = None) -> list[dict]:
    """Every number of the folder's result JSON files (dated sub-folders included) as rows."""
    context = _context(folder, inherited or {})
    rows = []
    for path in sorted(folder.glob("*.json")):
        for benchmark, data in _documents(path, json.loads(path.read_text())):
            reader = next((read for test, read in READERS if isinstance(data, dict) and test(data)), None)
            if reader is None:
                if unknown is not None:
                    unknown.append(_relative(path))
                continue
            src = Source(path, benchmark, data, context)
            rows.extend(row for row in reader(src) if row is not None)
    for sub in sorted(p for p in folder.iterdir() if p.is_dir()):
        rows.extend(collect(sub, context, unknown))
    return rows


def _removed_rows(csv_path: Path) -> list[dict]:
    """The rows of ``csv_path`` whose JSON has left the tree: the CSV keeps their numbers."""
    if not csv_path.is_file():
        return []
    with csv_path.open(newline="") as fh:
        return [row for row in csv.DictReader(fh) if not (ROOT / row["source_file"]).is_file()]


def main(argv: list[str]) -> int:
    if len(argv) > 1 or (argv and argv[0] in ("-h", "--help")):
        print(__doc__, file=sys.stderr)
        return 2
    results = Path(argv[0]) if argv else ROOT / "benchmarks" / "results"
    unknown: list[str] = []
    for folder in sorted(p for p in results.iterdir() if p.is_dir()):
        out = results / f"{folder.name}.csv"
        rows = _removed_rows(out) + collect(folder, unknown=unknown)
        if not rows:
            continue
        rows.sort(key=lambda r: (r["date"], r["benchmark"], r["source_file"]))
        with out.open("w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=COLUMNS, lineterminator="\n")
            writer.writeheader()
            writer.writerows(rows)
        print(f"{len(rows)} rows -> {_relative(out)}")
    for path in unknown:
        print(f"no reader for {path}: its numbers are not in the CSV", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
