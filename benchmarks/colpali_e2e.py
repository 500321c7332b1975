"""End-to-end ColQwen2 training step: vanilla colpali-engine vs ``lik_plugins.patch_colpali_engine()``.

    python benchmarks/colpali_e2e.py OUT_DIR [--budget-s 200] [--steps 3] [--max-batch 4096]
    HF_HUB_OFFLINE=1 python benchmarks/colpali_e2e.py /tmp/e2e --smoke      # CPU, tiny config

A ColQwen2 of Qwen2-VL-2B size built from a hard-coded config with random weights
(nothing downloaded): text 1536 x 28 layers, 12 heads / 2 KV heads, MLP 8960, vocabulary
151936; vision tower depth 32, width 1280, 16 heads; plus ColQwen2's 128-d projection.
bf16 weights, bf16 autocast (as the HF Trainer runs colpali's ``bf16: true``), LoRA as
colpali's ColQwen2 recipe (r=32, alpha=32, dropout 0.1, gaussian init, the language model's
q/k/v/o/gate/up/down projections and ``custom_text_proj``), AdamW, gradient checkpointing
(``use_reentrant=False``), ``ColbertPairwiseCELoss`` (in-batch negatives).

Inputs are what ``ColQwen2Processor`` hands the model, built directly: pages are the
visual prompt ``<|im_start|>user\\n<|vision_start|>[image]<|vision_end|>Describe the
image.<|im_end|><|endoftext|>`` with a 64 x 64 patch grid (1024 visual tokens after the
2 x 2 merge; 1036 tokens a page), ``pixel_values`` padded ``[B, 4096, 1176]`` float32 and
``image_grid_thw``; queries are 22 random tokens + 10 ``<|endoftext|>`` augmentation
tokens (32 tokens).

Variants: ``vanilla`` = colpali-engine unpatched with ``COLPALI_SCORES_BACKEND=torch``
(its einsum path); ``patched`` = ``lik_plugins.patch_colpali_engine()`` with the variable
unset.  The model is built once; each (variant, batch) trial restores the initial LoRA
weights and starts a fresh optimizer.  Batch sizes double from 4; at each size both
variants run one warm-up step then up to ``--steps`` timed steps (forward + loss +
backward + optimizer step): median step time and the peak of
``torch.cuda.max_memory_allocated`` over the timed steps.  A variant stops at its first
``torch.cuda.OutOfMemoryError``; the doubling stops when the next size would not fit in
``--budget-s`` (counted from the start of the script, model construction included).

Writes ``colpali_e2e.json`` and ``colpali_e2e.md`` in OUT_DIR.
"""
from __future__ import annotations

import time

T0 = time.perf_counter()

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import shlex  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from contextlib import nullcontext  # noqa: E402
from importlib.metadata import PackageNotFoundError, version  # noqa: E402
from pathlib import Path  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # this checkout's lik_plugins

import torch  # noqa: E402

import lik_plugins  # noqa: E402

VARIANTS = ("vanilla", "patched")
LORA_TARGETS = r"(.*(model)(?!.*visual).*(down_proj|gate_proj|up_proj|k_proj|q_proj|v_proj|o_proj).*$|.*(custom_text_proj).*$)"

# Qwen2-VL-2B(-Instruct) as vidore/colqwen2-base builds on it; token ids of the Qwen2 tokenizer.
FULL = dict(
    text=dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
              num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6,
              bos_token_id=151643, eos_token_id=151645, pad_token_id=151643, max_window_layers=28,
              rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 1e6}),
    vision=dict(depth=32, embed_dim=1280, hidden_size=1536, num_heads=16, mlp_ratio=4, in_channels=3,
                patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
    ids=dict(image=151655, video=151656, vision_start=151652, vision_end=151653, im_start=151644,
             im_end=151645, endoftext=151643, prefix_text=[872, 198], suffix_text=[74785, 279, 2168, 13],
             word_lo=1000, word_hi=150000),
    grid=(64, 64), lq=32, n_aug=10,
)
# --smoke: the same code path on CPU in seconds.
TINY = dict(
    text=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=3,
              rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4}),
    vision=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=4, in_channels=3,
                patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
    ids=dict(image=250, video=251, vision_start=252, vision_end=253, im_start=248, im_end=249, endoftext=3,
             prefix_text=[10, 11], suffix_text=[12, 13, 14, 15], word_lo=16, word_hi=240),
    grid=(8, 8), lq=16, n_aug=5,
)


def pkg_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except Exception:  # noqa: BLE001 - provenance only
        return None


# --------------------------------------------------------------------------- model
def build_model(spec: dict, device: torch.device, attn: str):
    """ColQwen2 from a config, random bf16 weights made on ``device`` (default dtype bf16 while
    constructing, as ``from_pretrained(torch_dtype=bfloat16)`` does), LoRA as colpali's recipe."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2VLConfig

    from colpali_engine.models import ColQwen2

    ids = spec["ids"]
    config = Qwen2VLConfig(
        text_config=dict(spec["text"]), vision_config=dict(spec["vision"]), image_token_id=ids["image"],
        video_token_id=ids["video"], vision_start_token_id=ids["vision_start"],
        vision_end_token_id=ids["vision_end"], vocab_size=spec["text"]["vocab_size"], tie_word_embeddings=True,
    )
    config._attn_implementation = attn
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with device:
            model = ColQwen2(config)
    finally:
        torch.set_default_dtype(default)
    model = model.to(device)
    lora = LoraConfig(r=32, lora_alpha=32, lora_dropout=0.1, init_lora_weights="gaussian", bias="none",
                      task_type="FEATURE_EXTRACTION", target_modules=LORA_TARGETS)
    peft_model = get_peft_model(model, lora)
    peft_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    peft_model.train()
    return peft_model, model, config


def make_inputs(spec: dict, config, batch: int, device: torch.device, seed: int):
    """What ColQwen2Processor.process_images / process_queries return, built directly."""
    ids, (gh, gw) = spec["ids"], spec["grid"]
    vis = config.vision_config
    merge = vis.spatial_merge_size
    g = torch.Generator().manual_seed(seed)
    n_patches, n_visual = gh * gw, gh * gw // merge**2
    page = ([ids["im_start"], *ids["prefix_text"], ids["vision_start"]] + [ids["image"]] * n_visual
            + [ids["vision_end"], *ids["suffix_text"], ids["im_end"], ids["endoftext"]])
    doc_ids = torch.tensor(page).repeat(batch, 1)
    patch_dim = vis.in_channels * vis.temporal_patch_size * vis.patch_size**2
    doc = dict(
        input_ids=doc_ids,
        attention_mask=torch.ones_like(doc_ids),
        mm_token_type_ids=(doc_ids == ids["image"]).long(),
        pixel_values=torch.randn(batch, n_patches, patch_dim, generator=g),  # normalised pixels, float32
        image_grid_thw=torch.tensor([[1, gh, gw]]).repeat(batch, 1),
    )
    n_words = spec["lq"] - spec["n_aug"]
    q_ids = torch.cat([torch.randint(ids["word_lo"], ids["word_hi"], (batch, n_words), generator=g),
                       torch.full((batch, spec["n_aug"]), ids["endoftext"])], dim=1)
    query = dict(input_ids=q_ids, attention_mask=torch.ones_like(q_ids), mm_token_type_ids=torch.zeros_like(q_ids))
    to = lambda d: {k: v.to(device) for k, v in d.items()}  # noqa: E731
    return to(query), to(doc), len(page)


# --------------------------------------------------------------------------- variants
def set_variant(name: str) -> None:
    lik_plugins.unpatch_colpali_engine()
    os.environ.pop("COLPALI_SCORES_BACKEND", None)
    if name == "vanilla":
        os.environ["COLPALI_SCORES_BACKEND"] = "torch"
    else:
        lik_plugins.patch_colpali_engine()


def train_step(model, base, optimizer, loss_fn, query, doc, autocast):
    base.rope_deltas = None  # Qwen2VLModel caches these across calls; start every step alike
    optimizer.zero_grad(set_to_none=True)
    with autocast():
        q = model(**query)
        d = model(**doc)
        loss = loss_fn(q, d)
    loss.backward()
    optimizer.step()
    return loss.detach()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def trial(variant, batch, model, base, init_state, spec, config, device, n_warmup, n_steps, deadline):
    """One (variant, batch) measurement; returns a row dict (status ok / oom)."""
    from colpali_engine.loss import ColbertPairwiseCELoss

    cuda = device.type == "cuda"
    set_variant(variant)
    lik_plugins.reset_routing_counts()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(init_state[n])
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=5e-5, weight_decay=0.0)
    loss_fn = ColbertPairwiseCELoss()
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16))
    row = dict(variant=variant, batch=batch, status="ok")
    times, losses, peak, static = [], [], None, None
    oom = None
    query = doc = None
    try:
        query, doc, ld = make_inputs(spec, config, batch, device, seed=1234 + batch)
        row["Ld"] = ld
        warm_s = None
        for _ in range(n_warmup):
            sync(device)
            t = time.perf_counter()
            losses.append(train_step(model, base, optimizer, loss_fn, query, doc, autocast).item())
            sync(device)
            warm_s = time.perf_counter() - t
        if warm_s is not None:  # timed steps that still fit before the deadline (at least one)
            n_steps = max(1, min(n_steps, int((deadline - time.perf_counter()) / warm_s)))
        if cuda:
            gc.collect()
            torch.cuda.reset_peak_memory_stats()
            static = torch.cuda.memory_allocated()
        for _ in range(n_steps):
            sync(device)
            t = time.perf_counter()
            losses.append(train_step(model, base, optimizer, loss_fn, query, doc, autocast).item())
            sync(device)
            times.append(time.perf_counter() - t)
        if cuda:
            peak = torch.cuda.max_memory_allocated()
        row["warmup_s"] = warm_s
    except torch.cuda.OutOfMemoryError as exc:
        oom = str(exc).splitlines()[0][:300]
    # cleanup outside the except block, so the traceback's frames are gone
    optimizer.zero_grad(set_to_none=True)
    del optimizer, query, doc
    routing = {k: v for k, v in lik_plugins.routing_counts().items() if k.startswith("colpali.")}
    lik_plugins.unpatch_colpali_engine()
    os.environ.pop("COLPALI_SCORES_BACKEND", None)
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    if oom is not None:
        row.update(status="oom", error=oom)
        return row
    row.update(
        step_ms_median=statistics.median(times) * 1e3, step_ms=[t * 1e3 for t in times], n_timed=len(times),
        n_warmup=n_warmup, peak_mib=None if peak is None else peak / 2**20,
        static_mib=None if static is None else static / 2**20, losses=losses, routing=routing,
    )
    if variant == "patched":
        row["our_path"] = any(p != "original" for v in routing.values() for p in v)
    return row


# --------------------------------------------------------------------------- report
def write_reports(out_dir: Path, meta: dict, rows: list[dict]) -> None:
    summary = {}
    for v in VARIANTS:
        ok = [r["batch"] for r in rows if r["variant"] == v and r["status"] == "ok"]
        oom = [r["batch"] for r in rows if r["variant"] == v and r["status"] == "oom"]
        summary[v] = dict(largest_batch=max(ok) if ok else None, first_oom=min(oom) if oom else None)
    patched_rows = [r for r in rows if r["variant"] == "patched" and r["status"] == "ok"]
    summary["patched_used_our_path"] = bool(patched_rows) and all(r.get("our_path") for r in patched_rows)
    data = dict(meta=meta, summary=summary, rows=rows)
    (out_dir / "colpali_e2e.json").write_text(json.dumps(data, indent=1))

    def fmt(x, spec=".1f"):
        return "—" if x is None else format(x, spec)

    by = {(r["variant"], r["batch"]): r for r in rows}
    lines = [
        "# ColQwen2 end-to-end training step: vanilla colpali-engine vs lik_plugins patched", "",
        f"- command: `{meta['command']}`",
        f"- device: {meta['device']}; torch {meta['torch']}, transformers {meta['transformers']}, "
        f"peft {meta['peft']}, colpali-engine {meta['colpali_engine']}, lik_plugins {meta['lik_plugins']} "
        f"({meta['git_commit']})",
        f"- model: {meta['model']}; {meta['params_total'] / 1e9:.3f} B parameters, "
        f"{meta['params_trainable'] / 1e6:.1f} M trainable (LoRA); attention `{meta['attn_implementation']}`",
        f"- step: {meta['step']}",
        f"- pages: {meta['visual_tokens']} visual tokens ({meta['page_tokens']} tokens a page), "
        f"queries {meta['query_tokens']} tokens",
        f"- budget {meta['budget_s']} s; model built in {meta['build_s']:.1f} s; total {meta['total_s']:.1f} s; "
        f"stopped: {meta['stop_reason']}",
        "",
        "| B | vanilla ms | patched ms | speed-up | vanilla peak MiB | patched peak MiB | saved MiB |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for b in sorted({r["batch"] for r in rows}):
        v, p = by.get(("vanilla", b), {}), by.get(("patched", b), {})
        vm, pm = v.get("step_ms_median"), p.get("step_ms_median")
        vp, pp = v.get("peak_mib"), p.get("peak_mib")
        cell = lambda r, x: ("OOM" if r.get("status") == "oom" else fmt(x))  # noqa: E731
        lines.append(
            f"| {b} | {cell(v, vm)} | {cell(p, pm)} | {fmt(vm / pm if vm and pm else None, '.3f') + ('x' if vm and pm else '')} "
            f"| {cell(v, vp)} | {cell(p, pp)} | {fmt(vp - pp if vp and pp else None)} |")
    lines += [
        "",
        f"- largest batch that fit: vanilla {summary['vanilla']['largest_batch']} "
        f"(first OOM: {summary['vanilla']['first_oom']}), patched {summary['patched']['largest_batch']} "
        f"(first OOM: {summary['patched']['first_oom']})",
        f"- patched run served by lik_plugins: {summary['patched_used_our_path']}; routing of the last patched "
        f"trial: `{json.dumps(patched_rows[-1]['routing']) if patched_rows else None}`",
        "",
    ]
    (out_dir / "colpali_e2e.md").write_text("\n".join(lines))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--budget-s", type=float, default=200.0,
                        help="wall-clock budget from script start; no batch size is started that would not fit")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per trial (after 1 warm-up step)")
    parser.add_argument("--start-batch", type=int, default=4)
    parser.add_argument("--max-batch", type=int, default=None, help="default 4096 (--smoke: the start batch)")
    parser.add_argument("--attn", default="sdpa", help="attn_implementation (colpali uses flash_attention_2 if installed)")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny config, batch 4, 1 step per variant")
    args = parser.parse_args(argv)

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        spec, device, n_warmup, n_steps, max_batch = TINY, torch.device("cpu"), 0, 1, args.max_batch or args.start_batch
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    else:
        if not torch.cuda.is_available():
            sys.exit("needs a CUDA device (or --smoke)")
        spec, device, n_warmup, n_steps, max_batch = FULL, torch.device("cuda"), 1, args.steps, args.max_batch or 4096
    deadline = T0 + args.budget_s

    t = time.perf_counter()
    model, base, config = build_model(spec, device, args.attn)
    sync(device)
    build_s = time.perf_counter() - t
    init_state = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    n_total = sum(p.numel() for p in model.parameters())
    n_train = sum(p.numel() for p in init_state.values())
    gh, gw = spec["grid"]
    merge = config.vision_config.spatial_merge_size
    meta = dict(
        command="python " + shlex.join(sys.argv if argv is None else [sys.argv[0], *argv]),
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor() or platform.machine()})",
        torch=torch.__version__, transformers=pkg_version("transformers"), peft=pkg_version("peft"),
        colpali_engine=pkg_version("colpali-engine"), lik_plugins=lik_plugins.__version__, git_commit=git_commit(),
        triton=pkg_version("triton"), python=platform.python_version(),
        model=("ColQwen2, Qwen2-VL-2B-sized config, random weights" if not args.smoke else "ColQwen2, TINY smoke config"),
        text_config=spec["text"], vision_config=spec["vision"], params_total=n_total, params_trainable=n_train,
        attn_implementation=args.attn, dtype="bfloat16 weights + bf16 autocast",
        lora=dict(r=32, lora_alpha=32, lora_dropout=0.1, init_lora_weights="gaussian", target_modules=LORA_TARGETS),
        step="queries forward + pages forward + ColbertPairwiseCELoss (in-batch) + backward + AdamW step, "
             "gradient checkpointing (use_reentrant=False)",
        visual_tokens=gh * gw // merge**2, image_grid_thw=[1, gh, gw], page_tokens=None, query_tokens=spec["lq"],
        env={k: os.environ.get(k) for k in ("COLPALI_SCORES_BACKEND", "LIK_DISABLE", "CUDA_VISIBLE_DEVICES")},
        budget_s=args.budget_s, n_warmup=n_warmup, steps=n_steps, build_s=build_s, smoke=args.smoke,
        variants={"vanilla": "unpatched, COLPALI_SCORES_BACKEND=torch",
                  "patched": "lik_plugins.patch_colpali_engine(), COLPALI_SCORES_BACKEND unset"},
    )
    print(f"[colpali_e2e] {meta['model']}: {n_total / 1e9:.3f} B params, {n_train / 1e6:.2f} M trainable, "
          f"built in {build_s:.1f} s on {meta['device']} ({time.perf_counter() - T0:.1f} s since start)", flush=True)

    rows: list[dict] = []
    alive = set(VARIANTS)
    last_ms: dict[str, float] = {}
    stop_reason = "max batch reached"
    batch = args.start_batch
    while alive and batch <= max_batch:
        # next size ~ twice the last one's step; a trial = warm-up (slower) + timed steps
        est = sum(2 * last_ms[v] / 1e3 * (n_warmup * 1.5 + 1) for v in alive if v in last_ms)
        if rows and time.perf_counter() + est > deadline:
            stop_reason = f"time budget (batch {batch} would need ~{est:.0f} s more)"
            break
        todo = [v for v in VARIANTS if v in alive]
        for i, variant in enumerate(todo):
            # this trial's share of the time left: its timed steps are cut to fit it
            share = time.perf_counter() + (deadline - time.perf_counter()) / (len(todo) - i)
            row = trial(variant, batch, model, base, init_state, spec, config, device, n_warmup, n_steps, share)
            row["elapsed_s"] = time.perf_counter() - T0
            meta["page_tokens"] = row.get("Ld", meta["page_tokens"])
            rows.append(row)
            if row["status"] == "oom":
                alive.discard(variant)
                print(f"[colpali_e2e] B={batch:5d} {variant:8s} OOM  ({row['elapsed_s']:.0f} s)", flush=True)
            else:
                last_ms[variant] = row["step_ms_median"]
                print(f"[colpali_e2e] B={batch:5d} {variant:8s} {row['step_ms_median']:9.1f} ms  "
                      f"peak {fmt_mib(row['peak_mib'])}  loss {row['losses'][-1]:.4f}  "
                      f"routing {json.dumps(row['routing'])}  ({row['elapsed_s']:.0f} s)", flush=True)
            meta["total_s"], meta["stop_reason"] = time.perf_counter() - T0, "running"
            write_reports(out_dir, meta, rows)  # a killed run keeps what it measured
        batch *= 2
    if not alive:
        stop_reason = "out of memory (both variants)"
    meta["total_s"], meta["stop_reason"] = time.perf_counter() - T0, stop_reason
    write_reports(out_dir, meta, rows)
    print((out_dir / "colpali_e2e.md").read_text(), flush=True)


def fmt_mib(x):
    return "—" if x is None else f"{x:.0f} MiB"


if __name__ == "__main__":
    main()
