"""Our ColBERTv2 residual format against fast-plaid's own decompression.

    python benchmarks/fast_plaid_parity.py OUT_DIR [--nbits 2 4]

fast-plaid (PyLate's PLAID index) pins one exact torch (1.4.6.2110: torch 2.11.0), so it
cannot live in the test environment (torch 2.13); run this in an environment that has
both, e.g. ``pip install fast-plaid==1.4.6.2110`` (it brings torch 2.11.0) plus this
repository on ``PYTHONPATH``.  It runs on a CPU.

For each ``nbits``: fast-plaid builds an index of random unit-norm documents on the CPU;
its stored codes, residual bytes, centroids and bucket weights go through
``lik_plugins.ops.plaid.decompress`` and are compared (after L2 normalisation, as ColBERTv2
reconstructs) with fast-plaid's ``get_embeddings``.  Also reported: the same with the bit
order inside each byte reversed (what a wrong layout looks like).  fast-plaid keeps fp16
centroids and reconstructs in fp16: the tolerance is two fp16 ulps of a unit-norm component
(``2**-10``).  Writes ``fast_plaid_parity.{json,md}``; exits 1 past the tolerance.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

from lik_plugins.ops import plaid  # noqa: E402

# two fp16 ulps at magnitudes up to 1 (unit-norm tokens): fast-plaid rounds its centroids and
# its reconstruction to fp16
TOLERANCE = 2.0 ** -10


def _fast_plaid_index(docs, nbits, path):
    from fast_plaid import search

    index = search.FastPlaid(index=path, device="cpu")
    index.create(documents_embeddings=docs, nbits=nbits, kmeans_niters=2)
    return index


def check(nbits: int, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 40, (60,), generator=gen).tolist()
    docs = [F.normalize(torch.randn(n, 64, generator=gen), dim=-1) for n in lengths]
    with tempfile.TemporaryDirectory() as path:
        index = _fast_plaid_index(docs, nbits, path)
        theirs = torch.cat(index.get_embeddings(list(range(len(docs))))).float()
        load = lambda name: torch.from_numpy(np.load(os.path.join(path, name)))  # noqa: E731
        codes, residuals = load("0.codes.npy").to(torch.int32), load("0.residuals.npy")
        centroids, weights = load("centroids.npy").float(), load("bucket_weights.npy").float()
    n = theirs.shape[0]
    ours = F.normalize(plaid.decompress(codes[:n], residuals[:n], centroids, weights, nbits).float(), dim=-1)
    flip = torch.tensor([int(f"{b:08b}"[::-1], 2) for b in range(256)], dtype=torch.uint8)
    other_order = F.normalize(plaid.decompress(codes[:n], flip[residuals[:n].long()], centroids, weights,
                                               nbits).float(), dim=-1)
    return dict(nbits=nbits, tokens=n, residual_bytes_per_token=residuals.shape[1],
                max_diff=(ours - theirs).abs().max().item(),
                max_diff_other_bit_order=(other_order - theirs).abs().max().item(),
                tolerance=TOLERANCE,
                max_diff_to_original=(torch.cat(docs) - theirs).abs().max().item())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--nbits", type=int, nargs="+", default=[2, 4])
    args = p.parse_args()
    import fast_plaid

    rows = [check(n) for n in args.nbits]
    meta = dict(torch=torch.__version__, fast_plaid=getattr(fast_plaid, "__version__", "1.4.6.2110"),
                command="python " + " ".join(sys.argv))
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "fast_plaid_parity.json"), "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    lines = ["# ColBERTv2 residual decompression: lik_plugins against fast-plaid", "",
             f"torch {meta['torch']}, fast-plaid {meta['fast_plaid']}, CPU. Command: `{meta['command']}`", "",
             "60 random unit-norm documents of 5-39 tokens, d = 64, indexed by fast-plaid; its stored codes and "
             "residuals decompressed by `lik_plugins.ops.plaid.decompress`, L2-normalised, against its `get_embeddings`.",
             "", "| nbits | tokens | bytes / token | max abs diff | with the bit order reversed | tolerance "
             "| fast-plaid vs the original tokens |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['nbits']} | {r['tokens']} | {r['residual_bytes_per_token']} | {r['max_diff']:.2e} | "
                     f"{r['max_diff_other_bit_order']:.3f} | {r['tolerance']:.2e} | "
                     f"{r['max_diff_to_original']:.3f} |")
    with open(os.path.join(args.out_dir, "fast_plaid_parity.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r["max_diff"] <= TOLERANCE for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
