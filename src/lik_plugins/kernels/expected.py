"""The backward a forward expects.

Around a forward that will need a gradient, the op layer (``library.py``) names the backward
call to expect; if that forward's Triton kernel has to be compiled, the launcher takes the
expectation and compiles the backward's kernels beside it (``kernels/triton/ahead.py``).
Kept apart from that module so the op layer does not import Triton.
"""
from __future__ import annotations

import contextvars

import torch

_expected: contextvars.ContextVar = contextvars.ContextVar("lik_expected_backward", default=None)


def expect(backward, args: tuple, step=None):
    """Until :func:`forget` of the returned token, :func:`take` gives ``(backward, args,
    step)`` once.  ``args``: the forward call's tensors (queries first, documents second)
    and plain values; ``step(*args)``: forward and backward, for guessing other lengths
    (None: not to be guessed).  (A token, not a context manager: this is on every training
    call's path, and a generator-based ``with`` costs microseconds.)  While tracing
    (``torch.compile`` traces the autograd Functions, and cannot trace a context variable)
    there is nothing to expect: the compiled graph's launches happen later, and the op it
    calls then expects the backward itself (``library.maxsim_forward`` and its kin)."""
    if torch.compiler.is_compiling():
        return None
    return _expected.set([backward, args, step])


def forget(token) -> None:
    """End what :func:`expect` or :func:`defer_compiles` began (``token``: what it returned)."""
    if token is not None:
        token.var.reset(token)


def take():
    """``(backward, args, step)`` expected by the forward running now, at most once; else None."""
    expected = _expected.get()
    if expected is None or expected[0] is None:
        return None
    taken = tuple(expected)
    expected[0] = None
    return taken


# ---------------------------------------------------------------- serving while compiling
class NotReady(Exception):
    """Raised by a Triton launch inside :func:`deferring` code when its binary is not built
    yet: the binary now compiles in the background (``kernels/triton/ahead.py``) and the op
    layer serves this call on the chunked path instead of waiting (1.5-2.5 s a binary)."""


_defer: contextvars.ContextVar = contextvars.ContextVar("lik_defer_compiles", default=False)


def defer_compiles():
    """Until :func:`forget` of the returned token, a launch whose binary is not built raises
    :class:`NotReady` instead of compiling.  The op layer sets it inside the hard-max training
    ops (``maxsim_forward`` saving its winners, ``maxsim_backward``), run by eager code or by
    a compiled graph: there a chunked call costs milliseconds against a compile's seconds,
    and the next step finds the binary built.  Inference calls (a rerank of 100k documents
    may take the chunked path far longer than a compile) wait for their binaries, as does a
    CUDA graph's capture; while tracing nothing is launched."""
    if torch.compiler.is_compiling():
        return None
    return _defer.set(True)


def deferring() -> bool:
    return _defer.get()
