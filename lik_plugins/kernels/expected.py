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
    call's path, and a generator-based ``with`` costs microseconds.)  While compiling
    (``torch.compile`` traces the autograd Functions, and cannot trace a context variable)
    there is nothing to expect: the compiled graph's launches happen later."""
    if torch.compiler.is_compiling():
        return None
    return _expected.set([backward, args, step])


def forget(token) -> None:
    if token is not None:
        _expected.reset(token)


def take():
    """``(backward, args, step)`` expected by the forward running now, at most once; else None."""
    expected = _expected.get()
    if expected is None or expected[0] is None:
        return None
    taken = tuple(expected)
    expected[0] = None
    return taken

