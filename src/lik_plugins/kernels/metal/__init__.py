"""Metal Shading Language kernels for Apple GPUs.

* ``shaders/*.metal`` -- the kernels, shipped as source, compiled at run time with
  ``torch.mps.compile_shader``;
* :mod:`.launch` -- the launchers (same signatures as :mod:`lik_plugins.kernels.chunked`),
  :func:`.launch.serves` and the fallback helper :func:`.launch.guarded`;
* :mod:`.checks` -- the correctness cases shared by the self-test and CI's emulator
  (``tools/metal_emulator`` in the repository, not shipped);
* :mod:`.selftest` -- for Mac users: the kernels on the real GPU against the reference,
  timed against the chunked path and eager PyTorch.

Opt-in: MPS tensors take these kernels only with ``LIK_METAL=1`` (they have never run on
Apple hardware); otherwise the chunked PyTorch path serves them.  Nothing here is imported
by ``import lik_plugins``.  See README.md in this folder for what has (and has not) been
run on Apple hardware.
"""
