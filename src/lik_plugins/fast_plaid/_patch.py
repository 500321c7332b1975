"""``patch_fast_plaid()`` / ``unpatch_fast_plaid()``: fast-plaid is a host of its own.

Two hosts search through it: PyLate's ``indexes.PLAID`` and colpali-engine's
``get_topk_plaid`` both call ``fast_plaid.search.FastPlaid.search``.  One attribute, so one
ledger: the patch is applied once, here, and *held* -- by ``patch_pylate()``, by
``patch_colpali_engine()`` (each where fast-plaid is installed) and by the user's own
``patch_fast_plaid()``.  Each ``unpatch_*()`` lets go of its hold; the original comes back
when nobody holds the patch any more (``unpatch_fast_plaid()`` lets go of every hold), so
unpatching one host never leaves the other's searches on a half-reverted class.
"""
from __future__ import annotations

import importlib
import importlib.metadata
from typing import NamedTuple

from .._patching import PatchLedger, lookalike
from ._search import make_search

MODULE, CLASS, METHOD = "fast_plaid.search", "FastPlaid", "search"
USER = "fast_plaid"
INSTALL_HINT = ("patch_fast_plaid() needs fast-plaid (1.4.6 - 1.7.x). Every fast-plaid wheel pins one exact torch "
                "(1.7.0.2110: torch 2.11.0): install the build of the torch you have, e.g. "
                "pip install fast-plaid==1.7.0.2110 beside torch 2.11.0")


class FastPlaidPatch(NamedTuple):
    """The active patch: the release it was built for and who holds it."""

    version: str
    holders: frozenset


_ledger = PatchLedger()   # its ``current``: the FastPlaidPatch


def _import_fast_plaid():
    try:
        return importlib.import_module(MODULE)
    except Exception:   # not installed, or a wheel built for another torch: nothing to serve
        return None


def _version() -> str:
    try:
        return importlib.metadata.version("fast-plaid")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _apply(current: FastPlaidPatch | None, owner: str) -> FastPlaidPatch | None:
    if current is None:
        module = _import_fast_plaid()
        cls = getattr(module, CLASS, None)
        if cls is None or METHOD not in vars(cls):
            return None
        original = vars(cls)[METHOD]
        _ledger.set_attr(cls, METHOD, lookalike(make_search(original), original))
        current = FastPlaidPatch(_version(), frozenset())
    return current._replace(holders=current.holders | {owner})


def hold(owner: str) -> FastPlaidPatch | None:
    """Serve ``FastPlaid.search`` on behalf of ``owner`` (a host patcher's name); None where
    fast-plaid is not installed."""
    return _ledger.patch(lambda current: _apply(current, owner))


def let_go(owner: str | None = None) -> None:
    """``owner`` no longer needs the patch (None: nobody does); the original comes back once
    no holder is left."""
    with _ledger.hold():
        current = _ledger.current
        if current is None:
            return
        holders = frozenset() if owner is None else current.holders - {owner}
        if holders:
            _ledger.current = current._replace(holders=holders)
        else:
            _ledger.revert()


def patch_fast_plaid() -> FastPlaidPatch:
    """Serve fast-plaid's ``FastPlaid.search`` with lik_plugins' batched PLAID search
    (:mod:`lik_plugins.plaid_search`), whoever calls it: PyLate's ``indexes.PLAID``,
    colpali-engine's ``get_topk_plaid``, your own code.  ``patch_pylate()`` and
    ``patch_colpali_engine()`` call it themselves; call it directly to use fast-plaid alone.

    Same results as fast-plaid's own search (the same top-k ids; its roundings and tie order),
    for fast-plaid 1.4.6 - 1.7.x and an index in any of their layouts.  Where ours does not
    serve (a CPU index, ``low_memory=True`` / ``index_gpu_memory="low"``, an unknown layout or
    parameter, ``LIK_DISABLE=1``), fast-plaid's own search runs:
    :func:`lik_plugins.routing_counts` counts calls under ``fast_plaid.search`` and
    :func:`lik_plugins.routing_reasons` each declined call's reason.

    Returns:
        The :class:`FastPlaidPatch` (the release's ``version``, who holds the patch).

    Raises:
        ImportError: fast-plaid is not installed.

    Example::

        from fast_plaid import search
        import lik_plugins.fast_plaid
        lik_plugins.fast_plaid.patch_fast_plaid()
        results = search.FastPlaid(index="index", device="cuda").search(queries, top_k=10)
    """
    patch = hold(USER)
    if patch is None:
        raise ImportError(INSTALL_HINT)
    return patch


def unpatch_fast_plaid() -> None:
    """Restore fast-plaid's own ``FastPlaid.search``, whoever patched it (no-op when not patched)."""
    let_go(None)


def is_patched() -> bool:
    return _ledger.active
