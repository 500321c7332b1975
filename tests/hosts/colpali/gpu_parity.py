"""GPU parity with real colpali-engine (run on a CUDA machine; not collected by pytest).

    PYTHONPATH=src:tests python tests/hosts/colpali/gpu_parity.py results/colpali_gpu_parity.json

For each of the five loss heads, hard max and smooth max, fp32 and bf16: colpali's own
code (``COLPALI_SCORES_BACKEND=torch``, unpatched) versus the patched heads (Triton),
both measured against a float64 oracle (colpali's own code in fp64).  Forward loss and
gradients w.r.t. the raw embeddings (through ``normalize(E) * mask``, as a model sees
them).  Pass rule (the host's own precision is the bar): ``|ours - oracle| <= 2 * |host -
oracle| + atol``.  Also the fused smooth-max kernel alone against the fp64 reference,
all three layouts.  Writes JSON to ``argv[1]``; exit code 1 if anything failed.
"""
from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

import torch

import lik_plugins
from lik_plugins import smooth_maxsim
from lik_plugins.kernels.reference import smooth_maxsim as smooth_maxsim_reference
from support.colpali_helpers import embed, padded

HEADS = [
    ("ColbertLoss", False), ("ColbertPairwiseCELoss", False), ("ColbertSigmoidLoss", False),
    ("ColbertNegativeCELoss", True), ("ColbertPairwiseNegativeCELoss", True),
]
# bf16: colpali divides bf16 scores by T = 0.02, so one bf16 ulp of a score (~4e-3) moves
# a logit by ~0.2 — which of two bf16 runs lands closer to fp64 is luck at that scale.
ATOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2}


def _run(head, raw, negative):
    leaves = [None if r is None else r[0].detach().clone().requires_grad_() for r in raw]
    emb = [None if r is None else embed(leaf, r[1]) for leaf, r in zip(leaves, raw)]
    kwargs = dict(query_embeddings=emb[0], doc_embeddings=emb[1], offset=0)
    if negative:
        kwargs["neg_doc_embeddings"] = emb[2]
    loss = head(**kwargs)
    loss.backward()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return loss.detach().double(), [None if x is None else x.grad.double() for x in leaves]


def _err(a, b):
    return (a - b).abs().max().item()


def heads_parity(device, B=8, LQ=32, LD=257, DIM=128, NNEG=3):
    from colpali_engine.loss import late_interaction_losses as L

    rows = []
    g = torch.Generator().manual_seed(0)
    base = [padded((B, LQ, DIM), 8, g), padded((B, LD, DIM), 60, g), padded((B, NNEG, LD, DIM), 60, g)]
    for name, negative in HEADS:
        for smooth in (False, True):
            for dtype in (torch.float32, torch.bfloat16):
                raw = [(e.to(device, dtype), m.to(device, dtype)) for e, m in base]
                raw64 = [(e.to(device, torch.float64), m.to(device, torch.float64)) for e, m in base]
                if not negative:
                    raw, raw64 = raw[:2] + [None], raw64[:2] + [None]
                cls = getattr(L, name)
                os.environ["COLPALI_SCORES_BACKEND"] = "torch"
                oracle = _run(cls(use_smooth_max=smooth).double(), raw64, negative)
                host = _run(cls(use_smooth_max=smooth), raw, negative)
                del os.environ["COLPALI_SCORES_BACKEND"]
                lik_plugins.patch_colpali_engine()
                lik_plugins.reset_routing_counts()
                ours = _run(cls(use_smooth_max=smooth), raw, negative)
                routing = lik_plugins.routing_counts().get(f"colpali.{name}", {})
                lik_plugins.unpatch_colpali_engine()
                atol = ATOL[dtype]
                lscale = max(1.0, oracle[0].abs().item())
                checks = {"loss": (_err(ours[0], oracle[0]) / lscale, _err(host[0], oracle[0]) / lscale)}
                for label, o, h, r in zip(("grad_q", "grad_d", "grad_n"), ours[1], host[1], oracle[1]):
                    if r is not None:
                        scale = max(1.0, r.abs().max().item())
                        checks[label] = (_err(o, r) / scale, _err(h, r) / scale)
                ok = all(o <= 2 * h + atol for o, h in checks.values()) and routing == {"triton": 1}
                rows.append(dict(
                    head=name, smooth_max=smooth, dtype=str(dtype).replace("torch.", ""), routing=routing,
                    loss_ours=ours[0].item(), loss_colpali=host[0].item(), loss_oracle=oracle[0].item(),
                    errors={k: {"ours": o, "colpali": h} for k, (o, h) in checks.items()}, passed=ok,
                ))
                print(f"{'PASS' if ok else 'FAIL'} {name:32s} smooth={smooth!s:5s} {dtype}  "
                      + "  ".join(f"{k} {o:.2e}/{h:.2e}" for k, (o, h) in checks.items()), flush=True)
    return rows


def smooth_kernel_parity(device):
    rows = []
    shapes = [("cross", (16, 32, 128), (24, 1030, 128)), ("candidates", (8, 32, 128), (8, 4, 1030, 128)),
              ("pairs", (8, 20, 96), (8, 333, 96)), ("cross", (5, 1, 16), (3, 1, 16))]
    for layout, qs, ds in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            g = torch.Generator().manual_seed(1)
            Q = torch.nn.functional.normalize(torch.randn(*qs, generator=g), dim=-1).to(device)
            D = torch.nn.functional.normalize(torch.randn(*ds, generator=g), dim=-1).to(device)
            Q[:, -3:] = 0
            Q64, D64 = Q.double().requires_grad_(), D.double().requires_grad_()
            ref = smooth_maxsim_reference(Q64, D64, tau=0.1, layout=layout)
            gout = torch.randn(ref.shape, generator=g, dtype=torch.float64).to(device)
            rq, rd = torch.autograd.grad(ref, (Q64, D64), gout)
            Qx, Dx = Q.to(dtype).requires_grad_(), D.to(dtype).requires_grad_()
            out = smooth_maxsim(Qx, Dx, tau=0.1, layout=layout)
            oq, od = torch.autograd.grad(out, (Qx, Dx), gout.float())
            # the host's own precision: colpali's formula in this dtype
            hx, hd = Q.to(dtype).requires_grad_(), D.to(dtype).requires_grad_()
            host = smooth_maxsim_reference(hx, hd, tau=0.1, layout=layout)
            hq, hdd = torch.autograd.grad(host, (hx, hd), gout.to(dtype))
            errs = {
                "fwd": (_err(out.double(), ref) / max(1, ref.abs().max().item()),
                        _err(host.double(), ref) / max(1, ref.abs().max().item())),
                "grad_q": (_err(oq.double(), rq) / max(1, rq.abs().max().item()),
                           _err(hq.double(), rq) / max(1, rq.abs().max().item())),
                "grad_d": (_err(od.double(), rd) / max(1, rd.abs().max().item()),
                           _err(hdd.double(), rd) / max(1, rd.abs().max().item())),
            }
            ok = all(o <= 2 * h + ATOL[dtype] for o, h in errs.values())
            rows.append(dict(layout=layout, q=list(qs), d=list(ds), dtype=str(dtype).replace("torch.", ""),
                             errors={k: {"ours": o, "torch": h} for k, (o, h) in errs.items()}, passed=ok))
            print(f"{'PASS' if ok else 'FAIL'} smooth kernel {layout:10s} {dtype}  "
                  + "  ".join(f"{k} {o:.2e}/{h:.2e}" for k, (o, h) in errs.items()), flush=True)
    return rows


def main():
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "colpali_gpu_parity.json")
    assert torch.cuda.is_available(), "needs a CUDA device"
    import colpali_engine

    device = torch.device("cuda")
    for var in ("LIK_DISABLE", "LIK_BACKEND", "COLPALI_SCORES_BACKEND"):
        os.environ.pop(var, None)
    result = {
        "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
        "colpali_engine": getattr(colpali_engine, "__version__", "?"), "python": platform.python_version(),
        "heads": heads_parity(device), "smooth_kernel": smooth_kernel_parity(device),
    }
    result["passed"] = all(r["passed"] for r in result["heads"] + result["smooth_kernel"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"{'ALL PASSED' if result['passed'] else 'FAILURES'} -> {out}")
    sys.exit(0 if result["passed"] else 1)


if __name__ == "__main__":
    main()
