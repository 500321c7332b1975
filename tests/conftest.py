"""Session-wide test setup shared by every test folder.

The Triton kernels run on CPU tensors under ``TRITON_INTERPRET=1``: that is how CI
exercises them.  Triton reads the variable when ``@triton.jit`` *decorates* a kernel, so
it must be set before any kernel module is imported — here, before any test module.

On a CUDA machine the variable is left alone: the CUDA cases (marker ``gpu``, run by
``benchmarks/run_gpu.sh`` as ``pytest -m gpu tests``) must run the compiled kernels, not the
interpreter.  CPU tests that need the interpreter there skip themselves (or run with
``TRITON_INTERPRET=1`` set by the caller, as ``make test`` does).
"""
import os

import pytest


def _cuda_available() -> bool:
    try:
        import torch
    except Exception:  # pragma: no cover - torch is a hard dependency
        return False
    return torch.cuda.is_available()


if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser):
    # A cold machine compiles every specialisation the CUDA cases touch (minutes in one
    # process, against a 10-minute limit per device call); benchmarks/run_gpu.sh runs them
    # as parallel shards that share Triton's on-disk cache.
    parser.addoption("--shard", default=None, metavar="I/N",
                     help="run only the selected tests whose index is I modulo N (0 <= I < N)")


@pytest.hookimpl(trylast=True)  # after -m / -k deselection: the shards split what is selected
def pytest_collection_modifyitems(config, items):
    shard = config.getoption("--shard")
    if not shard:
        return
    index, count = (int(part) for part in shard.split("/"))
    if not 0 <= index < count:
        raise ValueError(f"--shard {shard}: need 0 <= I < N")
    keep = [item for n, item in enumerate(items) if n % count == index]
    config.hook.pytest_deselected(items=[item for item in items if item not in keep])
    items[:] = keep
