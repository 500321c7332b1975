"""Per-token e4m3 or int8 quantisation in one pass (the fp8 / int8 paths' query side, and
index building).

Same numbers as :func:`lik_plugins.kernels.reference.quantize_fp8` and
:func:`~lik_plugins.kernels.reference.quantize_int8`, bit for bit (the arithmetic is
:func:`~lik_plugins.kernels.triton.forward.quantize_rows`, which the forward kernel also
runs on its query rows when it fuses the query's quantisation).  The torch formulation
takes ~8 launches; a query batch quantised inside a search call would pay them on every call.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference import FP8_DTYPE, FP8_MAX, INT8_MAX
from .forward import quantize_rows
from .direct import launch
from .tuning import cdiv, interpreting, next_pow2


@triton.jit(do_not_specialize=["n_rows"])
def quantize_rows_kernel(X, V, S, n_rows, dim, s_xr, s_xh, BLOCK_R: tl.constexpr, D_PAD: tl.constexpr,
                         QUANT_LIMIT: tl.constexpr, TO_INT: tl.constexpr, CAST_ON_HOST: tl.constexpr):
    o_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    o_h = tl.arange(0, D_PAD)
    m_r = o_r < n_rows
    m = m_r[:, None] & (o_h[None, :] < dim)
    x = tl.load(X + o_r.to(tl.int64)[:, None] * s_xr + o_h[None, :] * s_xh, mask=m, other=0.0).to(tl.float32)
    y, scale = quantize_rows(x, QUANT_LIMIT, TO_INT)
    if not CAST_ON_HOST:
        y = y.to(V.dtype.element_ty)
    tl.store(V + o_r.to(tl.int64)[:, None] * dim + o_h[None, :], y, mask=m)
    tl.store(S + o_r, scale, mask=m_r)


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, scales)`` of ``x [..., L, d]`` (16/32-bit floats), contiguous."""
    # Triton's interpreter converts fp32 -> e4m3 wrongly (124.7 became 64 in triton 3.7.1):
    # there the kernel writes the scaled fp32 values and torch casts them.  The GPU suite
    # checks the in-kernel cast bit for bit.
    return _quantize(x, FP8_DTYPE, FP8_MAX, to_int=False, cast_on_host=interpreting())


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, scales)`` of ``x [..., L, d]`` as ``reference.quantize_int8``: int8, contiguous
    (one launch where torch's formulation takes about eight)."""
    return _quantize(x, torch.int8, float(INT8_MAX), to_int=True, cast_on_host=False)


def _quantize(x, dtype, limit, *, to_int, cast_on_host):
    dim = x.shape[-1]
    rows = x.reshape(-1, dim)  # a view where it can be; the kernel takes the row stride
    values = torch.empty(x.shape, dtype=torch.float32 if cast_on_host else dtype, device=x.device)
    scales = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    n_rows = rows.shape[0]
    if n_rows == 0 or dim == 0:
        return values.to(dtype), scales.fill_(1.0)
    d_pad = max(16, next_pow2(dim))
    block_r = max(1, min(64, 8192 // d_pad))
    # the static key fixes every non-tensor argument: a repeated query shape skips featurising
    # the arguments (the int8 rerank's second launch, whose host time decides that call)
    launch(quantize_rows_kernel, (cdiv(n_rows, block_r),),
           (rows, values, scales, n_rows, dim, rows.stride(0), rows.stride(1)),
           dict(BLOCK_R=block_r, D_PAD=d_pad, QUANT_LIMIT=limit, TO_INT=to_int, CAST_ON_HOST=cast_on_host),
           static_key=("quantize", n_rows, dim, rows.stride(), x.dtype, dtype, limit, cast_on_host),
           caller_tensors=(rows,))
    return (values.to(dtype) if cast_on_host else values), scales
