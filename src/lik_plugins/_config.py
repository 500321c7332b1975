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
``LIK_DIRECT_LAUNCH=0``     launch every Triton kernel through the JIT instead of through the
                            CUDA driver with a cached plan (see ``kernels/triton/direct.py``).
``LIK_SHIPPED_BINARIES``    ``1`` (default): launch the kernel binaries shipped with the package
                            (``kernels/triton/binaries/<arch>.zip``) through the CUDA driver,
                            without Triton's JIT; variants not shipped, other architectures
                            and a failed load or self-check go through the JIT
                            (``kernels/triton/binaries_loader.diagnostics()`` says why).
                            ``0``: every launch through Triton's JIT.
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
import sys

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
BACKENDS = ("auto", "triton", "torch-chunked", "reference")


# ``os.environ.get`` encodes the key, decodes the value and, for an unset variable, raises and
# catches a KeyError inside: several times a dict lookup, on every op call (the dispatcher reads
# LIK_DISABLE and LIK_BACKEND per call).  ``os.environ`` keeps its encoded contents in ``_data``
# (CPython's ``os._Environ``: every assignment through the mapping, monkeypatch.setenv
# included, updates it), so a variable is read there by its key encoded once, and a parsed
# value is remembered per raw value: the same answer as ``os.environ.get`` at every call.
_ENCODED_KEYS: dict[str, object] = {}
_PARSED: dict[tuple, object] = {}
_MAX_PARSED = 256          # raw values seen: a bound, not a cache that grows with each new value


def _raw(name: str):
    """The variable's raw (encoded) value in ``os.environ``, None when unset.  Never called
    while torch.compile traces: the caches above would be guarded on, and every new entry
    would recompile the graph."""
    key = _ENCODED_KEYS.get(name)
    if key is None:                     # the first read of ``name``
        key = _ENCODED_KEYS[name] = os.environ.encodekey(name)
    return os.environ._data.get(key)


def _parsed(name: str, default: str, parse):
    """``parse(value or default)``, computed once per raw value of the variable; a value that
    ``parse`` rejects raises on every read."""
    if compiling():
        return parse(os.environ.get(name, default))
    key = (name, _raw(name), parse)
    try:
        return _PARSED[key]
    except KeyError:
        pass
    value = parse(default if key[1] is None else os.environ.decodevalue(key[1]))
    if len(_PARSED) >= _MAX_PARSED:
        _PARSED.clear()
    _PARSED[key] = value
    return value


def compiling() -> bool:
    """``torch.compiler.is_compiling()``: whether torch.compile is tracing the caller."""
    # torch is looked up, not imported: the start-up hook imports lik_plugins in every
    # interpreter and must stay cheap, and where torch is not imported nothing compiles.
    # No state of ours is set here: torch.compile would guard on it and recompile.
    torch = sys.modules.get("torch")
    return torch is not None and torch.compiler.is_compiling()


def _is_true(value: str) -> bool:
    return value.strip().lower() in _TRUE


def _flag(name: str) -> bool:
    return _parsed(name, "", _is_true)


def disabled() -> bool:
    """``LIK_DISABLE=1``: route everything to the plain formulation / the host original."""
    return _flag("LIK_DISABLE")


def metal_enabled() -> bool:
    """``LIK_METAL=1``: opt in to the Metal kernels for MPS tensors."""
    return _flag("LIK_METAL")


def _is_not_false(value: str) -> bool:
    return value.strip().lower() not in _FALSE


def direct_launch_enabled() -> bool:
    return _parsed("LIK_DIRECT_LAUNCH", "1", _is_not_false)


def shipped_binaries_enabled() -> bool:
    """The shipped kernel binaries (``binaries_loader``) serve launches unless
    ``LIK_SHIPPED_BINARIES=0``."""
    return _parsed("LIK_SHIPPED_BINARIES", "1", _is_not_false)


def _backend(raw: str) -> str:
    value = raw.strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"LIK_BACKEND={value!r} is not one of {', '.join(BACKENDS)}")
    return value


def forced_backend() -> str:
    return _parsed("LIK_BACKEND", "auto", _backend)


def _autotune(raw: str) -> str:
    value = raw.strip().lower() or "auto"
    if value in _TRUE:
        return "always"
    if value in _FALSE:
        return "never"
    if value != "auto":
        raise ValueError(f"LIK_AUTOTUNE={value!r} is not one of auto, 1, 0")
    return "auto"


def autotune_mode() -> str:
    return _parsed("LIK_AUTOTUNE", "auto", _autotune)


def triton_interpret() -> bool:
    return _flag("TRITON_INTERPRET")


def chunk_elements() -> int:
    return _parsed("LIK_CHUNK_ELEMENTS", str(1 << 24), int)


def scores_backend(variable: str) -> str:
    """A host's ``*_SCORES_BACKEND`` value (default ``auto``), lower-cased and otherwise as the
    host reads it (validation is the host adapter's: each host has its own accepted values and error)."""
    return _parsed(variable, "auto", str.lower)


def patch_hosts(environ) -> list[str]:
    """``LIK_PATCH`` in ``environ``: the host names listed (comma-separated, lower-cased, ``-`` read
    as ``_``), in order; validation is the start-up hook's (it warns about unknown names)."""
    raw = environ.get("LIK_PATCH", "")
    return [name.strip().lower().replace("-", "_") for name in raw.split(",") if name.strip()]
