"""``python -m lik_plugins.precompile``: the variant list the hosts' calls reach, an offline
compile for an H100 (sm_90) on a machine without a GPU, and no trace of the removed
serving-while-compiling machinery.  That the runtime JIT finds what precompile built (zero
compiles in a fresh process on the filled cache) needs a GPU: ``benchmarks/coldstart.py``."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _precompile(*args, cache_dir=None, timeout=600):
    # the real compiler, not the interpreter the CPU suite runs under
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if cache_dir is not None:
        env["TRITON_CACHE_DIR"] = str(cache_dir)
    return subprocess.run([sys.executable, "-m", "lik_plugins.precompile", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def _listed(*args) -> list[str]:
    done = _precompile("--list", "--arch", "sm_90", *args)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    count = int(re.fullmatch(r"(\d+) variants for sm_90", lines[-1]).group(1))
    assert count == len(lines) - 1
    return lines[:-1]


def test_list_names_each_hosts_kernels_and_options():
    pylate = _listed("--hosts", "pylate")
    names = {line.split()[0] for line in pylate}
    # the training forward, the lowmem grad_D kernel and the launcher's self-check
    assert {"maxsim_fwd_kernel", "maxsim_bwd_doc_kernel", "self_check_kernel"} <= names
    forwards = [line for line in pylate if line.startswith("maxsim_fwd_kernel")]
    # PyLate's multiplicative mask on its document mask, never a query mask
    assert all("ZERO_MODE=True" in line and "HAS_DM=True" in line and "HAS_QM=False" in line for line in forwards)
    assert any("SAVE_ARG=True" in line for line in forwards) and any("SAVE_ARG=False" in line for line in forwards)
    # sentence-transformers masks both sides and excludes masked tokens
    st = [line for line in _listed("--hosts", "sentence_transformers") if line.startswith("maxsim_fwd_kernel")]
    assert st and all("HAS_QM=True" in line and "ZERO_MODE=False" in line for line in st)
    # colpali's smooth-max losses reach the smooth-max kernels
    assert any(line.startswith("_smooth_fwd_kernel") for line in _listed("--hosts", "colpali"))


def test_list_follows_dtype_and_dim():
    fp16 = [line for line in _listed("--hosts", "ops", "--dtypes", "fp16", "--dims", "96")
            if line.startswith("maxsim_fwd_kernel")]
    assert fp16 and all("[float16," in line and "D_PAD=128" in line for line in fp16)
    d64 = [line for line in _listed("--hosts", "ops", "--dims", "64") if line.startswith("maxsim_fwd_kernel")]
    assert d64 and all("D_PAD=64" in line for line in d64)


def test_an_architecture_without_a_config_table_is_refused():
    done = _precompile("--list", "--arch", "sm_86")     # sm_80 takes sm_90's table (tuning.STAND_IN_TABLES)
    assert done.returncode != 0 and "no committed config table" in done.stderr


def test_offline_sm90_compile_writes_cubins(tmp_path):
    """Two variants (the self-check and one forward) built for sm_90 without a GPU, through
    the JIT's own warm-up under an offline driver: Triton's cache holds their cubins."""
    code = ("import torch; from lik_plugins import precompile as p; "
            "todo = p.variants(['pylate'], [torch.bfloat16], [128], 'sm_90'); "
            "first = {}; [first.setdefault(p.describe(*v).split()[0], v) for v in todo]; "
            "pick = [first['self_check_kernel'], first['maxsim_fwd_kernel']]; "
            "p.compile_all(pick, 'sm_90'); print(len(pick))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0 and "ptxas" in done.stderr.lower():
        pytest.skip(f"no usable ptxas for sm_90 here: {done.stderr.strip().splitlines()[-1]}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "2"
    cubins = sorted(p.name for p in tmp_path.rglob("*.cubin"))
    assert cubins == ["maxsim_fwd_kernel.cubin", "self_check_kernel.cubin"]


REMOVED = ("LIK_SERVE_WHILE_COMPILING", "LIK_COMPILE_AHEAD", "compile_worker", "launcher_check", "NotReady",
           "defer_compiles", "kernels.expected", "triton import ahead", "ahead.warm_up", "lik_plugins.warm_up")


def test_no_code_path_references_the_removed_machinery():
    sources = [*ROOT.joinpath("src").rglob("*.py"), *ROOT.joinpath("tests").rglob("*.py"),
               *ROOT.joinpath("benchmarks").glob("*.py"), *ROOT.joinpath("benchmarks").glob("*.sh"),
               *ROOT.joinpath("recipes").glob("*.py"), *ROOT.joinpath("ci").rglob("*.py"), ROOT / "README.md",
               ROOT / "docs" / "internals.md"]
    here = Path(__file__).resolve()
    hits = [f"{path.relative_to(ROOT)}: {name}" for path in sources if path.resolve() != here
            for name in REMOVED if name in path.read_text(encoding="utf-8")]
    assert hits == []
    for gone in ("kernels/triton/ahead.py", "kernels/triton/compile_worker.py", "kernels/expected.py",
                 "kernels/triton/launcher_check.py"):
        assert not ROOT.joinpath("src", "lik_plugins", gone).exists()


_BENCHMARK_CALLS = '''
import sys, torch, torch.nn.functional as F
import lik_plugins as lik
from lik_plugins import precompile as p
from lik_plugins.kernels.triton import variants as V

arch = sys.argv[1]
def t(dtype, *shape, grad=True):
    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=grad)
def m(*shape):
    return torch.ones(shape, dtype=torch.bool, device="meta")
def loss(s):
    F.cross_entropy(s / 0.05, torch.zeros(s.shape[0], dtype=torch.long, device="meta")).backward()

with p._planning_for(arch) as launches:
    # shipped_binaries_check: the CUDA cases of test_shipped_binaries, bf16 and fp32, and its launch-bound call
    for dt in (torch.bfloat16, torch.float32):
        for qs, ds, qmask, kw in (((32, 32), (64, 180), False, dict(mask_mode="zero")),
                                  ((16, 32), (16, 32, 180), False, dict(mask_mode="zero")),
                                  ((16, 32), (16, 128), True, {}), ((32, 16), (32, 300), False, {})):
            out = lik.maxsim(t(dt, *qs, 128), t(dt, *ds, 128), m(*qs) if qmask else None, m(*ds), **kw)
            out.backward(torch.empty_like(out))
        for ds in ((8, 1030), (8, 2, 1030)):
            out = lik.maxsim(t(dt, 8, 16, 128), t(dt, *ds, 128))
            out.backward(torch.empty_like(out))
        for layout in ("cross", "pairs"):
            out = lik.smooth_maxsim(t(dt, 8, 16, 128), t(dt, 8, 1030, 128), tau=0.1, layout=layout)
            out.backward(torch.empty_like(out))
    with torch.no_grad():
        lik.maxsim(t(torch.bfloat16, 2, 8, 128, grad=False), t(torch.bfloat16, 4, 16, 128, grad=False))
    # coldstart.py: ColBERT in-batch 256 x (32, 180), both backward choices
    for backward in ("auto", "lowmem"):
        loss(lik.maxsim(t(torch.bfloat16, 256, 32, 128), t(torch.bfloat16, 256, 180, 128), None, m(256, 180),
                        backward=backward))
    # real_loop.py: fixed (64, 32, 300), vary-colbert (Lq 8-32, Ld 60-300), vary-colpali (32, Lq 8-32, 1030)
    for lq in (8, 9, 17, 31, 32):
        for ld in (60, 61, 127, 128, 129, 180, 255, 256, 257, 299, 300):
            loss(lik.maxsim(t(torch.bfloat16, 64, lq, 128), t(torch.bfloat16, 64, ld, 128), None, m(64, ld)))
        loss(lik.maxsim(t(torch.bfloat16, 32, lq, 128), t(torch.bfloat16, 32, 1030, 128), None, m(32, 1030)))
    # its PyLate loop: Contrastive, batch 128 with one hard negative, (32, 300), fp32 under autocast
    for dt in (torch.float32, torch.bfloat16):
        loss(lik.maxsim(t(dt, 128, 32, 128), t(dt, 256, 300, 128), None, m(256, 300), mask_mode="zero"))
reached = {V.group(V.variant(*launch))[0] for launch in launches}
grid = {V.group(V.variant(*v))[0] for v in p.variants(list(p.HOSTS), [torch.bfloat16, torch.float32], [128], arch)}
print(len(reached), len(reached - grid))
for missing in sorted(reached - grid):
    print(missing)
'''


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_the_gpu_checks_calls_are_in_the_shipped_grid(arch, tmp_path):
    """Every launch of the GPU checks (benchmarks/shipped_binaries_check.py, coldstart.py,
    real_loop.py) has its group -- kernel, constexprs, dtypes -- in the grid ``--ship`` builds:
    a shipped binary serves it, with no JIT compile."""
    script = tmp_path / "calls.py"
    script.write_text(_BENCHMARK_CALLS)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(script), arch], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    reached, missing = map(int, done.stdout.split("\n")[0].split())
    assert reached >= 20 and missing == 0, done.stdout[-3000:]


def test_planning_for_one_architecture_leaves_nothing_to_the_next():
    """Configs and launch plans chosen for sm_80 (fewer stages) are not reused when the same
    process then lists sm_90: it gets what a fresh process lists."""
    code = ("import torch, json; from lik_plugins import precompile as p; "
            "from lik_plugins.kernels.triton import variants as v; "
            "keys = lambda arch: sorted(repr(v.variant(*t)) for t in p.variants(['pylate'], [torch.bfloat16], [128], arch)); "
            "{} print(json.dumps(keys('sm_90')))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    after_sm80, alone = (subprocess.run([sys.executable, "-c", code.format(first)], env=env, capture_output=True,
                                        text=True, timeout=600) for first in ("keys('sm_80');", ""))
    assert after_sm80.returncode == 0 and alone.returncode == 0, after_sm80.stderr[-2000:] + alone.stderr[-2000:]
    assert after_sm80.stdout == alone.stdout and len(json.loads(alone.stdout)) > 10
