"""Probe: does a forward whose tensor-core product overlaps its epilogue beat ours?

Our Triton forward waits for each document tile's warpgroup MMA before its max epilogue,
and Triton cannot be told otherwise (benchmarks/NOTES.md v17).  This is the same
inference forward (bf16, d = 128, no masks, cross product, queries whose length divides
the row block or is a multiple of it) written in Gluon, Triton's lower-level language, with
the MMA of tile t+1 issued asynchronously before the epilogue of tile t and waited for
after it; document tiles arrive by TMA into a ring of shared-memory stages.  It is a probe,
not a product path: no masks, no NaN propagation, no interpreter.

On the GPU: scores against ``launch.forward``, then each config against ours (do_bench).
``--compile-only``: compile for sm_90 on any machine and count the MMA waits.

Usage: python benchmarks/probe_gluon_forward.py OUT_JSON [--compile-only] [--only a,b]
"""
from __future__ import annotations

import json
import re
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, ".")


@gluon.jit
def _tile_rowmax(acc, t, ld, BLOCK_N: gl.constexpr, layout: gl.constexpr):
    # columns past the document belong to the next one (or are TMA's zero fill): -inf
    if (t + 1) * BLOCK_N > ld:
        cols = t * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        acc = gl.where((cols < ld)[None, :], acc, float("-inf"))
    return gl.max(acc, axis=1)


@gluon.jit
def maxsim_fwd_wgmma_kernel(q_desc, d_desc, out, n_q, n_j, lq, ld, n_qblocks,
                            ROWS_PER_Q: gl.constexpr, QPB: gl.constexpr, STAGES: gl.constexpr,
                            num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = d_desc.block_type.shape[0]
    DIM: gl.constexpr = d_desc.block_type.shape[1]
    pid = gl.program_id(0)
    i_j = pid // n_qblocks          # query blocks vary fastest: neighbours share the document in L2
    i_m = pid % n_qblocks
    n_chunks = gl.cdiv(lq, ROWS_PER_Q)
    i_qb = i_m // n_chunks if QPB == 1 else i_m
    i_chunk = i_m % n_chunks if QPB == 1 else 0

    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    q_smem = gl.allocate_shared_memory(q_desc.dtype, q_desc.block_type.shape, q_desc.layout)
    d_smem = gl.allocate_shared_memory(d_desc.dtype, [STAGES, BLOCK_N, DIM], d_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    d_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(d_bar.index(s), count=1)

    row0 = i_qb * (QPB * lq) + i_chunk * BLOCK_M   # rows of Q [n_q * lq, d]: whole queries, or one chunk
    doc0 = i_j * ld
    n_tiles = gl.cdiv(ld, BLOCK_N)
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [row0, 0], q_bar, q_smem)
    for s in gl.static_range(STAGES):
        if s < n_tiles:
            mbarrier.expect(d_bar.index(s), d_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(d_desc, [doc0 + s * BLOCK_N, 0], d_bar.index(s), d_smem.index(s))
    mbarrier.wait(q_bar, phase=0)

    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=acc_layout)
    row_max = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, acc_layout))
    mbarrier.wait(d_bar.index(0), phase=0)
    acc = warpgroup_mma(q_smem, d_smem.index(0).permute((1, 0)), zero, use_acc=False, is_async=True)
    for t in range(1, n_tiles):
        stage = t % STAGES
        mbarrier.wait(d_bar.index(stage), phase=(t // STAGES) & 1)
        nxt = warpgroup_mma(q_smem, d_smem.index(stage).permute((1, 0)), zero, use_acc=False, is_async=True)
        # tile t-1's product is done (tile t's may still run): free its stage, fold it in
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        refill = t - 1 + STAGES
        if refill < n_tiles:
            sp = (t - 1) % STAGES
            mbarrier.expect(d_bar.index(sp), d_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(d_desc, [doc0 + refill * BLOCK_N, 0], d_bar.index(sp), d_smem.index(sp))
        row_max = gl.maximum(row_max, _tile_rowmax(acc, t - 1, ld, BLOCK_N, acc_layout))
        acc = nxt
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    row_max = gl.maximum(row_max, _tile_rowmax(acc, n_tiles - 1, ld, BLOCK_N, acc_layout))

    mbarrier.invalidate(q_bar)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(d_bar.index(s))

    # each query's sum over its rows; rows past the last query are masked at the store
    out_layout: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [num_warps, 1], [1, 0])
    per_row = gl.convert_layout(row_max, gl.SliceLayout(1, out_layout))
    if QPB == 1:
        total = gl.sum(per_row, axis=0)
        gl.store(out + (i_chunk * n_q + i_qb).to(gl.int64) * n_j + i_j, total)
    else:
        scores = gl.sum(gl.reshape(per_row, [QPB, ROWS_PER_Q]), axis=1)
        o_q = i_qb * QPB + gl.arange(0, QPB, layout=scores.type.layout)
        gl.store(out + o_q.to(gl.int64) * n_j + i_j, scores, mask=o_q < n_q)


def blocking(lq, block_m):
    """(ROWS_PER_Q, QPB, n_chunks) or None where the row block cannot hold whole queries."""
    if lq >= block_m:
        return (block_m, 1, lq // block_m) if lq % block_m == 0 else None
    return (lq, block_m // lq, 1) if block_m % lq == 0 else None


def descriptors(Q, D, block_m, block_n):
    nq, lq, dim = Q.shape
    nj, ld, _ = D.shape
    q2, d2 = Q.reshape(nq * lq, dim), D.reshape(nj * ld, dim)
    q_layout = gl.NVMMASharedLayout.get_default_for([block_m, dim], gl.bfloat16)
    d_layout = gl.NVMMASharedLayout.get_default_for([block_n, dim], gl.bfloat16)
    return (TensorDescriptor.from_tensor(q2, [block_m, dim], q_layout),
            TensorDescriptor.from_tensor(d2, [block_n, dim], d_layout))


def gluon_forward(Q, D, block_m=256, block_n=64, stages=3, num_warps=8):
    nq, lq, dim = Q.shape
    nj, ld, _ = D.shape
    rows, qpb, n_chunks = blocking(lq, block_m)
    q_desc, d_desc = descriptors(Q, D, block_m, block_n)
    n_qblocks = triton.cdiv(nq, qpb) * n_chunks
    out = torch.empty((n_chunks, nq, nj), dtype=torch.float32, device=Q.device)
    maxsim_fwd_wgmma_kernel[(nj * n_qblocks,)](q_desc, d_desc, out, nq, nj, lq, ld, n_qblocks,
                                               ROWS_PER_Q=rows, QPB=qpb, STAGES=stages, num_warps=num_warps)
    return out[0] if n_chunks == 1 else out.sum(0)


CONFIGS = [(256, 64, 3, 8), (256, 64, 4, 8), (128, 128, 3, 8), (128, 64, 4, 4), (128, 128, 2, 4)]
SHAPES = [("long-query 1x2000 Lq1024", 1, 2000, 1024, 1030), ("long-query 16x1000 Lq512", 16, 1000, 512, 1030),
          ("search 64x4096 Lq128", 64, 4096, 128, 256), ("search 64x4096 Lq32", 64, 4096, 32, 256),
          ("in-batch 256 Lq32", 256, 256, 32, 256), ("colpali 16x1000 Lq32", 16, 1000, 32, 1030)]


def compile_only():
    """sm_90 PTX of the kernel for the first two configs: MMA waits and their counts."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    Q = torch.zeros(4, 256, 128, dtype=torch.bfloat16)
    D = torch.zeros(8, 300, 128, dtype=torch.bfloat16)
    found = {}
    for block_m, block_n, stages, warps in CONFIGS[:3]:
        q_desc, d_desc = descriptors(Q, D, block_m, block_n)
        rows, qpb, _ = blocking(256, block_m)
        params = ["q_desc", "d_desc", "out", "n_q", "n_j", "lq", "ld", "n_qblocks"]
        sig = {"q_desc": mangle_type(q_desc), "d_desc": mangle_type(d_desc), "out": "*fp32",
               **{p: "i32" for p in params[3:]}, "ROWS_PER_Q": "constexpr", "QPB": "constexpr",
               "STAGES": "constexpr", "num_warps": "constexpr"}
        src = GluonASTSource(fn=maxsim_fwd_wgmma_kernel, signature=sig,
                             constexprs={"ROWS_PER_Q": rows, "QPB": qpb, "STAGES": stages, "num_warps": warps})
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["ptx"]
        waits = re.findall(r"wgmma.wait_group.sync.aligned (\d+)", ptx)
        name = f"M{block_m} N{block_n} S{stages} W{warps}"
        found[name] = {"wgmma": ptx.count("wgmma.mma_async"), "waits": waits,
                       "tma": ptx.count("cp.async.bulk.tensor"), "lines": ptx.count("\n")}
        print(name, found[name], flush=True)
    return found


def main(out, only=None):
    from triton.testing import do_bench

    from lik_plugins.kernels.triton import launch

    rows = []
    for name, nq, nd, lq, ld in SHAPES:
        if only and not any(part in name for part in only.split(",")):
            continue
        g = torch.Generator(device="cuda").manual_seed(0)
        Q = torch.nn.functional.normalize(torch.randn(nq, lq, 128, device="cuda", dtype=torch.bfloat16, generator=g), dim=-1)
        D = torch.nn.functional.normalize(torch.randn(nd, ld, 128, device="cuda", dtype=torch.bfloat16, generator=g), dim=-1)
        flops = 2 * nq * nd * lq * ld * 128

        def ours():
            return launch.forward(Q, D, None, None, cross=True, normalize=False, zero_mode=False, save_argmax=False)[0]
        ref = ours()
        ms = do_bench(ours, rep=300)
        rows.append({"shape": name, "impl": "ours (Triton)", "ms": ms, "tflops": flops / ms / 1e9})
        print(f"{name:26s} ours                {ms:7.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s", flush=True)
        for block_m, block_n, stages, warps in CONFIGS:
            if blocking(lq, block_m) is None:
                continue
            label = f"gluon M{block_m} N{block_n} S{stages} W{warps}"
            try:
                fn = lambda: gluon_forward(Q, D, block_m, block_n, stages, warps)  # noqa: E731
                got = fn()
                err = ((got - ref).abs().max() / ref.abs().max()).item()
                ms = do_bench(fn, rep=300)
            except Exception as exc:  # noqa: BLE001 - record what did not compile or run
                rows.append({"shape": name, "impl": label, "error": repr(exc)[:400]})
                print(f"{name:26s} {label}: {exc!r}"[:400], flush=True)
                continue
            rows.append({"shape": name, "impl": label, "ms": ms, "tflops": flops / ms / 1e9, "err": err})
            print(f"{name:26s} {label:30s} {ms:7.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s err {err:.1e}", flush=True)
            with open(out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "triton": triton.__version__, "rows": rows}, f,
                          indent=1)
        del Q, D
        torch.cuda.empty_cache()


if __name__ == "__main__":
    if "--compile-only" in sys.argv:
        found = compile_only()
        with open(sys.argv[1], "w") as f:
            json.dump(found, f, indent=1)
    else:
        only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else None
        main(sys.argv[1], only)
