"""The one device dispatcher: which implementation serves a call, with the reason when one
cannot.

Every registered op (``lik_plugins.library``) asks :func:`served_by` for a path name and
:func:`implementation` for that path's launchers, at run time inside the op.  Paths:

* ``"triton"``: CUDA tensors on compute capability 8.0+ (fp8 scoring: 8.9+), or CPU tensors
  under ``TRITON_INTERPRET=1`` when ``LIK_BACKEND=triton`` asks for the kernels (this is how
  CI runs them);
* ``"metal"``: MPS tensors (Apple GPUs) under ``LIK_METAL=1`` where the Metal kernels
  compile (``kernels/metal``); a compile failure or a device fault warns once, naming the
  reason, and the chunked path serves that dtype from then on.  Opt-in because the kernels
  have never run on Apple hardware: without the variable MPS tensors take the chunked path;
* ``"torch-chunked"``: the bounded-memory PyTorch path, everywhere else;
* ``"reference"``: ``LIK_DISABLE=1`` or ``LIK_BACKEND=reference`` -- the public ops run the
  plain formulation (:mod:`lik_plugins.kernels.reference`) themselves.

Per-op rules: ``op="smooth"`` sends embeddings wider than ``SMOOTH_FUSED_MAX_DIM`` to the
chunked path under ``auto``; ``op="fp8"`` needs fp8 matrix units (capability 8.9+);
``op="int8"`` (int8 tokens), ``"residual"`` (PLAID residual documents) and ``"hidden"``
(the fused projection head) take the Triton kernels on capability 8.0+ and the chunked path
elsewhere, MPS included (no Metal kernels for them).  Their embeddings must be at most
``BUILT_OPERAND_MAX_DIM`` wide for the kernel (``serves_width``).

``served_by`` is a pure function of the tensor's device/dtype and the environment, so host
adapters can record routing without running anything.
"""
from __future__ import annotations

from types import ModuleType
from typing import NamedTuple

import torch

from .._config import disabled, forced_backend, metal_enabled, triton_interpret
from .common import SMOOTH_FUSED_MAX_DIM
from .device import capability, triton_available

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
OPS = ("maxsim", "smooth", "fp8", "int8", "residual", "hidden")
# ops whose tensors are quantised values, not float tokens (no dtype check)
_QUANTISED_OPS = ("fp8", "int8")
# ops without Metal kernels: MPS tensors take the chunked path
_NO_METAL_OPS = ("fp8", "int8", "residual", "hidden")
# int8, residual and hidden documents: the kernel holds a whole token in one K tile
BUILT_OPERAND_MAX_DIM = 256


def serves_width(path: str, op: str, dim: int) -> str:
    """``path`` for an ``op`` whose embeddings are ``dim`` wide: the chunked path where the
    Triton kernel cannot take that width (int8 / residual / hidden above 256)."""
    if path == "triton" and op in ("int8", "residual", "hidden") and dim > BUILT_OPERAND_MAX_DIM:
        return "torch-chunked"
    return path


def _triton_serves(t: torch.Tensor, op: str) -> tuple[bool, str]:
    if not triton_available():
        return False, "triton is not installed"
    if op not in _QUANTISED_OPS and t.dtype not in KERNEL_DTYPES:
        return False, f"the Triton kernels take fp16/bf16/fp32, got {t.dtype}"
    if t.is_cuda:
        need = (8, 9) if op == "fp8" else (8, 0)
        if capability(t.get_device()) < need:   # the index without building a torch.device
            what = "fp8 products need" if op == "fp8" else "the Triton kernels need"
            return False, f"{what} compute capability {need[0]}.{need[1]} or newer"
        return True, ""
    if t.device.type == "cpu" and triton_interpret():
        return True, ""
    return False, f"no Triton kernel for {t.device.type} tensors (set TRITON_INTERPRET=1 to interpret on CPU)"


def served_by(t: torch.Tensor, op: str = "maxsim") -> str:
    """Path name (as in :func:`lik_plugins.routing_counts`) that serves ``op`` on tensors
    like ``t`` now (``op``: one of :data:`OPS`; ``"maxsim"`` covers pairs too)."""
    if disabled():
        return "reference"
    forced = forced_backend()
    if forced == "triton":
        ok, why = _triton_serves(t, op)
        if not ok:
            raise RuntimeError(f"LIK_BACKEND=triton, but {why}")
        return "triton"
    if forced in ("torch-chunked", "reference"):
        return forced
    if not t.is_cuda and t.device.type == "mps":
        metal = metal_enabled() and op not in _NO_METAL_OPS and _metal_serves(t)
        return "metal" if metal else "torch-chunked"
    if op == "fp8":
        # the interpreter runs fp8 products too (CI covers the kernel without LIK_BACKEND)
        ok = _triton_serves(t, op)[0] and (t.is_cuda or triton_interpret())
        return "triton" if ok else "torch-chunked"
    if t.is_cuda and _triton_serves(t, op)[0]:
        if op == "smooth" and t.shape[-1] > SMOOTH_FUSED_MAX_DIM:
            return "torch-chunked"
        return "triton"
    return "torch-chunked"


def _metal_serves(t: torch.Tensor) -> bool:
    from .metal import launch as metal

    return metal.serves(t)[0] and metal.compile_or_reason(t.dtype) is None


def _metal_implementation():
    """The Metal launchers, each guarded: a compile failure or device fault falls back to
    the chunked path once and for all for that dtype, with a warning (metal.guarded)."""
    from types import SimpleNamespace

    from . import chunked
    from .metal import launch as metal

    def guard(name: str, dtype_arg: int):
        def call(*args, **kwargs):
            return metal.guarded(args[dtype_arg].dtype, lambda: getattr(metal, name)(*args, **kwargs),
                                 lambda: getattr(chunked, name)(*args, **kwargs))
        call.__name__ = name
        return call

    launchers = SimpleNamespace(forward=guard("forward", 0), backward=guard("backward", 1),
                                smooth_forward=guard("smooth_forward", 0), smooth_backward=guard("smooth_backward", 0))
    return Implementation(launchers, launchers)


class Implementation(NamedTuple):
    """The launcher modules of one path, with the same signatures on every path (see
    chunked.py): ``maxsim.forward`` / ``maxsim.backward`` and ``smooth.smooth_forward`` /
    ``smooth.smooth_backward``.  Modules, not functions: attributes are looked up per
    call, so a test can wrap one."""
    maxsim: ModuleType | object
    smooth: ModuleType | object


_IMPLEMENTATIONS: dict = {}


def implementation(path: str) -> Implementation:
    """The launchers for a path name, imported on first use (importing Triton is slow, and
    the chunked path must work without it)."""
    impl = _IMPLEMENTATIONS.get(path)
    if impl is not None:
        return impl
    if path == "triton":
        from .triton import launch, smoothmax

        impl = Implementation(launch, smoothmax)
    elif path == "torch-chunked":
        from . import chunked

        impl = Implementation(chunked, chunked)
    elif path == "metal":
        impl = _metal_implementation()
    else:
        raise ValueError(f"no launcher for path {path!r}")
    _IMPLEMENTATIONS[path] = impl
    return impl
