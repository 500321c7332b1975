"""End-to-end PyLate training benchmark: vanilla PyLate vs ``lik_plugins.patch_pylate()``.

    python benchmarks/pylate_e2e.py OUT_DIR [--budget-s 300] [--max-batch 4096] [--only nogc,gc,cached] [--steps 3]

A ColBERT model of ModernColBERT size (ModernBERT-base config, random weights, 50k
vocabulary, 128-d projection; nothing downloaded), bf16 weights, AdamW, ``Contrastive``
with one hard negative, ``Lq=32``, ``Ld=300`` (documents with padding and punctuation
holes, as the collator makes them).  For each (variant, gradient checkpointing) series
the batch size doubles from 8 until out of memory; each size runs 1 warm-up + 3 timed
optimiser steps, reporting the median step time and the step's peak memory.  Then
``CachedContrastive`` (mini-batch 32) at one large batch, vanilla vs patched.

Every series runs in its own subprocess (an OOM never poisons the next one).  Writes
``pylate_e2e.json`` (long format, one row per measurement) and ``pylate_e2e.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

LQ, LD, VOCAB, PROJ = 32, 300, 50368, 128


def build_model(tmp: str, device: str = "cuda", tiny: bool = False):
    """A PyLate ColBERT on a random ModernBERT-base (``tiny``: 2 layers of 64, 512-word
    vocabulary, for CPU smoke runs), bf16, saved to and loaded from ``tmp``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import ModernBertConfig, ModernBertModel, PreTrainedTokenizerFast
    from pylate import models as pmodels

    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    n_words = (512 if tiny else VOCAB) - 64
    vocab = {t: i for i, t in enumerate(special + list("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")
                                         + [f"w{i}" for i in range(n_words)])}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                  sep_token="[SEP]", mask_token="[MASK]")
    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2) if tiny else {}
    config = ModernBertConfig(vocab_size=len(vocab), pad_token_id=0, cls_token_id=2, sep_token_id=3,
                              bos_token_id=2, eos_token_id=3, **sizes)  # base: 768 x 22 layers
    torch.manual_seed(0)
    ModernBertModel(config).save_pretrained(tmp)
    tok.save_pretrained(tmp)
    torch.manual_seed(0)
    model = pmodels.ColBERT(model_name_or_path=tmp, device=device, embedding_size=PROJ, query_length=LQ,
                            document_length=LD)
    return model.to(torch.bfloat16)


def features(model, batch: int, seed: int, device: str = "cuda", lq: int = LQ, ld: int = LD):
    """Query / positive / negative features shaped like the collator's output."""
    import torch

    g = torch.Generator().manual_seed(seed)
    vocab = model.tokenizer.vocab_size if hasattr(model.tokenizer, "vocab_size") else VOCAB
    punct = torch.tensor(model.skiplist[:8] if model.skiplist else [5])

    def make(length: int, ragged: bool):
        ids = torch.randint(64, vocab - 2, (batch, length), generator=g)
        holes = torch.rand(batch, length, generator=g) < 0.08  # punctuation -> skiplist holes
        ids[holes] = punct[torch.randint(len(punct), (int(holes.sum()),), generator=g)]
        mask = torch.ones(batch, length, dtype=torch.long)
        if ragged:  # right padding: documents of 150..300 tokens
            lengths = torch.randint(length // 2, length + 1, (batch,), generator=g)
            mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
            ids = ids.masked_fill(mask == 0, 0)
        return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}

    return [make(lq, False), make(ld, True), make(ld, True)]


def train_step(loss, opt, feats):
    """One optimiser step of a PyLate loss on prepared features; returns the loss."""
    value = loss(feats, None)
    value.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return value


def use_variant(variant: str) -> None:
    """``vanilla``: the kill switch on (PyLate's own code runs); anything else: patched."""
    if variant == "vanilla":
        os.environ["LIK_DISABLE"] = "1"
    else:
        os.environ.pop("LIK_DISABLE", None)


def run_series(args) -> list[dict]:
    import torch

    def save(rows):  # after every batch size: a killed series keeps what it measured
        with open(args.json, "w") as fh:
            json.dump(rows, fh)

    if args.variant == "patched":
        import lik_plugins

        lik_plugins.patch_pylate()
    from pylate import losses

    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(tmp)
    if args.gc:
        model[0].auto_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    if args.loss == "cached":
        loss = losses.CachedContrastive(model=model, mini_batch_size=32)
    else:
        loss = losses.Contrastive(model=model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    sizes = [args.batch] if args.batch else [8 * 2**i for i in range(20) if 8 * 2**i <= args.max_batch]
    deadline = time.time() + args.budget_s
    for batch in sizes:
        if time.time() > deadline:
            rows.append({"batch": batch, "status": "skipped (time budget)"})
            break
        try:
            times, peaks, values = [], [], []
            for i in range(1 + args.steps):
                feats = features(model, batch, seed=i)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                t0 = time.perf_counter()
                value = train_step(loss, opt, feats)
                torch.cuda.synchronize()
                if i:
                    times.append(time.perf_counter() - t0)
                    peaks.append(torch.cuda.max_memory_allocated() - base)
                values.append(float(value.detach().float()))
                del feats, value
            rows.append({"batch": batch, "status": "ok", "step_ms": 1000 * statistics.median(times),
                         "step_peak_gib": max(peaks) / 2**30, "losses": values})
            print(f"  {args.variant:8s} {args.loss:11s} gc={int(args.gc)} batch {batch:5d}: "
                  f"{rows[-1]['step_ms']:8.1f} ms  {rows[-1]['step_peak_gib']:6.2f} GiB", flush=True)
            save(rows)
        except torch.cuda.OutOfMemoryError:
            rows.append({"batch": batch, "status": "oom"})
            print(f"  {args.variant:8s} {args.loss:11s} gc={int(args.gc)} batch {batch:5d}: OOM", flush=True)
            break
    if args.variant == "patched":
        import lik_plugins

        rows.append({"routing": {k: v for k, v in lik_plugins.routing_counts().items() if k.startswith("pylate.")}})
    return rows


def run_ab(args) -> list[dict]:
    """Step time of vanilla and patched PyLate *interleaved in one process*: the same model,
    optimiser and inputs, ``LIK_DISABLE`` toggled per step (read at call time: every patched
    entry then runs PyLate's own code).  Small batches are host-bound and their step time
    wanders by 10-20 % between processes, more than the difference being measured; in
    alternation a slow spell falls on both variants."""
    import tempfile

    import torch

    import lik_plugins

    lik_plugins.patch_pylate()
    from pylate import losses

    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(tmp)
    if args.gc:
        model[0].auto_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    loss = losses.Contrastive(model=model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    rows = []

    def step(feats, variant):
        use_variant(variant)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        train_step(loss, opt, feats)
        torch.cuda.synchronize()
        return 1000 * (time.perf_counter() - t0)

    for batch in [8 * 2**i for i in range(20) if 8 * 2**i <= args.max_batch]:
        try:
            feats = [features(model, batch, seed=i) for i in range(2)]
            for i in range(2):
                step(feats[i], "vanilla"), step(feats[i], "patched")
            times = {"vanilla": [], "patched": []}
            for r in range(args.steps):
                order = ("vanilla", "patched") if r % 2 == 0 else ("patched", "vanilla")
                for variant in order:
                    times[variant].append(step(feats[r % 2], variant))
            row = {"mode": "ab", "gc": args.gc, "batch": batch,
                   **{f"{v}_ms": statistics.median(t) for v, t in times.items()}, "samples": times}
            rows.append(row)
            print(f"  A/B gc={int(args.gc)} batch {batch:5d}: vanilla {row['vanilla_ms']:8.1f} ms  "
                  f"patched {row['patched_ms']:8.1f} ms  ({row['vanilla_ms'] / row['patched_ms']:.2f}x)", flush=True)
            with open(args.json, "w") as fh:
                json.dump(rows, fh)
            del feats
        except torch.cuda.OutOfMemoryError:
            rows.append({"mode": "ab", "gc": args.gc, "batch": batch, "status": "oom"})
            break
    os.environ.pop("LIK_DISABLE", None)
    return rows


def markdown_ab(results: list[dict]) -> list[str]:
    rows = [r for r in results if r.get("mode") == "ab" and "vanilla_ms" in r]
    if not rows:
        return []
    out = ["## Step time, vanilla and patched interleaved in one process (Contrastive)", "",
           "Median over alternating steps (`LIK_DISABLE` toggled per step); spread = max/min of each variant's steps.", "",
           "| gc | batch | vanilla ms | patched ms | speed-up | vanilla spread | patched spread |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        sv, sp = r["samples"]["vanilla"], r["samples"]["patched"]
        out.append(f"| {'on' if r['gc'] else 'off'} | {r['batch']} | {r['vanilla_ms']:.1f} | {r['patched_ms']:.1f} | "
                   f"{r['vanilla_ms'] / r['patched_ms']:.2f}x | {max(sv) / min(sv):.2f} | {max(sp) / min(sp):.2f} |")
    return out + [""]


def markdown(results: list[dict], meta: dict) -> str:
    out = [f"# PyLate end-to-end training: vanilla vs lik_plugins", "",
           f"{meta['device']}, torch {meta['torch']}, PyLate {meta['pylate']}; ModernBERT-base config (random), "
           f"bf16, AdamW, Lq={LQ}, Ld={LD}, one hard negative. Step time = median of the timed steps; "
           "peak = step peak over the allocated baseline.", ""]
    verdicts: list[str] = []
    for loss in ("contrastive", "cached"):
        series = [r for r in results if r["loss"] == loss and r.get("mode") != "ab"]
        if not series:
            continue
        out += [f"## {loss}", "", "| gc | batch | vanilla ms | patched ms | speed-up | vanilla GiB | patched GiB |",
                "|---|---|---|---|---|---|---|"]
        for gc in (False, True):
            v = {r["batch"]: r for r in series if r["variant"] == "vanilla" and r["gc"] == gc and "batch" in r}
            p = {r["batch"]: r for r in series if r["variant"] == "patched" and r["gc"] == gc and "batch" in r}
            for b in sorted(set(v) | set(p)):
                def cell(d, key, fmt):
                    r = d.get(b)
                    if r is None:
                        return "-"
                    return fmt.format(r[key]) if r["status"] == "ok" else r["status"]
                speed = "-"
                if b in v and b in p and v[b]["status"] == p[b]["status"] == "ok":
                    speed = f"{v[b]['step_ms'] / p[b]['step_ms']:.2f}x"
                out.append(f"| {'on' if gc else 'off'} | {b} | {cell(v, 'step_ms', '{:.1f}')} | {cell(p, 'step_ms', '{:.1f}')} "
                           f"| {speed} | {cell(v, 'step_peak_gib', '{:.2f}')} | {cell(p, 'step_peak_gib', '{:.2f}')} |")
            vmax = max([b for b, r in v.items() if r["status"] == "ok"], default=0)
            pmax = max([b for b, r in p.items() if r["status"] == "ok"], default=0)
            both = [b for b in v if b in p and v[b]["status"] == p[b]["status"] == "ok"]
            if both:
                slower = [b for b in both if p[b]["step_ms"] > v[b]["step_ms"] * 1.02]
                verdicts.append(f"- {loss}, gc {'on' if gc else 'off'}: patched slower than vanilla (>2%) at "
                                f"{slower if slower else 'no batch size'}; largest batch {vmax} -> {pmax}"
                                + (f" ({pmax / vmax:.1f}x)" if vmax else ""))
            if v or p:
                out.append(f"| {'on' if gc else 'off'} | **largest batch** | **{vmax}** | **{pmax}** | "
                           f"{(pmax / vmax) if vmax else float('nan'):.1f}x | | |")
        out.append("")
    out += markdown_ab(results)
    if verdicts:
        out += ["## Verdict", "", *verdicts, ""]
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", nargs="?")
    p.add_argument("--budget-s", type=float, default=300, help="total wall-clock budget (series start-up comes on top)")
    p.add_argument("--max-batch", type=int, default=4096)
    p.add_argument("--cached-batch", type=int, default=1024)
    p.add_argument("--steps", type=int, default=3, help="timed optimiser steps per batch size (after 1 warm-up)")
    p.add_argument("--only", default="nogc,gc,cached",
                   help="series to run, comma-separated: nogc, gc (Contrastive without / with gradient "
                        "checkpointing), cached (CachedContrastive), ab-nogc / ab-gc (vanilla and patched "
                        "interleaved in one process, for step time)")
    # internal: one series in a subprocess
    p.add_argument("--series", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ab", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ab-max", default="128,512", help="largest batch of the interleaved A/B runs, gc off,on")
    p.add_argument("--variant", choices=["vanilla", "patched"])
    p.add_argument("--loss", choices=["contrastive", "cached"], default="contrastive")
    p.add_argument("--gc", action="store_true")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.series:
        rows = run_ab(args) if args.ab else run_series(args)
        with open(args.json, "w") as fh:
            json.dump(rows, fh)
        return 0
    if not args.out_dir:
        p.error("OUT_DIR is required")
    import torch
    import pylate

    os.makedirs(args.out_dir, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "pylate": pylate.__version__}
    wanted = set(args.only.split(","))
    plan = [(v, "contrastive", gc, None) for gc in (False, True) if ("gc" if gc else "nogc") in wanted
            for v in ("vanilla", "patched")]
    if "cached" in wanted:
        plan += [(v, "cached", False, args.cached_batch) for v in ("vanilla", "patched")]
    ab_max = dict(zip((False, True), map(int, args.ab_max.split(","))))
    plan += [("ab", "contrastive", gc, None) for gc in (False, True) if ("ab-gc" if gc else "ab-nogc") in wanted]
    start = time.time()
    results = []
    for i, (variant, loss, gc, batch) in enumerate(plan):
        left = args.budget_s - (time.time() - start)
        per = max(20.0, left / (len(plan) - i)) - 15  # leave room for the subprocess start
        out = os.path.join(args.out_dir, f".series_{i}.json")
        cmd = [sys.executable, __file__, "--series", "--variant", variant, "--loss", loss, "--json", out,
               "--budget-s", str(per), "--max-batch", str(args.max_batch), "--steps", str(args.steps)]
        cmd += ["--gc"] if gc else []
        cmd += ["--batch", str(batch)] if batch else []
        if variant == "ab":  # one process, both variants interleaved (LIK_DISABLE toggled per step)
            cmd = [sys.executable, __file__, "--series", "--ab", "--json", out, "--max-batch", str(ab_max[gc]),
                   "--steps", str(args.steps)] + (["--gc"] if gc else [])
        print(f"[{i + 1}/{len(plan)}] {variant} {loss} gc={gc} (budget {per:.0f} s)", flush=True)
        env = {k: v for k, v in os.environ.items() if k not in ("LIK_DISABLE", "PYLATE_SCORES_BACKEND")}
        if variant == "vanilla":  # PyLate's own einsum path, even where flash-maxsim / LIK are installed
            env["PYLATE_SCORES_BACKEND"] = "torch"
        try:
            rc = subprocess.run(cmd, env=env, timeout=per + 60).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        rows = json.load(open(out)) if os.path.exists(out) else []
        if rc != 0:
            rows.append({"status": f"series ended early ({rc})"})
        if os.path.exists(out):
            os.unlink(out)
        for r in rows:
            results.append({"variant": variant, "loss": loss, "gc": gc, **r})
    with open(os.path.join(args.out_dir, "pylate_e2e.json"), "w") as fh:
        json.dump({"meta": meta, "rows": results}, fh, indent=1)
    md = markdown(results, meta)
    with open(os.path.join(args.out_dir, "pylate_e2e.md"), "w") as fh:
        fh.write(md + "\n")
    print(md)
    print(f"total {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
