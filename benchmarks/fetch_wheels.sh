#!/usr/bin/env bash
# Wheels the GPU machine lacks, for run_gpu.sh to install there.  Run here (a machine with PyPI),
# then carry the folders to the GPU machine.  Its image already holds torch 2.11, triton 3.6 and
# most of the hosts' dependencies (and tokenizers 0.23.2, newer than transformers 5.3.0 accepts:
# hence tokenizers 0.22.2 here).  Python 3.12, x86-64, no deps.  Three folders, because a device
# call carries at most 64 MiB with the tree (about 34 MiB):
#   .whl/       the PyLate host stack and the peers (stages rerank, firstrerank, firstcall, ...)
#   .whl-st63/  sentence-transformers 6.3 and what it needs beyond the image (stage st63)
#   .whl-fp/    fast-plaid 1.7.0 and usearch (stage fastplaid17; fastkmeans comes from .whl/)
#   bash benchmarks/fetch_wheels.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
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
ST63=(   # what ci/st6-requirements-6.3.txt resolves to here, less hf-xet (offline: never used)
  sentence-transformers==6.3.0 transformers==5.25.0 kernels==0.19.1 huggingface_hub==2.5.0 tokenizers==0.23.3
  httpx2==2.17.0 httpcore2==2.17.0 h11==0.16.0 anyio==4.16.0 safetensors==0.8.0 typer==0.29.3 shellingham==1.5.4
  tomlkit==0.15.3 truststore==0.10.5 annotated-doc==0.0.7 click==8.5.1 tqdm==4.70.1 packaging==26.4
  filelock==4.3.2 fsspec==2026.9.0 regex==2026.12.2 PyYAML==6.0.4 typing_extensions==4.16.0 idna==3.21
)
FAST_PLAID=(fast-plaid==1.7.0.2110 usearch)
download() {   # folder spec...
  local dir=$1; shift
  mkdir -p "$dir"
  for spec in "$@"; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --abi cp312 --abi abi3 --abi none \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d "$dir" "$spec"
  done
}
download .whl "${WHEELS[@]}"
download .whl-st63 "${ST63[@]}"
download .whl-fp "${FAST_PLAID[@]}"
ls .whl .whl-st63 .whl-fp
