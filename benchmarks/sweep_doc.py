"""The lowmem grad_D launch, config by config, against the time it must beat.

* candidates (KD, hard negatives, pairs): every config of the one-hot kernel (with and
  without the fused grad_Q gather) against a mere zero-fill of grad_D (the write floor).
* cross product (in-batch): every one-hot config (and the best one with the masked-row
  guard) against the forward with argmax (the same FLOPs) and the
  ``unified`` backward (atomics into an fp32 buffer): the ring (two slabs) and one slab.

* compact (cross product): the one-hot kernel where each tile first lists the rows that
  hit it (two scans of the document's winners), config by config, against the dense
  walk's best config (NOTES v9).

Usage: python benchmarks/sweep_doc.py OUT_JSON [cross|ring|candidates|compact|all]   (ring: cross without the configs)
"""
from __future__ import annotations

import itertools
import json
import sys

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, ".")
from lik_plugins.kernels.triton import launch, tuning  # noqa: E402
from lik_plugins.kernels.triton.backward import maxsim_bwd_doc_kernel  # noqa: E402

CANDIDATE_SHAPES = [("kd 64x32", 64, 32, 32, 256), ("hard-neg 256x16", 256, 16, 32, 1030), ("pairs 512", 512, 1, 32, 256)]
CROSS_SHAPES = [("colbert in-batch 256", 256, 256, 32, 256), ("colpali in-batch 64", 64, 64, 32, 1030),
                ("colpali in-batch 256", 256, 256, 32, 1030), ("colbert in-batch 1024", 1024, 1024, 32, 256)]


def _unit(*shape):
    return torch.nn.functional.normalize(torch.randn(*shape, device="cuda", dtype=torch.bfloat16), dim=-1)


def _doc_launch(g, Q, D, arg, gd, gq, *, cross, n_gather, block_j, block_s, cfg, guard=True, rows=None):
    nq, lq, _ = Q.shape
    nj, ld = (D.shape[0], D.shape[1]) if cross else (D.shape[1], D.shape[2])
    n_docs = nj if cross else nq * nj
    s_d = (0, *D.stride()) if cross else D.stride()
    ph = launch._placeholder(Q.device, torch.float32)
    maxsim_bwd_doc_kernel[(n_gather + n_docs * triton.cdiv(ld, cfg.kwargs["BLOCK_T"]),)](
        g, Q, D, ph, ph, arg, gd, gq, nq, nj, lq, ld, Q.shape[-1], g.stride(0), g.stride(1),
        *Q.stride(), *s_d, 0, 0, arg.stride(0), n_gather, ph if rows is None else rows,
        CROSS=cross, NORMALIZE=False, F32_DOT=False, PRECISION="tf32", UPCAST=False,
        D_PAD=128, WITH_GATHER=n_gather > 0, BLOCK_J=block_j, BLOCK_S=block_s,
        GUARD_ROWS=guard and rows is None, COMPACT=rows is not None,
        SCAN=min(launch.COMPACT_SCAN, triton.next_power_of_2(nq * lq)),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **cfg.kwargs,
    )


def _configs(Q):
    return tuning._doc_prune(tuning._doc_configs(), {"Q": Q}, D_PAD=128, F32_DOT=False)


def sweep_candidates(rows):
    for name, nq, k, lq, ld in CANDIDATE_SHAPES:
        Q, D = _unit(nq, lq, 128), _unit(nq, k, ld, 128)
        _, arg = launch.forward(Q, D, None, None, cross=False, normalize=False, zero_mode=False, save_argmax=True)
        g = torch.randn(nq, k, device="cuda")
        gd, gq = torch.empty_like(D), torch.empty_like(Q)
        block_s, block_j, n_gather, _, _ = launch._gather_blocking(nq, k, lq, 128)
        fill_ms = do_bench(lambda: gd.zero_())
        print(f"{name}: zero-fill grad_D {fill_ms*1e3:.1f} us ({D.numel()*2/fill_ms/1e9:.2f} TB/s)", flush=True)
        row = {"shape": name, "fill_us": fill_ms * 1e3, "configs": []}
        for cfg, with_gather in itertools.product(_configs(Q), (False, True)):
            ms = do_bench(lambda: _doc_launch(g, Q, D, arg, gd, gq, cross=False, n_gather=n_gather if with_gather else 0,
                                              block_j=block_j, block_s=block_s, cfg=cfg))
            desc = f"{cfg} gather={with_gather}"
            row["configs"].append({"config": desc, "us": ms * 1e3})
            print(f"   {desc:70s} {ms*1e3:8.1f} us", flush=True)
        rows.append(row)


def sweep_cross(rows, configs=True):
    for name, nq, nd, lq, ld in CROSS_SHAPES:
        Q, D = _unit(nq, lq, 128), _unit(nd, ld, 128)
        fwd = lambda: launch.forward(Q, D, None, None, cross=True, normalize=False, zero_mode=False, save_argmax=True)  # noqa: E731
        _, arg = fwd()
        g = torch.randn(nq, nd, device="cuda")
        gd, gq = torch.empty_like(D), torch.empty_like(Q)
        fwd_ms = do_bench(fwd)
        uni = lambda: launch.backward(g, Q, D, arg, cross=True, normalize=False, need_q=True, need_d=True,  # noqa: E731
                                      strategy="unified")
        launch.RING_ENABLED = True  # off by default (launch.py): timed here for the record
        ring_ms = do_bench(uni)
        launch.RING_ENABLED = False
        default_slabs = launch.RING_SLABS
        launch.RING_SLABS = 1  # one slab covering every document: the old one-pass buffer
        uni_ms = do_bench(uni)
        launch.RING_SLABS = default_slabs
        gather_ms = do_bench(lambda: launch.backward(g, Q, D, arg, cross=True, normalize=False, need_q=True,
                                                     need_d=False, strategy="lowmem"))
        print(f"{name}: forward+argmax {fwd_ms*1e3:.1f} us, unified backward one slab {uni_ms*1e3:.1f} us, "
              f"ring {ring_ms*1e3:.1f} us, "
              f"grad_Q gather alone {gather_ms*1e3:.1f} us", flush=True)
        row = {"shape": name, "fwd_us": fwd_ms * 1e3, "unified_us": uni_ms * 1e3, "ring_us": ring_ms * 1e3, "gather_us": gather_ms * 1e3,
               "configs": []}
        if not configs:
            rows.append(row)
            continue
        best = None
        for cfg in _configs(Q):
            ms = do_bench(lambda: _doc_launch(g, Q, D, arg, gd, gq, cross=True, n_gather=0, block_j=1, block_s=1,
                                              cfg=cfg, guard=False))
            row["configs"].append({"config": str(cfg), "us": ms * 1e3})
            print(f"   {str(cfg):70s} {ms*1e3:8.1f} us", flush=True)
            if best is None or ms < best[0]:
                best = (ms, cfg)
        ms, cfg = best
        guarded = do_bench(lambda: _doc_launch(g, Q, D, arg, gd, gq, cross=True, n_gather=0, block_j=1, block_s=1,
                                               cfg=cfg, guard=True))
        row["best"] = {"config": str(cfg), "us": ms * 1e3, "guarded_us": guarded * 1e3}
        print(f"   best {cfg}: {ms*1e3:.1f} us, with the masked-row guard {guarded*1e3:.1f} us", flush=True)
        rows.append(row)
        del Q, D, gd, arg
        torch.cuda.empty_cache()


DENSE_CONFIGS = [triton.Config({"BLOCK_T": 128, "BLOCK_R": 64}, num_warps=4, num_stages=2)]


def sweep_compact(rows):
    for name, nq, nd, lq, ld in CROSS_SHAPES:
        if nq * lq > launch.COMPACT_MAX_ROWS:
            continue
        Q, D = _unit(nq, lq, 128), _unit(nd, ld, 128)
        _, arg = launch.forward(Q, D, None, None, cross=True, normalize=False, zero_mode=False, save_argmax=True)
        g = torch.randn(nq, nd, device="cuda")
        gd, gq = torch.empty_like(D), torch.empty_like(Q)
        lists = torch.empty((nd, nq * lq), dtype=torch.int16, device="cuda")
        row = {"shape": name, "compact": [], "dense": []}
        for kind, kw, configs in (("compact", {"rows": lists}, _configs(Q)), ("dense", {"guard": False}, DENSE_CONFIGS)):
            for cfg in configs:
                ms = do_bench(lambda: _doc_launch(g, Q, D, arg, gd, gq, cross=True, n_gather=0, block_j=1, block_s=1,
                                                  cfg=cfg, **kw))
                row[kind].append({"config": str(cfg), "us": ms * 1e3})
            best = min(row[kind], key=lambda r: r["us"])
            print(f"{name:24s} {kind:7s} best {best['config']:60s} {best['us']:8.1f} us", flush=True)
        rows.append(row)
        del Q, D, gd, arg, lists
        torch.cuda.empty_cache()


def main(out, which="all"):
    rows = []
    if which == "compact":
        sweep_compact(rows)
    if which in ("cross", "all", "ring"):
        sweep_cross(rows, configs=which != "ring")
    if which in ("candidates", "all"):
        sweep_candidates(rows)
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:])
