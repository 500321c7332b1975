"""How much fp8 (e4m3) and int8 scoring change rankings, on the recipes' offline retrieval set.

Encodes the standard-library docstring pairs of ``recipes/_common.py`` (query = a
function's summary, its one relevant passage = the rest of its documentation) with a
PyLate ColBERT model -- by default the bundled all-MiniLM-L6-v2, no download -- and ranks
every passage for every query four ways: fp32 tokens, bf16 tokens (the baseline: what
a bf16 model serves), fp8 tokens (``lik_plugins.quantize_fp8`` + ``maxsim_fp8``) and int8
tokens (``lik_plugins.quantize_int8`` + ``maxsim_int8``).

Reported against bf16: the share of queries whose top-10 list is identical (same
documents, same order), whose top-10 *set* is identical, whose top-1 is identical, and
nDCG@10 / MRR@10 of each precision with the difference.  fp32 vs bf16 is printed beside
it as the yardstick: the change bf16 itself makes.

    python recipes/fp8_fidelity.py --out fidelity/           # encode + score here
    python recipes/fp8_fidelity.py --save-embeddings emb.pt   # encode only (CPU)
    python recipes/fp8_fidelity.py --embeddings emb.pt --device cuda --out OUT   # score on a GPU
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

TOP_K = 10


def encode(args) -> dict:
    """fp32 token embeddings of every query and passage, padded, with the passage mask."""
    import torch

    import _common

    pairs = _common.docstring_pairs()[: args.max_pairs]
    model = _common.load_colbert(args)
    with torch.no_grad():
        q = model.encode([p["query"] for p in pairs], is_query=True, convert_to_tensor=True, batch_size=64)
        d = model.encode([p["passage"] for p in pairs], is_query=False, convert_to_tensor=True, batch_size=64)
    lengths = torch.tensor([len(x) for x in d])
    return {
        "queries": torch.nn.utils.rnn.pad_sequence([x.float().cpu() for x in q], batch_first=True),
        "passages": torch.nn.utils.rnn.pad_sequence([x.float().cpu() for x in d], batch_first=True),
        "passage_mask": torch.arange(int(lengths.max()))[None, :] < lengths[:, None],
        "model": str(args.model),
        "names": [p["name"] for p in pairs],
    }


def score_all(emb: dict, device: str) -> dict:
    """Scores ``[queries, passages]`` at each precision (query i's relevant passage is i)."""
    import torch

    import lik_plugins as lik

    Q = emb["queries"].to(device)
    D = emb["passages"].to(device)
    dm = emb["passage_mask"].to(device)
    with torch.no_grad():
        out = {
            "fp32": lik.maxsim(Q, D, d_mask=dm),
            "bf16": lik.maxsim(Q.bfloat16(), D.bfloat16(), d_mask=dm),
            # an fp8 index is quantised from the model's own output; the query on the fly
            "fp8": lik.maxsim_fp8(Q, lik.quantize_fp8(D), d_mask=dm),
            "int8": lik.maxsim_int8(Q, lik.quantize_int8(D), d_mask=dm),
        }
    return {k: v.float().cpu() for k, v in out.items()}


def ranking_metrics(scores) -> dict:
    """nDCG@10 and MRR@10 with one relevant passage per query (the diagonal)."""
    import torch

    gold = scores.diagonal()[:, None]
    # rank of the relevant passage; ties with it count against it (pessimistic, deterministic)
    rank = (scores >= gold).sum(dim=1)
    hit = rank <= TOP_K
    ndcg = torch.where(hit, 1.0 / torch.log2(rank.double() + 1), torch.zeros((), dtype=torch.float64))
    mrr = torch.where(hit, 1.0 / rank.double(), torch.zeros((), dtype=torch.float64))
    return {"ndcg@10": float(ndcg.mean()), "mrr@10": float(mrr.mean()), "recall@10": float(hit.double().mean())}


def agreement(base, other) -> dict:
    """Share of queries whose top-10 (ordered list / set) and top-1 match the baseline's."""
    k = min(TOP_K, base.shape[1])
    a = base.topk(k, dim=1).indices
    b = other.topk(k, dim=1).indices
    same_list = (a == b).all(dim=1)
    same_set = (a.sort(dim=1).values == b.sort(dim=1).values).all(dim=1)
    return {
        "identical_top10": float(same_list.double().mean()),
        "same_top10_set": float(same_set.double().mean()),
        "same_top1": float((a[:, 0] == b[:, 0]).double().mean()),
        "max_abs_score_diff": float((base - other).abs().max()),
    }


def fidelity(scores: dict) -> dict:
    base = scores["bf16"]
    base_ndcg = ranking_metrics(base)["ndcg@10"]
    report = {"queries": base.shape[0], "passages": base.shape[1], "baseline": "bf16", "precisions": {}}
    for name, s in scores.items():
        row = ranking_metrics(s)
        row.update(agreement(base, s))
        row["ndcg@10_minus_bf16"] = row["ndcg@10"] - base_ndcg
        report["precisions"][name] = row
    return report


def markdown(report: dict, meta: dict) -> str:
    lines = [
        f"# fp8 / int8 ranking fidelity — {meta['device']}",
        "",
        f"{report['queries']} queries × {report['passages']} passages (standard-library docstring pairs, "
        f"one relevant passage each), model `{meta['model']}`; baseline: bf16 tokens. "
        f"Command: `{meta['command']}`.",
        "",
        "| precision | identical top-10 | same top-10 set | same top-1 | nDCG@10 | Δ nDCG@10 vs bf16 | MRR@10 | "
        "max |score diff| |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in report["precisions"].items():
        lines.append(
            f"| {name} | {r['identical_top10']:.1%} | {r['same_top10_set']:.1%} | {r['same_top1']:.1%} | "
            f"{r['ndcg@10']:.4f} | {r['ndcg@10_minus_bf16']:+.4f} | {r['mrr@10']:.4f} | {r['max_abs_score_diff']:.3g} |"
        )
    return "\n".join(lines) + "\n"


def embedding_parser(description: str, name: str) -> argparse.ArgumentParser:
    """The options of the recipes that score these embeddings (this one, plaid_rerank.py,
    whose results are ``<name>.json`` / ``.md``)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None, help="model name or path (default: the bundled all-MiniLM-L6-v2)")
    p.add_argument("--device", default=None, help="cpu / cuda (default: cuda when available)")
    p.add_argument("--max-pairs", type=int, default=None, help="use the first N pairs (default: all)")
    p.add_argument("--query-length", type=int, default=32)
    p.add_argument("--document-length", type=int, default=180)
    p.add_argument("--seed", type=int, default=0, help="seeds the projection PyLate adds to a plain encoder")
    p.add_argument("--embeddings", help="score embeddings saved by fp8_fidelity.py --save-embeddings instead of encoding")
    p.add_argument("--out", help=f"write {name}.json and {name}.md into this folder")
    return p


def load_or_encode(args) -> dict:
    """The embeddings saved at ``--embeddings``, or encoded now (the bundled model unless
    ``--model``); ``args.device`` defaults to cuda when available."""
    import torch

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.embeddings:
        return torch.load(args.embeddings)
    import _common

    bundled = args.model is None
    if bundled:
        args.model = _common.default_model()
    emb = encode(args)
    emb["model"] = "all-MiniLM-L6-v2 (bundled) + PyLate projection" if bundled else str(args.model)
    return emb


def write_results(out: str | None, name: str, meta: dict, report: dict, md: str) -> None:
    """``<name>.json`` (meta + report) and ``<name>.md`` into the folder ``out``, if given."""
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"{name}.json"), "w") as f:
            json.dump({"meta": meta, **report}, f, indent=1)
        with open(os.path.join(out, f"{name}.md"), "w") as f:
            f.write(md)


def parse_args(argv=None):
    p = embedding_parser(__doc__.split("\n\n")[0], "fp8_fidelity")
    p.add_argument("--save-embeddings", help="encode and save the embeddings to this .pt file, then stop")
    args = p.parse_args(argv)
    args.dtype = "float32"
    return args


def main(argv=None) -> dict:
    import torch

    args = parse_args(argv)
    emb = load_or_encode(args)
    if args.save_embeddings and not args.embeddings:
        torch.save(emb, args.save_embeddings)
        print(f"saved {emb['queries'].shape[0]} queries and passages to {args.save_embeddings}")
        return {}
    start = time.perf_counter()
    report = fidelity(score_all(emb, args.device))
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    meta = {"device": device, "model": emb["model"],
            "command": "python " + " ".join([os.path.relpath(__file__)] + (argv if argv is not None else sys.argv[1:])),
            "torch": torch.__version__, "seconds": round(time.perf_counter() - start, 2)}
    from lik_plugins import routing_counts

    meta["routing"] = routing_counts()
    md = markdown(report, meta)
    print(md)
    write_results(args.out, "fp8_fidelity", meta, report, md)
    return report


if __name__ == "__main__":
    main()
