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
``LIK_METAL=1``             MPS tensors take the Metal kernels (``kernels/metal``), which have
                            never run on Apple hardware; unset, MPS tensors take the chunked
                            torch path.  ``python -m lik_plugins.kernels.metal.selftest``
                            checks them on a Mac.
``LIK_CHUNK_ELEMENTS``      element budget of one similarity chunk on the chunked path
                            (default 2**24, i.e. 64 MB of fp32 scratch).
``LIK_DIRECT_LAUNCH=0``      launch every Triton kernel through the JIT instead of replaying
                            the compiled launcher (see ``kernels/triton/direct.py``).
``LIK_SHIPPED_BINARIES``    ``1``: launch the kernel binaries shipped with the package
                            (``kernels/triton/binaries/<arch>/``) through the CUDA driver,
                            without Triton's JIT; variants not shipped, other architectures
                            and a failed load or self-check go through the JIT
                            (``kernels/triton/binaries_loader.diagnostics()`` says why).
``LIK_AUTOTUNE``            ``auto`` (default): forward and backward configs come from the
                            committed per-architecture table (``kernels/triton/configs/``);
                            an architecture without a table is swept once and the result
                            persisted in Triton's cache.  ``1``: always sweep (persisted);
                            ``0``: never sweep (table, else one default config).
``PYLATE_SCORES_BACKEND``   PyLate's own selector, honoured by the patch on every release:
                            ``lik`` (ours), ``torch`` (PyLate's path), ``auto`` (ours where
                            it applies); ``lik``/``auto`` also activate the patch at start-up.
``COLPALI_SCORES_BACKEND``  the same for colpali-engine (``auto`` | ``torch`` | ``lik``; any
                            other value raises colpali's own ``ValueError``).
``LIK_PATCH``               hosts to patch at interpreter start, comma-separated:
                            ``pylate``, ``colpali``, ``sentence_transformers`` or ``all``
                            (e.g. ``LIK_PATCH=sentence_transformers``); read once, at start-up.
==========================  =========================================================
"""
from __future__ import annotations

import os

_TRUE = {"1", "true", "yes", "on"}
BACKENDS = ("auto", "triton", "torch-chunked", "reference")


def _getenv(name: str, default: str) -> str:
    # The public mapping, read at every call (about a microsecond): a user may flip a
    # variable between two calls, and tests do.
    return os.environ.get(name, default)


def _flag(name: str) -> bool:
    return _getenv(name, "").strip().lower() in _TRUE


def disabled() -> bool:
    """``LIK_DISABLE=1``: route everything to the plain formulation / the host original."""
    return _flag("LIK_DISABLE")


def metal_enabled() -> bool:
    """``LIK_METAL=1``: opt in to the Metal kernels for MPS tensors."""
    return _flag("LIK_METAL")


def direct_launch_enabled() -> bool:
    return _getenv("LIK_DIRECT_LAUNCH", "1").strip().lower() not in ("0", "false", "no", "off")


def shipped_binaries_enabled() -> bool:
    """``LIK_SHIPPED_BINARIES=1``: opt in to the shipped kernel binaries (``binaries_loader``)."""
    return _flag("LIK_SHIPPED_BINARIES")


def forced_backend() -> str:
    value = _getenv("LIK_BACKEND", "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"LIK_BACKEND={value!r} is not one of {', '.join(BACKENDS)}")
    return value


def autotune_mode() -> str:
    value = _getenv("LIK_AUTOTUNE", "auto").strip().lower() or "auto"
    if value in _TRUE:
        return "always"
    if value in ("0", "false", "no", "off"):
        return "never"
    if value != "auto":
        raise ValueError(f"LIK_AUTOTUNE={value!r} is not one of auto, 1, 0")
    return "auto"


def triton_interpret() -> bool:
    return _flag("TRITON_INTERPRET")


def chunk_elements() -> int:
    return int(_getenv("LIK_CHUNK_ELEMENTS", str(1 << 24)))


def scores_backend(variable: str, default: str = "auto") -> str:
    """A host's ``*_SCORES_BACKEND`` value, lower-cased and otherwise as the host reads it
    (validation is the host adapter's: each host has its own accepted values and error)."""
    return _getenv(variable, default).lower()


def patch_hosts(environ=None) -> list[str]:
    """``LIK_PATCH``: the host names listed (comma-separated, lower-cased, ``-`` read as ``_``),
    in order; validation is the start-up hook's (it warns about unknown names)."""
    raw = _getenv("LIK_PATCH", "") if environ is None else environ.get("LIK_PATCH", "")
    return [name.strip().lower().replace("-", "_") for name in raw.split(",") if name.strip()]
