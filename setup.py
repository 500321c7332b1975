"""Packaging hook: ship ``lik_plugins_autoactivate.pth`` at the root of site-packages.

Everything else lives in pyproject.toml.  The .pth line imports nothing unless
``LIK_PATCH`` is set or a ``*_SCORES_BACKEND`` variable is ``lik``/``auto`` (see src/lik_plugins/_autoactivate.py).

* ``pip install .``: ``build_py`` copies the file into the wheel root.
* ``pip install -e .`` (PEP 660): setuptools writes the editable wheel through a
  "strategy" object; we wrap it to add the same file.  ``_select_strategy`` exists in
  every setuptools since 64 (the first with PEP 660); if it ever goes away the
  editable install still works, only without zero-code activation.
"""
import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "lik_plugins_autoactivate.pth"
PTH_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), PTH)


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        if not getattr(self, "editable_mode", False):
            self.mkpath(self.build_lib)
            shutil.copyfile(PTH_SOURCE, os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode=True):
        outputs = list(super().get_outputs(include_bytecode))
        if not getattr(self, "editable_mode", False):
            outputs.append(os.path.join(self.build_lib, PTH))
        return outputs


cmdclass = {"build_py": BuildPyWithPth}

try:
    from setuptools.command.editable_wheel import editable_wheel
except ImportError:  # setuptools < 64: no PEP 660 editable installs
    editable_wheel = None

if editable_wheel is not None and hasattr(editable_wheel, "_select_strategy"):

    class _StrategyWithPth:
        def __init__(self, strategy):
            self._strategy = strategy

        def __enter__(self):
            self._strategy.__enter__()
            return self

        def __exit__(self, *exc):
            return self._strategy.__exit__(*exc)

        def __call__(self, wheel, files, mapping):
            self._strategy(wheel, files, mapping)
            with open(PTH_SOURCE, encoding="utf-8") as fh:
                wheel.writestr(PTH, fh.read())

    class EditableWheelWithPth(editable_wheel):
        def _select_strategy(self, *args, **kwargs):
            return _StrategyWithPth(super()._select_strategy(*args, **kwargs))

    cmdclass["editable_wheel"] = EditableWheelWithPth

setup(cmdclass=cmdclass)
