"""pytest plugin for ``ci/host_suites.py``: the explicit-call mode.  ``-p host_suite_plugin`` with
``LIK_HOST_SUITE_PATCH=<patch function name>`` calls that ``lik_plugins`` function once before the
host's tests are collected (so the doctest finder and every test see the patched host)."""
from __future__ import annotations

import os


def pytest_configure(config):
    name = os.environ.get("LIK_HOST_SUITE_PATCH")
    if name:
        import lik_plugins

        getattr(lik_plugins, name)()
