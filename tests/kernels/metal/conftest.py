"""Shared fixtures of the Metal tests: the C++ compiler the emulator needs."""
import pytest

from metal_emulator import emulate


@pytest.fixture(scope="session")
def compiler():
    """The emulator's compiler command; skips (with the reason) only if none can be found."""
    try:
        return emulate.find_compiler()
    except emulate.NoCompiler as exc:
        pytest.skip(f"Metal emulator: {exc}")
