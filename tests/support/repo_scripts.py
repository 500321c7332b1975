"""Load a script of the repository (``ci/``, ``recipes/``, ``benchmarks/``) as a module, by
its path: those folders are not packages, and putting them on ``sys.path`` would let their
module names shadow installed ones for the whole session."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load(relative_path: str) -> ModuleType:
    """The module of ``ROOT / relative_path``, executed once per session; it is registered in
    ``sys.modules`` under its file name, where dataclasses look their module up."""
    path = ROOT / relative_path
    name = path.stem
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) == str(path):
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
