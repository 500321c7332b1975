"""sentence-transformers 6.x tests: they run where ST 6 is installed (``ci/st6_env.sh`` builds
that environment); in the main environment (ST 5.x, pinned by PyLate) every module skips."""
from __future__ import annotations

import pytest

from support import st_tiny


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in ("LIK_DISABLE", "LIK_BACKEND", "LIK_PATCH"):
        monkeypatch.delenv(var, raising=False)
    yield


def pytest_report_header(config):
    major = st_tiny.st_major()
    return f"sentence-transformers major: {major} ({'tests run' if major == 6 else 'tests skipped: needs 6.x'})"
