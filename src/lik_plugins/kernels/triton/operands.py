"""The host side of a launch's arguments, shared by every launcher: placeholders for absent
tensors, mask bytes, the strides of each layout, the matrix units' precision, and the
document formats the forward builds in its tile load (:class:`DocFormat`)."""
from __future__ import annotations

from typing import NamedTuple

import torch

from . import forward as forward_kernels
from .direct import MAX_PLANS

# Counts above this do not fit the kernels' 32-bit integer arguments (Triton would specialise them as 64-bit).
INT32_MAX = 2**31 - 1


def precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision for operands of ``dtype``: fp32 inputs must not be
    silently computed at reduced precision, so they take three TF32 passes (about fp32
    accuracy on the tensor cores).  16-bit operands ignore the setting."""
    return "tf32x3" if dtype == torch.float32 else "tf32"


_PLACEHOLDERS: dict = {}


def placeholder(device, dtype) -> torch.Tensor:
    """A stand-in for an absent optional tensor (never read: its flag is off).  Empty, so it
    owns no memory (a null pointer): a cached allocation made while CUDA graph trees warm up
    would live in their pool untracked, which they reject.  Cached per device so the hot
    path builds nothing for it."""
    key = (device, dtype)
    found = _PLACEHOLDERS.get(key)
    if found is None:
        found = _PLACEHOLDERS[key] = torch.empty(0, dtype=dtype, device=device)
    return found


def cached_plan(plans: dict, key, make) -> tuple:
    """``(plan, after_launch)`` of a launch of geometry ``key``: ``plans[key]``, else ``make()``'s,
    remembered unless the autotuner still has to run (``after_launch`` set: the plan is for
    this call only)."""
    plan = plans.get(key)
    if plan is not None:
        return plan, None
    plan, after_launch = make()
    if after_launch is None:
        if len(plans) >= MAX_PLANS:  # shapes that never repeat: start over
            plans.clear()
        plans[key] = plan
    return plan, after_launch


def mask_bytes(mask: torch.Tensor | None, device) -> torch.Tensor:
    if mask is None:
        return placeholder(device, torch.uint8)
    return mask.view(torch.uint8) if mask.dtype == torch.bool else (mask != 0).view(torch.uint8)


def doc_view(D, cross):
    """(documents per query, Ld, strides (query, document, token, dim)) of ``D``: in the
    cross product every query sees the same documents (query stride 0)."""
    if cross:
        return D.shape[0], D.shape[1], (0, *D.stride())
    return D.shape[1], D.shape[2], tuple(D.stride())


def norm_strides(rd, cross, normalize):
    """(query, document) strides of the document inverse norms (zeros when unused)."""
    if not normalize:
        return 0, 0
    return (0, rd.stride(0)) if cross else (rd.stride(0), rd.stride(1))


# The forward kernel's document formats (forward.py ``DOC_FORMAT``), as plain ints for the host.
DENSE, INT8, RESIDUAL, HIDDEN = (f.value for f in (forward_kernels.DENSE, forward_kernels.INT8,
                                                  forward_kernels.RESIDUAL, forward_kernels.HIDDEN))


class DocFormat(NamedTuple):
    """How the forward builds its document operand when ``D`` is not float tokens:

    * ``INT8``: ``D`` int8 tokens (``Q`` int8 too); the scales come in ``scales``.
    * ``RESIDUAL``: ``D`` the packed residuals ``[.., Ld, d*nbits/8]`` uint8, ``a0`` the codes
      ``[.., Ld]`` int32, ``a1`` the centroids ``[C, d]`` contiguous, ``a2`` the bucket
      weights ``[2**nbits]`` fp32 in stream order (:func:`stream_order_weights`); ``aux_n = C``.
    * ``HIDDEN``: ``D`` the hidden states ``[.., Ld, h]``, ``a0`` the projection ``W [d, h]``
      contiguous, ``a1`` its bias ``[d]`` (``has_bias``); ``aux_n = h``.

    ``a0_strides``: (query, document, token) strides of ``a0`` as ``D``'s (0 where ``a0``
    is shared by every document)."""
    kind: int
    a0: torch.Tensor | None = None
    a1: torch.Tensor | None = None
    a2: torch.Tensor | None = None
    a0_strides: tuple = (0, 0, 0)
    aux_n: int = 0
    nbits: int = 0
    has_bias: bool = False

    def key(self) -> tuple:
        dtypes = tuple(None if t is None else t.dtype for t in (self.a0, self.a1, self.a2))
        return (self.kind, dtypes, self.a0_strides, self.aux_n, self.nbits, self.has_bias)

    def tensors(self, stand_in: torch.Tensor) -> tuple:
        """``(a0, a1, a2)`` with ``stand_in`` for the absent ones."""
        return tuple(stand_in if t is None else t for t in (self.a0, self.a1, self.a2))


_STREAM_ORDER: dict = {}


def stream_order_weights(bucket_weights: torch.Tensor, nbits: int) -> torch.Tensor:
    """``bucket_weights`` re-indexed by the residual field as stored in a byte (the bucket's
    ``nbits`` bits reversed): the RESIDUAL operand's ``a2``.  The permutation is cached per
    device; applying it is one small gather."""
    key = (nbits, bucket_weights.device)
    perm = _STREAM_ORDER.get(key)
    if perm is None:
        perm = torch.tensor([int(f"{field:0{nbits}b}"[::-1], 2) for field in range(1 << nbits)],
                            device=bucket_weights.device)
        _STREAM_ORDER[key] = perm
    return bucket_weights[perm].contiguous()


def format_meta(fmt: DocFormat, dtype: torch.dtype, dim: int, d_pad: int) -> dict:
    """The forward kernel's compile-time arguments for a document format (the projection
    head's sizes among them: forward.maxsim_fwd_kernel says why)."""
    # BLOCK_H: the hidden state's slice per projection step ([d, BLOCK_H] of W, [BLOCK_H, BLOCK_N] of H)
    return dict(DOC_FORMAT=fmt.kind, NBITS=fmt.nbits, HAS_BIAS=fmt.has_bias,
                BLOCK_H=32 if dtype == torch.float32 else 64, N_HIDDEN=fmt.aux_n if fmt.kind == HIDDEN else 0,
                EVEN_DIM=fmt.kind in (HIDDEN, RESIDUAL) and dim == d_pad)


def built_key(Q: torch.Tensor, D: torch.Tensor, fmt: DocFormat, packed: bool = False) -> tuple:
    """The config table's dtype field for documents built in the kernel.  Residuals are tuned
    per bit width, and apart when packed: padded and packed residual documents run best on
    different tile widths (docs/performance-notes.md, PLAID residual)."""
    if fmt.kind != RESIDUAL:
        return (Q.dtype, D.dtype, fmt.kind)
    return (Q.dtype, D.dtype, fmt.kind, fmt.nbits) + (("packed",) if packed else ())


def documents_only(doc_format: DocFormat | None) -> bool:
    """``normalize`` leaves the queries as given: the projection head's meaning (the kernel's
    SCALE_Q)."""
    return doc_format is not None and doc_format.kind == HIDDEN
