"""sentence-transformers 6.x multi-vector scoring: patched (lik_plugins) vs ST's own path, side by side.

Same process, same inputs: for each case ST's function is run unpatched, then with
``lik_plugins.patch_sentence_transformers()``.  Reports parity (max |patched - ST| and against
an fp32 run of ST's own path), median time and peak memory above the inputs, and writes
``st_scoring.json`` + ``st_scoring.md`` into the directory given as argument.

    python benchmarks/st_scoring.py results/st_h100          # on the GPU machine (bf16)
    python benchmarks/st_scoring.py /tmp/st --quick          # tiny shapes, any device (smoke test)

Cases: the in-batch loss head (``colbert_scores`` over stacked groups, forward + backward),
knowledge distillation (``colbert_kd_scores``, forward + backward), MarginMSE-style pairs
(``colbert_scores_pairwise``), and evaluation (``maxsim`` of a query batch against a corpus,
padded and ragged, no grad).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _measure(fn, device, repeats: int):
    """(median seconds, peak bytes above the memory in use before the call, last output)."""
    out = fn()  # warm-up (compile, autotune)
    _sync(device)
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        out = fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    peak = None
    if device.type == "cuda":
        del out
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn()
        _sync(device)
        peak = torch.cuda.max_memory_allocated() - base
    return statistics.median(times), peak, out


def _tokens(shape, dtype, device, g, grad=False, pad_from=None):
    x = torch.nn.functional.normalize(torch.randn(*shape, generator=g, device=device), dim=-1)
    if pad_from is not None:  # zero-padded tails of random length (ST derives masks from them)
        lengths = torch.randint(pad_from, shape[-2] + 1, shape[:-2], generator=g, device=device)
        keep = torch.arange(shape[-2], device=device) < lengths[..., None]
        x = x * keep[..., None]
    x = x.to(dtype)
    return x.requires_grad_(grad)


def cases(quick: bool, dtype, device):
    g = torch.Generator(device=device).manual_seed(0)
    s = (lambda full, small: small if quick else full)
    B, Lq, Ld, H = s(64, 4), 32, s(256, 24), s(128, 16)
    N = 2
    q = _tokens((B, Lq, H), dtype, device, g, grad=True)
    docs = _tokens((B, N, Ld, H), dtype, device, g, grad=True, pad_from=Ld // 3)
    dmask = docs.detach().abs().sum(-1) > 0
    qmask = torch.ones(B, Lq, dtype=torch.bool, device=device)
    Bk, K, Ldk = s(32, 3), s(16, 3), s(180, 20)
    qk = _tokens((Bk, Lq, H), dtype, device, g, grad=True)
    dk = _tokens((Bk, K, Ldk, H), dtype, device, g, grad=True, pad_from=Ldk // 2)
    Nq, Nd, Lde = s(64, 4), s(4096, 40), s(300, 30)
    qe = _tokens((Nq, Lq, H), dtype, device, g)
    de = _tokens((Nd, Lde, H), dtype, device, g, pad_from=Lde // 4)
    ragged = [row[row.abs().sum(-1) > 0] for row in de]

    def scoring():
        from sentence_transformers.multi_vector_encoder import scoring as sc

        return sc

    def backward(out):
        out.float().sum().backward()
        return out

    return {
        f"loss head: colbert_scores B={B} N={N} Lq={Lq} Ld={Ld} d={H} fwd+bwd": (
            lambda: backward(scoring().colbert_scores(q, docs, queries_mask=qmask, documents_mask=dmask)), (q, docs)),
        f"distillation: colbert_kd_scores B={Bk} K={K} Ld={Ldk} fwd+bwd": (
            lambda: backward(scoring().colbert_kd_scores(qk, dk)), (qk, dk)),
        f"pairs: colbert_scores_pairwise B={B} Ld={Ld} fwd+bwd": (
            lambda: backward(scoring().colbert_scores_pairwise(q, docs[:, 0], documents_mask=dmask[:, 0])), (q, docs)),
        f"evaluation: maxsim Nq={Nq} Nd={Nd} Ld={Lde} padded, no grad": (
            lambda: _no_grad(lambda: __import__("sentence_transformers.util", fromlist=["maxsim"]).maxsim(qe, de)), ()),
        f"evaluation: maxsim Nq={Nq} Nd={Nd} ragged list, no grad": (
            lambda: _no_grad(lambda: __import__("sentence_transformers.util", fromlist=["maxsim"]).maxsim(qe, ragged)), ()),
    }


def _no_grad(fn):
    with torch.no_grad():
        return fn()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--quick", action="store_true", help="tiny shapes (smoke test on any device)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    if device.type == "cpu" and not args.quick:
        print("no CUDA device: use --quick for a CPU smoke test", file=sys.stderr)
        return 2
    import lik_plugins
    import sentence_transformers

    repeats = 3 if args.quick else args.repeats
    rows = []
    for name, (fn, leaves) in cases(args.quick, dtype, device).items():
        lik_plugins.unpatch_sentence_transformers()
        for leaf in leaves:
            leaf.grad = None
        st_time, st_peak, st_out = _measure(fn, device, repeats)
        st_out = st_out.detach().float()
        st_grads = [leaf.grad.float().clone() for leaf in leaves if leaf.grad is not None]
        lik_plugins.patch_sentence_transformers()
        lik_plugins.reset_routing_counts()
        for leaf in leaves:
            leaf.grad = None
        our_time, our_peak, our_out = _measure(fn, device, repeats)
        our_out = our_out.detach().float()
        our_grads = [leaf.grad.float().clone() for leaf in leaves if leaf.grad is not None]
        routing = lik_plugins.routing_counts()
        lik_plugins.unpatch_sentence_transformers()
        finite = st_out > -1e8  # the empty-document sentinel is compared for equality separately
        row = {
            "case": name,
            "st_ms": st_time * 1e3,
            "lik_ms": our_time * 1e3,
            "speedup": st_time / our_time,
            "st_peak_mb": None if st_peak is None else st_peak / 2**20,
            "lik_peak_mb": None if our_peak is None else our_peak / 2**20,
            "max_abs_diff": float((our_out - st_out)[finite].abs().max()) if finite.any() else 0.0,
            "max_rel_diff": float(((our_out - st_out).abs() / st_out.abs().clamp_min(1e-3))[finite].max()) if finite.any() else 0.0,
            "sentinels_equal": bool(torch.equal(our_out[~finite], st_out[~finite])),
            "grad_max_abs_diff": max((float((a - b).abs().max()) for a, b in zip(our_grads, st_grads)), default=None),
            "routing": routing,
        }
        rows.append(row)
        print(json.dumps(row))
    meta = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "sentence_transformers": sentence_transformers.__version__,
        "dtype": args.dtype,
        "quick": args.quick,
        "repeats": repeats,
    }
    with open(os.path.join(args.out_dir, "st_scoring.json"), "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    lines = [
        f"# sentence-transformers {meta['sentence_transformers']} scoring: lik_plugins vs ST's own path",
        "",
        f"{meta['device']}, torch {meta['torch']}, {meta['dtype']}, median of {repeats}.",
        "Parity: max |patched - ST| over finite scores (ST rounds each similarity to the input dtype, we keep fp32).",
        "",
        "| case | ST ms | lik ms | speedup | ST peak MB | lik peak MB | max abs diff | max rel diff | grad max abs diff |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    fmt = (lambda v, f="{:.3g}": "-" if v is None else f.format(v))
    for r in rows:
        lines.append(
            f"| {r['case']} | {fmt(r['st_ms'])} | {fmt(r['lik_ms'])} | {fmt(r['speedup'], '{:.2f}x')} | "
            f"{fmt(r['st_peak_mb'])} | {fmt(r['lik_peak_mb'])} | {fmt(r['max_abs_diff'])} | {fmt(r['max_rel_diff'])} | "
            f"{fmt(r['grad_max_abs_diff'])} |"
        )
    with open(os.path.join(args.out_dir, "st_scoring.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    ok = all(r["sentinels_equal"] for r in rows) and all(
        set(p) <= {"triton", "torch-chunked", "metal"} for r in rows for e, p in r["routing"].items()
        if e.startswith("sentence_transformers."))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
