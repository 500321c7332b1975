"""Compiling Triton kernels for a GPU architecture that is not here: the device's own target
where the GPU is that architecture, else a stand-in driver that only names the target.

A leaf module (torch, and Triton inside the functions): ``precompile`` and ``binaries_build``
both compile through it without importing each other.
"""
from __future__ import annotations

import contextlib

import torch


def device_arch() -> str | None:
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


class OfflineDriver:
    """Triton's active driver for compiling without a device: it names the target and a
    device and stream that nothing is launched on.  ``warmup`` compiles and returns."""

    def __init__(self, target):
        self.target = target

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


@contextlib.contextmanager
def compiling_for(arch: str):
    """Triton's active driver targets ``arch`` (``sm_90``) inside the block."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    if device_arch() == arch:
        yield
        return
    driver.set_active(OfflineDriver(GPUTarget("cuda", int(arch[3:]), 32)))
    try:
        yield
    finally:
        # back to the default, built on its next use (``reset_active`` would build it now,
        # and fails where no GPU driver is installed)
        driver.set_active(None)
