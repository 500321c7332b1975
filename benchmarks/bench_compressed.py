"""Compressed indexes and the fused projection head, side by side with the peers: PLAID
residual rerank, PLAID's centroid score, int8 vs bf16 memory-bound rerank, maxsim_from_hidden.

Usage: python benchmarks/bench_compressed.py OUT_DIR [--smoke] [--reps 50]

Peers, in the same process on the same inputs, where installed (a missing one is skipped
and the table says so): late-interaction-kernels 0.4.5 (``plaid.maxsim_residual``,
``plaid.maxsim_residual_varlen``, ``plaid.plaid_approx_score``,
``fused_head.maxsim_from_hidden``) and flash-maxsim 0.3.0's int8 paths
(``flash_maxsim_int8``: affine uint8 tokens with fp16 scales and mins;
``flash_maxsim_int8x8``: symmetric int8 x int8).  Each peer gets its own representation of
the same data, built outside the timing: residual bytes re-packed into
late-interaction-kernels' layout, its ``[C, Lq]`` centroid scores, flash-maxsim's own
quantisation helpers.  A peer call that raises is recorded with its error, not hidden.

Per row: median time (CUDA events; p10-p90 spread), peak memory above the inputs, max
relative error against an fp32 computation of the same numbers (int8 rows: of the
unquantised tokens, plus the error against their own dequantised tokens), and for the
memory-bound reranks the fraction of the bandwidth floor: the bytes of the compressed (or
int8 / bf16) index read once at this GPU's measured copy bandwidth.  Writes ``compressed.json`` and
``compressed.md``.  ``--smoke``: tiny shapes on the CPU (timing by the wall clock), to
show the script runs.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
sys.path.insert(0, "src")  # this checkout's lik_plugins
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lik_plugins as lik  # noqa: E402
from lik_plugins.ops import plaid  # noqa: E402
from lik_plugins.kernels import reference  # noqa: E402

from bench_kernels import environment, measure_ceilings, peak_bytes  # noqa: E402


def _time(fn, reps: int, cuda: bool, warmup: int = 3) -> dict:
    """Median and p10/p90 of ``fn()`` in ms."""
    for _ in range(warmup):
        fn()
    samples = []
    if cuda:
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for r in range(reps):
            starts[r].record()
            fn()
            ends[r].record()
        torch.cuda.synchronize()
        samples = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    samples.sort()
    pick = lambda q: samples[min(len(samples) - 1, int(q * len(samples)))]  # noqa: E731
    # back to back: wall time per call over ``reps`` calls in a row, one sync at the end --
    # what a serving loop sees; where the host is slower than the GPU this, not the
    # per-call events above, is the call's cost, and where it is faster the two agree
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if cuda:
        torch.cuda.synchronize()
    pipelined = (time.perf_counter() - t0) * 1e3 / reps
    return {"ms": statistics.median(samples), "p10_ms": pick(0.1), "p90_ms": pick(0.9), "pipelined_ms": pipelined}


def _rel(out, ref):
    out = out.float().reshape(ref.shape)
    return float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


def _peer(module: str, attr: str):
    """(callable, None) or (None, why it is missing)."""
    try:
        mod = __import__(module, fromlist=[attr])
        return getattr(mod, attr), None
    except Exception as exc:  # noqa: BLE001 - not installed, or a different API
        return None, f"{module}.{attr} unavailable: {type(exc).__name__}: {exc}"


def _measure(rows, group, name, fn, ref, reps, cuda, floor_bytes=None, bw=None, extra=None, own_ref=None):
    row = {"group": group, "impl": name, **(extra or {})}
    try:
        out = fn()
        if cuda:
            torch.cuda.synchronize()
        row["rel_err"] = _rel(out, ref) if ref is not None else None
        if own_ref is not None:
            row["own_err"] = _rel(out, own_ref)
        del out
        row["peak_bytes"] = peak_bytes(fn, cuda)
        row.update(_time(fn, reps, cuda))
        if floor_bytes is not None:
            row["floor_bytes"] = floor_bytes
            if bw:
                row["fraction_of_bandwidth_floor"] = floor_bytes / (bw * 1e12) / (row["ms"] * 1e-3)
    except Exception as exc:  # noqa: BLE001 - a peer with another API: record, go on
        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
    rows.append(row)
    print(json.dumps(row))


def _skip(rows, group, name, why):
    rows.append({"group": group, "impl": name, "skipped": why})
    print(f"[skip] {group} / {name}: {why}")


def _bucket_slots_low_first(residuals: torch.Tensor, nbits: int, dim: int) -> torch.Tensor:
    """The same buckets in late-interaction-kernels 0.4.5's residual layout: dimension ``h``
    in byte ``h // (8 / nbits)``, at bit offset ``(h % (8 / nbits)) * nbits`` from the least
    significant bit (its ``maxsim_residual`` docstring: "little-endian within the byte").
    Ours is ColBERTv2's: each bucket's bits least significant first in a stream packed most
    significant bit first (``lik_plugins.ops.plaid``)."""
    per_byte = 8 // nbits
    shifts = torch.arange(per_byte, device=residuals.device) * nbits
    out = torch.empty_like(residuals)
    for start in range(0, residuals.shape[0], 256):    # unpacking takes 64 bytes a bit: bounded chunks
        buckets = reference.unpack_buckets(residuals[start:start + 256], nbits, dim)           # [n, ..., d]
        slots = buckets.reshape(*buckets.shape[:-1], dim // per_byte, per_byte)
        out[start:start + 256] = (slots << shifts).sum(-1).to(torch.uint8)
    return out


def residual_rows(rows, sz, reps, cuda, bw, device):
    g = torch.Generator(device="cpu").manual_seed(0)
    nd, ld, dim, lq, n_centroids = sz["rerank_docs"], sz["ld"], 128, 32, sz["centroids"]
    centroids = F.normalize(torch.randn(n_centroids, dim, generator=g), dim=-1)
    Q = F.normalize(torch.randn(1, lq, dim, generator=g), dim=-1).to(device, torch.bfloat16)
    m_res, why_res = _peer("late_interaction_kernels.plaid", "maxsim_residual")
    m_var, why_var = _peer("late_interaction_kernels.plaid", "maxsim_residual_varlen")
    full = torch.full((nd,), ld, dtype=torch.int32)
    # every document full, at 2 and 4 bits; then lengths as a rerank's candidates have them
    # (uniform in Ld/3 .. Ld, padded to Ld): the padded op bounds each document by its length
    varied = torch.randint(ld // 3, ld + 1, (nd,), generator=g, dtype=torch.int32)
    for nbits, lengths in ((2, full), (4, full), (2, varied)):
        cu = torch.zeros(nd + 1, dtype=torch.int32)
        cu[1:] = lengths.cumsum(0)
        valid = torch.arange(ld)[None, :] < lengths[:, None]
        # codes and residual bits drawn at random: the kernel's work does not depend on them
        codes = torch.randint(0, n_centroids, (nd, ld), generator=g, dtype=torch.int32)
        residuals = torch.randint(0, 256, (nd, ld, dim * nbits // 8), generator=g, dtype=torch.uint8)
        weights = torch.sort(torch.randn(2**nbits, generator=g) * 0.05).values
        c_dev = centroids.to(device, torch.bfloat16)
        args = [t.to(device) for t in (codes, residuals, lengths)]
        codes_d, res_d, len_d = args
        w_d = weights.to(device)
        cu_d = cu.to(device)
        n_valid = int(lengths.sum())
        floor = n_valid * (4 + residuals.shape[-1]) + c_dev.numel() * 2 + nd * 4
        with torch.no_grad():
            ref = lik.maxsim(Q.float(), plaid.decompress(codes_d, res_d, c_dev.float(), w_d, nbits),
                             d_mask=valid.to(device), normalize=True)
        spread = "" if lengths is full else f" lengths {ld // 3}-{ld}"
        group = f"residual rerank 1x{nd} Ld{ld} nbits{nbits}{spread}"
        extra = {"nbits": nbits}
        with torch.no_grad():
            _measure(rows, group, "lik_plugins maxsim_residual",
                     lambda: lik.maxsim_residual(Q, codes_d, res_d, len_d, c_dev, w_d, nbits), ref, reps, cuda,
                     floor, bw, extra)
            valid_d = valid.to(device)
            flat_codes, flat_res = codes_d[valid_d], res_d[valid_d]
            _measure(rows, group, "lik_plugins maxsim_residual_varlen",
                     lambda: lik.maxsim_residual_varlen(Q, flat_codes, flat_res, cu_d, c_dev, w_d, nbits,
                                                        max_seqlen_d=ld), ref, reps, cuda, floor, bw, extra)
            # late-interaction-kernels reads another byte layout (see _bucket_slots_low_first):
            # the same buckets, re-packed outside the timing, so both score the same tokens
            res_peer = _bucket_slots_low_first(res_d, nbits, dim) if m_res or m_var else None
            peer_extra = {**extra, "note": "residuals re-packed into its byte layout outside the timing"}
            if m_res is None:
                _skip(rows, group, "late-interaction-kernels maxsim_residual", why_res)
            else:
                _measure(rows, group, "late-interaction-kernels maxsim_residual",
                         lambda: m_res(Q, codes_d, res_peer, len_d, c_dev, w_d, nbits), ref, reps, cuda, floor, bw,
                         peer_extra)
            if m_var is None:
                _skip(rows, group, "late-interaction-kernels maxsim_residual_varlen", why_var)
            else:
                flat_peer = res_peer[valid_d]
                _measure(rows, group, "late-interaction-kernels maxsim_residual_varlen",
                         lambda: m_var(Q, flat_codes, flat_peer, cu_d, c_dev, w_d, nbits, max_seqlen_d=ld), ref,
                         reps, cuda, floor, bw, peer_extra)
            if lengths is full:
                # the unfused way: decompress everything, then score (what fast-plaid's rerank does in spirit)
                _measure(rows, group, "decompress + lik_plugins maxsim",
                         lambda: lik.maxsim(Q, plaid.decompress(codes_d, res_d, c_dev, w_d, nbits).to(Q.dtype),
                                            normalize=True), ref, reps, cuda, floor, bw, extra)
        # PLAID's centroid score over the same documents
        qcs = c_dev.float() @ Q[0].float().T                 # [C, Lq], both libraries' layout
        with torch.no_grad():
            ref_a = lik.plaid_approx_score(qcs, codes_d, len_d)
        group_a = f"plaid_approx_score 1x{nd} Ld{ld} C{n_centroids}"
        if nbits == 2 and lengths is full:
            _measure(rows, group_a, "lik_plugins plaid_approx_score",
                     lambda: lik.plaid_approx_score(qcs, codes_d, len_d), ref_a, reps, cuda,
                     codes.numel() * 4 + qcs.numel() * 4, bw)
            m_a, why_a = _peer("late_interaction_kernels.plaid", "plaid_approx_score")
            if m_a is None:
                _skip(rows, group_a, "late-interaction-kernels plaid_approx_score", why_a)
            else:
                _measure(rows, group_a, "late-interaction-kernels plaid_approx_score",
                         lambda: m_a(qcs, codes_d, len_d), ref_a, reps, cuda, codes.numel() * 4 + qcs.numel() * 4,
                         bw)


def int8_rows(rows, sz, reps, cuda, bw, device):
    """int8 vs bf16 rerank.  Every row's ``rel_err`` is against the fp32 scores of the
    unquantised tokens (what quantising costs, kernel included); ``own_err`` is a quantised
    row's error against MaxSim of its own dequantised tokens (the kernel alone).  Each
    library quantises the documents with its own helper, outside the timing."""
    g = torch.Generator(device="cpu").manual_seed(1)
    nd, ld, dim, lq = sz["rerank_docs"], sz["ld"], 128, 32
    D = F.normalize(torch.randn(nd, ld, dim, generator=g), dim=-1).to(device, torch.bfloat16)
    Q = F.normalize(torch.randn(1, lq, dim, generator=g), dim=-1).to(device, torch.bfloat16)
    index = lik.quantize_int8(D)
    group = f"int8 vs bf16 rerank 1x{nd} Ld{ld}"
    tokens = nd * ld
    with torch.no_grad():
        ref = lik.maxsim(Q.float(), D.float())
        _measure(rows, group, "lik_plugins bf16 maxsim", lambda: lik.maxsim(Q, D), ref, reps, cuda, D.numel() * 2, bw)
        own = reference.maxsim_int8(reference.quantize_int8(Q), tuple(index))
        _measure(rows, group, "lik_plugins maxsim_int8", lambda: lik.maxsim_int8(Q, index), ref, reps, cuda,
                 index.values.numel() + tokens * 4, bw, own_ref=own,
                 extra={"note": "symmetric int8 per token (fp32 scale), query quantised in the call"})
        # flash-maxsim 0.3.0: flash_maxsim_int8(Q [Lq, d], D_uint8, scales, mins) with its affine
        # per-token uint8 (quantize_int8 -> values, fp16 scales, fp16 mins; fp16 query), and
        # flash_maxsim_int8x8(Q, D_int8, d_scales) with its symmetric int8 (quantize_int8_symmetric;
        # the query quantised in the call).  Both score one query: [Nd].
        fm, why = _peer("flash_maxsim", "flash_maxsim_int8")
        if fm is None:
            _skip(rows, group, "flash-maxsim flash_maxsim_int8", why)
        else:
            import flash_maxsim as fmod

            values, scales, mins = fmod.quantize_int8(D)
            own = lik.maxsim(Q.half().float(), fmod.dequantize_int8(values, scales, mins))
            _measure(rows, group, "flash-maxsim flash_maxsim_int8", lambda: fm(Q[0], values, scales, mins), ref, reps,
                     cuda, values.numel() + tokens * 4, bw, own_ref=own,
                     extra={"note": "affine uint8 per token (fp16 scale and min), fp16 query"})
            del values, scales, mins
        fm8, why = _peer("flash_maxsim", "flash_maxsim_int8x8")
        if fm8 is None:
            _skip(rows, group, "flash-maxsim flash_maxsim_int8x8", why)
        else:
            import flash_maxsim as fmod

            values, scales = fmod.quantize_int8_symmetric(D)
            q_values, q_scales = fmod.quantize_query_int8(Q[0])
            own = lik.maxsim((q_values.float() * q_scales.float()[:, None])[None],
                             values.float() * scales.float())
            _measure(rows, group, "flash-maxsim flash_maxsim_int8x8", lambda: fm8(Q[0], values, scales), ref, reps,
                     cuda, values.numel() + tokens * 2, bw, own_ref=own,
                     extra={"note": "symmetric int8 x int8 (fp16 scales), query quantised in the call"})


def hidden_rows(rows, sz, reps, cuda, device):
    g = torch.Generator(device="cpu").manual_seed(2)
    m_h, why = _peer("late_interaction_kernels.fused_head", "maxsim_from_hidden")
    for nq, nd, ld, train in ((sz["hidden_batch"], sz["hidden_batch"], sz["ld"], True), (1, sz["hidden_docs"], sz["ld"], False)):
        hidden, dim = 768, 128
        Q = F.normalize(torch.randn(nq, 32, dim, generator=g), dim=-1).to(device, torch.bfloat16)
        H = torch.randn(nd, ld, hidden, generator=g).to(device, torch.bfloat16)
        W = (torch.randn(dim, hidden, generator=g) / hidden**0.5).to(device, torch.bfloat16)
        b = (torch.randn(dim, generator=g) * 0.01).to(device, torch.bfloat16)
        tensors = (Q, H, W, b)
        if train:
            for t in tensors:
                t.requires_grad_()
        group = f"maxsim_from_hidden {nq}x{nd} Ld{ld} h{hidden} {'fwd+bwd' if train else 'fwd'}"
        with torch.no_grad():
            ref = lik.maxsim(Q.float(), F.linear(H.float(), W.float(), b.float()), normalize=True)
        grad = torch.randn(nq, nd, device=device)

        def step(fn):
            def run():
                if train:
                    for t in tensors:
                        t.grad = None
                    out = fn()
                    out.backward(grad)
                    return out.detach()
                with torch.no_grad():
                    return fn()
            return run

        _measure(rows, group, "lik_plugins maxsim_from_hidden", step(lambda: lik.maxsim_from_hidden(Q, H, W, b)),
                 ref, reps, cuda)
        _measure(rows, group, "linear + lik_plugins maxsim (unfused)",
                 step(lambda: lik.maxsim(Q, F.linear(H, W, b), normalize=True)), ref, reps, cuda)
        if m_h is None:
            _skip(rows, group, "late-interaction-kernels maxsim_from_hidden", why)
        else:
            _measure(rows, group, "late-interaction-kernels maxsim_from_hidden", step(lambda: m_h(Q, H, W, b)), ref,
                     reps, cuda)


def markdown(rows, meta) -> str:
    lines = [f"# Compressed indexes and the fused head — {meta.get('device', 'CPU')}", "",
             f"Command: `{meta['command']}`; peers: late-interaction-kernels {meta.get('late_interaction_kernels')}, "
             f"flash-maxsim {meta.get('flash_maxsim')}; copy bandwidth {meta.get('copy_tb_per_s')} TB/s.", "",
             "rel err: max relative error against fp32 scores of the same tokens (int8 rows: of the unquantised "
             "tokens); err vs own dequantised: an int8 row against MaxSim of its own dequantised tokens.", "",
             "back to back: wall ms per call over the repetitions run in a row (one sync at the end).", "",
             "| case | implementation | median ms (p10-p90) | back to back ms | peak MiB | rel err "
             "| err vs own dequantised | bandwidth floor | note |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "skipped" in r or "error" in r:
            text = f"skipped: {r['skipped']}" if "skipped" in r else f"error: {r['error']}"
            text = " ".join(text.replace("|", "/").split())
            lines.append(f"| {r['group']} | {r['impl']} | {text} | | | | | | {r.get('note', '')} |")
            continue
        peak = "" if r.get("peak_bytes") is None else f"{r['peak_bytes'] / 2**20:.1f}"
        frac = r.get("fraction_of_bandwidth_floor")
        err, own = r.get("rel_err"), r.get("own_err")
        piped = "" if r.get("pipelined_ms") is None else f"{r['pipelined_ms']:.3f}"
        lines.append(f"| {r['group']} | {r['impl']} | {r['ms']:.3f} ({r['p10_ms']:.3f}-{r['p90_ms']:.3f}) | {piped} | "
                     f"{peak} | "
                     f"{'' if err is None else f'{err:.1e}'} | {'' if own is None else f'{own:.1e}'} | "
                     f"{'' if frac is None else f'{frac:.0%}'} | {r.get('note', '')} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    p.add_argument("--reps", type=int, default=50)
    args = p.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    cuda = torch.cuda.is_available() and not args.smoke
    device = "cuda" if cuda else "cpu"
    if cuda:
        sz = {"rerank_docs": 10_000, "ld": 300, "centroids": 1 << 14, "hidden_batch": 32, "hidden_docs": 1000}
        meta = environment()
        meta.update(measure_ceilings())
        bw = meta["copy_tb_per_s"]
    else:
        sz = {"rerank_docs": 24, "ld": 30, "centroids": 64, "hidden_batch": 3, "hidden_docs": 8}
        meta = {"device": "CPU (smoke)", "command": " ".join(sys.argv), "torch": torch.__version__}
        bw = None
        args.reps = min(args.reps, 3)
    rows: list = []
    residual_rows(rows, sz, args.reps, cuda, bw, device)
    int8_rows(rows, sz, args.reps, cuda, bw, device)
    hidden_rows(rows, sz, args.reps, cuda, device)
    meta["routing"] = lik.routing_counts()
    with open(os.path.join(args.out_dir, "compressed.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    md = markdown(rows, meta)
    with open(os.path.join(args.out_dir, "compressed.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
