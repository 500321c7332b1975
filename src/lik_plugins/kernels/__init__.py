"""Kernels and the specification beside them.

* :mod:`.reference` — plain PyTorch, float64-capable: the specification and test oracle.
* :mod:`.chunked` — bounded-memory PyTorch path (CPU and fallback).
* :mod:`.triton` — fused Triton kernels (imported lazily).
* :mod:`.dispatch` — which of them serves a call.
* :mod:`.device` — the facts of the device a call runs on (Triton present, capability, SMs).
"""
