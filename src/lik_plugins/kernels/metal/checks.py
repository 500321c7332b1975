"""Correctness checks of the Metal launchers against the reference, shared by the Mac
self-test (:mod:`.selftest`) and the repository's CPU emulator (``tools/metal_emulator``).

Each :class:`Case` builds fresh random inputs (masks with holes, a fully masked query and
document where the sizes allow), runs the launchers of :mod:`.launch` forward and
backward on ``device``, and measures the distance to the float64 reference
(:mod:`lik_plugins.kernels.reference`, the smooth-max reference) on the CPU; the argmax is
compared entry by entry with the chunked path's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import launch

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# max |kernel - reference| / max(1, max |reference|); the inputs are exact in their dtype,
# the kernel accumulates in fp32 and rounds gradients to the input dtype once
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@dataclass
class Case:
    name: str
    kind: str                  # "maxsim" or "smooth"
    layout: str                # "cross", "candidates", "pairs"
    nq: int
    lq: int
    nj: int                    # Nd (cross) or K (candidates); 1 for pairs
    ld: int
    dim: int
    masks: bool = False
    zero_mode: bool = False
    normalize: bool = False
    tau: float = 0.1
    seed: int = 0


def default_cases(quick: bool = False) -> list[Case]:
    """Small shapes that still reach every code path: row blocks spanning several queries
    (Lq < 32) and queries spanning several row blocks (Lq > 32), tails in every tile, d not
    a multiple of 8 or of the 32-wide slices, d over 128 (two grad passes), Lq = 1, Ld = 1."""
    cases = [
        Case("cross exclude masks", "maxsim", "cross", 3, 5, 4, 37, 40, masks=True),
        Case("cross zero norm Lq=1", "maxsim", "cross", 5, 1, 3, 9, 20, masks=True, zero_mode=True, normalize=True),
        Case("candidates zero masks", "maxsim", "candidates", 2, 7, 3, 10, 24, masks=True, zero_mode=True),
        Case("pairs norm Lq=40 d=136", "maxsim", "pairs", 3, 40, 1, 33, 136, masks=True, normalize=True),
        Case("cross Ld=1 d=13", "maxsim", "cross", 3, 6, 2, 1, 13),
        Case("smooth cross", "smooth", "cross", 3, 5, 2, 37, 40, tau=0.2),
        Case("smooth candidates Lq=40", "smooth", "candidates", 2, 40, 2, 9, 24, tau=0.05),
        Case("smooth pairs Ld=1 d=13", "smooth", "pairs", 3, 3, 1, 1, 13, tau=0.1),
    ]
    if quick:
        return [cases[0], cases[1], cases[2], cases[5]]
    return cases


def make_inputs(case: Case, dtype: torch.dtype):
    """CPU inputs of ``case`` in ``dtype``: ``(Q, D, q_mask, d_mask, grad)``."""
    g = torch.Generator().manual_seed(1000 + case.seed)
    nq, lq, nj, ld, dim = case.nq, case.lq, case.nj, case.ld, case.dim
    Q = torch.randn(nq, lq, dim, generator=g).to(dtype)
    cross = case.layout == "cross"
    d_shape = (nj, ld, dim) if cross else (nq, nj, ld, dim)
    D = torch.randn(*d_shape, generator=g).to(dtype)
    q_mask = d_mask = None
    if case.masks:
        q_mask = torch.rand(nq, lq, generator=g) > 0.25
        q_mask[0, 0] = True
        if nq >= 3:
            q_mask[-1] = False                       # a fully masked query
        d_mask = torch.rand(*d_shape[:-1], generator=g) > 0.3   # holes anywhere
        units = d_mask.view(-1, ld)
        units[:, 0] = True
        if units.shape[0] >= 3:
            units[1] = False                         # a fully masked document
    grad = torch.randn(nq, nj, generator=g)
    return Q, D, q_mask, d_mask, grad


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    if want.numel() == 0:
        return 0.0
    got, want = got.double(), want.double()
    if not torch.isfinite(got).all():
        return math.inf
    return float((got - want).abs().max() / max(1.0, float(want.abs().max())))


def check(case: Case, dtype: torch.dtype, device="cpu") -> dict[str, float]:
    """Run ``case`` in ``dtype`` on ``device``: ``{quantity: error}``."""
    return (check_maxsim if case.kind == "maxsim" else check_smooth)(case, dtype, device)


def check_maxsim(case: Case, dtype: torch.dtype, device="cpu") -> dict[str, float]:
    """Errors of ``launch.forward`` / ``launch.backward`` on ``device`` for ``case``."""
    from .. import chunked, reference

    Q, D, q_mask, d_mask, grad = make_inputs(case, dtype)
    Qd, Dd, qm, dm, g = (None if t is None else t.to(device) for t in (Q, D, q_mask, d_mask, grad))
    cross = case.layout == "cross"
    mode = "zero" if case.zero_mode else "exclude"
    scores, argmax = launch.forward(Qd, Dd, qm, dm, cross=cross, normalize=case.normalize,
                                    zero_mode=case.zero_mode, save_argmax=True)
    gq, gd = launch.backward(g, Qd, Dd, argmax, cross=cross, normalize=case.normalize,
                             need_q=True, need_d=True, strategy="lowmem")
    scores, argmax, gq, gd = scores.cpu(), argmax.cpu(), gq.cpu(), gd.cpu()

    Q64, D64 = Q.double().requires_grad_(), D.double().requires_grad_()
    # pairs are candidates of one ([Nq, 1, Ld, d]), as the launchers take them
    want = reference.maxsim(Q64, D64, q_mask, d_mask, normalize=case.normalize, mask_mode=mode)
    want_gq, want_gd = torch.autograd.grad(want, (Q64, D64), grad.double())
    # the argmax contract, against the independent chunked formulation on the same values
    _, want_arg = chunked.forward(Q.float(), D.float(), q_mask, d_mask, cross=cross,
                                  normalize=case.normalize, zero_mode=case.zero_mode, save_argmax=True)
    arg_mismatch = float((argmax.long() != want_arg).sum())
    if not want.detach().abs().max() > 0:
        raise AssertionError("degenerate case: every reference score is 0")
    return {
        "scores": _rel_err(scores, want.detach()),
        "grad_q": _rel_err(gq, want_gq),
        "grad_d": _rel_err(gd, want_gd),
        "argmax": arg_mismatch,
    }


def check_smooth(case: Case, dtype: torch.dtype, device="cpu") -> dict[str, float]:
    """Errors of ``launch.smooth_forward`` / ``smooth_backward`` on ``device`` for ``case``."""
    from ..reference import smooth_maxsim as smooth_maxsim_reference

    Q, D, _, _, grad = make_inputs(case, dtype)
    cross = case.layout == "cross"
    Qd, Dd = Q.to(device), D.to(device)
    scores, lse = launch.smooth_forward(Qd, Dd, case.tau, cross)
    gq, gd = launch.smooth_backward(Qd, Dd, lse, grad.to(device), case.tau, cross, True, True)
    scores, lse, gq, gd = scores.cpu(), lse.cpu(), gq.cpu(), gd.cpu()
    Q64, D64 = Q.double().requires_grad_(), D.double().requires_grad_()
    want = smooth_maxsim_reference(Q64, D64, tau=case.tau)   # its layout follows D: 3-D cross, 4-D candidates
    want_gq, want_gd = torch.autograd.grad(want, (Q64, D64), grad.double())
    sim = torch.einsum("ash,bth->abst", Q64, D64) if cross else torch.einsum("ash,akth->akst", Q64, D64)
    want_lse = torch.logsumexp(sim / case.tau, dim=-1)
    return {
        "scores": _rel_err(scores, want.detach()),
        "lse": _rel_err(lse, want_lse.detach()),
        "grad_q": _rel_err(gq, want_gq),
        "grad_d": _rel_err(gd, want_gd),
    }


@dataclass
class Result:
    case: Case
    dtype: torch.dtype
    errors: dict[str, float]
    kernels: list[str]
    failure: str = ""

    @property
    def ok(self) -> bool:
        return not self.failure


def judge(errors: dict[str, float], dtype: torch.dtype) -> str:
    bad = []
    for name, err in errors.items():
        if name == "argmax":
            if err:
                bad.append(f"{int(err)} argmax entries differ")
        elif not err <= TOLERANCE[dtype]:
            bad.append(f"{name} error {err:.3g} > {TOLERANCE[dtype]:.3g}")
    return "; ".join(bad)


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}[dtype]


def report(results: list[Result]) -> str:
    """Per-case lines, then one line per kernel: cases that ran it, failures, worst error."""
    lines = [f"{'case':<28} {'dtype':<5} {'result':<6} errors (relative to max(1, |ref|)) / failure"]
    for r in results:
        detail = r.failure or "  ".join(f"{k}={v:.2g}" for k, v in r.errors.items())
        lines.append(f"{r.case.name:<28} {dtype_name(r.dtype):<5} {'ok' if r.ok else 'FAIL':<6} {detail}")
    lines += ["", f"{'kernel':<20} {'cases':>5} {'failed':>6}  worst error"]
    for name in sorted({k for r in results for k in r.kernels}):
        rs = [r for r in results if name in r.kernels]
        worst = max((v for r in rs for k, v in r.errors.items() if k != "argmax"), default=float("nan"))
        lines.append(f"{name:<20} {len(rs):>5} {sum(not r.ok for r in rs):>6}  {worst:.2g}")
    return "\n".join(lines)
