"""sentence-transformers 6.3: our MaxSim against ST's own torch path and against late-interaction-kernels,
side by side in one process on the same inputs.

    python benchmarks/bench_st63.py [OUT_DIR] [--tiny] [--reps 5] [--warmup 2] [--rounds 3]

(a) ``lists``: ``sentence_transformers.util.maxsim`` on two lists of ragged tensors -- 6.3's public
    list scorer, what its evaluators and ``model.similarity`` on encoded lists call -- 100 queries
    of 32 tokens x 5000 documents of 50-300 tokens, bf16: ST's own chunked path (``st``) against
    the same call patched (``ours``).  The patch is applied and removed between the timed calls
    of a round, so both variants see the same machine state.
(b) ``kernel_config``: ST's scoring shapes through ST's own kernel mechanism (the model scorer
    ``model.similarity`` uses, ``_MaxSimScorer(kernel_config)``, patch off): ``st`` (no
    kernel_config: ST's einsum), ``ours`` (``lik_plugins.sentence_transformers.kernel_config()``)
    and ``lik045`` -- late-interaction-kernels 0.4.5 (the pip package, namesake of ST's default
    Hub repository ``sentence-transformers/late-interaction-kernels``, which this machine cannot
    reach) wrapped in a layer repository written to a temporary folder, its ``maxsim`` /
    ``maxsim_pairs`` on ST's chunks.  Cases: in-batch training scores (forward + backward),
    hard-negative pairs (forward + backward), a padded rerank block (forward, no grad).

Every call is synchronised and timed with ``perf_counter`` after ``--warmup`` untimed calls
(compilation, kernels' layer loading); variants alternate within each round.  Rows: median,
min, max seconds a call, ``x_st`` (ST's median over the variant's), the largest absolute score
difference from ST's on documents with a valid token, the share of queries ranked identically
(``lists``), peak GPU memory above what was in use before the calls.  Written to
``OUT_DIR/bench_st63.csv`` (default ``$OUT``, else the current folder) and printed as Markdown.
``--tiny``: small shapes in fp32 on the CPU, to check that the script runs.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

FIELDS = ["part", "case", "variant", "dtype", "device", "median_s", "min_s", "max_s", "x_st",
          "max_abs_diff_vs_st", "identical_rankings", "peak_mib", "error", "torch", "sentence_transformers", "gpu"]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time(fn, device, reps, warmup):
    """(seconds of each timed call, peak bytes above the memory in use before them, last output)."""
    for _ in range(warmup):
        out = fn()
    _sync(device)
    base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        out = fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() - base if device.type == "cuda" else 0
    return times, peak, out


def _ragged(n, lo, hi, dim, dtype, device, seed):
    """``n`` unit-token tensors of ``lo..hi`` tokens, split views of one buffer (how encoders return them)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    flat = torch.nn.functional.normalize(torch.randn(sum(lengths), dim, generator=g), dim=-1)
    return list(torch.split(flat.to(device=device, dtype=dtype), lengths))


def _padded(n, length, dim, dtype, device, seed, holes=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.nn.functional.normalize(torch.randn(n, length, dim, generator=g), dim=-1).to(device=device, dtype=dtype)
    lengths = torch.randint(max(1, length // 3), length + 1, (n,), generator=g)
    mask = torch.arange(length)[None, :] < lengths[:, None]
    if holes:   # ST's skiplist punches holes inside documents
        mask &= torch.rand(n, length, generator=g) > 0.1
    return x, mask.to(device)


def _diff(ours, theirs):
    ours, theirs = ours.detach().float().cpu(), theirs.detach().float().cpu()
    valid = theirs > -1e8   # ST's sentinel marks documents without a valid token
    return float((ours - theirs).abs()[valid].max()) if bool(valid.any()) else 0.0


def _row(part, case, variant, dtype, device, times, peak, **extra):
    return {"part": part, "case": case, "variant": variant, "dtype": str(dtype).replace("torch.", ""),
            "device": device.type, "median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "peak_mib": round(peak / 2**20, 1), **extra}


# ---------------------------------------------------------------------------------- (a) lists


def bench_lists(args, device, dtype):
    from sentence_transformers.util import maxsim

    from lik_plugins.sentence_transformers import patch_sentence_transformers, unpatch_sentence_transformers

    nq, nd, lo, hi = (4, 30, 5, 20) if args.tiny else (100, 5000, 50, 300)
    queries = _ragged(nq, 32, 32, 128, dtype, device, seed=1)
    docs = _ragged(nd, lo, hi, 128, dtype, device, seed=2)
    variants = {"st": unpatch_sentence_transformers, "ours": patch_sentence_transformers}
    times = {v: [] for v in variants}
    peaks, outs = {v: 0 for v in variants}, {}
    for _ in range(args.rounds):
        for variant, switch in variants.items():
            switch()
            t, peak, outs[variant] = _time(lambda: maxsim(queries, docs), device, args.reps, args.warmup)
            times[variant] += t
            peaks[variant] = max(peaks[variant], peak)
    unpatch_sentence_transformers()
    order = {v: torch.argsort(o.float().cpu(), dim=1, descending=True, stable=True) for v, o in outs.items()}
    st_median = statistics.median(times["st"])
    return [_row("lists", f"{nq}x{nd} {lo}-{hi} tok", v, dtype, device, times[v], peaks[v],
                 x_st=round(st_median / statistics.median(times[v]), 3), max_abs_diff_vs_st=_diff(outs[v], outs["st"]),
                 identical_rankings=float((order[v] == order["st"]).all(dim=1).float().mean()))
            for v in variants]


# ------------------------------------------------------------------------- (b) kernel_config

LIK045_LAYERS = '''"""late-interaction-kernels as an ST 6.3 kernel layer (benchmark only)."""
import torch
import late_interaction_kernels as lik


class MaxSim(torch.nn.Module):
    def forward(self, a, b, a_mask, b_mask):
        return lik.maxsim(a, b, a_mask, b_mask).float()


class MaxSimPairwise(torch.nn.Module):
    def forward(self, a, b, a_mask, b_mask):
        return lik.maxsim_pairs(a, b, a_mask, b_mask).float()


class layers:
    MaxSim = MaxSim
    MaxSimPairwise = MaxSimPairwise
'''


def _lik045_repository(folder: Path) -> Path:
    variant = folder / "lik045" / "torch-universal"
    variant.mkdir(parents=True, exist_ok=True)
    (variant / "__init__.py").write_text(LIK045_LAYERS)
    (variant / "metadata.json").write_text(json.dumps({
        "id": "bench_late_interaction_kernels_045", "name": "bench-late-interaction-kernels", "version": 1,
        "license": "Apache-2.0", "python-depends": [], "backend": {"type": "universal"}}))
    return variant.parent


def _scorers(folder: Path):
    from sentence_transformers.multi_vector_encoder.scoring.colbert import _MaxSimScorer
    from transformers import KernelConfig

    from lik_plugins.sentence_transformers import kernel_config

    repo = _lik045_repository(folder)
    lik045 = KernelConfig({"STMaxSim": f"{repo}:MaxSim", "STMaxSimPairwise": f"{repo}:MaxSimPairwise"},
                          use_local_kernel=True)
    return {"st": _MaxSimScorer(None), "ours": _MaxSimScorer(kernel_config()), "lik045": _MaxSimScorer(lik045)}


def _cases(tiny, device, dtype):
    """(name, call(scorer) -> scores, needs grad); inputs built once, shared by every variant."""
    b, n, lq, ld = (4, 2, 8, 20) if tiny else (128, 2, 32, 180)
    Q, q_mask = _padded(b, lq, 128, dtype, device, seed=3, holes=False)
    D, d_mask = _padded(b * n, ld, 128, dtype, device, seed=4)
    k = 4 if tiny else 16
    Qk = Q.repeat_interleave(k, dim=0)
    qk_mask = q_mask.repeat_interleave(k, dim=0)
    Dk, dk_mask = _padded(b * k, ld, 128, dtype, device, seed=5)
    nr, ndr, ldr = (4, 30, 40) if tiny else (100, 1000, 300)
    Qr, qr_mask = _padded(nr, 32, 128, dtype, device, seed=6, holes=False)
    Dr, dr_mask = _padded(ndr, ldr, 128, dtype, device, seed=7)

    def train_step(scorer, pairwise, q, qm, d, dm):
        q, d = q.detach().requires_grad_(), d.detach().requires_grad_()
        out = (scorer.pairwise if pairwise else scorer)(q, d, a_mask=qm, b_mask=dm)
        out.float().sum().backward()
        return out.detach()

    def rerank(scorer):
        with torch.no_grad():
            return scorer(Qr, Dr, a_mask=qr_mask, b_mask=dr_mask)

    return [
        (f"in-batch fwd+bwd {b}x{b * n} Lq{lq} Ld{ld}", lambda s: train_step(s, False, Q, q_mask, D, d_mask)),
        (f"pairs fwd+bwd {b}x{k} Lq{lq} Ld{ld}", lambda s: train_step(s, True, Qk, qk_mask, Dk, dk_mask)),
        (f"rerank fwd {nr}x{ndr} Ld{ldr}", rerank),
    ]


def bench_kernel_config(args, device, dtype, folder: Path):
    from lik_plugins.sentence_transformers import unpatch_sentence_transformers

    unpatch_sentence_transformers()   # ST's own mechanism alone
    scorers = _scorers(folder)
    rows = []
    for case, call in _cases(args.tiny, device, dtype):
        times = {v: [] for v in scorers}
        peaks, outs, errors = {v: 0 for v in scorers}, {}, {}
        for _ in range(args.rounds):
            for variant, scorer in scorers.items():
                if variant in errors:
                    continue
                try:
                    t, peak, outs[variant] = _time(lambda: call(scorer), device, args.reps, args.warmup)
                except Exception as exc:  # noqa: BLE001 -- a peer that cannot run here is a row, not a crash
                    errors[variant] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                    continue
                times[variant] += t
                peaks[variant] = max(peaks[variant], peak)
        st_median = statistics.median(times["st"])
        for variant in scorers:
            if variant in errors:
                rows.append({"part": "kernel_config", "case": case, "variant": variant, "dtype": str(dtype).replace("torch.", ""),
                             "device": device.type, "error": errors[variant]})
                continue
            rows.append(_row("kernel_config", case, variant, dtype, device, times[variant], peaks[variant],
                             x_st=round(st_median / statistics.median(times[variant]), 3),
                             max_abs_diff_vs_st=_diff(outs[variant], outs["st"])))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", default=os.environ.get("OUT", "."))
    parser.add_argument("--tiny", action="store_true", help="small fp32 shapes on the CPU (does it run?)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--parts", default="lists,kernel_config")
    args = parser.parse_args()

    import sentence_transformers

    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    common = {"torch": torch.__version__, "sentence_transformers": sentence_transformers.__version__,
              "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if "lists" in args.parts:
            rows += bench_lists(args, device, dtype)
        if "kernel_config" in args.parts:
            rows += bench_kernel_config(args, device, dtype, Path(tmp))
    rows = [{**row, **common} for row in rows]

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_st63.csv")
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    print(f"# sentence-transformers {common['sentence_transformers']}, torch {common['torch']}, {common['gpu']} "
          f"({args.rounds} rounds x {args.reps} calls, {args.warmup} warm-up)\n")
    shown = ["part", "case", "variant", "dtype", "median_s", "x_st", "max_abs_diff_vs_st", "identical_rankings", "peak_mib", "error"]
    print("| " + " | ".join(shown) + " |\n|" + "---|" * len(shown))
    for row in rows:
        cells = [f"{row[k]:.4g}" if isinstance(row.get(k), float) else str(row.get(k, "")) for k in shown]
        print("| " + " | ".join(cells) + " |")
    print(f"\nwritten: {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
