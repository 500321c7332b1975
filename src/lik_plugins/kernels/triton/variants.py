"""What identifies a compiled Triton kernel variant, and the tiny kernel that checks a launch path.

A leaf module (torch and Triton only): the direct launcher keys its plans on :func:`variant`,
and the shipped-binary loader finds binaries by it and runs :func:`self_check_kernel` before
trusting a device, without either importing the other.
"""
from __future__ import annotations

import inspect

import torch
import triton
import triton.language as tl


def _feature(arg, specialized: bool = True):
    kind = type(arg)
    if kind is int:
        fits = -0x80000000 <= arg <= 0x7FFFFFFF
        return (arg == 1, arg % 16 == 0, fits) if specialized else fits
    if kind is bool or arg is None:
        return (kind, arg)
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    return (kind,)


_SPECIALIZED: dict = {}


def specialized_args(kernel) -> tuple[bool, ...]:
    """Per positional parameter of ``kernel`` (a JIT or interpreted function, or an
    autotuner around one): does Triton specialise on its value?"""
    key = id(kernel)
    flags = _SPECIALIZED.get(key)
    if flags is None:
        fn = kernel
        if not (hasattr(fn, "params") or hasattr(fn, "kwargs")):
            fn = fn.fn                               # an Autotuner wraps the JIT function
        inner = fn.fn                                # the Python function itself
        names = list(inspect.signature(inner).parameters)
        params = getattr(fn, "params", None)
        if params is not None:
            skip = {p.name for p in params if p.do_not_specialize}
        else:                                          # the interpreter keeps the decorator's kwargs
            skip = set(getattr(fn, "kwargs", {}).get("do_not_specialize", ()) or ())
        flags = _SPECIALIZED[key] = tuple(name not in skip for name in names)
    return flags


def signature(kernel, args: tuple) -> tuple:
    """What Triton specialises ``kernel`` on in ``args``."""
    flags = specialized_args(kernel)
    return tuple(_feature(a, flags[i] if i < len(flags) else True) for i, a in enumerate(args))


def variant(kernel, args: tuple, meta: dict) -> tuple:
    """The binary a launch needs: kernel name, constexprs and warps, argument features."""
    return (kernel_name(kernel), tuple(sorted(meta.items())), signature(kernel, args))


def kernel_name(kernel) -> str:
    fn = getattr(kernel, "fn", kernel)
    return getattr(getattr(fn, "fn", fn), "__name__", repr(kernel))


@triton.jit(do_not_specialize=["n"])
def self_check_kernel(X, OUT, n, scale, BLOCK: tl.constexpr):
    """``OUT[i] = X[i] * scale`` for ``i < n``: the launch paths' self-check (``direct.replay_ok``,
    the shipped binaries' check)."""
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(OUT + o, tl.load(X + o, mask=o < n) * scale, mask=o < n)


# the self-check launch: (n, scale) of its two calls, and its meta
CHECK_CALLS = ((37, 2.0), (91, 3.0))
CHECK_META = {"BLOCK": 64}
