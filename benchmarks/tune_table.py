"""Sweep the forward and lowmem-backward configs on this GPU and write its config table.

    LIK_AUTOTUNE=1 python benchmarks/tune_table.py OUT.json [--formats]

Runs every benchmark shape (``bench_kernels.ALL_SHAPES``: training shapes forward and
backward, inference shapes forward, fp8 forward where the GPU has fp8 units) plus the
length buckets of ``real_loop.py``'s changing-length loops, each with the autotuner on, then
writes the configs it chose as ``src/lik_plugins/kernels/triton/configs/<arch>.json``'s format
(commit the file there: a fresh process then tunes nothing for these keys; see
``kernels/triton/tuning.py``).

``--formats`` sweeps only the document formats other than float tokens (int8 tokens, PLAID
residuals, the projection head: ``bench_compressed.py``'s shapes) and writes them merged
into the committed table for this GPU (its other entries kept).
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ["LIK_AUTOTUNE"] = "1"

import lik_plugins as lik  # noqa: E402
from bench_kernels import ALL_SHAPES, make_inputs  # noqa: E402
from lik_plugins.kernels.triton import tuning  # noqa: E402


def _run(Q, D, layout, train, dm=None):
    fn = lik.maxsim_pairs if layout == "pairs" else lik.maxsim
    if train:
        Q, D = Q.detach().requires_grad_(), D.detach().requires_grad_()
        fn(Q, D, None, dm).float().sum().backward()
    else:
        with torch.no_grad():
            fn(Q, D, None, dm)


def _format_steps() -> dict:
    """The int8, residual and projection-head forwards of bench_compressed.py (their own
    keys), by name: each is swept in a process of its own (``--step``)."""
    F = torch.nn.functional
    dim, lq = 128, 32

    def unit(*shape):
        return F.normalize(torch.randn(*shape, device="cuda"), dim=-1).bfloat16()

    @torch.no_grad()
    def int8():
        D = lik.quantize_int8(unit(10000, 300, dim))
        Q = unit(1, lq, dim)
        lik.maxsim_int8(Q, D)
        lik.maxsim_int8(lik.quantize_int8(Q), D)

    @torch.no_grad()
    def residual():
        for nq in (1, 32):
            Q = unit(nq, lq, dim)
            for nbits in (2, 4):
                codes = torch.randint(0, 16384, (10000 // nq, 300), device="cuda", dtype=torch.int32)
                residuals = torch.randint(0, 256, (*codes.shape, dim * nbits // 8), device="cuda", dtype=torch.uint8)
                weights = torch.sort(torch.randn(2**nbits, device="cuda") * 0.05).values
                lengths = torch.full((codes.shape[0],), 300, dtype=torch.int32, device="cuda")
                centroids = unit(16384, dim)
                lik.maxsim_residual(Q, codes, residuals, lengths, centroids, weights, nbits)
                # packed documents have their own entries (operands.built_key)
                cu = torch.arange(0, codes.numel() + 1, 300, dtype=torch.int32, device="cuda")
                lik.maxsim_residual_varlen(Q, codes.reshape(-1), residuals.reshape(codes.numel(), -1), cu, centroids,
                                           weights, nbits, max_seqlen_d=300)

    def hidden():
        for nq, nd, train in ((32, 32, True), (1, 1000, False), (32, 1000, False)):
            Q = unit(nq, lq, dim)
            H = torch.randn(nd, 300, 768, device="cuda").bfloat16()
            W = (torch.randn(dim, 768, device="cuda") / 768**0.5).bfloat16()
            b = (torch.randn(dim, device="cuda") * 0.01).bfloat16()
            if train:
                Q.requires_grad_()
                W.requires_grad_()
                lik.maxsim_from_hidden(Q, H, W, b).sum().backward()
            else:
                with torch.no_grad():
                    lik.maxsim_from_hidden(Q, H, W, b)

    return {"int8": int8, "residual": residual, "hidden": hidden}


def _formats(out: str, t0: float) -> list:
    """Sweep each format step in a child process (a step that crashes costs only its own
    entries, and says so); returns the tables the children wrote."""
    import subprocess

    written = []
    for step in _format_steps():
        part = f"{out}.{step}"
        done = subprocess.run([sys.executable, __file__, part, "--step", step], capture_output=True, text=True,
                              timeout=300)
        ok = done.returncode == 0 and os.path.exists(part)
        print(f"{step}: {'ok' if ok else 'FAILED'} at {time.perf_counter() - t0:.0f}s", flush=True)
        if ok:
            written.append(part)
        else:
            print("\n".join((done.stdout + done.stderr).strip().splitlines()[-12:]), flush=True)
    return written


def _merge_into_committed(out: str, arch: str, parts: list) -> int:
    """Write ``out``: the committed table for ``arch`` with the entries of the tables
    ``parts`` added or replacing the ones of the same key; returns the number of entries."""
    committed = os.path.join(os.path.dirname(tuning.__file__), "configs", f"{arch}.json")
    entries = {}
    if os.path.exists(committed):
        with open(committed) as f:
            entries = {(e["kernel"], json.dumps(e["key"])): e for e in json.load(f)["entries"]}
    for part in parts:
        with open(part) as f:
            for e in json.load(f)["entries"]:
                entries[(e["kernel"], json.dumps(e["key"]))] = e
    table = {"version": tuning.TABLE_VERSION, "arch": arch, "entries": [entries[k] for k in sorted(entries)]}
    with open(out, "w") as f:
        json.dump(table, f, indent=1)
    return len(table["entries"])


def _export_table(path: str, arch: str) -> int:
    """Write every config the tuner chose in this process (swept or from a table) to
    ``path`` as ``arch``'s table; returns the number of entries."""
    entries = []
    for key, config in sorted(tuning._chosen.items(), key=lambda kv: tuning._encode_key(kv[0])):
        kernel = "doc" if key and key[0] == "doc" else "forward"
        entries.append({"kernel": kernel, "key": json.loads(tuning._encode_key(key)), "config": config})
    with open(path, "w") as f:
        json.dump({"version": tuning.TABLE_VERSION, "arch": arch, "entries": entries}, f, indent=1)
    return len(entries)


def main(out: str, formats_only: bool = False, step: str | None = None) -> int:
    t0 = time.perf_counter()
    if step is not None:
        _format_steps()[step]()
        _export_table(out, tuning.architecture())
        return 0
    if formats_only:
        arch = tuning.architecture()
        n = _merge_into_committed(out, arch, _formats(out, t0))
        print(f"{n} configs for {arch} (formats swept, the rest as committed) -> {out} in "
              f"{time.perf_counter() - t0:.0f}s")
        return 0
    fp8 = torch.cuda.get_device_capability() >= (8, 9)
    for shape in ALL_SHAPES:
        Q, D = make_inputs(shape)
        _run(Q, D, shape.layout, shape.kind == "train")
        if shape.kind == "inference":
            dm = torch.ones(D.shape[:-1], dtype=torch.bool, device="cuda")
            _run(Q, D, shape.layout, False, dm)           # with a mask: same keys, other variant
            if fp8 and shape.layout != "pairs":
                with torch.no_grad():
                    lik.maxsim_fp8(Q, lik.quantize_fp8(D))
        print(f"{shape.name}: {time.perf_counter() - t0:.0f}s", flush=True)
    # the real loops' buckets: ColBERT-like (64 x 64, Ld 60-300), ColPali-like (32 x 32, Ld 1030),
    # PyLate Contrastive with one hard negative (128 queries x 256 documents, 512 x 1024)
    for nq, nd, ld in ((64, 64, 300), (64, 64, 100), (32, 32, 1030), (128, 256, 300), (512, 1024, 300)):
        for lq in (8, 16, 32):
            Q = torch.nn.functional.normalize(torch.randn(nq, lq, 128, device="cuda"), dim=-1).bfloat16()
            D = torch.nn.functional.normalize(torch.randn(nd, ld, 128, device="cuda"), dim=-1).bfloat16()
            dm = torch.ones(nd, ld, dtype=torch.bool, device="cuda")
            _run(Q, D, "cross", True, dm)
    arch = tuning.architecture()
    n = _export_table(out, arch)
    print(f"{n} configs for {arch} -> {out} in {time.perf_counter() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    args = sys.argv[2:]
    sys.exit(main(sys.argv[1], "--formats" in args, args[args.index("--step") + 1] if "--step" in args else None))
