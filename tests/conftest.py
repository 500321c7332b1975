"""Session-wide test setup shared by every test folder.

The Triton kernels run on CPU tensors under ``TRITON_INTERPRET=1``: that is how CI
exercises them.  Triton reads the variable when ``@triton.jit`` *decorates* a kernel, so
it must be set before any kernel module is imported — here, before any test module.

On a CUDA machine the variable is left alone: ``tests/gpu`` (run by
``benchmarks/run_gpu.sh``) must run the compiled kernels, not the interpreter.  CPU
tests that need the interpreter there skip themselves (or run with
``TRITON_INTERPRET=1`` set by the caller, as ``make test`` does).
"""
import os


def _cuda_available() -> bool:
    try:
        import torch
    except Exception:  # pragma: no cover - torch is a hard dependency
        return False
    return torch.cuda.is_available()


if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
