"""Bar chart of best peer / lik_plugins per shape from a ``kernels.json``.

Usage: python benchmarks/plot_ratios.py benchmarks/results/h100/kernels.json [OUT_PNG]
"""
from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PEERS = ("late-interaction-kernels", "flash-maxsim")


def ratios(rows):
    best: dict = {}
    for r in rows:
        if "ms" in r:
            key = (r["shape"]["name"], r["impl"])
            best[key] = min(best.get(key, float("inf")), r["ms"])
    shapes = list(dict.fromkeys(r["shape"]["name"] for r in rows))
    out = []
    for s in shapes:
        peers = [best[(s, p)] for p in PEERS if (s, p) in best]
        if peers and (s, "lik_plugins") in best:
            out.append((s, min(peers) / best[(s, "lik_plugins")]))
    return out


def main(path, png=None):
    with open(path) as f:
        data = json.load(f)
    pairs = ratios(data["rows"])
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(pairs) + 1.5))
    names = [p[0] for p in pairs][::-1]
    vals = [p[1] for p in pairs][::-1]
    colors = ["tab:green" if v >= 1.0 else ("tab:orange" if v >= 0.9 else "tab:red") for v in vals]
    ax.barh(names, vals, color=colors)
    ax.axvline(1.0, color="black", lw=1)
    ax.axvline(0.9, color="grey", lw=1, ls="--")
    for y, v in enumerate(vals):
        ax.text(v, y, f" {v:.2f}x", va="center", fontsize=8)
    ax.set_xlabel("best peer time / lik_plugins time (>1: lik_plugins faster)")
    ax.set_title(f"MaxSim kernels, {data['meta']['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(png or path.replace(".json", "_ratios.png"), dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:])
