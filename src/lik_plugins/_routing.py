"""Which code path served each call: ``{entry_name: {path_name: count}}``.

Users read this to check that their training really runs on the kernels; the
integration tests observe it instead of checking that an attribute was assigned.
:func:`listed_table` is the one path choice of the hosts' candidate lists.
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


def listed_table(first, target, candidates: list, extra: list[int]):
    """``(path, table)`` for a host's list of ``[Ld, d]`` candidates against queries like
    ``first`` scored on ``target``: only the Triton kernels read such a list where it lies
    (:mod:`lik_plugins.kernels.triton.listed`), so ``table`` is None where ``path`` is another,
    else ``candidate_table``'s answer (a reason string where the list cannot be read in place;
    ``extra`` goes to the device with it)."""
    from . import ops

    probe = first.to(target) if first.device != target else first
    path = ops.served_by(probe)
    if path != "triton":
        return path, None
    from .kernels.triton.listed import candidate_table

    return path, candidate_table(candidates, first.dtype, first.shape[-1], target, extra=extra)


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
