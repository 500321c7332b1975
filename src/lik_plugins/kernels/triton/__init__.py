"""Triton kernels (CUDA, compute capability 8.0+; CPU tensors under ``TRITON_INTERPRET=1``).

Importing this package imports Triton; :mod:`lik_plugins.kernels.dispatch` does so only
when a call is routed here.

Kernels: ``forward.py`` (MaxSim forward, every layout and document format), ``backward.py``
(gather, lowmem and packed backward), ``smoothmax.py``, ``quantize.py``, ``approx.py``,
``listed.py``, ``plaid_probe.py``, ``checks.py``.  Their host side: ``launch.py`` (the
launchers the dispatcher hands out; the forward's), ``backward_launch.py``,
``varlen_launch.py``, ``blocking.py`` (how a launch is cut into programs), ``operands.py``
(arguments built on the host), ``tuning.py`` (configs), ``direct.py`` (compiled launches).
"""
