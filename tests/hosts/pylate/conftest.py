"""The PyLate tests' shared fixture."""
import pytest

from lik_plugins import reset_routing_counts


@pytest.fixture
def patched(monkeypatch):
    """PyLate patched, with the switches unset and the routing counts at zero; unpatched after."""
    from lik_plugins.pylate import patch_pylate, unpatch_pylate

    monkeypatch.delenv("PYLATE_SCORES_BACKEND", raising=False)
    monkeypatch.delenv("LIK_DISABLE", raising=False)
    layout = patch_pylate()
    reset_routing_counts()
    yield layout
    unpatch_pylate()
