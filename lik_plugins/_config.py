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
``LIK_PATCH``               hosts to patch at interpreter start, comma-separated:
                            ``pylate``, ``colpali``, ``sentence_transformers`` or ``all``
                            (e.g. ``LIK_PATCH=sentence_transformers``); read once, at start-up.
==========================  =========================================================
"""
from __future__ import annotations

import os

_TRUE = {"1", "true", "yes", "on"}
BACKENDS = ("auto", "triton", "torch-chunked", "reference")

# ``os.environ.get`` encodes the key and decodes the value on every call: ~2 us on the CPU
# machine, and a launch-bound training step reads four or five variables (routing, the
# kill switch, the direct launch per kernel) -- a tenth of our host time per step
# (benchmarks/NOTES.md, v17).  CPython's mapping keeps the encoded process environment in
# ``os.environ._data``, which every ``os.environ[...] = ...`` / ``del`` / ``update`` writes
# through, so looking the encoded key up there is the same read, still made at call time.
# Where that layout is absent, the public mapping is used.
_RAW = getattr(os.environ, "_data", None)
_ENCODE_KEY = getattr(os.environ, "encodekey", None)
_DECODE_VALUE = getattr(os.environ, "decodevalue", None)
_FAST = isinstance(_RAW, dict) and callable(_ENCODE_KEY) and callable(_DECODE_VALUE)
_KEYS: dict = {}


def _getenv(name: str, default: str) -> str:
    if not _FAST:
        return os.environ.get(name, default)
    key = _KEYS.get(name)
    if key is None:
        key = _KEYS[name] = _ENCODE_KEY(name)
    raw = _RAW.get(key)
    return default if raw is None else _DECODE_VALUE(raw)


def _flag(name: str) -> bool:
    return _getenv(name, "").strip().lower() in _TRUE


def disabled() -> bool:
    """``LIK_DISABLE=1``: route everything to the plain formulation / the host original."""
    return _flag("LIK_DISABLE")


def direct_launch_enabled() -> bool:
    return _getenv("LIK_DIRECT_LAUNCH", "1").strip().lower() not in ("0", "false", "no", "off")


def forced_backend() -> str:
    value = _getenv("LIK_BACKEND", "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"LIK_BACKEND={value!r} is not one of {', '.join(BACKENDS)}")
    return value


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
