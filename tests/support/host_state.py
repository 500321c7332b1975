"""What a patch may change in a host, read so a test can check that unpatching restores it."""
from __future__ import annotations

import sys


def module_globals(prefix: str, names: tuple[str, ...]) -> dict:
    """``{(module, name): value}`` for every loaded module under ``prefix`` holding a global
    called one of ``names`` (the patchers replace such globals, re-exports included)."""
    return {
        (n, a): vars(m)[a]
        for n, m in sorted(sys.modules.items())
        if m is not None and n.startswith(prefix) and hasattr(m, "__dict__")
        for a in names
        if a in vars(m)
    }


def routes_of_one_call(call) -> dict:
    """``routing_counts()`` of ``call()`` alone: the counts reset first."""
    from lik_plugins import reset_routing_counts, routing_counts

    reset_routing_counts()
    call()
    return routing_counts()


def same_objects(before: dict, after: dict) -> bool:
    """The same names, each bound to the very same object (not an equal one)."""
    return before.keys() == after.keys() and all(before[k] is after[k] for k in before)
