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


# A signature's hints (:func:`split`), one character per positional argument: what Triton
# assumed of the value when it compiled a binary, which a binary compiled without it does
# not need.  Specialised integers: equal to 1 (compiled in as a constant), divisible by 16,
# or neither; tensors: a 16-byte aligned address or not; anything else carries no hint.
ONE, DIVISIBLE, PLAIN, NO_HINT = "1", "D", ".", "-"


def split(signature: tuple) -> tuple[tuple, str]:
    """``(shape, hints)`` of a :func:`signature`: the shape holds what every binary serving
    the launch must match exactly (dtypes, integer widths, bools, ``None``, floats), the
    hints what a more generic binary may leave out."""
    shape, hints = [], []
    for feature in signature:
        if isinstance(feature, tuple) and len(feature) == 3:               # a specialised integer
            is_one, divisible, fits = feature
            shape.append(("int", fits))
            hints.append(ONE if is_one else DIVISIBLE if divisible else PLAIN)
        elif isinstance(feature, tuple) and len(feature) == 2 and isinstance(feature[0], torch.dtype):
            shape.append(feature[0])                                         # a tensor
            hints.append(DIVISIBLE if feature[1] else PLAIN)
        else:
            shape.append(feature)
            hints.append(NO_HINT)
    return tuple(shape), "".join(hints)


def group(variant: tuple) -> tuple[str, str]:
    """``(group key, hints)`` of a :func:`variant`: binaries of one group differ only in their
    hints, so any of them whose hints the launch satisfies computes the launch."""
    name, meta, sig = variant
    shape, hints = split(sig)
    return repr((name, meta, shape)), hints


def serves(binary_hints: str, binary_params: str, launch_hints: str) -> bool:
    """Whether a binary compiled with ``binary_hints`` (its launch parameter codes
    ``binary_params``, ``-`` where Triton compiled the argument in) is valid for a launch with
    ``launch_hints`` of the same group: each hint of the binary holds for the launch, and an
    argument the launch passes as 1 is one the binary takes as a parameter (a binary
    compiled for other values keeps it: Triton makes only a value of 1 a constant)."""
    for have, need, param in zip(binary_hints, launch_hints, binary_params):
        if have == need or have == NO_HINT:
            continue
        if have != PLAIN:
            return False                       # the binary assumes 1 or a multiple of 16
        if need == ONE and param == "-":
            return False                       # never the case for Triton 3.6/3.7; the manifest decides
    return True


def specialisation(hints: str) -> int:
    """How many hints a binary assumes: of the binaries serving a launch, the most
    specialised is preferred (unit strides as constants, aligned vector loads)."""
    return sum(h in (ONE, DIVISIBLE) for h in hints)


def generic_args(kernel, args: tuple) -> tuple:
    """``args`` with every hint taken away (``meta`` tensors: a view at an odd address;
    specialised integers: a value that is neither 1 nor a multiple of 16, of the same
    width): the launch whose binary serves every launch of its group."""
    flags = specialized_args(kernel)
    out = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            a = torch.empty(2, dtype=a.dtype, device="meta")[1:]
        elif type(a) is int and (flags[i] if i < len(flags) else True):
            a = 3 if -0x80000000 <= a <= 0x7FFFFFFF else 2**40 + 3
        out.append(a)
    return tuple(out)


def kernel_name(kernel) -> str:
    fn = getattr(kernel, "fn", kernel)
    return getattr(getattr(fn, "fn", fn), "__name__", repr(kernel))


@triton.jit(do_not_specialize=["n"])
def self_check_kernel(X, OUT, n, scale, BLOCK: tl.constexpr):
    """``OUT[i] = X[i] * scale`` for ``i < n``: the self-check of launches through the driver
    (``binaries_loader``)."""
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(OUT + o, tl.load(X + o, mask=o < n) * scale, mask=o < n)


# the self-check launch: (n, scale) of its two calls, and its meta
CHECK_CALLS = ((37, 2.0), (91, 3.0))
CHECK_META = {"BLOCK": 64}
