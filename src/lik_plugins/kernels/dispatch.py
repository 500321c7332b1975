"""The one chooser of the device path: which implementation serves a call, and why the
others do not.

Every registered op (:mod:`lik_plugins.autograd`) calls :func:`serve` at run time, inside
the op, and gets that path's launchers (:class:`Implementation`); the public ops
(:mod:`lik_plugins.ops`) ask :func:`reference_requested` first.  Nothing else chooses a
path.  The backends, in the order they are considered:

* ``"reference"``: ``LIK_DISABLE=1`` or ``LIK_BACKEND=reference`` -- the public ops run the
  plain formulation (:mod:`lik_plugins.kernels.reference`) themselves, by torch's autograd;
  a registered op that still runs (a graph compiled before the variable was set) takes the
  chunked path, which has the same semantics;
* ``"triton"``: CUDA tensors on compute capability 8.0+ (fp8 scoring: 8.9+), or CPU tensors
  under ``TRITON_INTERPRET=1`` when ``LIK_BACKEND=triton`` asks for the kernels (this is how
  CI runs them; fp8 scoring takes the interpreter without being asked);
* ``"metal"``: MPS tensors (Apple GPUs) under ``LIK_METAL=1`` where the Metal kernels
  compile (``kernels/metal``); a compile failure or a device fault warns once, naming the
  reason, and the chunked path serves that dtype from then on.  Opt-in because the kernels
  have never run on Apple hardware: without the variable MPS tensors take the chunked path;
* ``"torch-chunked"``: the bounded-memory PyTorch path (:mod:`.chunked`, :mod:`.torch_ops`),
  which serves everything else.

Each backend says whether it serves ``op`` on tensors like ``t`` and, if not, why
(:func:`why_not`); ``LIK_BACKEND=triton`` turns the Triton backend's reason into an error.
Per-op rules (``op``, one of :data:`OPS`): ``"smooth"`` sends embeddings wider than
``SMOOTH_FUSED_MAX_DIM`` to the chunked path unless ``LIK_BACKEND=triton`` asks for the
kernel; ``"int8"``, ``"residual"`` and ``"hidden"`` build each document token in one tile of
the kernel, so wider than ``BUILT_OPERAND_MAX_DIM`` they take the chunked path even then;
``"varlen"`` (packed tokens), ``"fp8"``, ``"int8"``, ``"residual"``, ``"approx"`` (PLAID's
centroid score) and ``"hidden"`` have no Metal kernels.

:func:`served_by` is a pure function of the tensor's device, dtype and width and of the
environment, so host adapters can record routing without running anything.
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import NamedTuple

import torch

from .._config import disabled, forced_backend, metal_enabled, triton_interpret
from .._routing import record
from .common import SMOOTH_FUSED_MAX_DIM
from .device import capability, triton_available

CHUNKED = "torch-chunked"
PATHS = ("reference", "triton", "metal", CHUNKED)
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
OPS = ("maxsim", "varlen", "smooth", "fp8", "int8", "residual", "approx", "hidden")
# ops whose tensors are quantised values, not float tokens (no dtype check)
_QUANTISED_OPS = ("fp8", "int8")
# ops without Metal kernels: MPS tensors take the chunked path
_NO_METAL_OPS = ("varlen", "fp8", "int8", "residual", "approx", "hidden")
# int8, residual and hidden documents: the kernel holds a whole token in one K tile
_BUILT_OPS = ("int8", "residual", "hidden")
BUILT_OPERAND_MAX_DIM = 256
# ops whose embedding width can send a call to the chunked path (:func:`_width_refuses`)
_WIDTH_LIMITED_OPS = _BUILT_OPS + ("smooth",)


# ----------------------------------------------------------------------------- the backends
def _reference_on() -> bool:
    return disabled() or forced_backend() == "reference"


def reference_requested(entry: str = "") -> bool:
    """``LIK_DISABLE=1`` or ``LIK_BACKEND=reference``: the public op runs the plain
    formulation (:mod:`lik_plugins.kernels.reference`) by torch's own autograd, and its call
    is counted for ``entry`` (when given) in :func:`lik_plugins.routing_counts`.  The one
    place the public ops ask; under ``torch.compile`` it is read when the function is traced."""
    if not _reference_on():
        return False
    if entry:
        record(entry, "reference")
    return True


def _triton_refuses(t: torch.Tensor, op: str, asked: bool) -> str:
    """Why the Triton kernels do not serve ``op`` on ``t`` ("" when they do); ``asked``:
    ``LIK_BACKEND=triton`` (the interpreter then serves CPU tensors, and the smooth kernel
    any width)."""
    # the device's own refusals first: they need no import, so a CPU call under torch.compile
    # traces without asking for Triton (an import call breaks the graph)
    if not t.is_cuda:
        if t.device.type != "cpu" or not triton_interpret():
            return f"no Triton kernel for {t.device.type} tensors (set TRITON_INTERPRET=1 to interpret on CPU)"
        if not (asked or op == "fp8"):
            # the interpreter is for testing the kernels: asked for, or fp8 (CI covers that kernel so)
            return "CPU tensors take the Triton kernels (interpreted) only with LIK_BACKEND=triton"
    if not triton_available():
        return "triton is not installed"
    if op not in _QUANTISED_OPS and t.dtype not in KERNEL_DTYPES:
        return f"the Triton kernels take fp16/bf16/fp32, got {t.dtype}"
    if t.is_cuda:
        need = (8, 9) if op == "fp8" else (8, 0)
        if capability(t.get_device()) < need:   # the index without building a torch.device
            what = "fp8 products need" if op == "fp8" else "the Triton kernels need"
            return f"{what} compute capability {need[0]}.{need[1]} or newer"
    return ""


def _width_refuses(t: torch.Tensor, op: str, asked: bool) -> str:
    """The kernels' limits on the embedding width (the last dim of ``t``)."""
    if op in _BUILT_OPS and t.shape[-1] > BUILT_OPERAND_MAX_DIM:
        return f"{op} tokens wider than {BUILT_OPERAND_MAX_DIM} do not fit the kernel's tile"
    if op == "smooth" and not asked and t.shape[-1] > SMOOTH_FUSED_MAX_DIM:
        return f"the fused smooth-max kernel keeps at most {SMOOTH_FUSED_MAX_DIM}-wide query tiles on chip"
    return ""


def _metal_refuses(t: torch.Tensor, op: str) -> str:
    if t.device.type != "mps":
        return f"the Metal kernels take MPS tensors, not {t.device.type}"
    if not metal_enabled():
        return "the Metal kernels are opt-in (LIK_METAL=1): they have never run on Apple hardware"
    if op in _NO_METAL_OPS:
        return f"no Metal kernel for {op}"
    from .metal import launch as metal

    ok, why = metal.serves(t)
    if not ok:
        return why
    return metal.compile_or_reason(t.dtype) or ""


def why_not(path: str, t: torch.Tensor, op: str = "maxsim") -> str:
    """Why ``path`` (one of :data:`PATHS`) does not serve ``op`` on tensors like ``t`` now;
    "" when it does (it may still not be chosen: an earlier backend serves first)."""
    if path == "reference":
        return "" if _reference_on() else "only with LIK_DISABLE=1 or LIK_BACKEND=reference"
    asked = forced_backend() == "triton"
    if path == "triton":
        return _triton_refuses(t, op, asked) or _width_refuses(t, op, asked)
    if path == "metal":
        return _metal_refuses(t, op)
    if path == CHUNKED:
        return ""
    raise ValueError(f"unknown path {path!r}; expected one of {PATHS}")


def served_by(t: torch.Tensor, op: str = "maxsim") -> str:
    """Path name (as in :func:`lik_plugins.routing_counts`) that serves ``op`` on tensors
    like ``t`` now (``op``: one of :data:`OPS`; ``"maxsim"`` covers pairs too)."""
    if disabled():
        return "reference"
    forced = forced_backend()
    if forced in ("reference", CHUNKED):
        return forced
    asked = forced == "triton"
    # ``t.is_cuda`` before ``t.device``, which builds a torch.device on every read
    if not (asked or t.is_cuda):
        if t.device.type == "mps":
            return "metal" if not _metal_refuses(t, op) else CHUNKED
        if op != "fp8":     # _triton_refuses' answer off CUDA unless asked, without building its reason
            return CHUNKED
    why = _triton_refuses(t, op, asked)
    if why and asked:
        raise RuntimeError(f"LIK_BACKEND=triton, but {why}")
    if why or (op in _WIDTH_LIMITED_OPS and _width_refuses(t, op, asked)):
        return CHUNKED
    return "triton"


# ----------------------------------------------------------------------------- the launchers
class Implementation(NamedTuple):
    """The launcher modules of one path, with the same signatures on every path.  Modules,
    not functions: attributes are looked up per call, so a test can wrap one.

    * ``maxsim``: ``forward``, ``backward``, ``varlen_forward``, ``varlen_backward``
      (:mod:`.chunked`, :mod:`.triton.launch`);
    * ``smooth``: ``smooth_forward``, ``smooth_backward`` (:mod:`.chunked`, :mod:`.triton.smoothmax`);
    * ``quantized``: ``quantize_fp8``, ``maxsim_fp8``, ``maxsim_int8``;
    * ``residual``: ``residual_forward``, ``residual_backward``, ``residual_varlen``,
      ``plaid_approx_score``;
    * ``hidden``: ``hidden_forward``, ``hidden_backward``
      (the last three: :mod:`.torch_ops`, :mod:`.triton_ops`)."""
    maxsim: ModuleType | object
    smooth: ModuleType | object
    quantized: ModuleType
    residual: ModuleType
    hidden: ModuleType


def _metal_implementation() -> Implementation:
    """The Metal launchers, each guarded: a compile failure or device fault falls back to
    the chunked path once and for all for that dtype, with a warning (metal.guarded).  The
    families without Metal kernels never reach this path (:data:`_NO_METAL_OPS`)."""
    from types import SimpleNamespace

    from . import chunked, torch_ops
    from .metal import launch as metal

    def guard(name: str, dtype_arg: int):
        def call(*args, **kwargs):
            return metal.guarded(args[dtype_arg].dtype, lambda: getattr(metal, name)(*args, **kwargs),
                                 lambda: getattr(chunked, name)(*args, **kwargs))
        call.__name__ = name
        return call

    launchers = SimpleNamespace(forward=guard("forward", 0), backward=guard("backward", 1),
                                smooth_forward=guard("smooth_forward", 0), smooth_backward=guard("smooth_backward", 0))
    return Implementation(launchers, launchers, torch_ops, torch_ops, torch_ops)


class _ImportedOnUse:
    """A launcher module imported at its first attribute lookup, which then takes this
    stand-in's place in the implementations handed out (later calls look attributes up on
    the module itself).  Triton reads the source of every ``@triton.jit`` function when its
    module is imported, so a training step that scores with the hard max does not pay for
    the smooth max's, the quantised or the residual kernels on its first call."""

    __slots__ = ("_name",)

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        module = importlib.import_module(self._name)
        for path, impl in list(_IMPLEMENTATIONS.items()):
            _IMPLEMENTATIONS[path] = impl._replace(**{f: module for f, v in zip(impl._fields, impl) if v is self})
        return getattr(module, attr)


_IMPLEMENTATIONS: dict = {}


def implementation(path: str) -> Implementation:
    """The launchers for a path name, imported on first use (importing Triton is slow, and
    the chunked path must work without it)."""
    impl = _IMPLEMENTATIONS.get(path)
    if impl is not None:
        return impl
    if path == "triton":
        from .triton import launch

        others = _ImportedOnUse(__package__ + ".triton_ops")
        impl = Implementation(launch, _ImportedOnUse(__package__ + ".triton.smoothmax"), others, others, others)
    elif path == CHUNKED:
        from . import chunked, torch_ops

        impl = Implementation(chunked, chunked, torch_ops, torch_ops, torch_ops)
    elif path == "metal":
        impl = _metal_implementation()
    else:
        raise ValueError(f"no launcher for path {path!r}")
    _IMPLEMENTATIONS[path] = impl
    return impl


def packed_checks_kernel(t: torch.Tensor):
    """The one-launch check of packed offsets and pair indices (``kernels/triton/checks.py``:
    a device-side assertion, no host sync) where the Triton kernels serve packed CUDA tensors
    like ``t``; None elsewhere (the caller checks with torch ops)."""
    if not t.is_cuda or served_by(t, "varlen") != "triton":
        return None
    from .triton.checks import packed_inputs_ok

    return packed_inputs_ok


def serve(t: torch.Tensor, op: str = "maxsim", entry: str = "") -> Implementation:
    """The launchers of the path that serves ``op`` on tensors like ``t``, the call counted
    for the public op ``entry`` (none: not counted).  A reference request that reaches a
    registered op (a graph compiled before the variable was set) is served by the chunked
    path: the same semantics.  A CUDA call whose Triton binary is not built waits for it
    (Triton's JIT, or its disk cache: ``python -m lik_plugins.precompile`` fills that ahead)."""
    path = served_by(t, op)
    if path == "reference":
        path = CHUNKED
    if entry:
        record(entry, path)
    return _IMPLEMENTATIONS.get(path) or implementation(path)
