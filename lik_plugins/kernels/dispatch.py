"""Device dispatch: which implementation serves a call, with the reason when one cannot.

``served_by`` is a pure function of the tensor's device/dtype and the environment, so
host adapters can record routing without running anything.
"""
from __future__ import annotations

import functools
import importlib

import torch

from .._config import disabled, forced_backend, triton_interpret

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        importlib.import_module("triton")
    except Exception:  # ImportError, or a broken install on an unsupported platform
        return False
    return True


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def capability(index: int | None) -> tuple[int, int]:
    """Compute capability of CUDA device ``index`` (None: the current one), cached per device."""
    return _capability(index if index is not None else torch.cuda.current_device())


def _triton_serves(t: torch.Tensor) -> tuple[bool, str]:
    if not triton_available():
        return False, "triton is not installed"
    if t.dtype not in KERNEL_DTYPES:
        return False, f"the Triton kernels take fp16/bf16/fp32, got {t.dtype}"
    if t.is_cuda:
        if capability(t.get_device())[0] < 8:   # the index without building a torch.device
            return False, "the Triton kernels need compute capability 8.0 or newer"
        return True, ""
    if t.device.type == "cpu" and triton_interpret():
        return True, ""
    return False, f"no Triton kernel for {t.device.type} tensors (set TRITON_INTERPRET=1 to interpret on CPU)"


def served_by(t: torch.Tensor) -> str:
    """Path name (as in :func:`lik_plugins.routing_counts`) that serves a call on ``t`` now."""
    if disabled():
        return "reference"
    forced = forced_backend()
    if forced == "triton":
        ok, why = _triton_serves(t)
        if not ok:
            raise RuntimeError(f"LIK_BACKEND=triton, but {why}")
        return "triton"
    if forced in ("torch-chunked", "reference"):
        return forced
    if t.is_cuda and _triton_serves(t)[0]:
        return "triton"
    return "torch-chunked"


_LAUNCHERS: dict = {}


def implementation(path: str):
    """The launcher module (``forward``/``backward``) for a path name (imported on first
    use: importing Triton is slow, and the chunked path must work without it)."""
    module = _LAUNCHERS.get(path)
    if module is not None:
        return module
    if path == "triton":
        from .triton import launch as module
    elif path == "torch-chunked":
        from . import chunked as module
    else:
        raise ValueError(f"no launcher for path {path!r}")
    _LAUNCHERS[path] = module
    return module
