"""The committed per-architecture config table: a fresh process on a known GPU launches
the table's config without a sweep; the nearest size class stands in for a missing one;
a key the table lacks gets one default config; LIK_AUTOTUNE=1 sweeps; an unknown GPU
sweeps (persisted by Triton)."""
from __future__ import annotations

import json
from importlib import resources

import pytest
import torch

from lik_plugins.kernels.triton import tuning


@pytest.fixture
def on_h100(monkeypatch):
    monkeypatch.setattr(tuning, "architecture", lambda: "sm90")
    monkeypatch.setattr(tuning, "interpreting", lambda: False)   # the GPU's decision path
    monkeypatch.setattr(tuning, "_chosen", {})
    monkeypatch.delenv("LIK_AUTOTUNE", raising=False)


def _table_rows():
    text = resources.files("lik_plugins.kernels.triton").joinpath("configs", "sm90.json").read_text()
    return json.loads(text)["entries"]


def _forward(**kw):
    args = dict(rows_per_q=32, qpb=8, d_pad=128, dtype=torch.bfloat16, n_programs=4096, save_arg=True)
    args.update(kw)
    return tuning.forward_kernel_and_meta(**args)


def test_the_committed_table_is_well_formed():
    rows = _table_rows()
    assert rows and {r["kernel"] for r in rows} == {"forward", "doc"}
    for r in rows:
        if r["kernel"] == "forward":
            assert set(r["config"]) == {"BLOCK_N", "num_warps", "num_stages"} and r["config"]["BLOCK_N"] in (32, 64, 128)
        else:
            assert set(r["config"]) == {"BLOCK_T", "BLOCK_R", "num_warps", "num_stages"}


def test_a_key_in_the_table_launches_its_config_without_a_sweep(on_h100):
    row = next(r for r in _table_rows() if r["kernel"] == "forward" and r["key"][3] and r["key"][7] == "bfloat16")
    rows, qpb, d_pad, save, running, dpp, size, _ = row["key"]
    n_programs = 4096 * 8 ** (size - 1) if size else 1024
    kernel, meta, after = _forward(rows_per_q=rows, qpb=qpb, d_pad=d_pad, save_arg=save, running_max=running,
                                   docs_per_program=dpp, n_programs=n_programs)
    assert kernel is tuning.maxsim_fwd_kernel and after is None          # not the autotuner
    assert {k: meta[k] for k in row["config"]} == row["config"]


def test_nearest_size_class_then_default(on_h100):
    rows = [r for r in _table_rows() if r["kernel"] == "forward"]
    # a size class the table lacks for a key it has in another class: that class's config
    base = next(r for r in rows if r["key"][7] == "bfloat16")
    present = {r["key"][6] for r in rows if r["key"][:6] == base["key"][:6] and r["key"][7] == "bfloat16"}
    missing = next(c for c in range(1, 8) if c not in present)
    want = min(((abs(c - missing), r["config"]) for r in rows for c in [r["key"][6]]
                if r["key"][:6] == base["key"][:6] and r["key"][7] == "bfloat16"), key=lambda t: t[0])[1]
    k = base["key"]
    _, meta, after = _forward(rows_per_q=k[0], qpb=k[1], d_pad=k[2], save_arg=k[3], running_max=k[4],
                              docs_per_program=k[5], n_programs=4096 * 8 ** (missing - 1))
    assert after is None and {x: meta[x] for x in want} == want
    # a key the table has in no class (fp16 here): the default config, no sweep
    _, meta, after = _forward(dtype=torch.float16, rows_per_q=64, qpb=4)
    assert after is None and meta["BLOCK_N"] == 64 and meta["num_warps"] == 8


def test_autotune_variable(on_h100, monkeypatch):
    monkeypatch.setenv("LIK_AUTOTUNE", "1")
    kernel, _, after = _forward()
    assert kernel is tuning._tuned_forward and after is not None      # sweeps
    monkeypatch.setattr(tuning, "_chosen", {})
    monkeypatch.setattr(tuning, "architecture", lambda: "sm70")      # no table for this GPU
    monkeypatch.setenv("LIK_AUTOTUNE", "auto")
    assert _forward()[2] is not None                                  # swept once, persisted by Triton
    monkeypatch.setenv("LIK_AUTOTUNE", "0")
    assert _forward()[2] is None                                      # never: the default config
    monkeypatch.setenv("LIK_AUTOTUNE", "sometimes")
    with pytest.raises(ValueError, match="LIK_AUTOTUNE"):
        _forward(rows_per_q=16)


def test_packed_launches_have_their_own_rows(on_h100, monkeypatch):
    # a packed launch (maxsim_varlen, score_pairs_packed) asks the table with its own key, so
    # the pair lists' short documents do not take the padded rerank's tiles of the same shape
    from lik_plugins.kernels.triton import varlen_launch

    asked = []
    real = varlen_launch.forward_kernel_and_meta

    def record(**kwargs):
        asked.append(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(varlen_launch, "forward_kernel_and_meta", record)
    Q = torch.randn(32, 128).bfloat16()
    D = torch.randn(300, 128).bfloat16()
    cu_q = torch.tensor([0, 32], dtype=torch.int32)
    cu_d = torch.tensor([0, 100, 300], dtype=torch.int32)
    pairs = (torch.tensor([0, 0], dtype=torch.int32), torch.tensor([1, 0], dtype=torch.int32))
    with torch.no_grad():
        varlen_launch.varlen_forward(Q, D, cu_q, cu_d, pairs, None, None, max_q=32, max_d=200, normalize=False,
                                     zero_mode=False, save_argmax=False)
    packed_key = asked[-1]["dtype"]
    rows = [r for r in _table_rows() if r["kernel"] == "forward" and r["key"][:6] == [32, 1, 128, False, False, 1]
            and r["key"][6] == 2]
    packed_row = next(r for r in rows if r["key"][7] == ["bfloat16", "bfloat16", 0, "packed"])
    dense_row = next(r for r in rows if r["key"][7] == "bfloat16")
    monkeypatch.setattr(tuning, "_chosen", {})
    _, meta, after = _forward(rows_per_q=32, qpb=1, save_arg=False, dtype=packed_key, n_programs=48_000)
    assert after is None and {k: meta[k] for k in packed_row["config"]} == packed_row["config"]
    _, meta, _ = _forward(rows_per_q=32, qpb=1, save_arg=False, dtype=torch.bfloat16, n_programs=48_000)
    assert {k: meta[k] for k in dense_row["config"]} == dense_row["config"] != packed_row["config"]


def test_an_a100_takes_the_h100_table_with_the_stages_its_shared_memory_holds(monkeypatch):
    """sm_80 has no table of its own: sm_90's picks, with pipeline stages taken off where the
    estimate (with the no-sweep margin) exceeds its 163 KiB; no sweep (the launches are the
    ones ``precompile --ship --arch sm_80`` builds)."""
    monkeypatch.setattr(tuning, "architecture", lambda: "sm80")
    monkeypatch.setattr(tuning, "interpreting", lambda: False)
    monkeypatch.setattr(tuning, "_chosen", {})
    monkeypatch.setattr(tuning, "_smem_budget", lambda: 166912)
    monkeypatch.delenv("LIK_AUTOTUNE", raising=False)
    # table row [32, 8, 128, True, False, 1, 1, bf16] -> BLOCK_N 64, 8 warps, 3 stages on sm_90.
    # A 256-row block: 256*128*2 (queries) + s*64*128*2 (tiles) + 256*64*4 (scratch) bytes;
    # 1.4 x that exceeds 166912 - 8192 for every s >= 1, so it keeps the least: 1 stage
    kernel, meta, after = _forward(rows_per_q=32, qpb=8, n_programs=4096)
    assert kernel is tuning.maxsim_fwd_kernel and after is None
    assert (meta["BLOCK_N"], meta["num_warps"], meta["num_stages"]) == (64, 8, 1)
    # row [32, 1, 128, True, False, 1, 1, bf16] -> BLOCK_N 128, 4 warps, 2 stages: a 32-row block,
    # 1.4 x (8192 + 2*32768 + 16384) = 126 KiB fits: unchanged
    kernel, meta, after = _forward(rows_per_q=32, qpb=1, n_programs=4096)
    assert (meta["BLOCK_N"], meta["num_warps"], meta["num_stages"]) == (128, 4, 2)
    # the H100 keeps its own table's stages
    monkeypatch.setattr(tuning, "architecture", lambda: "sm90")
    monkeypatch.setattr(tuning, "_chosen", {})
    monkeypatch.setattr(tuning, "_smem_budget", lambda: 232448)
    assert _forward(rows_per_q=32, qpb=8, n_programs=4096)[1]["num_stages"] == 3
