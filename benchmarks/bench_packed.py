"""Packed, pair-list and padded MaxSim side by side with late-interaction-kernels 0.4.5 and
flash-maxsim 0.3.0 (one process, the same inputs), plus PyLate's ``rank.rerank`` patched vs
its own loop.

Usage: python benchmarks/bench_packed.py OUT_DIR [--smoke] [--reps 30]

Cases (bf16, d = 128, document lengths uniform in 50-300, query lengths <= 32):
* rerank 1 query x 1000 candidates (``maxsim_varlen``);
* 64 queries x 100 candidates each (``score_pairs_packed`` of 6400 pairs, and
  ``maxsim_padded`` on the padded ``[64, 100, 300, d]`` layout with lengths);
* in-batch packed training B = 256 (``maxsim_varlen`` forward + backward);
* a pair list of 100k pairs (1000 queries, 10k documents);
* PyLate ``rank.rerank`` 100 queries x 1000 candidates: patched against PyLate's own loop
  with its best native backend (``PYLATE_SCORES_BACKEND=auto``: flash-maxsim, else
  late-interaction-kernels, else torch).

Per case and implementation: median time over ``--reps`` (CUDA events; the interquartile
range as spread), peak memory above the inputs, max abs difference from ours.  A missing
peer is skipped with the reason printed.  flash-maxsim scores aligned pairs only: its rows
get the pairs pre-gathered outside the timed region (noted in the table), and it has no
in-batch packed cross product.  ``--smoke`` runs tiny sizes on the CPU (chunked path,
wall-clock timer) to show the script works.  Writes ``packed.json`` and ``packed.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lik_plugins as lik  # noqa: E402


def _peers():
    peers = {}
    try:
        import late_interaction_kernels as m

        peers["late-interaction-kernels"] = m
    except Exception as exc:  # noqa: BLE001 - report the missing peer
        print(f"[bench] late-interaction-kernels unavailable: {exc!r}")
    try:
        import flash_maxsim as m

        peers["flash-maxsim"] = m
    except Exception as exc:  # noqa: BLE001
        print(f"[bench] flash-maxsim unavailable: {exc!r}")
    return peers


def _timer(fn, reps, cuda):
    """(median ms, interquartile range ms)."""
    for _ in range(3):
        fn()
    if cuda:
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for s, e in zip(starts, ends):
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    else:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return statistics.median(times), q[2] - q[0]


def _peak(fn, cuda):
    if not cuda:
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _ragged(n, lo, hi, d, dtype, device, g):
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.nn.functional.normalize(torch.randn(L, d, generator=g), dim=-1).to(dtype).to(device)
            for L in lengths]


def _sizes(smoke):
    if smoke:
        return dict(rerank_c=40, multi_q=4, multi_c=6, train_b=6, pairs=300, pair_q=20, pair_d=60, ld=(5, 30),
                    lq=8, rr_q=3, rr_c=20, d=32)
    return dict(rerank_c=1000, multi_q=64, multi_c=100, train_b=256, pairs=100_000, pair_q=1000, pair_d=10_000,
                ld=(50, 300), lq=32, rr_q=100, rr_c=1000, d=128)


def run(out_dir, smoke, reps):
    cuda = torch.cuda.is_available() and not smoke
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    s = _sizes(smoke)
    d, (lo, hi), lq = s["d"], s["ld"], s["lq"]
    g = torch.Generator().manual_seed(0)
    peers = _peers() if cuda else {}
    rows = []

    def record(case, impl, fn, ref=None, note=""):
        try:
            out = fn()
            diff = None if ref is None else (out.float() - ref.float()).abs().max().item()
            ms, iqr = _timer(fn, reps, cuda)
            peak = _peak(fn, cuda)
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run a case: say why
            print(f"[bench] {case} / {impl}: {exc!r}")
            rows.append(dict(case=case, impl=impl, error=repr(exc)))
            return None
        rows.append(dict(case=case, impl=impl, ms=ms, iqr_ms=iqr, peak_mib=peak, max_abs_diff=diff, note=note))
        print(f"[bench] {case:34s} {impl:28s} {ms:9.3f} ms (IQR {iqr:.3f})  peak {peak}  diff {diff}")
        return out

    lik_m, flash_m = peers.get("late-interaction-kernels"), peers.get("flash-maxsim")

    # 1. rerank 1 x C
    Qp, cu_q, mq = lik.pack(_ragged(1, lq, lq, d, dtype, device, g))
    Dp, cu_d, md = lik.pack(_ragged(s["rerank_c"], lo, hi, d, dtype, device, g))
    case = f"rerank 1x{s['rerank_c']} Ld{lo}-{hi}"
    with torch.no_grad():
        ref = record(case, "lik_plugins", lambda: lik.maxsim_varlen(Qp, Dp, cu_q, cu_d, mq, md))
        if lik_m:
            record(case, "late-interaction-kernels", lambda: lik_m.maxsim_varlen(Qp, Dp, cu_q, cu_d, mq, md), ref)
        if flash_m:
            record(case, "flash-maxsim", lambda: flash_m.flash_maxsim_rerank(Qp, Dp, cu_d, md), ref)

    # 2. Nq x C candidates each: pair list and padded
    nq, c = s["multi_q"], s["multi_c"]
    qs = _ragged(nq, lq, lq, d, dtype, device, g)
    docs = _ragged(nq * c, lo, hi, d, dtype, device, g)
    Qp, cu_q, mq = lik.pack(qs)
    Dp, cu_d, md = lik.pack(docs)
    pq = torch.arange(nq, device=device, dtype=torch.int32).repeat_interleave(c)
    pd = torch.arange(nq * c, device=device, dtype=torch.int32)
    case = f"{nq} queries x {c} candidates"
    with torch.no_grad():
        ref = record(case, "lik_plugins pairs", lambda: lik.score_pairs_packed(Qp, Dp, cu_q, cu_d, pq, pd,
                                                                             max_seqlen_q=mq, max_seqlen_d=md))
        if lik_m:
            record(case, "late-interaction-kernels pairs", lambda: lik_m.score_pairs_packed(
                Qp, Dp, cu_q, cu_d, pq, pd, max_seqlen_q=mq, max_seqlen_d=md), ref)
        Qpad = torch.stack(qs)
        Dpad = torch.nn.utils.rnn.pad_sequence(docs, batch_first=True).view(nq, c, -1, d)
        q_len = torch.full((nq,), lq, device=device)
        d_len = torch.tensor([x.shape[0] for x in docs], device=device).view(nq, c)
        record(case, "lik_plugins padded", lambda: lik.maxsim_padded(Qpad, Dpad, q_len, d_len), ref.view(nq, c))
        if lik_m:
            record(case, "late-interaction-kernels padded", lambda: lik_m.maxsim_padded(Qpad, Dpad, q_len, d_len),
                   ref.view(nq, c))
        if flash_m:
            Qa, cu_qa, _ = lik.pack([qs[i] for i in pq.tolist()])
            record(case, "flash-maxsim varlen (pre-aligned)", lambda: flash_m.flash_maxsim_varlen(
                Qa, Dp, cu_qa, cu_d, mq, md), ref, note="pairs gathered outside the timing")

    # 3. in-batch packed training B x B, forward + backward
    b = s["train_b"]
    Qp, cu_q, mq = lik.pack(_ragged(b, max(1, lq // 2), lq, d, dtype, device, g))
    Dp, cu_d, md = lik.pack(_ragged(b, lo, hi, d, dtype, device, g))
    Qp.requires_grad_()
    Dp.requires_grad_()
    case = f"in-batch packed train B{b} fwd+bwd"

    def train(fn):
        def step():
            Qp.grad = Dp.grad = None
            out = fn(Qp, Dp, cu_q, cu_d, mq, md)
            out.backward(torch.ones_like(out))
            return out.detach()
        return step

    ref = record(case, "lik_plugins", train(lik.maxsim_varlen))
    if lik_m:
        record(case, "late-interaction-kernels", train(lik_m.maxsim_varlen), ref)

    # 4. a pair list
    n_pairs = s["pairs"]
    Qp, cu_q, mq = lik.pack(_ragged(s["pair_q"], max(1, lq // 2), lq, d, dtype, device, g))
    Dp, cu_d, md = lik.pack(_ragged(s["pair_d"], lo, hi, d, dtype, device, g))
    pq = torch.randint(0, s["pair_q"], (n_pairs,), generator=g).to(torch.int32).to(device)
    pd = torch.randint(0, s["pair_d"], (n_pairs,), generator=g).to(torch.int32).to(device)
    case = f"pair list {n_pairs}"
    with torch.no_grad():
        ref = record(case, "lik_plugins", lambda: lik.score_pairs_packed(Qp, Dp, cu_q, cu_d, pq, pd,
                                                                        max_seqlen_q=mq, max_seqlen_d=md))
        if lik_m:
            record(case, "late-interaction-kernels", lambda: lik_m.score_pairs_packed(
                Qp, Dp, cu_q, cu_d, pq, pd, max_seqlen_q=mq, max_seqlen_d=md), ref)
        if flash_m:
            qrows, drows = lik.unpack(Qp, cu_q), lik.unpack(Dp, cu_d)
            Qa, cu_qa, _ = lik.pack([qrows[i] for i in pq.tolist()])
            Da, cu_da, _ = lik.pack([drows[i] for i in pd.tolist()])
            record(case, "flash-maxsim varlen (pre-aligned)", lambda: flash_m.flash_maxsim_varlen(
                Qa, Da, cu_qa, cu_da, mq, md), ref, note="pairs gathered outside the timing")
            del Qa, Da

    # 5. PyLate rank.rerank, patched vs its own loop (best native backend under auto)
    rows.extend(_pylate_rerank(s, dtype, device, cuda, reps, g))
    meta = _environment(cuda, smoke)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "packed.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(os.path.join(out_dir, "packed.md"), "w") as f:
        f.write(_markdown(rows, meta))
    print(f"[bench] wrote {out_dir}/packed.json and packed.md")


def _pylate_rerank(s, dtype, device, cuda, reps, g):
    try:
        from pylate import rank
    except Exception as exc:  # noqa: BLE001
        print(f"[bench] PyLate unavailable: {exc!r}")
        return []
    nq, c, d = s["rr_q"], s["rr_c"], s["d"]
    lo, hi = s["ld"]
    queries = _ragged(nq, s["lq"], s["lq"], d, dtype, device, g)
    docs = [_ragged(c, lo, hi, d, dtype, device, g) for _ in range(nq)]
    ids = [list(range(c)) for _ in range(nq)]
    case = f"PyLate rank.rerank {nq}x{c} Ld{lo}-{hi}"
    out, results = [], {}
    runs = max(3, reps // 10)
    for name, patched in (("PyLate own loop (auto)", False), ("PyLate patched (lik_plugins)", True)):
        (lik.patch_pylate if patched else lik.unpatch_pylate)()
        call = lambda: rank.rerank(ids, queries, docs)  # noqa: E731
        results[name] = call()
        ms, iqr = _timer(call, runs, False)            # wall clock: the host loop is the cost
        peak = _peak(call, cuda)
        out.append(dict(case=case, impl=name, ms=ms, iqr_ms=iqr, peak_mib=peak,
                        note=f"PYLATE_SCORES_BACKEND={os.environ.get('PYLATE_SCORES_BACKEND', 'auto')}"))
        print(f"[bench] {case:34s} {name:28s} {ms:9.1f} ms (IQR {iqr:.1f})")
    lik.unpatch_pylate()
    a, b = results.values()
    same = sum([r["id"] for r in x] == [r["id"] for r in y] for x, y in zip(a, b))
    out[-1]["identical_rankings"] = f"{same}/{nq}"
    out[-1]["speedup_vs_own_loop"] = out[0]["ms"] / out[1]["ms"]
    return out


def _environment(cuda, smoke):
    meta = {"smoke": smoke, "torch": torch.__version__, "command": " ".join(sys.argv),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "device": torch.cuda.get_device_name() if cuda else "cpu"}
    from importlib.metadata import PackageNotFoundError, version

    for pkg in ("late-interaction-kernels", "flash-maxsim", "pylate", "triton"):
        try:
            meta[pkg] = version(pkg)
        except PackageNotFoundError:
            meta[pkg] = None
    return meta


def _markdown(rows, meta):
    lines = [f"# Packed / pair-list / padded MaxSim ({meta['device']})", "",
             f"`{meta['command']}` -- {meta['date']}; torch {meta['torch']}, triton {meta['triton']}, "
             f"late-interaction-kernels {meta['late-interaction-kernels']}, flash-maxsim {meta['flash-maxsim']}, "
             f"pylate {meta['pylate']}", "",
             "| case | implementation | median ms | IQR ms | peak MiB | max abs diff vs ours | note |",
             "|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['impl']} | error | | | | {r['error'][:80]} |")
            continue
        peak = "" if r.get("peak_mib") is None else f"{r['peak_mib']:.1f}"
        diff = "" if r.get("max_abs_diff") is None else f"{r['max_abs_diff']:.2e}"
        note = r.get("note", "")
        if "identical_rankings" in r:
            note += f"; identical rankings {r['identical_rankings']}, {r['speedup_vs_own_loop']:.1f}x own loop"
        lines.append(f"| {r['case']} | {r['impl']} | {r['ms']:.3f} | {r['iqr_ms']:.3f} | {peak} | {diff} | {note} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("out_dir")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU: the script works")
    p.add_argument("--reps", type=int, default=30)
    a = p.parse_args()
    run(a.out_dir, a.smoke, a.reps if not a.smoke else 3)
