"""Argument checks shared by the public ops (:mod:`lik_plugins.ops`): clear errors, raised
before anything runs, and the score dtype every op promises."""
from __future__ import annotations

import torch

from ..kernels.reference import MASK_MODES
from ..autograd.dense import BACKWARD_STRATEGIES

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def score_tensor(scores: torch.Tensor) -> torch.Tensor:
    """Scores as every op returns them: float32, float64 for float64 inputs."""
    return scores if scores.dtype in (torch.float32, torch.float64) else scores.float()


def check_options(backward: str, mask_mode: str) -> None:
    if backward not in BACKWARD_STRATEGIES:
        raise ValueError(f"backward must be one of {', '.join(map(repr, BACKWARD_STRATEGIES))}; got {backward!r}")
    if mask_mode not in MASK_MODES:
        raise ValueError(f"mask_mode must be one of {', '.join(map(repr, MASK_MODES))}; got {mask_mode!r}")


def check_tensor(name: str, x, rank: int | tuple[int, ...]) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    ranks = (rank,) if isinstance(rank, int) else rank
    if x.dim() not in ranks:
        want = " or ".join(f"{r}-D" for r in ranks)
        raise ValueError(f"{name} must be {want}, got shape {tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}")


def check_mask(name: str, mask, shape: tuple[int, ...], owner) -> torch.Tensor | None:
    """``owner``: the tokens the mask belongs to (its ``.device`` is read only when there is a mask)."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(mask).__name__}")
    if tuple(mask.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(mask.shape)}")
    if mask.device != owner.device:
        raise ValueError(f"{name} is on {mask.device} but the embeddings are on {owner.device}")
    if mask.is_complex():
        raise TypeError(f"{name} must be bool or a real 0/1 tensor, got {mask.dtype}")
    # Non-zero = valid.  bool stays as is (the kernels read its bytes without a copy).
    return mask if mask.dtype == torch.bool else mask != 0


def prepare(Q, D, q_mask, d_mask, *, pairs: bool, backward: str, mask_mode: str):
    """Validate a dense op's options and tensors; return ``(q_mask, d_mask, cross)``.  Pairs
    keep ``D`` 3-D: the one-candidate view is taken inside the registered op."""
    check_options(backward, mask_mode)
    check_tensor("Q", Q, 3)
    check_tensor("D", D, 3 if pairs else (3, 4))
    if Q.dtype != D.dtype:
        raise TypeError(f"Q and D must have the same dtype, got {Q.dtype} and {D.dtype}")
    if pairs and D.shape[0] != Q.shape[0]:
        raise ValueError(f"maxsim_pairs needs one document per query: Q has B={Q.shape[0]}, D has B={D.shape[0]}")
    # pairs' D [B, Ld, d] and its mask [B, Ld] have the cross product's shapes
    q_mask, d_mask, cross = check_geometry(Q, D, q_mask, d_mask)
    return q_mask, d_mask, cross and not pairs


def check_geometry(Q: torch.Tensor, D: torch.Tensor, q_mask, d_mask):
    """Device, embedding dim, per-query candidate count and masks of ``Q [Nq, Lq, d]``
    against ``D [Nd, Ld, d]`` or ``[Nq, K, Ld, d]`` (token tensors of any dtype: the fp8
    path checks its values with it too).  Returns ``(q_mask, d_mask, cross)``."""
    # is_cuda and the device index are plain attributes; a torch.device is built only off CUDA
    if Q.is_cuda != D.is_cuda or Q.get_device() != D.get_device() or (not Q.is_cuda and Q.device != D.device):
        raise ValueError(f"Q is on {Q.device} but D is on {D.device}; move both to one device")
    if Q.shape[-1] != D.shape[-1]:
        raise ValueError(f"embedding dims differ: Q has d={Q.shape[-1]}, D has d={D.shape[-1]}")
    nq, lq = Q.shape[0], Q.shape[1]
    if D.dim() == 4 and D.shape[0] != nq:
        raise ValueError(f"per-query candidates D [Nq, K, Ld, d] must have Nq={nq} like Q, "
                         f"got D shape {tuple(D.shape)}")
    q_mask = check_mask("q_mask", q_mask, (nq, lq), Q)
    d_mask = check_mask("d_mask", d_mask, tuple(D.shape[:-1]), D)
    return q_mask, d_mask, D.dim() == 3


# ------------------------------------------------------------------ packed (cu_seqlens) inputs
INDEX_DTYPES = (torch.int32, torch.int64)
_INT32_MAX = 2**31 - 1


def check_index_tensor(name: str, x, owner) -> torch.Tensor:
    """A 1-D int32/int64 tensor on ``owner``'s device.  int64 is accepted: the caller checks
    the values, then converts to int32 (the kernels' index type)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64 (int64 is converted to int32), got {x.dtype}")
    if x.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(x.shape)}")
    if x.device != owner.device:
        raise ValueError(f"{name} is on {x.device} but the embeddings are on {owner.device}")
    return x


def check_offsets_shape(name: str, cu: torch.Tensor, packed_rows: int) -> None:
    """What the host can check of ``cu_seqlens`` without reading it."""
    if cu.numel() == 0:
        raise ValueError(f"{name} must hold at least one offset (0), got an empty tensor")
    if packed_rows > _INT32_MAX:
        raise ValueError(f"{name}: {packed_rows} packed tokens do not fit int32 offsets")


def check_offsets(name: str, cu: torch.Tensor, packed_rows: int, max_seqlen, max_name: str) -> tuple:
    """The offsets rule of ``cu_seqlens`` against its packed tensor of ``packed_rows`` tokens
    (starts at 0, ends at ``packed_rows``, never decreases, no sequence longer than
    ``max_seqlen``) as a check for :func:`settle_checks`: ``ok`` and ``longest`` 0-d device
    tensors (no host sync here), the broken rules' messages, and the whole rule in one sentence
    (the message of a check asserted on the device, where the offending index cannot be read
    without a host sync)."""
    check_offsets_shape(name, cu, packed_rows)
    lengths = cu[1:] - cu[:-1]
    # one [N] temporary and two reductions of it: with a second [N] one (a concatenation, a
    # bool mask) live beside it, the check's peak was twice the scores' of a 1-query rerank
    shortest, longest = torch.aminmax(lengths) if lengths.numel() else (lengths.new_zeros(()),) * 2
    ok = (cu[0] == 0) & (cu[-1] == packed_rows) & (shortest >= 0)
    if max_seqlen is not None:
        ok = ok & (longest <= max_seqlen)
    bound = "" if max_seqlen is None else f", and no sequence may be longer than {max_name}={max_seqlen}"
    rule = (f"{name} must start at 0, end at the packed length {packed_rows}, never decrease{bound} "
            f"(the error names the broken rule and its index when the offsets are checked on the host: "
            f"on the CPU outside torch.compile, or with {max_name} omitted)")
    return ok, longest, lambda: offsets_problems(name, cu, packed_rows, max_seqlen, max_name), rule


def _first(flags: torch.Tensor) -> int | None:
    hits = flags.nonzero()
    return int(hits[0]) if hits.numel() else None


def offsets_problems(name: str, cu: torch.Tensor, packed_rows: int, max_seqlen=None,
                     max_name: str = "max_seqlen") -> list[str]:
    """Every rule of the offsets that ``cu`` breaks, each with its first offending index
    (empty when it breaks none).  Reads ``cu`` on the host: for the error path, or where
    the offsets already are on the host."""
    if cu.numel() == 0:
        return [f"{name} must hold at least one offset (0), got an empty tensor"]
    cu = cu.detach().to("cpu", torch.int64)
    problems = []
    if cu[0] != 0:
        problems.append(f"{name}[0] = {int(cu[0])}: offsets must start at 0")
    past = _first(cu > packed_rows)
    if past is not None:
        problems.append(f"{name}[{past}] = {int(cu[past])} is past the packed length {packed_rows}: no offset may "
                        f"exceed the packed length")
    elif cu[-1] != packed_rows:
        problems.append(f"{name}[{cu.numel() - 1}] = {int(cu[-1])} (the last offset): offsets must end at the "
                        f"packed length {packed_rows}")
    lengths = cu[1:] - cu[:-1]
    down = _first(lengths < 0)
    if down is not None:
        problems.append(f"{name}[{down + 1}] = {int(cu[down + 1])} is below {name}[{down}] = {int(cu[down])}: "
                        f"offsets must never decrease")
    if max_seqlen is not None:
        long = _first(lengths > max_seqlen)
        if long is not None:
            problems.append(f"sequence {long} ({name}[{long}:{long + 2}] = {int(cu[long])}, {int(cu[long + 1])}) has "
                            f"{int(lengths[long])} tokens: no sequence may be longer than {max_name}={max_seqlen} "
                            f"(a bound below the longest sequence is an error, never a truncation)")
    return problems


def index_problems(name: str, idx: torch.Tensor, bound: int, bound_name: str) -> list[str]:
    """The first entry of ``idx`` outside ``[0, bound)``, as a message (host read)."""
    idx = idx.detach().to("cpu", torch.int64)
    bad = _first((idx < 0) | (idx >= bound))
    if bad is None:
        return []
    return [f"{name}[{bad}] = {int(idx[bad])}: pair indices must lie in [0, {bound_name}={bound})"]


def lengths_problems(name: str, lengths: torch.Tensor, bound: int) -> list[str]:
    """The first entry of an integer ``lengths`` tensor outside ``[0, bound]``, as a message
    with its index (host read)."""
    lengths = lengths.detach().cpu()
    bad = ((lengths < 0) | (lengths > bound)).nonzero()
    if not bad.numel():
        return []
    at = tuple(int(i) for i in bad[0])
    return [f"{name}[{', '.join(map(str, at))}] = {int(lengths[at])}: lengths must lie in [0, {bound}]"]


def settle_checks(checks: list, host_read_needed: bool) -> list | None:
    """Settle the checks ``[(ok, longest or None, explain, rule)]``: ``ok`` and ``longest``
    0-d device tensors, ``explain()`` the list of broken rules with their indices (called
    only when ``ok`` fails), ``rule`` the one-sentence rule.

    On the host -- when the caller needs a value read anyway (``host_read_needed``: a
    missing ``max_seqlen``, one sync), or when the tensors are on the CPU outside
    ``torch.compile`` (reading them costs nothing) -- every failure is a ``ValueError`` from
    ``explain()``, whatever the arguments, and each check's ``longest`` comes back as an
    int.  Otherwise (an accelerator with nothing to read, or a compiled graph) each check is
    asserted on the device (no sync) and None is returned."""
    device = checks[0][0].device
    if not host_read_needed and (device.type != "cpu" or torch.compiler.is_compiling()):
        for ok, _, _, rule in checks:
            # CUDA refuses a device assertion's message of 255 characters or more (a
            # RuntimeError on every call, broken or not): the rule's head is what fits
            torch._assert_async(ok, rule if len(rule) < 255 else rule[:251] + "...")
        return None
    values = torch.stack([torch.stack([ok.to(torch.int64), (longest if longest is not None else ok).to(torch.int64)])
                          for ok, longest, _, _ in checks]).tolist()
    for (ok, _), (_, _, explain, rule) in zip(values, checks):
        if not ok:
            raise ValueError("; ".join(explain()) or rule)
    return [longest for _, longest in values]


def check_max_seqlen(name: str, value) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise TypeError(f"{name} must be an int or None, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value
