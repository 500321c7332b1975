"""The direct launcher's self-check kernel (``direct.replay_ok``), in a module of its own that
imports Triton only: a compiler process (``compile_worker.py``) imports it in a fraction of
a second, where a module that imports torch would take two."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["n"])
def self_check_kernel(X, OUT, n, scale, BLOCK: tl.constexpr):
    """``OUT[i] = X[i] * scale`` for ``i < n``."""
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(OUT + o, tl.load(X + o, mask=o < n) * scale, mask=o < n)
