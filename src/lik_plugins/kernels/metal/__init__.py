"""Metal Shading Language kernels for Apple GPUs, and their CPU emulator.

* ``shaders/*.metal`` -- the kernels, shipped as source, compiled at run time with
  ``torch.mps.compile_shader``;
* :mod:`.launch` -- the launchers (same signatures as :mod:`lik_plugins.kernels.chunked`),
  :func:`.launch.serves` and the fallback helper :func:`.launch.guarded`;
* :mod:`.emulate` -- compiles the same source as C++ on the CPU and checks every kernel
  against the reference (``python -m lik_plugins.kernels.metal.emulate``);
* :mod:`.selftest` -- for Mac users: the kernels on the real GPU against the reference,
  timed against the chunked path and eager PyTorch.

Nothing here is imported by ``import lik_plugins``.  See README.md in this folder for what
has (and has not) been run on Apple hardware.
"""
