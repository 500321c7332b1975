"""Facts about the device a call runs on: whether Triton imports, a CUDA device's compute
capability and SM count.

A leaf module (torch only), so the dispatcher, the launchers and the op layer can all ask
without importing one another.  Each fact is read from the driver once per device.
"""
from __future__ import annotations

import functools
import importlib

import torch


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        importlib.import_module("triton")
    except Exception:  # ImportError, or a broken install on an unsupported platform
        return False
    return True


@functools.lru_cache(maxsize=None)
def capability(index: int) -> tuple[int, int]:
    """Compute capability of CUDA device ``index``, cached per device."""
    return torch.cuda.get_device_capability(index)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# Where no GPU is present (the interpreter in CI, precompile's meta tensors) the decisions
# that depend on the number of SMs are made for the GPU the committed config table was built
# on, so CI exercises the blocking that GPU takes.  precompile.py sets it to its target's.
DEFAULT_SM_COUNT = 132


def sm_count(device: torch.device | None) -> int:
    """Streaming multiprocessors of a CUDA ``device``, from the device itself."""
    if device is None or device.type != "cuda":
        return DEFAULT_SM_COUNT
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
