"""Every environment variable lik_plugins reads, parsed in one place.

All of them are read at call time (never cached at import), so a user can flip them
between two calls in the same process.

==========================  =========================================================
``LIK_DISABLE=1``           kill switch: public ops run the plain reference formulation,
                            patched host entries run the host's original code.
``LIK_BACKEND``             ``auto`` (default) | ``triton`` | ``torch-chunked`` | ``reference``.
                            ``auto``: CUDA tensors -> Triton, everything else -> chunked
                            torch.  ``triton`` on CPU tensors needs ``TRITON_INTERPRET=1``
                            (this is how CI runs the real kernels).
``LIK_CHUNK_ELEMENTS``      element budget of one similarity chunk on the chunked path
                            (default 2**24, i.e. 64 MB of fp32 scratch).
``LIK_DIRECT_LAUNCH=0``      launch every Triton kernel through the JIT instead of replaying
                            the compiled launcher (see ``kernels/triton/direct.py``).
``PYLATE_SCORES_BACKEND``   PyLate's own selector, honoured by the patch on every release:
                            ``lik`` (ours), ``torch`` (PyLate's path), ``auto`` (ours where
                            it applies); ``lik``/``auto`` also activate the patch at start-up.
``COLPALI_SCORES_BACKEND``  the same for colpali-engine (``auto`` | ``torch`` | ``lik``; any
                            other value raises colpali's own ``ValueError``).
==========================  =========================================================
"""
from __future__ import annotations

import os

_TRUE = {"1", "true", "yes", "on"}
BACKENDS = ("auto", "triton", "torch-chunked", "reference")


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE


def disabled() -> bool:
    """``LIK_DISABLE=1``: route everything to the plain formulation / the host original."""
    return _flag("LIK_DISABLE")


def direct_launch_enabled() -> bool:
    return os.environ.get("LIK_DIRECT_LAUNCH", "1").strip().lower() not in ("0", "false", "no", "off")


def forced_backend() -> str:
    value = os.environ.get("LIK_BACKEND", "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"LIK_BACKEND={value!r} is not one of {', '.join(BACKENDS)}")
    return value


def triton_interpret() -> bool:
    return _flag("TRITON_INTERPRET")


def chunk_elements() -> int:
    return int(os.environ.get("LIK_CHUNK_ELEMENTS", str(1 << 24)))


def scores_backend(variable: str, default: str = "auto") -> str:
    """A host's ``*_SCORES_BACKEND`` value, lower-cased and otherwise as the host reads it
    (validation is the host adapter's: each host has its own accepted values and error)."""
    return os.environ.get(variable, default).lower()
