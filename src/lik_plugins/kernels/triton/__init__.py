"""Triton kernels (CUDA, compute capability 8.0+; CPU tensors under ``TRITON_INTERPRET=1``).

Importing this package imports Triton; :mod:`lik_plugins.kernels.dispatch` does so only
when a call is routed here.
"""
