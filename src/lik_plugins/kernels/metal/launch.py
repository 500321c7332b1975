"""Launchers for the Metal kernels (Apple GPUs, ``torch.mps.compile_shader``).

Signatures match :mod:`lik_plugins.kernels.chunked` (``forward`` / ``backward``) and the
chunked smooth-max pair (``smooth_forward`` / ``smooth_backward``), so the device
dispatcher can treat this module as one more implementation.

The shaders live in ``shaders/*.metal`` (package data) and are compiled on first use, one
library per input dtype (fp16 / bf16 / fp32), prefixed by :func:`library_source`.  The
same source runs under the repository's CPU emulator (``tools/metal_emulator``):
:func:`using_compiler` swaps the compiler, so every launcher here also runs on CPU tensors
in tests.  Where a launcher differs from the chunked path (the kernel's int32 argmax, the
ignored ``strategy``, the widest embedding the smooth-max backward takes) its docstring says.
"""
from __future__ import annotations

import contextlib
import math
import threading
import warnings
from pathlib import Path
from typing import Callable

import torch

from ..common import argmax_dtype

SHADER_DIR = Path(__file__).with_name("shaders")
SHADER_FILES = ("maxsim.metal", "smoothmax.metal")   # concatenated in this order
ELEM_TYPES = {torch.float16: "half", torch.bfloat16: "bfloat", torch.float32: "float"}

# Must equal the #defines in shaders/maxsim.metal and shaders/smoothmax.metal
# (tests/kernels/metal/test_metal_launch.py checks that they do).
THREADS = 128          # LIK_THREADS
SIMDGROUPS = 4         # LIK_SIMDGROUPS
BLOCK_ROWS = 32        # FWD_BM
GRAD_D_TOKENS = 32     # GD_TOKENS
SMOOTH_MAX_DIM = 128   # SM_DMAX
MODE_MAX, MODE_SMOOTH = 0, 1

_NO_WINNER = -1


# --------------------------------------------------------------------------- compiling
def library_source(dtype: torch.dtype, shader_dir: Path | str | None = None) -> str:
    """The full Metal source of the library for inputs of ``dtype``: a three-line prelude
    (``#include <metal_stdlib>``, ``using namespace metal;``, ``typedef <type> elem_t;``)
    followed by :data:`SHADER_FILES` from ``shader_dir`` (default: the shipped shaders)."""
    if dtype not in ELEM_TYPES:
        raise TypeError(f"the Metal kernels take fp16/bf16/fp32 inputs, got {dtype}")
    folder = Path(shader_dir) if shader_dir is not None else SHADER_DIR
    parts = ["#include <metal_stdlib>\nusing namespace metal;\n", f"typedef {ELEM_TYPES[dtype]} elem_t;\n"]
    for name in SHADER_FILES:
        parts += [f"// ---- {name}\n", (folder / name).read_text(encoding="utf-8")]
    return "".join(parts)


def _compile_on_mps(source: str):
    return torch.mps.compile_shader(source)


_lock = threading.Lock()
_compiler: tuple[Callable[[str], object], Path | None] = (_compile_on_mps, None)
_libraries: dict = {}
_failures: dict[torch.dtype, str] = {}


@contextlib.contextmanager
def using_compiler(compile_fn: Callable[[str], object], shader_dir: Path | str | None = None):
    """Within the block, libraries are built by ``compile_fn(source)`` from ``shader_dir``.

    The emulator (``tools/metal_emulator``) passes its CPU compiler here, so the launchers
    run on CPU tensors::

        with using_compiler(emulate.EmulatedLibrary):
            scores, argmax = forward(Q, D, None, None, cross=True, normalize=False,
                                     zero_mode=False, save_argmax=True)
    """
    global _compiler
    with _lock:
        previous = _compiler
        _compiler = (compile_fn, None if shader_dir is None else Path(shader_dir))
    try:
        yield
    finally:
        with _lock:
            _compiler = previous


def library(dtype: torch.dtype):
    """The compiled library for ``dtype`` (cached per compiler, shader folder and dtype)."""
    compile_fn, shader_dir = _compiler
    key = (compile_fn, shader_dir, dtype)
    lib = _libraries.get(key)
    if lib is None:
        lib = compile_fn(library_source(dtype, shader_dir))
        with _lock:
            _libraries[key] = lib
    return lib


def compile_or_reason(dtype: torch.dtype) -> str | None:
    """Build the library for ``dtype`` now: ``None`` on success, else the reason it cannot
    be used (a compile error, e.g. ``bfloat`` needs Metal 3.1 / macOS 14).  A failure
    disables Metal for ``dtype`` (see :func:`failure_reason`)."""
    if dtype in _failures:
        return _failures[dtype]
    try:
        library(dtype)
    except Exception as exc:  # the Metal compiler reports through RuntimeError and friends
        return _record_failure(dtype, exc)
    return None


def failure_reason(dtype: torch.dtype) -> str | None:
    """Why Metal was disabled for ``dtype`` in this process, or ``None``."""
    return _failures.get(dtype)


def _record_failure(dtype: torch.dtype, exc: BaseException) -> str:
    reason = f"{type(exc).__name__}: {exc}".strip()
    first = dtype not in _failures
    _failures[dtype] = reason
    if first:
        warnings.warn(f"lik_plugins: the Metal kernels failed for {dtype} ({reason}); "
                      "the chunked PyTorch path serves these calls from now on", RuntimeWarning, stacklevel=3)
    return reason


def reset_failures() -> None:
    """Forget recorded failures (tests; or after fixing the environment)."""
    _failures.clear()


def guarded(dtype: torch.dtype, metal_call: Callable[[], object], fallback_call: Callable[[], object]):
    """Run ``metal_call()``; on a compile failure or device fault, warn once (naming the
    reason), disable Metal for ``dtype`` and return ``fallback_call()`` -- now and on every
    later call.  Bad-input errors (``ValueError``, ``TypeError``) propagate.

    Example (in the dispatcher)::

        scores, argmax = metal.guarded(
            Q.dtype,
            lambda: metal.forward(Q, D, qm, dm, cross=c, normalize=n, zero_mode=z, save_argmax=s),
            lambda: chunked.forward(Q, D, qm, dm, cross=c, normalize=n, zero_mode=z, save_argmax=s),
        )
    """
    if dtype not in _failures:
        try:
            return metal_call()
        except (ValueError, TypeError):
            raise
        except Exception as exc:
            _record_failure(dtype, exc)
    return fallback_call()


def serves(t: torch.Tensor) -> tuple[bool, str]:
    """``(True, "")`` if the Metal kernels can take tensors like ``t``, else ``(False, why)``.

    Checks the device (MPS), the dtype (fp16/bf16/fp32), that this torch has
    ``torch.mps.compile_shader`` and that MPS is available, and that Metal has not been
    disabled for the dtype by an earlier failure.  It does not compile: call
    :func:`compile_or_reason` for that (once, e.g. at the first call).
    """
    if t.device.type != "mps":
        return False, f"the Metal kernels take MPS tensors, got {t.device.type}"
    if t.dtype not in ELEM_TYPES:
        return False, f"the Metal kernels take fp16/bf16/fp32, got {t.dtype}"
    if not hasattr(torch.mps, "compile_shader"):
        return False, f"torch {torch.__version__} has no torch.mps.compile_shader (torch 2.6 or newer has it)"
    if not torch.backends.mps.is_available():
        return False, "MPS is not available"
    reason = _failures.get(t.dtype)
    if reason is not None:
        return False, f"Metal was disabled after a failure: {reason}"
    return True, ""


# --------------------------------------------------------------------------- grids
def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def queries_per_group(lq: int, cross: bool) -> int:
    """Whole queries per forward threadgroup: as many as fit in :data:`BLOCK_ROWS` rows for
    the cross product (one document tile then serves all of them); 1 for candidates."""
    if cross and 0 < lq <= BLOCK_ROWS:
        return BLOCK_ROWS // lq
    return 1


def query_grid(nq: int, lq: int, nj: int, cross: bool) -> tuple[list[int], list[int]]:
    """``(threads, group_size)`` of ``maxsim_forward`` / smooth dQ: threadgroup (x, y) =
    (query group, document)."""
    groups = _ceil_div(nq, queries_per_group(lq, cross))
    return [groups * THREADS, nj], [THREADS, 1]


def token_grid(nq: int, nj: int, ld: int, cross: bool, block: int) -> tuple[list[int], list[int]]:
    """``(threads, group_size)`` of the destination-owned dD kernels: threadgroup (x, y) =
    (block of ``block`` tokens, document (cross) or pair ``q * NJ + k``)."""
    units = nj if cross else nq * nj
    return [_ceil_div(ld, block) * THREADS, units], [THREADS, 1]


def row_grid(rows: int) -> tuple[list[int], list[int]]:
    """``(threads, group_size)`` of the one-simdgroup-per-row kernels."""
    return [_ceil_div(rows, SIMDGROUPS) * THREADS], [THREADS]


def _checked_shape(Q: torch.Tensor, D: torch.Tensor, cross: bool) -> tuple[int, int, int, int, int]:
    """``(Nq, Lq, NJ, Ld, d)`` of inputs the kernels take (else a ValueError / TypeError)."""
    if Q.dim() != 3 or D.dim() != (3 if cross else 4):
        raise ValueError(f"metal: expected Q 3-D and D {3 if cross else 4}-D, got {tuple(Q.shape)} and {tuple(D.shape)}")
    if Q.dtype != D.dtype:
        raise TypeError(f"metal: Q and D must share a dtype, got {Q.dtype} and {D.dtype}")
    if Q.dtype not in ELEM_TYPES:
        raise TypeError(f"metal: the kernels take fp16/bf16/fp32, got {Q.dtype}")
    if Q.shape[-1] != D.shape[-1]:
        raise ValueError(f"metal: embedding dims differ ({Q.shape[-1]} vs {D.shape[-1]})")
    if not cross and D.shape[0] != Q.shape[0]:
        raise ValueError(f"metal: D must have one entry per query ({D.shape[0]} vs {Q.shape[0]})")
    nq, lq, dim = Q.shape
    nj, ld = (D.shape[0], D.shape[1]) if cross else (D.shape[1], D.shape[2])
    return nq, lq, nj, ld, dim


def _mask_bytes(mask: torch.Tensor | None, shape: tuple[int, ...], placeholder: torch.Tensor) -> torch.Tensor:
    if mask is None:
        return placeholder
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"metal: mask of shape {tuple(mask.shape)}, expected {tuple(shape)}")
    if mask.dtype == torch.bool:
        return mask.contiguous().view(torch.uint8)
    return (mask != 0).to(torch.uint8).contiguous()


def _inverse_norms(lib, X: torch.Tensor) -> torch.Tensor:
    rows, dim = X.numel() // max(X.shape[-1], 1), X.shape[-1]
    out = torch.empty(rows, dtype=torch.float32, device=X.device)
    if rows:
        threads, group = row_grid(rows)
        lib.inverse_norms(X, out, [rows, dim], threads=threads, group_size=group)
    return out


def _project(lib, g32: torch.Tensor, X: torch.Tensor, inv: torch.Tensor) -> None:
    rows, dim = inv.numel(), X.shape[-1]
    if rows:
        threads, group = row_grid(rows)
        lib.project_out_norm(g32, X, inv, [rows, dim], threads=threads, group_size=group)


# --------------------------------------------------------------------------- MaxSim
def forward(Q, D, q_mask, d_mask, *, cross, normalize, zero_mode, save_argmax):
    """Scores ``[Nq, NJ]`` fp32 and, if ``save_argmax``, the argmax ``[Nq, NJ, Lq]``: the
    kernel writes int32, returned in :func:`~lik_plugins.kernels.common.argmax_dtype` as every path's.

    Args:
        Q: ``[Nq, Lq, d]`` fp16 / bf16 / fp32 on the device of the library.
        D: ``[NJ, Ld, d]`` (``cross=True``) or ``[Nq, NJ, Ld, d]`` (candidates; pairs are
            ``NJ = 1``), same dtype as ``Q``.
        q_mask: ``[Nq, Lq]`` or None; d_mask: ``D.shape[:-1]`` or None (bool or 0/1).
        normalize: L2-normalise tokens (fused: inverse norms scale the similarities).
        zero_mode: PyLate's masks (a masked doc token scores 0 and takes part in the max)
            instead of "exclude".
        save_argmax: also return the winners (``-1``: masked query row, no valid token, or
            a masked 0 won in zero mode), as :func:`lik_plugins.kernels.chunked.forward`.
    """
    nq, lq, nj, ld, dim = _checked_shape(Q, D, cross)
    device = Q.device
    scores = torch.zeros((nq, nj), dtype=torch.float32, device=device)
    argmax = torch.full((nq, nj, lq), _NO_WINNER, dtype=torch.int32, device=device) if save_argmax else None
    if nq and nj and lq and ld:   # else nothing to win
        u8 = torch.empty(1, dtype=torch.uint8, device=device)
        qm = _mask_bytes(q_mask, (nq, lq), u8)
        dm = _mask_bytes(d_mask, tuple(D.shape[:-1]), u8)
        lib = library(Q.dtype)
        Q, D = Q.contiguous(), D.contiguous()
        f32 = torch.empty(1, dtype=torch.float32, device=device)
        i32 = torch.empty(1, dtype=torch.int32, device=device)
        q_inv = _inverse_norms(lib, Q) if normalize else f32
        d_inv = _inverse_norms(lib, D) if normalize else f32
        threads, group = query_grid(nq, lq, nj, cross)
        lib.maxsim_forward(
            Q, D, qm, dm, q_inv, d_inv, scores, argmax if save_argmax else i32, f32,
            [nq, lq, nj, ld, dim, queries_per_group(lq, cross)],
            [int(cross), int(q_mask is not None), int(d_mask is not None), int(normalize), int(zero_mode),
             int(save_argmax), MODE_MAX],
            1.0,
            threads=threads, group_size=group,
        )
    return scores, (None if argmax is None else argmax.to(argmax_dtype(ld)))


def backward(grad, Q, D, argmax, *, cross, normalize, need_q, need_d, strategy="lowmem", q_masked=True):
    """``(grad_Q or None, grad_D or None)`` in the inputs' dtypes, through the saved argmax
    (any integer dtype).

    grad_Q gathers each row's winners in document order (one simdgroup per query row);
    grad_D is destination-owned (each element written by the one thread that owns it, in
    query-row order): deterministic, no atomics, no fp32 copy of the scores' graph.
    ``strategy`` and ``q_masked`` are accepted for signature parity and ignored (masked
    rows carry ``-1`` in the argmax and are skipped).
    """
    del strategy, q_masked
    nq, lq, nj, ld, dim = _checked_shape(Q, D, cross)
    device = Q.device
    gq32 = torch.zeros((nq * lq, dim), dtype=torch.float32, device=device) if need_q else None
    gd32 = torch.zeros(D.shape, dtype=torch.float32, device=device) if need_d else None
    if nq and nj and lq and ld and dim and (need_q or need_d):
        lib = library(Q.dtype)
        Q, D = Q.contiguous(), D.contiguous()
        grad = grad.to(torch.float32).contiguous()
        argmax = argmax.to(torch.int32).contiguous()
        f32 = torch.empty(1, dtype=torch.float32, device=device)
        shape = [nq, lq, nj, ld, dim]
        flags = [int(cross), int(normalize)]
        if need_q:
            d_inv = _inverse_norms(lib, D) if normalize else f32
            threads, group = row_grid(nq * lq)
            lib.maxsim_grad_q(D, d_inv, argmax, grad, gq32, shape, flags, threads=threads, group_size=group)
            if normalize:
                _project(lib, gq32, Q, _inverse_norms(lib, Q))
        if need_d:
            q_inv = _inverse_norms(lib, Q) if normalize else f32
            threads, group = token_grid(nq, nj, ld, cross, GRAD_D_TOKENS)
            lib.maxsim_grad_d(Q, q_inv, argmax, grad, gd32, shape, flags, threads=threads, group_size=group)
            if normalize:
                _project(lib, gd32.view(-1, dim), D, _inverse_norms(lib, D))
    return (gq32.view(Q.shape).to(Q.dtype) if need_q else None), (gd32.to(D.dtype) if need_d else None)


# --------------------------------------------------------------------------- smooth max
def smooth_forward(Q, D, tau, cross):
    """``(scores [Nq, NJ], lse [Nq, NJ, Lq])`` fp32 of ``sum_s tau * logsumexp_t(S / tau)``
    (no masks, no normalisation), as the chunked smooth-max forward."""
    nq, lq, nj, ld, dim = _checked_shape(Q, D, cross)
    device = Q.device
    lse = torch.full((nq, nj, lq), -math.inf, dtype=torch.float32, device=device)
    if nq and nj and lq and ld:
        lib = library(Q.dtype)
        Q, D = Q.contiguous(), D.contiguous()
        f32 = torch.empty(1, dtype=torch.float32, device=device)
        u8 = torch.empty(1, dtype=torch.uint8, device=device)
        i32 = torch.empty(1, dtype=torch.int32, device=device)
        scores = torch.empty((nq, nj), dtype=torch.float32, device=device)
        threads, group = query_grid(nq, lq, nj, cross)
        lib.maxsim_forward(
            Q, D, u8, u8, f32, f32, scores, i32, lse,
            [nq, lq, nj, ld, dim, queries_per_group(lq, cross)],
            [int(cross), 0, 0, 0, 0, 0, MODE_SMOOTH],
            float(tau),
            threads=threads, group_size=group,
        )
        return scores, lse
    return lse.sum(dim=-1) * tau, lse   # Ld = 0: -inf rows (as logsumexp of nothing)


def smooth_backward(Q, D, lse, grad, tau, cross, need_q, need_d):
    """fp32 ``(dQ or None, dD or None)`` from recomputed softmax weights
    ``P = exp(S / tau - lse)``; embeddings wider than :data:`SMOOTH_MAX_DIM` go to the
    chunked smooth-max backward (same device)."""
    nq, lq, nj, ld, dim = _checked_shape(Q, D, cross)
    if dim > SMOOTH_MAX_DIM:
        from ..chunked import smooth_backward as chunked_smooth_backward

        return chunked_smooth_backward(Q, D, lse, grad, tau, cross, need_q, need_d)
    device = Q.device
    gq = torch.zeros(Q.shape, dtype=torch.float32, device=device) if need_q else None
    gd = torch.zeros(D.shape, dtype=torch.float32, device=device) if need_d else None
    if nq and nj and lq and ld and dim:
        lib = library(Q.dtype)
        Q, D = Q.contiguous(), D.contiguous()
        lse = lse.to(torch.float32).contiguous()
        grad = grad.to(torch.float32).contiguous()
        if need_q:
            threads, group = query_grid(nq, lq, nj, cross)
            lib.smooth_backward(
                Q, D, lse, grad, gq, [nq, lq, nj, ld, dim, queries_per_group(lq, cross)], [int(cross), 0],
                float(tau), threads=threads, group_size=group,
            )
        if need_d:
            threads, group = token_grid(nq, nj, ld, cross, BLOCK_ROWS)
            lib.smooth_backward(
                D, Q, lse, grad, gd, [nq, lq, nj, ld, dim, 1], [int(cross), 1],
                float(tau), threads=threads, group_size=group,
            )
    return gq, gd
