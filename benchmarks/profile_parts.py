"""Where the time goes: forward with/without argmax, backward per strategy, host overhead.

Usage: python benchmarks/profile_parts.py [OUT_JSON]
"""
import json
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
import lik_plugins as lik  # noqa: E402

SHAPES = [  # (name, layout, nq, nj, lq, ld)
    ("rerank 1x1000", "cross", 1, 1000, 32, 300),
    ("colbert 256", "cross", 256, 256, 32, 256),
    ("colbert 1024", "cross", 1024, 1024, 32, 256),
    ("colpali 64", "cross", 64, 64, 32, 1030),
    ("colpali 256", "cross", 256, 256, 32, 1030),
    ("kd 64x32", "kd", 64, 32, 32, 256),
    ("hardneg 256x16", "kd", 256, 16, 32, 1030),
]


def timed(fn, reps=30):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        a.record(); fn(); b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev)


def main():
    res = []
    for name, layout, nq, nj, lq, ld in SHAPES:
        Q = torch.nn.functional.normalize(torch.randn(nq, lq, 128, device="cuda", dtype=torch.bfloat16), dim=-1)
        shp = (nj, ld, 128) if layout == "cross" else (nq, nj, ld, 128)
        D = torch.nn.functional.normalize(torch.randn(*shp, device="cuda", dtype=torch.bfloat16), dim=-1)
        row = {"shape": name}
        with torch.no_grad():
            row["fwd_nograd_ms"] = timed(lambda: lik.maxsim(Q, D))
        Qg, Dg = Q.clone().requires_grad_(), D.clone().requires_grad_()
        row["fwd_argmax_ms"] = timed(lambda: lik.maxsim(Qg, Dg))
        for strat in ("lowmem", "unified"):
            out = lik.maxsim(Qg, Dg, backward=strat)
            g = torch.randn_like(out)

            def bwd():
                torch.autograd.grad(out, (Qg, Dg), g, retain_graph=True)
            row[f"bwd_{strat}_ms"] = timed(bwd)
            row[f"bwd_{strat}_dq_only_ms"] = timed(lambda: torch.autograd.grad(out, (Qg,), g, retain_graph=True))
        # host overhead: wall time per call without waiting for the GPU
        with torch.no_grad():
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(200):
                lik.maxsim(Q, D)
            row["host_us_per_call"] = (time.perf_counter() - t) / 200 * 1e6
            torch.cuda.synchronize()
        print(json.dumps(row), flush=True)
        res.append(row)
        del Q, D, Qg, Dg
        torch.cuda.empty_cache()
    tuned = tuned_configs()
    print(json.dumps(tuned, indent=1))
    if len(sys.argv) > 1:
        json.dump({"parts": res, "tuned": tuned}, open(sys.argv[1], "w"), indent=1)




def tuned_configs():
    """What the autotuners picked, per key (feeds a fixed heuristic table)."""
    from lik_plugins.kernels.triton import tuning

    out = {}
    for name in ("_tuned_forward", "_tuned_doc"):
        tuner = getattr(tuning, name)
        out[name] = {str(k): str(v) for k, v in tuner.cache.items()}
    return out


if __name__ == "__main__":
    main()
