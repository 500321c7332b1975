"""Metal is opt-in for MPS tensors (``LIK_METAL=1``): the kernels have never run on Apple
hardware, so by default MPS tensors take the chunked path without compiling anything.

No MPS device exists here: the dispatcher reads only the tensor's device, dtype and shape,
so a stand-in with an MPS device plays the tensor, and the device facts Metal checks (MPS
available, ``torch.mps.compile_shader`` present) are patched in."""
from types import SimpleNamespace

import pytest
import torch

from lik_plugins.kernels import dispatch
from lik_plugins.kernels.metal import launch


def _mps_tensor(dtype=torch.float16):
    return SimpleNamespace(is_cuda=False, device=torch.device("mps"), dtype=dtype, shape=(2, 3, 16))


@pytest.fixture
def fake_mac(monkeypatch):
    """MPS reported available with a shader compiler; every compile is recorded."""
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.mps, "compile_shader", lambda source: None, raising=False)
    monkeypatch.delenv("LIK_BACKEND", raising=False)
    monkeypatch.delenv("LIK_DISABLE", raising=False)
    compiled = []
    launch.reset_failures()
    with launch.using_compiler(lambda source: compiled.append(source) or object()):
        yield compiled
    launch.reset_failures()


@pytest.mark.parametrize("unset", [None, "0", ""])
def test_mps_takes_the_chunked_path_by_default(fake_mac, monkeypatch, unset):
    if unset is None:
        monkeypatch.delenv("LIK_METAL", raising=False)
    else:
        monkeypatch.setenv("LIK_METAL", unset)
    for op in ("maxsim", "smooth"):
        assert dispatch.served_by(_mps_tensor(), op) == "torch-chunked"
    assert fake_mac == [], "without LIK_METAL nothing may be compiled"


def test_lik_metal_turns_the_kernels_on(fake_mac, monkeypatch):
    monkeypatch.setenv("LIK_METAL", "1")
    assert dispatch.served_by(_mps_tensor(), "maxsim") == "metal"
    assert dispatch.served_by(_mps_tensor(torch.float32), "smooth") == "metal"
    assert len(fake_mac) == 2   # one library per dtype, built at the first call
    # ops without Metal kernels stay on the chunked path
    for op in ("fp8", "int8", "residual", "hidden"):
        assert dispatch.served_by(_mps_tensor(), op) == "torch-chunked"


def test_lik_metal_with_a_compile_failure_falls_back(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.mps, "compile_shader", lambda source: None, raising=False)
    monkeypatch.delenv("LIK_BACKEND", raising=False)
    monkeypatch.setenv("LIK_METAL", "1")

    def failing(source):
        raise RuntimeError("program_source:1: error: unknown type name 'bfloat'")

    launch.reset_failures()
    try:
        with launch.using_compiler(failing), pytest.warns(RuntimeWarning, match="bfloat"):
            assert dispatch.served_by(_mps_tensor(torch.bfloat16)) == "torch-chunked"
        assert "bfloat" in launch.failure_reason(torch.bfloat16)
    finally:
        launch.reset_failures()


def test_lik_metal_does_not_touch_other_devices(monkeypatch):
    monkeypatch.delenv("LIK_BACKEND", raising=False)
    monkeypatch.setenv("LIK_METAL", "1")
    assert dispatch.served_by(torch.zeros(2, 3, 4)) == "torch-chunked"
