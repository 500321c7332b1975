"""The patch ledger shared by the host integrations: apply once, revert exactly.

A host patcher describes *what* it replaces (a table per host version); the ledger
does the replacing and remembers every original, so ``unpatch_*()`` restores the
exact objects that were there before.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
import functools
import sys
import threading
from typing import Any, Callable

_MISSING = object()


def hashable_in(value: Any, table: dict) -> bool:
    """``value in table``; False for an unhashable value (a list default, say), which is
    never one of the host's functions."""
    try:
        return value in table
    except TypeError:
        return False


@dataclass
class _Change:
    owner: Any
    name: str
    restore: Callable[[], None]


@dataclass
class PatchLedger:
    """One host's patch: every change made, in order, so it can be undone in reverse; the
    lookalike serving each original; what the patch function returned (``current``).

    Its lock is safe against the patcher re-entering itself.  A patch function imports its
    host; with ``LIK_PATCH`` or ``*_SCORES_BACKEND=auto|lik`` set, that import runs the
    start-up hook, which calls the same patch function again on the same thread.  A plain
    lock deadlocks there.  The inner call instead learns it is nested (``hold()`` yields
    False) and returns: the outer call, which owns the import, finishes the patch.
    """

    changes: list[_Change] = field(default_factory=list)
    current: Any = None
    _lookalikes: dict = field(default_factory=dict)
    _lock: Any = field(default_factory=threading.RLock)
    _depth: Any = field(default_factory=threading.local)

    @contextlib.contextmanager
    def hold(self):
        with self._lock:
            depth = getattr(self._depth, "value", 0)
            self._depth.value = depth + 1
            try:
                yield depth == 0
            finally:
                self._depth.value = depth

    def patch(self, apply: Callable[[Any], Any]) -> Any:
        """``current = apply(current)`` under the lock, returned; a nested call (the host's
        import re-entering the patcher) returns ``current``, what the outer call has so far."""
        with self.hold() as outermost:
            if outermost:
                self.current = apply(self.current)
            return self.current

    @property
    def active(self) -> bool:
        return bool(self.changes)

    def changed(self, owner: Any, name: str) -> bool:
        """Whether ``owner.name`` was already replaced (a repeated patch skips it)."""
        return any(c.owner is owner and c.name == name for c in self.changes)

    def replace_globals(self, module: Any, table: dict) -> None:
        """Every global of ``module`` that *is* a key of ``table`` (found by identity, so
        re-exports are covered) becomes its value, once."""
        for attr, value in list(vars(module).items()):
            if hashable_in(value, table) and not self.changed(module, attr):
                self.set_attr(module, attr, table[value])

    def replace_defaults(self, function: Any, table: dict) -> None:
        """``function``'s positional and keyword-only defaults that are keys of ``table``
        become their values (a scorer bound as a default argument at import time)."""
        defaults = function.__defaults__
        if defaults and any(hashable_in(d, table) for d in defaults):
            self._set_defaults(function, "__defaults__",
                               tuple(table[d] if hashable_in(d, table) else d for d in defaults))
        kwdefaults = function.__kwdefaults__
        if kwdefaults and any(hashable_in(v, table) for v in kwdefaults.values()):
            self._set_defaults(function, "__kwdefaults__",
                               {k: table[v] if hashable_in(v, table) else v for k, v in kwdefaults.items()})

    def replace_module_defaults(self, module: Any, table: dict, owns: Callable[[Any], bool]) -> None:
        """:meth:`replace_defaults` of every function ``module`` defines and of its classes'
        methods (those ``owns`` accepts), each function once."""
        for value in list(vars(module).values()):
            if getattr(value, "__module__", None) != module.__name__:
                continue
            members = list(vars(value).values()) if isinstance(value, type) else [value] if callable(value) else []
            for member in members:
                function = getattr(member, "__func__", member)
                if hasattr(function, "__defaults__") and owns(function) and not self.changed(function, "__defaults__"):
                    self.replace_defaults(function, table)

    def serve(self, prefix: str, adapters: dict, slots: list, doc: str,
              owns: Callable[[Any], bool] = lambda f: True) -> None:
        """Every capture point of one host, each original of ``adapters`` (``{original:
        adapter}``) served by a :func:`lookalike` of its adapter -- the same one for the life of
        the patch (identity matters: the instance slots map it back, and re-applying must find
        it): in each module named ``prefix`` or ``prefix.*``, the globals (found by identity:
        re-exports) and the defaults bound at import time (:meth:`replace_module_defaults`);
        then the instance ``slots`` (``(class, attribute)``) of objects built before the patch,
        each becoming an :func:`instance_slot_property`."""
        to_adapter = {o: self._lookalikes.get(o) or lookalike(a, o) for o, a in adapters.items()}
        self._lookalikes.update(to_adapter)
        to_original = {adapter: original for original, adapter in to_adapter.items()}
        modules = [m for n, m in list(sys.modules.items())
                   if m is not None and (n == prefix or n.startswith(prefix + "."))]
        for module in modules:
            self.replace_globals(module, to_adapter)
            self.replace_module_defaults(module, to_adapter, owns=owns)
        for cls, attr in slots:
            if self.changed(cls, attr) or isinstance(vars(cls).get(attr), property):
                continue  # done already, or the host made it a property itself: leave it alone
            self.set_attr(cls, attr, instance_slot_property(attr, to_adapter, to_original, doc=f"{attr} ({doc})"))

    def set_attr(self, owner: Any, name: str, value: Any) -> None:
        """``setattr(owner, name, value)``, keeping the raw original from ``owner.__dict__``.

        Reading ``__dict__`` (not ``getattr``) keeps descriptors such as
        ``staticmethod``/``classmethod`` intact on revert, and tells an inherited
        attribute (restored by deleting ours) from an own one.
        """
        original = vars(owner).get(name, _MISSING) if hasattr(owner, "__dict__") else getattr(owner, name, _MISSING)

        def restore() -> None:
            if original is _MISSING:
                try:
                    delattr(owner, name)
                except AttributeError:
                    pass
            else:
                setattr(owner, name, original)

        setattr(owner, name, value)
        self.changes.append(_Change(owner, name, restore))

    def _set_defaults(self, function: Any, slot: str, value: tuple | dict) -> None:
        """Replace a function's ``__defaults__`` or ``__kwdefaults__``, keeping a copy of the original."""
        original = getattr(function, slot)
        original = dict(original) if isinstance(original, dict) else original
        setattr(function, slot, value)
        self.changes.append(_Change(function, slot, lambda: setattr(function, slot, original)))

    def revert(self) -> None:
        """Undo every change, newest first, and forget the patch (its lookalikes, ``current``)."""
        for change in reversed(self.changes):
            change.restore()
        self.changes.clear()
        self._lookalikes.clear()
        self.current = None


def instance_slot_property(name: str, to_adapter: dict, to_original: dict, doc: str) -> property:
    """A class-level data descriptor over the instance slot ``name``: reading maps a host
    original to its adapter (``to_adapter``), writing stores the original (``to_original``),
    so objects built before, during or after a patch behave alike and, once the property is
    removed again, hold exactly what the host put there.  Dict values (e.g. an evaluator's
    ``{name: function}``) are mapped item by item; an ``nn.Module`` stored in ``_modules``
    is returned as is."""

    def swap(value: Any, table: dict) -> Any:
        try:
            if isinstance(value, dict):
                return {key: table.get(item, item) for key, item in value.items()}
            return table.get(value, value)
        except TypeError:  # unhashable callable: not one of ours
            return value

    def fget(self):
        try:
            value = self.__dict__[name]
        except KeyError:
            modules = self.__dict__.get("_modules")  # an nn.Module stored by nn.Module.__setattr__
            if modules is not None and name in modules:
                return modules[name]
            raise AttributeError(name) from None
        return swap(value, to_adapter)

    def fset(self, value):
        self.__dict__[name] = swap(value, to_original)

    def fdel(self):
        del self.__dict__[name]

    return property(fget, fset, fdel, doc=doc)


def lookalike(adapter: Callable, original: Callable) -> Callable:
    """A new function that calls ``adapter`` and carries ``original``'s identity:
    ``__module__``, ``__name__``, ``__qualname__``, ``__doc__``, ``__wrapped__`` (so
    ``inspect.signature`` shows the host's signature) -- what doctest collection, help()
    and pickling by qualified name look at.  ``adapter`` itself is left untouched."""

    @functools.wraps(original)
    def served(*args, **kwargs):
        return adapter(*args, **kwargs)

    return served
