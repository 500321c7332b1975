"""Packed, pair-list and padded MaxSim side by side with late-interaction-kernels 0.4.5 and
flash-maxsim 0.3.0 (the same inputs), plus PyLate's ``rank.rerank`` patched vs
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
peer is skipped, with the reason in the table.  flash-maxsim scores aligned pairs only: its
rows get the pairs pre-gathered outside the timed region (noted in the table), and it has no
in-batch packed cross product.  ``--smoke`` runs tiny sizes on the CPU (chunked path,
wall-clock timer) to show the script works.  Writes ``packed.json`` and ``packed.md``.

Isolation: every (case, implementation) runs in a child process of this script (``--child
CASE IMPL``; same inputs from the case's seed; rows come back as JSON, our scores as a
tensor file for the peers' differences).  A peer that crashes -- flash-maxsim 0.3.0's
varlen kernel hit an illegal memory access on the 100k-pair case, which poisons the whole
CUDA context -- leaves an error row with its message, and every other row still runs.
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
sys.path.insert(0, "src")  # this checkout's lik_plugins
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lik_plugins as lik  # noqa: E402
from bench_kernels import peak_bytes  # noqa: E402


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
    """Peak MB of one call above the memory allocated before it (None on a CPU)."""
    peak = peak_bytes(fn, cuda)
    return None if peak is None else peak / 2**20


PROFILE = False    # --profile: each row also gets its host time and GPU kernels per call
CONFIG_AB = False  # --config-ab: ours also with forced forward configs on the held-out shapes


def _breakdown(fn, calls=5):
    """Host wall time of one call on an idle GPU (median of ``calls``) and the device
    kernels of a call: ``[(name, us per call, launches per call)]``, longest first."""
    from torch.profiler import ProfilerActivity, profile

    host = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = sorted(((e.key[:48], round(e.device_time_total / calls, 1), round(e.count / calls, 2))
                      for e in prof.key_averages() if e.device_time_total > 0), key=lambda k: -k[1])
    return {"host_us": round(statistics.median(host), 1), "kernels": kernels[:8], "host_profile": _host_profile(fn)}


def _host_profile(fn, calls=50):
    """cProfile's top functions of ``calls`` calls by own time: ``[(function, us per call)]``
    (profiled, so inflated; the ranking says where host time goes)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats
    top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:8]
    return [(f"{os.path.basename(f)}:{line}({name})"[:60], round(tt / calls * 1e6, 1))
            for (f, line, name), (_, _, tt, _, _) in top]


def _ragged(n, lo, hi, d, dtype, device, g):
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.nn.functional.normalize(torch.randn(L, d, generator=g), dim=-1).to(dtype).to(device)
            for L in lengths]


def _sizes(smoke):
    if smoke:
        return dict(rerank_c=40, multi_q=4, multi_c=6, train_b=6, pairs=300, pair_q=20, pair_d=60, ld=(5, 30),
                    lq=8, rr_q=3, rr_c=20, d=32, ho_train=(5, (4, 12), (10, 40)), ho_pairs=(3, 20, (5, 25)),
                    ho_rerank=(50, (3, 18)), ho_lists=(100, 1000))
    return dict(rerank_c=1000, multi_q=64, multi_c=100, train_b=256, pairs=100_000, pair_q=1000, pair_d=10_000,
                ld=(50, 300), lq=32, rr_q=100, rr_c=1000, d=128,
                # the held-out shapes of issue 37: (B, query lengths, document lengths); (queries,
                # candidates each, lengths); (documents, lengths); pair-list sizes
                ho_train=(128, (16, 48), (100, 500)), ho_pairs=(16, 3000, (50, 250)),
                ho_rerank=(5000, (30, 180)), ho_lists=(10_000, 1_000_000))


# ----------------------------------------------------------------------------- cases
# Each case builds its inputs from its own seed, so every child process of a case sees the
# same tensors; ``impls`` are the implementation groups that each run in a child of their own.
PEER_MODULES = {"late-interaction-kernels": "late_interaction_kernels", "flash-maxsim": "flash_maxsim"}


class Child:
    """One (case, implementation group) run: records rows to ``work/<case>__<impl>.json``
    after each row (a later crash keeps them), and shares our output through
    ``work/<case>.pt`` so the peers' rows report their difference from it."""

    def __init__(self, case, impl, smoke, reps, work):
        self.case, self.impl, self.reps, self.work = case, impl, reps, work
        self.cuda = torch.cuda.is_available() and not smoke
        self.device = "cuda" if self.cuda else "cpu"
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.s = _sizes(smoke)
        self.rows = []
        self.ref_path = os.path.join(work, f"{case}.pt")

    def generator(self):
        return torch.Generator().manual_seed(list(CASES).index(self.case))

    def ragged(self, n, lo, hi, g):
        return _ragged(n, lo, hi, self.s["d"], self.dtype, self.device, g)

    def peer(self, submodule=""):
        import importlib

        return importlib.import_module(PEER_MODULES[self.impl] + submodule)

    def record(self, label, fn, *, note="", save_ref=False):
        """Run ``fn`` once (its output; the difference from ours), then time it and take its
        peak memory.  An exception becomes the row's error."""
        ref = None
        if not save_ref and os.path.exists(self.ref_path):
            ref = torch.load(self.ref_path).to(self.device)
        title = CASES[self.case]["title"](self.s)
        try:
            out = fn()
            diff = None if ref is None else (out.float() - ref.reshape(out.shape)).abs().max().item()
            if save_ref:
                torch.save(out.detach().float().cpu(), self.ref_path)
            ms, iqr = _timer(fn, self.reps, self.cuda)
            peak = _peak(fn, self.cuda)
            extra = _breakdown(fn) if self.cuda and PROFILE else {}
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run a case: say why
            print(f"[bench] {title} / {label}: {exc!r}")
            self.add(dict(case=title, impl=label, error=repr(exc)))
            return
        print(f"[bench] {title:34s} {label:28s} {ms:9.3f} ms (IQR {iqr:.3f})  peak {peak}  diff {diff}  {extra}")
        self.add(dict(case=title, impl=label, ms=ms, iqr_ms=iqr, peak_mib=peak, max_abs_diff=diff, note=note,
                      **extra))

    def record_configs(self, label, fn, configs, block_m=None):
        """``record`` once per forward config ``(BLOCK_N, num_warps, num_stages)`` forced on
        our packed forward (an A/B of the config table; ``block_m``: the query block's rows
        instead of ``blocking.WIDE_BLOCK_M``).  Ours only."""
        from lik_plugins.kernels.triton import varlen_launch as launch
        from lik_plugins.kernels.triton.forward import maxsim_fwd_kernel

        pick, wide = launch.forward_kernel_and_meta, launch.WIDE_BLOCK_M

        for config in configs:
            def forced(**kwargs):
                kernel, meta, after = pick(**kwargs)
                if config is None:
                    return kernel, meta, after
                n, w, st = config
                return maxsim_fwd_kernel, {**meta, "BLOCK_N": n, "num_warps": w, "num_stages": st}, None

            launch.forward_kernel_and_meta = forced
            launch.WIDE_BLOCK_M = block_m or wide
            try:
                name = "table" if config is None else "N{}w{}s{}".format(*config)
                self.record(f"{label} {block_m or wide} rows {name}", fn)
            finally:
                launch.forward_kernel_and_meta, launch.WIDE_BLOCK_M = pick, wide

    def add(self, row):
        self.rows.append(row)
        with open(os.path.join(self.work, f"{self.case}__{self.impl}.json"), "w") as f:
            json.dump(self.rows, f)


def case_rerank(c: Child):
    s, g = c.s, c.generator()
    Qp, cu_q, mq = lik.pack(c.ragged(1, s["lq"], s["lq"], g))
    Dp, cu_d, md = lik.pack(c.ragged(s["rerank_c"], *s["ld"], g))
    with torch.no_grad():
        if c.impl == "lik_plugins":
            c.record("lik_plugins", lambda: lik.maxsim_varlen(Qp, Dp, cu_q, cu_d, mq, md), save_ref=True)
        elif c.impl == "late-interaction-kernels":
            m = c.peer()
            c.record(c.impl, lambda: m.maxsim_varlen(Qp, Dp, cu_q, cu_d, mq, md))
        else:
            m = c.peer()
            c.record(c.impl, lambda: m.flash_maxsim_rerank(Qp, Dp, cu_d, md))


def case_candidates(c: Child):
    s, g = c.s, c.generator()
    nq, n_cand, lq, d = s["multi_q"], s["multi_c"], s["lq"], s["d"]
    qs = c.ragged(nq, lq, lq, g)
    docs = c.ragged(nq * n_cand, *s["ld"], g)
    Qp, cu_q, mq = lik.pack(qs)
    Dp, cu_d, md = lik.pack(docs)
    pq = torch.arange(nq, device=c.device, dtype=torch.int32).repeat_interleave(n_cand)
    pd = torch.arange(nq * n_cand, device=c.device, dtype=torch.int32)
    Qpad = torch.stack(qs)
    Dpad = torch.nn.utils.rnn.pad_sequence(docs, batch_first=True).view(nq, n_cand, -1, d)
    q_len = torch.full((nq,), lq, device=c.device)
    d_len = torch.tensor([x.shape[0] for x in docs], device=c.device).view(nq, n_cand)
    with torch.no_grad():
        if c.impl == "lik_plugins":
            c.record("lik_plugins pairs", lambda: lik.score_pairs_packed(Qp, Dp, cu_q, cu_d, pq, pd, max_seqlen_q=mq,
                                                                         max_seqlen_d=md), save_ref=True)
            c.record("lik_plugins padded", lambda: lik.maxsim_padded(Qpad, Dpad, q_len, d_len))
        elif c.impl == "late-interaction-kernels":
            pairs = c.peer(".score_pairs").score_pairs_packed    # a submodule, not the top level
            c.record(f"{c.impl} pairs", lambda: pairs(Qp, Dp, cu_q, cu_d, pq, pd, max_seqlen_q=mq, max_seqlen_d=md))
            padded = c.peer().maxsim_padded
            c.record(f"{c.impl} padded", lambda: padded(Qpad, Dpad, q_len, d_len))
        else:
            m = c.peer()
            Qa, cu_qa, _ = lik.pack([qs[i] for i in pq.tolist()])
            c.record(f"{c.impl} varlen (pre-aligned)", lambda: m.flash_maxsim_varlen(Qa, Dp, cu_qa, cu_d, mq, md),
                     note="pairs gathered outside the timing")


def _record_training(c: Child, queries: tuple, documents: tuple):
    """Record one packed training step (forward + backward of this child's ``maxsim_varlen``)
    over ``queries`` and ``documents`` (each ``lik.pack``'s triple); returns the step builder."""
    (Qp, cu_q, mq), (Dp, cu_d, md) = queries, documents
    Qp.requires_grad_()
    Dp.requires_grad_()

    def train(fn):
        def step():
            Qp.grad = Dp.grad = None
            out = fn(Qp, Dp, cu_q, cu_d, mq, md)
            out.backward(torch.ones_like(out))
            return out.detach()
        return step

    if c.impl == "lik_plugins":
        c.record("lik_plugins", train(lik.maxsim_varlen), save_ref=True)
    else:
        c.record(c.impl, train(c.peer().maxsim_varlen))
    return train


def case_train(c: Child):
    s, g = c.s, c.generator()
    _record_training(c, lik.pack(c.ragged(s["train_b"], max(1, s["lq"] // 2), s["lq"], g)),
                     lik.pack(c.ragged(s["train_b"], *s["ld"], g)))


def case_pair_list(c: Child):
    s, g = c.s, c.generator()
    n_pairs = s["pairs"]
    Qp, cu_q, mq = lik.pack(c.ragged(s["pair_q"], max(1, s["lq"] // 2), s["lq"], g))
    Dp, cu_d, md = lik.pack(c.ragged(s["pair_d"], *s["ld"], g))
    pq = torch.randint(0, s["pair_q"], (n_pairs,), generator=g).to(torch.int32).to(c.device)
    pd = torch.randint(0, s["pair_d"], (n_pairs,), generator=g).to(torch.int32).to(c.device)
    with torch.no_grad():
        if c.impl == "lik_plugins":
            c.record("lik_plugins", lambda: lik.score_pairs_packed(Qp, Dp, cu_q, cu_d, pq, pd, max_seqlen_q=mq,
                                                                   max_seqlen_d=md), save_ref=True)
        elif c.impl == "late-interaction-kernels":
            pairs = c.peer(".score_pairs").score_pairs_packed
            c.record(c.impl, lambda: pairs(Qp, Dp, cu_q, cu_d, pq, pd, max_seqlen_q=mq, max_seqlen_d=md))
        else:
            m = c.peer()
            qrows, drows = lik.unpack(Qp, cu_q), lik.unpack(Dp, cu_d)
            Qa, cu_qa, _ = lik.pack([qrows[i] for i in pq.tolist()])
            Da, cu_da, _ = lik.pack([drows[i] for i in pd.tolist()])
            # the aligned documents hold more than 2**31 elements at full size: past int32 offsets
            c.record(f"{c.impl} varlen (pre-aligned)", lambda: m.flash_maxsim_varlen(Qa, Da, cu_qa, cu_da, mq, md),
                     note=f"pairs gathered outside the timing; aligned D has {Da.numel():.3g} elements")


def case_ho_train(c: Child):
    """Held-out packed training: B queries of 16-48 tokens x B documents of 100-500, fwd + bwd.
    ``lik_plugins 128-row blocks``: the forward's query block capped at 128 rows (A/B)."""
    s, g = c.s, c.generator()
    b, lq, ld = s["ho_train"]
    train = _record_training(c, lik.pack(c.ragged(b, *lq, g)), lik.pack(c.ragged(b, *ld, g)))
    if c.impl == "lik_plugins" and c.cuda and CONFIG_AB:
        step = train(lik.maxsim_varlen)
        c.record_configs("lik_plugins", step, [(64, 8, 2)])
        c.record_configs("lik_plugins", step, [None], block_m=128)
        c.record_configs("lik_plugins", step, [None], block_m=64)


def case_ho_pairs(c: Child):
    """Held-out pair list: Nq queries x C candidates each (Nq * C distinct documents)."""
    s, g = c.s, c.generator()
    nq, n_cand, ld = s["ho_pairs"]
    Qp, cu_q, mq = lik.pack(c.ragged(nq, s["lq"], s["lq"], g))
    Dp, cu_d, md = lik.pack(c.ragged(nq * n_cand, *ld, g))
    pq = torch.arange(nq, device=c.device, dtype=torch.int32).repeat_interleave(n_cand)
    pd = torch.arange(nq * n_cand, device=c.device, dtype=torch.int32)
    _score_pairs(c, Qp, Dp, cu_q, cu_d, pq, pd, mq, md)
    if c.impl == "lik_plugins" and c.cuda and CONFIG_AB:
        with torch.no_grad():
            c.record_configs("lik_plugins", lambda: lik.score_pairs_packed(
                Qp, Dp, cu_q, cu_d, pq, pd, max_seqlen_q=mq, max_seqlen_d=md), [(64, 4, 3), (32, 4, 3)])


def case_ho_rerank(c: Child):
    """Held-out one-query rerank with ``maxsim_varlen``."""
    s, g = c.s, c.generator()
    n, ld = s["ho_rerank"]
    Qp, cu_q, mq = lik.pack(c.ragged(1, s["lq"], s["lq"], g))
    Dp, cu_d, md = lik.pack(c.ragged(n, *ld, g))
    with torch.no_grad():
        if c.impl == "lik_plugins":
            fn = lambda: lik.maxsim_varlen(Qp, Dp, cu_q, cu_d, mq, md)  # noqa: E731
            c.record("lik_plugins", fn, save_ref=True)
            if c.cuda and CONFIG_AB:
                c.record_configs("lik_plugins", fn, [(32, 4, 3), (128, 4, 4)])
        else:
            m = c.peer()
            c.record(c.impl, lambda: m.maxsim_varlen(Qp, Dp, cu_q, cu_d, mq, md))


def _pair_list_case(which: int):
    def case(c: Child):
        s, g = c.s, c.generator()
        n_pairs = s["ho_lists"][which]
        Qp, cu_q, mq = lik.pack(c.ragged(s["pair_q"], max(1, s["lq"] // 2), s["lq"], g))
        Dp, cu_d, md = lik.pack(c.ragged(s["pair_d"], *s["ld"], g))
        pq = torch.randint(0, s["pair_q"], (n_pairs,), generator=g).to(torch.int32).to(c.device)
        pd = torch.randint(0, s["pair_d"], (n_pairs,), generator=g).to(torch.int32).to(c.device)
        _score_pairs(c, Qp, Dp, cu_q, cu_d, pq, pd, mq, md)
    return case


def _score_pairs(c: Child, Qp, Dp, cu_q, cu_d, pq, pd, mq, md):
    """Ours against late-interaction-kernels' ``score_pairs_packed`` (inference)."""
    with torch.no_grad():
        if c.impl == "lik_plugins":
            c.record("lik_plugins", lambda: lik.score_pairs_packed(Qp, Dp, cu_q, cu_d, pq, pd, max_seqlen_q=mq,
                                                                   max_seqlen_d=md), save_ref=True)
        else:
            pairs = c.peer(".score_pairs").score_pairs_packed
            c.record(c.impl, lambda: pairs(Qp, Dp, cu_q, cu_d, pq, pd, max_seqlen_q=mq, max_seqlen_d=md))


def case_pylate_rerank(c: Child):
    """PyLate ``rank.rerank``: its own loop (best native backend under
    ``PYLATE_SCORES_BACKEND=auto``) or patched; the row carries the rankings so the parent
    can compare the two children."""
    from pylate import rank

    s, g = c.s, c.generator()
    nq, n_cand = s["rr_q"], s["rr_c"]
    queries = c.ragged(nq, s["lq"], s["lq"], g)
    docs = [c.ragged(n_cand, *s["ld"], g) for _ in range(nq)]
    ids = [list(range(n_cand)) for _ in range(nq)]
    patched = c.impl == "PyLate patched (lik_plugins)"
    (lik.patch_pylate if patched else lik.unpatch_pylate)()
    call = lambda: rank.rerank(ids, queries, docs)  # noqa: E731
    title = CASES[c.case]["title"](s)
    try:
        rankings = [[r["id"] for r in per_query] for per_query in call()]
        ms, iqr = _timer(call, max(3, c.reps // 10), False)     # wall clock: the host loop is the cost
        peak = _peak(call, c.cuda)
    except Exception as exc:  # noqa: BLE001
        print(f"[bench] {title} / {c.impl}: {exc!r}")
        c.add(dict(case=title, impl=c.impl, error=repr(exc)))
        return
    print(f"[bench] {title:34s} {c.impl:28s} {ms:9.1f} ms (IQR {iqr:.1f})")
    c.add(dict(case=title, impl=c.impl, ms=ms, iqr_ms=iqr, peak_mib=peak, rankings=rankings,
               note=f"PYLATE_SCORES_BACKEND={os.environ.get('PYLATE_SCORES_BACKEND', 'auto')}"))


CASES = {
    "rerank": dict(run=case_rerank, impls=("lik_plugins", "late-interaction-kernels", "flash-maxsim"),
                   title=lambda s: f"rerank 1x{s['rerank_c']} Ld{s['ld'][0]}-{s['ld'][1]}"),
    "candidates": dict(run=case_candidates, impls=("lik_plugins", "late-interaction-kernels", "flash-maxsim"),
                       title=lambda s: f"{s['multi_q']} queries x {s['multi_c']} candidates"),
    # flash-maxsim has no in-batch packed cross product
    "train": dict(run=case_train, impls=("lik_plugins", "late-interaction-kernels"),
                  title=lambda s: f"in-batch packed train B{s['train_b']} fwd+bwd"),
    "pairs": dict(run=case_pair_list, impls=("lik_plugins", "late-interaction-kernels", "flash-maxsim"),
                  title=lambda s: f"pair list {s['pairs']}"),
    "pylate": dict(run=case_pylate_rerank, impls=("PyLate own loop (auto)", "PyLate patched (lik_plugins)"),
                   title=lambda s: f"PyLate rank.rerank {s['rr_q']}x{s['rr_c']} Ld{s['ld'][0]}-{s['ld'][1]}"),
    # issue 37's held-out shapes, against late-interaction-kernels
    "ho_train": dict(run=case_ho_train, impls=("lik_plugins", "late-interaction-kernels"),
                     title=lambda s: "packed train {0} q Lq{1[0]}-{1[1]} x {0} d Ld{2[0]}-{2[1]} fwd+bwd".format(
                         *s["ho_train"])),
    "ho_pairs": dict(run=case_ho_pairs, impls=("lik_plugins", "late-interaction-kernels"),
                     title=lambda s: "score_pairs_packed {0} q x {1} cand Ld{2[0]}-{2[1]}".format(*s["ho_pairs"])),
    "ho_rerank": dict(run=case_ho_rerank, impls=("lik_plugins", "late-interaction-kernels"),
                      title=lambda s: "varlen rerank 1x{0} Ld{1[0]}-{1[1]}".format(*s["ho_rerank"])),
    "ho_list_small": dict(run=_pair_list_case(0), impls=("lik_plugins", "late-interaction-kernels"),
                          title=lambda s: f"pair list {s['ho_lists'][0]}"),
    "ho_list_large": dict(run=_pair_list_case(1), impls=("lik_plugins", "late-interaction-kernels"),
                          title=lambda s: f"pair list {s['ho_lists'][1]}"),
}
CHILD_TIMEOUT_S = int(os.environ.get("BENCH_CHILD_TIMEOUT_S", "480"))


def _unavailable(impl, cuda):
    """Why ``impl`` cannot run here (None: it can), found without importing it."""
    import importlib.util

    module = PEER_MODULES.get(impl) or ("pylate" if impl.startswith("PyLate") else None)
    if module is None:
        return None
    if impl in PEER_MODULES and not cuda:
        return "the peers' kernels need CUDA (smoke run on the CPU)"
    return None if importlib.util.find_spec(module) else f"{module} is not installed"


def _run_child(case, impl, smoke, reps, work):
    """Rows of one (case, implementation group), run in a child process so that a crash
    there (an illegal memory access poisons the whole CUDA context) takes no other row
    down.  A child that dies leaves an error row with the tail of its stderr.  ``case``
    may list several cases (comma-separated): one process runs them in order."""
    import subprocess

    cmd = [sys.executable, os.path.abspath(__file__), work, "--child", case, impl, "--reps", str(reps)]
    if smoke:
        cmd.append("--smoke")
    if PROFILE:
        cmd.append("--profile")
    if CONFIG_AB:
        cmd.append("--config-ab")
    if "," in case:
        rows = []
        for one in case.split(","):
            path = os.path.join(work, f"{one}__{impl}.json")
            if os.path.exists(path):
                os.remove(path)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
            sys.stdout.write(proc.stdout)
            why = f"child exited with {proc.returncode}: {proc.stderr.strip()[-300:]}"
        except subprocess.TimeoutExpired:
            why = f"child timed out after {CHILD_TIMEOUT_S} s"
        for one in case.split(","):
            path = os.path.join(work, f"{one}__{impl}.json")
            rows += json.load(open(path)) if os.path.exists(path) else [
                dict(case=CASES[one]["title"](_sizes(smoke)), impl=impl, error=why)]
        return rows
    title = CASES[case]["title"](_sizes(smoke))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
        rc, err = proc.returncode, proc.stderr
        sys.stdout.write(proc.stdout)
    except subprocess.TimeoutExpired as exc:
        rc, err = None, f"timed out after {CHILD_TIMEOUT_S} s; {exc.stderr or ''}"
    path = os.path.join(work, f"{case}__{impl}.json")
    rows = json.load(open(path)) if os.path.exists(path) else []
    if rc != 0:
        tail = " | ".join(line.strip() for line in (err or "").strip().splitlines()[-3:])
        print(f"[bench] {title} / {impl}: child process exited with {rc}: {tail}")
        if rows:
            for row in rows:
                row["child_exit"] = rc
        else:
            rows = [dict(case=title, impl=impl, error=f"child process exited with {rc}: {tail}")]
    return rows


def run(out_dir, smoke, reps, cases=None, grouped=False):
    """``cases``: the case names to run (default: all); ``grouped``: one child process per
    implementation for all its cases (fewer process starts; a crash takes that
    implementation's later cases with it)."""
    import tempfile

    cuda = torch.cuda.is_available() and not smoke
    rows = []
    selected = {name: spec for name, spec in CASES.items() if cases is None or name in cases}
    with tempfile.TemporaryDirectory(prefix="bench_packed_") as work:
        if grouped:
            impls = list(dict.fromkeys(i for spec in selected.values() for i in spec["impls"]))
            for impl in impls:
                mine = [name for name, spec in selected.items() if impl in spec["impls"]]
                why = _unavailable(impl, cuda)
                if why:
                    rows += [dict(case=CASES[n]["title"](_sizes(smoke)), impl=impl, skipped=why) for n in mine]
                    continue
                rows.extend(_run_child(",".join(mine), impl, smoke, reps, work))
            selected = {}
        for case, spec in selected.items():
            for impl in spec["impls"]:
                why = _unavailable(impl, cuda)
                if why:
                    print(f"[bench] {spec['title'](_sizes(smoke))} / {impl}: skipped, {why}")
                    rows.append(dict(case=spec["title"](_sizes(smoke)), impl=impl, skipped=why))
                    continue
                rows.extend(_run_child(case, impl, smoke, reps, work))
    _compare_pylate_rankings(rows)
    meta = _environment(cuda, smoke)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "packed.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(os.path.join(out_dir, "packed.md"), "w") as f:
        f.write(_markdown(rows, meta))
    print(f"[bench] wrote {out_dir}/packed.json and packed.md")


def _compare_pylate_rankings(rows):
    """The patched PyLate row gets how many queries rank identically and its speed-up."""
    own, patched = (next((r for r in rows if r.get("impl") == name and "rankings" in r), None)
                    for name in CASES["pylate"]["impls"])
    if own and patched:
        same = sum(a == b for a, b in zip(own["rankings"], patched["rankings"]))
        patched["identical_rankings"] = f"{same}/{len(own['rankings'])}"
        patched["speedup_vs_own_loop"] = own["ms"] / patched["ms"]
    for r in rows:
        r.pop("rankings", None)

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
        if "error" in r or "skipped" in r:
            text = f"error: {r['error']}" if "error" in r else f"skipped: {r['skipped']}"
            text = " ".join(text.replace("|", "/").split())[:240]
            lines.append(f"| {r['case']} | {r['impl']} | | | | | {text} |")
            continue
        peak = "" if r.get("peak_mib") is None else f"{r['peak_mib']:.1f}"
        diff = "" if r.get("max_abs_diff") is None else f"{r['max_abs_diff']:.2e}"
        note = r.get("note", "")
        if "child_exit" in r:
            note += f"; its child process then exited with {r['child_exit']}"
        if "identical_rankings" in r:
            note += f"; identical rankings {r['identical_rankings']}, {r['speedup_vs_own_loop']:.1f}x own loop"
        lines.append(f"| {r['case']} | {r['impl']} | {r['ms']:.3f} | {r['iqr_ms']:.3f} | {peak} | {diff} | {note} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("out_dir")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU: the script works")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--cases", help="comma-separated case names (default: all): " + ",".join(CASES))
    p.add_argument("--grouped", action="store_true", help="one child process per implementation")
    p.add_argument("--profile", action="store_true", help="rows get host time and GPU kernels per call")
    p.add_argument("--config-ab", action="store_true", help="ours also with forced forward configs")
    p.add_argument("--child", nargs=2, metavar=("CASE", "IMPL"),
                   help="internal: run cases' rows of one implementation group (OUT_DIR is the work folder)")
    a = p.parse_args()
    reps = a.reps if not a.smoke else 3
    PROFILE, CONFIG_AB = a.profile, a.config_ab
    if a.child:
        cases, impl = a.child
        for case in cases.split(","):
            CASES[case]["run"](Child(case, impl, a.smoke, reps, a.out_dir))
    else:
        run(a.out_dir, a.smoke, reps, None if a.cases is None else a.cases.split(","), a.grouped)
