"""Which code path served each call: ``{entry_name: {path_name: count}}``.

Users read this to check that their training really runs on the kernels; the
integration tests observe it instead of checking that an attribute was assigned.
"""
from __future__ import annotations

import threading
from collections import defaultdict

from ._config import compiling

PATHS = ("triton", "metal", "torch-chunked", "reference", "original")

_lock = threading.Lock()
_counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
_reasons: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))


def record(entry: str, path: str, reason: str | None = None) -> None:
    """Count one call of ``entry`` served by ``path`` (one of :data:`PATHS`); ``reason``: why a
    call went to the host's own code, counted apart (:func:`routing_reasons`).

    While ``torch.compile`` traces a function nothing is counted here: the registered ops
    count their calls when they run (``lik_plugins.autograd``), so a compiled function's
    op entries (``maxsim``, ``maxsim_pairs``, ...) are counted on every call, and the host
    adapters' entries only in eager code."""
    if compiling():
        return
    if path not in PATHS:
        raise ValueError(f"unknown routing path {path!r}; expected one of {PATHS}")
    with _lock:
        _counts[entry][path] += 1
        if reason is not None:
            _reasons[entry][reason] += 1


def routing_counts() -> dict[str, dict[str, int]]:
    """A snapshot copy: ``{entry_name: {path_name: count}}``."""
    with _lock:
        return {entry: dict(paths) for entry, paths in _counts.items()}


def routing_reasons() -> dict[str, dict[str, int]]:
    """Why calls went to the host's own code where an entry records it: a snapshot copy,
    ``{entry_name: {reason: count}}`` (e.g. ``{"fast_plaid.search": {"unknown index layout": 1}}``)."""
    with _lock:
        return {entry: dict(reasons) for entry, reasons in _reasons.items()}


def reset_routing_counts() -> None:
    """Forget every count and reason."""
    with _lock:
        _counts.clear()
        _reasons.clear()
