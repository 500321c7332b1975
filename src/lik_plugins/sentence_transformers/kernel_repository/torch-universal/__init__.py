"""lik_plugins' MaxSim layers in the ``kernels`` layer-repository format.

``kernels`` imports this file as the kernel module and looks up the layers a
``KernelConfig`` names (``MaxSim``, ``MaxSimPairwise``) in its ``layers`` attribute.  The
layers live in the installed package, so this build variant holds no code of its own and
serves every device (``torch-universal``): the fused op picks Triton, Metal or the
chunked-torch path by the inputs' device.
"""
from lik_plugins.sentence_transformers import kernel_layers as layers

__all__ = ["layers"]
