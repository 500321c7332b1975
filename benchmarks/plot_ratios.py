"""Bar chart of best peer / lik_plugins per shape from a ``kernels.json`` (bf16), with the
opt-in fp8 path beside it where it was measured (hatched bars).

Usage: python benchmarks/plot_ratios.py benchmarks/results/h100/kernels.json [OUT_PNG]
"""
from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PEERS = ("late-interaction-kernels", "flash-maxsim")


def ratios(rows, ours="lik_plugins"):
    best: dict = {}
    for r in rows:
        if "ms" in r:
            key = (r["shape"]["name"], r["impl"])
            best[key] = min(best.get(key, float("inf")), r["ms"])
    shapes = list(dict.fromkeys(r["shape"]["name"] for r in rows))
    out = []
    for s in shapes:
        peers = [best[(s, p)] for p in PEERS if (s, p) in best]
        if peers and (s, ours) in best:
            out.append((s, min(peers) / best[(s, ours)]))
    return out


def main(path, png=None):
    with open(path) as f:
        data = json.load(f)
    pairs = ratios(data["rows"])
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(pairs) + 1.5))
    names = [p[0] for p in pairs][::-1]
    vals = [p[1] for p in pairs][::-1]
    colors = ["tab:green" if v >= 1.0 else ("tab:orange" if v >= 0.9 else "tab:red") for v in vals]
    fp8 = dict(ratios(data["rows"], "lik_plugins fp8"))
    height = 0.4 if fp8 else 0.8
    ys = list(range(len(names)))
    ax.barh([y + (height / 2 if fp8 else 0) for y in ys], vals, height=height, color=colors, label="bf16")
    for y, v in enumerate(vals):
        ax.text(v, y + (height / 2 if fp8 else 0), f" {v:.2f}x", va="center", fontsize=7)
    if fp8:
        f_y = [y - height / 2 for y, n in zip(ys, names) if n in fp8]
        f_v = [fp8[n] for n in names if n in fp8]
        ax.barh(f_y, f_v, height=height, color="white", edgecolor="tab:blue", hatch="//", label="fp8 (opt-in)")
        for y, v in zip(f_y, f_v):
            ax.text(v, y, f" {v:.2f}x", va="center", fontsize=7, color="tab:blue")
        ax.legend(loc="lower right", fontsize=8)
    ax.set_yticks(ys)
    ax.set_yticklabels(names)
    ax.axvline(1.0, color="black", lw=1)
    ax.axvline(0.9, color="grey", lw=1, ls="--")
    ax.set_xlabel("best peer time / lik_plugins time (>1: lik_plugins faster)")
    ax.set_title(f"MaxSim kernels, {data['meta']['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(png or path.replace(".json", "_ratios.png"), dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:])
