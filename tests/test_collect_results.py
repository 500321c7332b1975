"""benchmarks/collect_results.py on a made-up results folder: one long-format CSV per device
folder, readers chosen by the JSON's layout, unknown layouts reported (not guessed), and the
rows of result files that have left the tree kept on a re-run."""
from __future__ import annotations

import csv
import json

from support import repo_scripts

collect_results = repo_scripts.load("benchmarks/collect_results.py")


def _kernels_json(times):
    rows = [{"shape": {"name": "search 64x4096"}, "impl": "lik_plugins", "run": i, "ms": t, "peak_mb": 1.5,
             "rel_err": 3e-7, "roofline": 0.7} for i, t in enumerate(times)]
    rows.append({"shape": {"name": "search 64x4096"}, "impl": "flash-maxsim", "run": 0, "error": "skipped"})
    return {"meta": {"device": "GPU X", "torch": "2.0", "triton": "3.0", "date": "2026-01-02 10:00",
                     "command": "python benchmarks/bench_kernels.py OUT", "flash_maxsim": "0.3.0"}, "rows": rows}


def _read(path: Path) -> list[dict]:
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


def test_one_csv_per_device_with_spread_command_and_source(tmp_path, capsys):
    day = tmp_path / "gpux" / "2026-01-02"
    day.mkdir(parents=True)
    (day / "kernels.json").write_text(json.dumps(_kernels_json([1.25, 1.0, 1.5])))
    (day / "packed.json").write_text(json.dumps({"meta": {"device": "GPU X", "command": "bench_packed"}, "rows": [
        {"case": "pair list 10000", "impl": "lik_plugins", "ms": 0.167, "iqr_ms": 0.002, "peak_mib": 0.0}]}))
    (day / "odd.json").write_text(json.dumps({"something": [1, 2, 3]}))

    assert collect_results.main([str(tmp_path)]) == 0
    rows = _read(tmp_path / "gpux.csv")
    assert list(rows[0]) == list(collect_results.COLUMNS)
    time = [r for r in rows if r["benchmark"] == "kernels" and r["metric"] == "time"]
    assert len(time) == 1   # the best of three runs, as the kernel table takes it; the failed peer has no row
    assert time[0]["value"] == "1.0" and time[0]["spread"] == "3 runs 1-1.5 ms"
    assert time[0]["date"] == "2026-01-02" and time[0]["device"] == "GPU X"
    assert time[0]["command"] == "python benchmarks/bench_kernels.py OUT"
    assert time[0]["source_file"].endswith("gpux/2026-01-02/kernels.json")
    packed = [r for r in rows if r["benchmark"] == "packed" and r["metric"] == "time"]
    assert packed[0]["spread"] == "IQR 0.002 ms" and packed[0]["date"] == "2026-01-02"
    assert not [r for r in rows if r["benchmark"] == "odd"]
    assert "no reader for" in capsys.readouterr().err


def test_rows_of_removed_files_survive_a_rerun(tmp_path):
    day = tmp_path / "gpux" / "2026-01-02"
    day.mkdir(parents=True)
    kept = day / "kernels.json"
    kept.write_text(json.dumps(_kernels_json([2.0])))
    gone = day / "kernels_before.json"
    gone.write_text(json.dumps(_kernels_json([3.0])))
    assert collect_results.main([str(tmp_path)]) == 0
    first = _read(tmp_path / "gpux.csv")

    gone.unlink()
    kept.write_text(json.dumps(_kernels_json([1.0])))   # a re-measured run replaces its rows
    assert collect_results.main([str(tmp_path)]) == 0
    second = _read(tmp_path / "gpux.csv")
    assert len(second) == len(first)
    times = {r["benchmark"]: r["value"] for r in second if r["metric"] == "time"}
    assert times == {"kernels": "1.0", "kernels_before": "3.0"}


def test_the_shipped_binaries_check_is_read_per_mode(tmp_path):
    day = tmp_path / "gpux" / "2026-01-03"
    day.mkdir(parents=True)
    mode = {"device": "GPU X", "torch": "2.0", "triton": "3.0", "first_pass_s": 3.0, "jit_launches_first_pass": 0}
    (day / "shipped_binaries_check.json").write_text(json.dumps({
        "modes": {"shipped": mode, "jit-cold": {**mode, "first_pass_s": 44.0, "jit_launches_first_pass": 32},
                  "jit-warm": {"error": "crashed"}},
        "correctness": {"a/bf16": {"bitwise_jit-warm": True}, "b/fp32": {"bitwise_jit-warm": False}}}))

    assert collect_results.main([str(tmp_path)]) == 0
    rows = {(r["implementation"], r["metric"]): r for r in _read(tmp_path / "gpux.csv")}
    assert rows["shipped", "first_pass_s"]["value"] == "3.0" and rows["shipped", "first_pass_s"]["device"] == "GPU X"
    assert rows["jit-cold", "jit_launches_first_pass"]["value"] == "32"
    assert not [k for k in rows if k[0] == "jit-warm"]          # an errored mode measured nothing
    assert rows["shipped", "cases_bitwise_equal_to_jit"]["value"] == "1"
    assert rows["shipped", "cases_bitwise_equal_to_jit"]["spread"] == "of 2"


def test_the_first_call_is_read_per_process_without_the_profiled_ones(tmp_path):
    day = tmp_path / "gpux" / "2026-01-04"
    day.mkdir(parents=True)
    calls = [{"forward_ms": 70.0, "backward_ms": 8.0}, {"forward_ms": 2.2, "backward_ms": 2.5},
             {"forward_ms": 2.0, "backward_ms": 2.4}]
    (day / "first_call.json").write_text(json.dumps({"meta": {"device": "GPU X", "command": "first_call"}, "rows": [
        {"impl": "lik_plugins", "calls": calls, "profiled": False},
        {"impl": "torch", "calls": calls[:1], "profiled": False},
        {"impl": "torch", "error": "crashed"},
        {"impl": "lik_plugins", "calls": calls, "profiled": True}]}))

    assert collect_results.main([str(tmp_path)]) == 0
    rows = [r for r in _read(tmp_path / "gpux.csv") if r["benchmark"] == "first_call"]
    first = {(r["implementation"], r["metric"]): r for r in rows if "process 1" in r["case"]}
    assert first["lik_plugins", "first_forward_time"]["value"] == "70.0"
    assert first["lik_plugins", "later_forward_backward_time"]["value"] == "4.55"
    assert first["lik_plugins", "later_forward_backward_time"]["spread"] == "2 calls 4.4-4.7 ms"
    assert {r["implementation"] for r in rows if r["metric"] == "later_forward_backward_time"} == {"lik_plugins"}
    assert len([r for r in rows if r["metric"] == "first_forward_time"]) == 2   # neither the errored nor the profiled
