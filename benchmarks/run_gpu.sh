#!/usr/bin/env bash
# The one GPU script: GPU test suite + memcheck + side-by-side benchmark, in one call.
# Run on the device machine from the repo root:
#   bash benchmarks/run_gpu.sh [tests|memcheck|bench|kernels|tune|compressed|host|rerank|realloop|firstcall|firstrerank|st63|fastplaid17|coldstart|shipped|coldtable|multigpu|fidelity|plaid|parity|e2e|hosts|all] [options]
# tune [--formats] = sweep this GPU's config table (writes $OUT/<arch>.json: commit it to
#   src/lik_plugins/kernels/triton/configs/); realloop = benchmarks/real_loop.py (options passed on);
#   firstcall = benchmarks/first_call.py: PyLate's first scoring call in fresh processes, ours against its torch path;
#   firstrerank = benchmarks/first_rerank.py: PyLate's first rank.rerank 100 x 1000 of a fresh process, ours against its backends;
#   st63 = benchmarks/bench_st63.py (sentence-transformers 6.3 and its deps from .whl-st63/, late-interaction-kernels from .whl/);
#   fastplaid17 = benchmarks/bench_fastplaid17.py (fast-plaid 1.7.0 and usearch from .whl-fp/, fastkmeans from .whl/);
#   coldstart = benchmarks/coldstart.py and PyLate's real loop cold / precompiled / torch, one call;
#   shipped = the shipped binaries against the JIT, then coldstart.py and the cold loops (default settings);
#   coldtable = coldstart.py --table: every side-by-side row in a fresh process, do_bench first against again;
#   multigpu = benchmarks/multi_gpu.py over every GPU of the machine (NCCL, multicast off; options passed on).
# kernels = tests (GPU suite) + memcheck + bench (side-by-side); hosts = parity + e2e;
# compressed = benchmarks/bench_compressed.py (PLAID residuals, int8, the projection head; ~2.5 min cold);
# host = benchmarks/host_overhead.py (host against GPU time of a rerank call; --profile adds cProfile's view).
# tests = the CUDA cases of the test tree (`pytest -m gpu tests`, marker gpu in each family file).
# A cold machine compiles every specialisation: the suite took ~9 minutes in one process, so
# `tests` runs it as GPU_TEST_SHARDS (default 3) parallel pytest shards; with a 10-minute
# limit per device call run `tests` and `memcheck` + `bench` in separate calls.
# fidelity = fp8 ranking fidelity on embeddings saved by
#   python recipes/fp8_fidelity.py --save-embeddings benchmarks/data/fidelity_embeddings.pt
# (encoded on any machine; copy benchmarks/data along); plaid = recipes/plaid_rerank.py on them.
# Peers and host libraries come from wheels in .whl/ when present (for machines without network).
# Results (JSON + Markdown + logs) go to $OUT (default: benchmarks/results/latest).
set -uo pipefail
stage=${1:-all}; shift || true
OUT=${OUT:-benchmarks/results/latest}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/late_interaction_kernels-*.whl >/dev/null 2>&1; then
  # byte-compiled at install, as pip does by default: otherwise the first process to import a
  # module (often a cold-start cell's first step, through lazy imports) compiles it for the rest
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/peers \
    .whl/late_interaction_kernels-*.whl .whl/flash_maxsim-*.whl || exit 1
  python3 -m compileall -q -j 0 /tmp/peers > /dev/null
  export PYTHONPATH=/tmp/peers:$PWD/src:$PWD
else
  export PYTHONPATH=$PWD/src:$PWD
fi
python3 -m compileall -q -j 0 src/lik_plugins benchmarks > /dev/null   # as an installed package is
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"

# hosts: PyLate 1.6.0 / colpali-engine 0.3.18 with the transformers / sentence-transformers they pin
host_env() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/hosts .whl/*.whl || exit 1
  python3 -m compileall -q -j 0 /tmp/hosts > /dev/null
  export PYTHONPATH=/tmp/hosts:$PWD/src:$PWD HF_HUB_OFFLINE=1
}

if [[ $stage == tests || $stage == kernels || $stage == all ]]; then
  # shards in parallel: compilation (CPU) is most of a cold suite, and the shards share
  # Triton's on-disk cache; one log per shard, their summary lines at the end
  shards=${GPU_TEST_SHARDS:-3}
  for ((i = 0; i < shards; i++)); do
    # a module that fails to import here (a CPU test's dependency) must not stop the CUDA cases
    timeout 560 python3 -m pytest -q -m gpu tests -p no:cacheprovider --continue-on-collection-errors --shard "$i/$shards" \
      > "$OUT/gpu_tests_shard$i.log" 2>&1 &
  done
  wait
  for ((i = 0; i < shards; i++)); do echo "shard $i/$shards: $(tail -1 "$OUT/gpu_tests_shard$i.log")"; done \
    | tee "$OUT/gpu_tests.log"
fi
if [[ $stage == memcheck || $stage == kernels || $stage == all ]]; then
  timeout 300 compute-sanitizer --tool memcheck --print-limit 20 python3 benchmarks/sanitize_calls.py > "$OUT/memcheck.log" 2>&1
  tail -3 "$OUT/memcheck.log"
fi
if [[ $stage == bench || $stage == kernels || $stage == all ]]; then
  python3 benchmarks/bench_kernels.py "$OUT" "$@" 2>&1 | tee "$OUT/bench.log" | grep -v '^\[bench\]' | tail -30
fi

if [[ $stage == tune ]]; then
  arch=$(python3 -c "import torch; m, n = torch.cuda.get_device_capability(); print(f'sm{m}{n}')")
  LIK_AUTOTUNE=1 timeout 560 python3 benchmarks/tune_table.py "$OUT/$arch.json" "$@" 2>&1 | tail -25
fi
if [[ $stage == compressed || $stage == all ]]; then
  timeout 300 python3 benchmarks/bench_compressed.py "$OUT/compressed" --reps 20 "$@" > "$OUT/compressed.log" 2>&1
  grep '^|' "$OUT/compressed.log" | grep -v decompress
fi
if [[ $stage == rerank ]]; then
  # the hosts' reranking entry points, ours against their own backends (benchmarks/bench_rerank.py);
  # sentence-transformers 6 (not PyLate's pinned 5.x) from .whl/st6 for its stage.
  # RERANK_HOSTS (default pylate,colpali,st) picks hosts, RERANK_TESTS=0 skips the listed kernel's
  # GPU tests, RERANK_TIMEOUT (s, default 420) bounds the PyLate + colpali run: with --rounds 2 run
  # one host per device call (RERANK_HOSTS=pylate, then colpali,st).
  host_env
  hosts=${RERANK_HOSTS:-pylate,colpali,st}
  if [[ ${RERANK_TESTS:-1} == 1 ]]; then
    timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_listed.py tests/kernels/test_listed_parity.py \
      2>&1 | tail -3 | tee "$OUT/listed_tests.log"
  fi
  main=$(echo "$hosts" | tr ',' '\n' | grep -E '^(pylate|colpali)$' | paste -sd, -)
  if [[ -n $main ]]; then
    timeout "${RERANK_TIMEOUT:-420}" python3 benchmarks/bench_rerank.py "$OUT/rerank" --only "$main" "$@" 2>&1 | grep -E '^(\||\[bench\])'
  fi
  if [[ ,$hosts, == *,st,* ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/st6 .whl/st6/*.whl || exit 1
    PYTHONPATH=/tmp/st6:$PYTHONPATH timeout 150 python3 benchmarks/bench_rerank.py "$OUT/rerank_st" --only st "$@" 2>&1 | grep '^|'
  fi
fi
if [[ $stage == host ]]; then
  timeout 200 python3 benchmarks/host_overhead.py "$OUT" "$@" 2>&1 | tail -12
fi
if [[ $stage == realloop ]]; then
  host_env
  python3 benchmarks/real_loop.py "$OUT" "$@" 2>&1 | tail -60
fi
if [[ $stage == firstcall ]]; then
  host_env
  timeout 300 python3 benchmarks/first_call.py "$OUT" "$@" 2>&1 | grep -v '^{'
fi
if [[ $stage == firstrerank ]]; then
  host_env
  timeout 560 python3 benchmarks/first_rerank.py "$OUT" "$@"
fi
if [[ $stage == st63 ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/st63 .whl-st63/*.whl \
    .whl/late_interaction_kernels-*.whl || exit 1
  PYTHONPATH=/tmp/st63:$PWD/src:$PWD HF_HUB_OFFLINE=1 timeout 400 python3 benchmarks/bench_st63.py "$OUT" "$@"
fi
if [[ $stage == fastplaid17 ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/fp .whl-fp/*.whl \
    .whl/fastkmeans-*.whl || exit 1
  PYTHONPATH=/tmp/fp:$PWD/src:$PWD timeout 540 python3 benchmarks/bench_fastplaid17.py --out "$OUT" --index-dir /tmp/fpindex "$@"
fi
if [[ $stage == coldstart ]]; then
  # fresh processes on empty caches: routing, do_bench first against again, lowmem bitwise, precompile ->
  # zero compiles; then PyLate's loop cold, on a precompiled cache, and on PyLate's torch path
  host_env
  timeout 200 python3 benchmarks/coldstart.py "$OUT" 2>&1 | tail -8
  timeout 260 python3 benchmarks/real_loop.py "$OUT" --loops pylate --impls lik_plugins,torch --steps 12 \
    --precompiled --timeout 100 "$@" 2>&1 | grep -v '^{'
fi
if [[ $stage == shipped ]]; then
  # the shipped binaries against Triton's JIT in fresh processes on empty caches (results, first pass,
  # launch cost); then the cold-process checks and the cold loops with the shipped binaries on,
  # PyLate's torch path beside them in the same run
  host_env
  timeout 200 python3 benchmarks/shipped_binaries_check.py "$OUT/shipped" 2>&1 | tail -6
  timeout 200 python3 benchmarks/coldstart.py "$OUT/coldstart" 2>&1 | tail -8
  timeout 280 python3 benchmarks/real_loop.py "$OUT/loops" --loops pylate,vary-colbert \
    --impls lik_plugins,torch --steps 12 --timeout 100 "$@" 2>&1 | grep -v '^{'
fi
if [[ $stage == coldtable ]]; then
  # every side-by-side row from a fresh process on an empty cache: do_bench first against again
  timeout 400 python3 benchmarks/coldstart.py "$OUT/coldstart" --table "$@" 2>&1 | tail -20
fi
if [[ $stage == multigpu ]]; then
  # NVLink multicast stays off in every process (NCCL, PyTorch symmetric memory, NVSHMEM)
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  host_env
  nvidia-smi topo -m | tee "$OUT/topology.txt"
  timeout 570 python3 benchmarks/multi_gpu.py "$OUT/multi_gpu" "$@" 2>&1 | grep -v Warning | grep -v 'all_gather(' | tail -40
fi

if [[ $stage == fidelity || $stage == all ]]; then
  if [[ -f benchmarks/data/fidelity_embeddings.pt ]]; then
    timeout 120 python3 recipes/fp8_fidelity.py --embeddings benchmarks/data/fidelity_embeddings.pt \
      --device cuda --out "$OUT" 2>&1 | tail -8
  else
    echo "fidelity: benchmarks/data/fidelity_embeddings.pt not carried; skipped"
  fi
fi
if [[ $stage == plaid || $stage == all ]]; then
  # the PLAID rerank recipe on the same embeddings (its centroids come from fastkmeans' wheel)
  if [[ -f benchmarks/data/fidelity_embeddings.pt ]]; then
    python3 -m pip install -q --no-index --no-deps --no-cache-dir --target /tmp/kmeans .whl/fastkmeans-*.whl || exit 1
    PYTHONPATH=$PYTHONPATH:/tmp/kmeans timeout 300 python3 recipes/plaid_rerank.py \
      --embeddings benchmarks/data/fidelity_embeddings.pt --device cuda --out "$OUT" 2>&1 | tail -8
  else
    echo "plaid: benchmarks/data/fidelity_embeddings.pt not carried; skipped"
  fi
  # PyLate's PLAID index searched by fast-plaid, then patched (recipes/plaid_search.py): PyLate,
  # fast-plaid and their dependencies from .whl/; synthetic 100k, offline, long (sized to make
  # fast-plaid's fixed batch run out of this GPU's memory)
  host_env
  offline=()
  [[ -f benchmarks/data/plaid_offline_fp16.pt ]] && offline=(--offline-embeddings benchmarks/data/plaid_offline_fp16.pt)
  timeout 590 python3 recipes/plaid_search.py --device cuda --out "$OUT" --docs 100000 --queries 1000 --single 60 \
    "${offline[@]}" --long-docs auto 2>&1 | tail -45
fi

if [[ $stage == parity || $stage == hosts || $stage == all ]]; then
  host_env
  # the parity scripts import the shared test helpers (tests/support) as the package support
  PYTHONPATH=$PYTHONPATH:$PWD/tests timeout 150 python3 tests/hosts/pylate/gpu_parity.py "$OUT/pylate_gpu_parity.json" 2>&1 | tail -12
  PYTHONPATH=$PYTHONPATH:$PWD/tests timeout 150 python3 tests/hosts/colpali/gpu_parity.py "$OUT/colpali_gpu_parity.json" 2>&1 | tail -12
  timeout 170 python3 benchmarks/colpali_heads.py "$OUT" 2>&1 | tail -20
fi
if [[ $stage == e2e || $stage == hosts || $stage == all ]]; then
  host_env
  timeout 170 python3 benchmarks/pylate_e2e.py "$OUT" --budget-s 120 2>&1 | tail -20
  timeout 170 python3 benchmarks/colpali_e2e.py "$OUT" --budget-s 120 2>&1 | tail -20
fi
