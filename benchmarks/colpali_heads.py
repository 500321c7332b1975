"""colpali-engine loss heads at ColPali scale (Lq=32, Ld=1030, d=128, bf16), forward + backward.

    python benchmarks/colpali_heads.py benchmarks/results/colpali_heads

Providers, side by side in one process on the same inputs:
* ``vanilla``   colpali-engine unpatched, ``COLPALI_SCORES_BACKEND=torch`` (its einsum path);
* ``lik-native`` colpali-engine 0.3.18 unpatched, ``COLPALI_SCORES_BACKEND=lik`` (its own
  backend running late-interaction-kernels; smooth max has no kernel there and runs einsum);
* ``patched``   ``lik_plugins.patch_colpali_engine()`` (our kernels; fused smooth max).

Rows: in-batch ``ColbertLoss`` B in {32, 64, 128, 256}; explicit negatives
``ColbertPairwiseNegativeCELoss`` (defaults, so with its in-batch term) B x n_neg in
{64x4, 128x8, 256x8, 256x16}; smooth max ``ColbertLoss(use_smooth_max=True)`` B in {64, 128}.
Time = median of CUDA-event-timed iterations of loss + backward; peak = peak allocated
during one iteration above the inputs.  Writes ``colpali_heads.json`` and
``colpali_heads.md`` into the directory given.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import lik_plugins  # noqa: E402

LQ, LD, DIM = 32, 1030, 128
ROWS = (
    [("in-batch", "ColbertLoss", {}, b, 0) for b in (32, 64, 128, 256)]
    + [("negatives", "ColbertPairwiseNegativeCELoss", {}, b, n) for b, n in ((64, 4), (128, 8), (256, 8), (256, 16))]
    + [("smooth-max", "ColbertLoss", {"use_smooth_max": True}, b, 0) for b in (64, 128)]
)


def _inputs(b, n_neg, device):
    g = torch.Generator(device=device).manual_seed(0)

    def emb(*shape, pad):
        x = torch.nn.functional.normalize(torch.randn(*shape, DIM, device=device, generator=g), dim=-1)
        length = shape[-1]
        keep = torch.randint(length - pad, length + 1, shape[:-1], device=device, generator=g)
        mask = torch.arange(length, device=device) < keep.unsqueeze(-1)
        return (x * mask.unsqueeze(-1)).to(torch.bfloat16).requires_grad_()

    q = emb(b, LQ, pad=12)
    d = emb(b, LD, pad=200)
    n = emb(b, n_neg, LD, pad=200) if n_neg else None
    return q, d, n


def _step(loss_fn, q, d, n):
    for t in (q, d, n):
        if t is not None:
            t.grad = None
    kwargs = dict(query_embeddings=q, doc_embeddings=d, offset=0)
    if n is not None:
        kwargs["neg_doc_embeddings"] = n
    loss_fn(**kwargs).backward()


def _measure(loss_fn, q, d, n, iters):
    for _ in range(2):
        _step(loss_fn, q, d, n)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    _step(loss_fn, q, d, n)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        _step(loss_fn, q, d, n)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), peak


def _provider(name):
    """Set the process up for one provider; returns False if it is unavailable."""
    lik_plugins.unpatch_colpali_engine()
    os.environ.pop("COLPALI_SCORES_BACKEND", None)
    if name == "vanilla":
        os.environ["COLPALI_SCORES_BACKEND"] = "torch"
    elif name == "lik-native":
        try:
            import late_interaction_kernels  # noqa: F401
            from colpali_engine.utils import _lik_backend
        except ImportError:
            return False
        _lik_backend._IMPORT_OK = None
        os.environ["COLPALI_SCORES_BACKEND"] = "lik"
    else:
        lik_plugins.patch_colpali_engine()
    return True


def main():
    out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/colpali_heads")
    out_dir.mkdir(parents=True, exist_ok=True)
    from colpali_engine.loss import late_interaction_losses as L

    device = torch.device("cuda")
    results = []
    for kind, head, kwargs, b, n_neg in ROWS:
        q, d, n = _inputs(b, n_neg, device)
        iters = 10 if b * max(n_neg, 1) <= 512 else 5
        row = dict(kind=kind, head=head, kwargs=kwargs, B=b, n_neg=n_neg, Lq=LQ, Ld=LD, d=DIM, dtype="bfloat16")
        for provider in ("vanilla", "lik-native", "patched"):
            if not _provider(provider):
                row[provider] = None
                continue
            effective = provider
            if provider == "lik-native" and kwargs.get("use_smooth_max"):
                effective = "lik-native (einsum: no smooth-max kernel)"
            lik_plugins.reset_routing_counts()
            try:
                ms, peak = _measure(getattr(L, head)(**kwargs), q, d, n, iters)
                row[provider] = dict(ms=ms, peak_mib=peak / 2**20, note=effective,
                                     routing=lik_plugins.routing_counts() if provider == "patched" else None)
            except torch.cuda.OutOfMemoryError:
                row[provider] = dict(ms=None, peak_mib=None, note="OOM")
            torch.cuda.empty_cache()
        lik_plugins.unpatch_colpali_engine()
        os.environ.pop("COLPALI_SCORES_BACKEND", None)
        results.append(row)
        print(json.dumps(row), flush=True)
        del q, d, n
        torch.cuda.empty_cache()

    meta = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__)
    (out_dir / "colpali_heads.json").write_text(json.dumps(dict(meta=meta, rows=results), indent=2))
    lines = [
        f"# colpali-engine loss heads, fwd+bwd, bf16, Lq={LQ}, Ld={LD}, d={DIM} — {meta['device']}", "",
        "| rows | head | B | n_neg | vanilla ms | lik-native ms | patched ms | vanilla/patched | lik/patched "
        "| vanilla MiB | lik MiB | patched MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(x, key, fmt):
        return "—" if not x or x.get(key) is None else format(x[key], fmt)

    for r in results:
        v, k, p = r["vanilla"], r["lik-native"], r["patched"]
        ratio = lambda a: "—" if not a or not p or a.get("ms") is None or p.get("ms") is None else f"{a['ms'] / p['ms']:.2f}x"  # noqa: E731
        lines.append(
            f"| {r['kind']} | {r['head']}{' (smooth)' if r['kwargs'] else ''} | {r['B']} | {r['n_neg']} "
            f"| {f(v, 'ms', '.2f')} | {f(k, 'ms', '.2f')} | {f(p, 'ms', '.2f')} | {ratio(v)} | {ratio(k)} "
            f"| {f(v, 'peak_mib', '.0f')} | {f(k, 'peak_mib', '.0f')} | {f(p, 'peak_mib', '.0f')} |"
        )
    (out_dir / "colpali_heads.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
