#!/usr/bin/env bash
# Wheels the GPU machine lacks, into .whl/ (git-ignored), for run_gpu.sh to install there.
# Run here (a machine with PyPI), then carry .whl to the GPU machine.  Its image already holds
# torch, triton and most of the hosts' dependencies (and tokenizers 0.23.2, newer than
# transformers 5.3.0 accepts: hence tokenizers 0.22.2 here).  Python 3.12, x86-64, no deps.
#   bash benchmarks/fetch_wheels.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p .whl
WHEELS=(
  late_interaction_kernels==0.4.5   # peer
  flash_maxsim==0.3.0               # peer
  pylate==1.6.0                     # host
  colpali-engine==0.3.18            # host
  sentence-transformers==5.3.0      # PyLate 1.6.0's pin
  transformers==5.3.0
  tokenizers==0.22.2                # transformers 5.3.0 wants >=0.22.0,<=0.23.0
  ujson==5.12.0
  fastkmeans==0.5.0
  datasets==5.2.0                   # PyLate's training imports it; the image has pyarrow, fsspec, xxhash
  dill==0.4.1
  multiprocess==0.70.19
)
for spec in "${WHEELS[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d .whl "$spec"
done
ls .whl
