"""Multi-GPU training with documents gathered across ranks: vanilla host vs lik_plugins patched.

    torchrun --standalone --nproc_per_node=N benchmarks/multi_gpu.py OUT_DIR [options]
    python benchmarks/multi_gpu.py OUT_DIR [--nproc N]           # spawns N ranks itself (default: all GPUs)
    python benchmarks/multi_gpu.py OUT_DIR --device cpu --tiny    # gloo, 2 CPU ranks, tiny configs (smoke)

Two models, random weights from configs (nothing downloaded), bf16:

* ``colbert``: PyLate ``Contrastive(gather_across_devices=True)`` on a ColBERT of
  ModernColBERT size (ModernBERT-base config, 50k vocabulary, 128-d projection; the
  builder and inputs of ``pylate_e2e.py``: Lq=32, Ld=300 with padding and punctuation
  holes, one hard negative), AdamW.
* ``colqwen2``: colpali-engine's ``ColbertPairwiseCELoss`` on a ColQwen2 of Qwen2-VL-2B size
  with LoRA and gradient checkpointing (the builder and inputs of ``colpali_e2e.py``: 1036
  tokens a page, 32-token queries), bf16 autocast, AdamW; the pages are gathered the
  way colpali's ``ContrastiveTrainer`` does it (left zero padding to the longest page over
  ranks, ``torch.distributed.nn.all_gather``, ``offset = rank * B``).

Gradients are averaged over ranks after each backward (see ``Workload``).  Per model:

1. parity: one step at a small batch from the same weights.  First in fp32 (the model cast
   to fp32, no autocast): vanilla -- the oracle -- and patched, which checks what crosses
   the ranks (gradients back through the all-gather, per-rank labels, loss scaling) at
   fp32 precision.  Then in bf16: vanilla, vanilla again (the run-to-run noise floor: bf16
   GEMMs, attention backward) and patched, each one's relative L2 gradient error against
   the fp32 oracle -- the bar of ``tests/*/gpu_parity.py``: patched no further from it than
   about the host's own bf16 step.  Loss on every rank, every rank's routing counts;
2. scaling: the batch per GPU doubles from ``--start-batch`` until a variant runs out of
   memory (caught; every rank agrees before moving on).  At each size the variants take
   ``--rounds`` turns in ABBA order, each 1 warm-up + ``--steps`` timed steps: median step
   time (slowest rank) with the spread of the per-round ratios, peak memory (largest rank),
   Triton compiles during timed steps, largest batch that fit.

Vanilla = host unpatched with ``PYLATE_SCORES_BACKEND=torch`` / ``COLPALI_SCORES_BACKEND=torch``
(their own einsum path); patched = ``patch_pylate()`` / ``patch_colpali_engine()``, variables
unset.  NVLink multicast stays off (``NCCL_NVLS_ENABLE=0``).  Rank 0 writes
``multi_gpu.json`` and ``multi_gpu.md`` into OUT_DIR after every measurement, so a run cut
short keeps what it measured.  A collective that never completes (e.g. one rank out of
memory while another is not) times out after ``--collective-timeout-s`` seconds.
"""
from __future__ import annotations

import os

# NVLink multicast off in NCCL, PyTorch's symmetric memory and NVSHMEM, before any communicator exists
os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "src"), str(HERE)]  # this checkout's lik_plugins; the sibling benchmarks

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import lik_plugins  # noqa: E402

VARIANTS = ("vanilla", "patched")
HOST_ENV = {"colbert": "PYLATE_SCORES_BACKEND", "colqwen2": "COLPALI_SCORES_BACKEND"}


# --------------------------------------------------------------------------- launch
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spawned(local_rank: int, world_size: int, port: int, args) -> None:
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    worker(args)


def init_distributed(args) -> torch.device:
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.device == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ["WORLD_SIZE"])))
        backend = "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.collective_timeout_s))
    return device


# --------------------------------------------------------------------------- variants
def set_variant(model_name: str, variant: str) -> None:
    """Vanilla: host unpatched on its own torch path; patched: our patch, selector unset."""
    var = HOST_ENV[model_name]
    os.environ.pop(var, None)
    os.environ.pop("LIK_DISABLE", None)
    if model_name == "colbert":
        patch, unpatch = lik_plugins.patch_pylate, lik_plugins.unpatch_pylate
    else:
        patch, unpatch = lik_plugins.patch_colpali_engine, lik_plugins.unpatch_colpali_engine
    unpatch()
    if variant == "vanilla":
        os.environ[var] = "torch"
    else:
        patch()


# --------------------------------------------------------------------------- models
class Workload:
    """One model on this rank: ``step(batch, seed)`` runs forward, loss, backward, the
    gradient average over ranks and the optimiser step, and returns the loss; ``reset()``
    restores the initial trainable weights and a fresh optimiser.

    The gradients are averaged with one all-reduce per tensor after the backward -- the
    arithmetic of DDP without its overlap with the backward.  Not DDP itself: a backward cut
    short by an out-of-memory error would leave DDP's reducer mid-iteration, and the
    doubling search must carry on with the next variant in the same process."""

    def __init__(self, trainable, make_loss_fn, lr, modules):
        self.trainable, self.make_loss_fn, self.lr, self.modules = trainable, make_loss_fn, lr, modules
        self.initial = {n: p.detach().clone() for n, p in trainable}
        self.dtype = torch.bfloat16
        self.reset()

    def cast(self, dtype: torch.dtype) -> None:
        """Every weight to ``dtype`` (fp32 for the parity oracle; back to bf16 for the rest:
        bf16 -> fp32 -> bf16 is exact), then the initial trainable weights and a fresh optimiser.
        ``make_loss_fn`` reads ``self.dtype`` to choose autocast."""
        for m in self.modules:
            m.to(dtype)
        self.dtype = dtype
        self.reset()

    def reset(self):
        with torch.no_grad():
            for n, p in self.trainable:
                p.copy_(self.initial[n])
                p.grad = None
        self.opt = torch.optim.AdamW([p for _, p in self.trainable], lr=self.lr, weight_decay=0.0)

    def step(self, batch: int, seed: int):
        self.opt.zero_grad(set_to_none=True)
        torch.manual_seed(seed)  # the same dropout masks (ColQwen2's LoRA) for every variant
        loss = self.make_loss_fn(batch, seed)
        loss.backward()
        world = dist.get_world_size()
        if world > 1:
            grads = [p.grad for _, p in self.trainable if p.grad is not None]
            for work in [dist.all_reduce(g, async_op=True) for g in grads]:
                work.wait()
            for g in grads:
                g.div_(world)
        self.opt.step()
        return loss.detach().float()

    def flat_grad(self) -> torch.Tensor:
        return torch.cat([p.grad.detach().float().flatten() for _, p in self.trainable if p.grad is not None])


def colbert_workload(args, device) -> tuple[Workload, dict]:
    import pylate_e2e
    from pylate import losses

    with tempfile.TemporaryDirectory() as tmp:
        model = pylate_e2e.build_model(tmp, device=str(device), tiny=args.tiny)
    model.train()
    loss = losses.Contrastive(model=model, gather_across_devices=True)
    lq, ld = (16, 48) if args.tiny else (pylate_e2e.LQ, pylate_e2e.LD)

    def loss_fn(batch, seed):
        return loss(pylate_e2e.features(model, batch, seed, device=str(device), lq=lq, ld=ld), None)

    shape = {"Lq": lq, "Ld": ld, "docs_per_query": 2, "model": "ModernBERT-base ColBERT" + (" (tiny)" if args.tiny else "")}
    return Workload([(n, p) for n, p in model.named_parameters() if p.requires_grad], loss_fn, 1e-5, [model]), shape


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient.  On gloo, torch 2.13's
    backward of ``torch.distributed.nn.all_gather`` receives each rank's slice into
    ``empty_like(grad)``, which keeps a permuted gradient's strides while gloo writes
    contiguous bytes: colpali's einsum gradient arrives scrambled.  NCCL (a reduce-scatter
    into a contiguous buffer) is not affected; the CPU smoke run needs this to compare
    anything."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def gather_pages(d: torch.Tensor) -> tuple[torch.Tensor, int]:
    """colpali's ContrastiveTrainer with several processes: pages left-padded with zero
    tokens to the longest over ranks, all-gathered with gradients; ``offset = rank * B``."""
    from torch.distributed.nn import all_gather

    longest = torch.tensor([d.size(1)], device=d.device)
    dist.all_reduce(longest, op=dist.ReduceOp.MAX)
    if int(longest) > d.size(1):
        d = torch.nn.functional.pad(d, (0, 0, int(longest) - d.size(1), 0))
    pages = torch.cat(all_gather(d), dim=0)
    if dist.get_backend() == "gloo":
        pages = _ContiguousGrad.apply(pages)
    return pages, dist.get_rank() * d.size(0)


def colqwen2_workload(args, device) -> tuple[Workload, dict]:
    import colpali_e2e
    from colpali_engine.loss import ColbertPairwiseCELoss

    spec = colpali_e2e.TINY if args.tiny else colpali_e2e.FULL
    peft_model, base, config = colpali_e2e.build_model(spec, device, args.attn)
    head = ColbertPairwiseCELoss()
    page_tokens = {}

    def loss_fn(batch, seed):
        query, doc, page_tokens["Ld"] = colpali_e2e.make_inputs(spec, config, batch, device, seed)
        query, doc = ({k: v.to(work.dtype) if v.is_floating_point() else v for k, v in x.items()} for x in (query, doc))
        base.rope_deltas = None  # Qwen2VLModel caches these across calls; start every step alike
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=work.dtype == torch.bfloat16):
            q = peft_model(**query)
            d = peft_model(**doc)
            pages, offset = gather_pages(d)
            return head(query_embeddings=q, doc_embeddings=pages, offset=offset)

    trainable = [(n, p) for n, p in peft_model.named_parameters() if p.requires_grad]
    shape = {"Lq": spec["lq"], "Ld": "1036 (page tokens)" if not args.tiny else "tiny", "docs_per_query": 1,
             "model": "ColQwen2 (Qwen2-VL-2B size, LoRA r=32)" + (" (tiny)" if args.tiny else "")}
    work = Workload(trainable, loss_fn, 5e-5, [peft_model])
    return work, shape


WORKLOADS = {"colbert": colbert_workload, "colqwen2": colqwen2_workload}


# --------------------------------------------------------------------------- measurements
def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gather_objects(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def parity(model_name, work: Workload, batch: int, seed: int) -> dict:
    """Same weights, same inputs: fp32 vanilla (the oracle) and patched, then bf16 vanilla,
    vanilla again and patched; loss per rank and the relative L2 error of the (all-reduced,
    rank-identical) gradient against the oracle and between the bf16 variants."""
    runs = {}
    for dtype, plan in ((torch.float32, (("fp32_vanilla", "vanilla"), ("fp32_patched", "patched"))),
                        (torch.bfloat16, (("vanilla", "vanilla"), ("vanilla_again", "vanilla"),
                                          ("patched", "patched")))):
        work.cast(dtype)
        for label, variant in plan:
            set_variant(model_name, variant)
            lik_plugins.reset_routing_counts()
            work.reset()
            loss = work.step(batch, seed)
            runs[label] = (float(loss), work.flat_grad().cpu(), lik_plugins.routing_counts())
    set_variant(model_name, "vanilla")
    work.reset()

    def rel(label, ref):
        g, r = runs[label][1], runs[ref][1]
        return float((g - r).norm() / r.norm().clamp_min(1e-30))

    local = {
        "loss": {k: v[0] for k, v in runs.items()},
        "grad_rel_err": {
            "fp32_patched_vs_oracle": rel("fp32_patched", "fp32_vanilla"),
            "bf16_vanilla_vs_oracle": rel("vanilla", "fp32_vanilla"),
            "bf16_patched_vs_oracle": rel("patched", "fp32_vanilla"),
            "bf16_patched_vs_vanilla": rel("patched", "vanilla"),
            "bf16_vanilla_again_vs_vanilla": rel("vanilla_again", "vanilla"),
        },
        "routing_patched": runs["patched"][2],
        "routing_fp32_patched": runs["fp32_patched"][2],
        "routing_vanilla": runs["vanilla"][2],
    }
    every = gather_objects(local)
    return {"batch_per_rank": batch, "ranks": every}


COMPILES: list = []  # every Triton compile in this process (any thread): kernel name, cache hit


def listen_to_compiles() -> None:
    import triton

    def listen(*, src, metadata, metadata_group, times, cache_hit):
        COMPILES.append((getattr(src, "name", str(src)), bool(cache_hit)))

    if getattr(getattr(triton, "knobs", None), "compilation", None) is not None:
        triton.knobs.compilation.listener = listen


def timed_trial(model_name, variant, work: Workload, batch: int, steps: int, device, seed: int) -> dict:
    """One variant at one batch size: a warm-up step, then ``steps`` timed steps.  Returns the
    merged row: per-step times of the slowest rank, peak memory of the largest rank, and the
    Triton compiles that happened during the timed steps (summed over ranks)."""
    set_variant(model_name, variant)
    lik_plugins.reset_routing_counts()
    work.reset()
    row = {"variant": variant, "batch_per_rank": batch}
    oom = None
    try:
        work.step(batch, seed)  # warm-up (compilation, autotuning, allocator)
        sync(device)
        if device.type == "cuda":
            gc.collect()
            torch.cuda.reset_peak_memory_stats(device)
        compiled_before = len(COMPILES)
        times = []
        for i in range(steps):
            sync(device)
            t0 = time.perf_counter()
            work.step(batch, seed + 1 + i)
            sync(device)
            times.append(time.perf_counter() - t0)
        row["times_ms"] = [1e3 * t for t in times]
        row["compiles_timed"] = len(COMPILES) - compiled_before
        row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    except torch.cuda.OutOfMemoryError as exc:
        oom = str(exc).splitlines()[0][:200]
    work.opt.zero_grad(set_to_none=True)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    row["routing"] = lik_plugins.routing_counts()
    flag = torch.tensor([1 if oom else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank agrees: out of memory anywhere ends the series
    every = gather_objects(row)
    merged = {"variant": variant, "batch_per_rank": batch, "status": "oom" if int(flag) else "ok",
              "routing_rank0": every[0]["routing"]}
    if not int(flag):
        # the slowest rank sets the pace of every step
        merged["times_ms"] = [max(r["times_ms"][i] for r in every) for i in range(steps)]
        merged["compiles_timed"] = sum(r["compiles_timed"] for r in every)
        peaks = [r["peak_gib"] for r in every if r["peak_gib"] is not None]
        merged["peak_gib"] = max(peaks) if peaks else None
    elif oom:
        merged["error"] = oom
    return merged


def merge_rounds(trials: list) -> dict:
    """One variant's rounds at one batch size: the median over every timed step, each round's
    median (their spread is the run-to-run noise), the largest peak, the compiles."""
    ok = [t for t in trials if t["status"] == "ok"]
    row = {"variant": trials[0]["variant"], "batch_per_rank": trials[0]["batch_per_rank"],
           "status": "ok" if len(ok) == len(trials) else "oom", "routing_rank0": trials[-1]["routing_rank0"]}
    if ok:
        row["step_ms"] = statistics.median([t for r in ok for t in r["times_ms"]])
        row["round_ms"] = [statistics.median(r["times_ms"]) for r in ok]
        row["compiles_timed"] = sum(r["compiles_timed"] for r in ok)
        row["peak_gib"] = max((r["peak_gib"] for r in ok if r["peak_gib"] is not None), default=None)
    if row["status"] != "ok":
        row["error"] = next((t.get("error") for t in trials if t["status"] != "ok"), None)
    return row


def scale(name, work: Workload, args, device, seed: int, deadline: float, record) -> tuple[dict, dict]:
    """Double the batch per GPU until a variant runs out of memory.  At each size the variants
    take turns, ``--rounds`` times (ABBA order), so drift on the machine falls on both alike;
    ``record(row)`` is called with each merged row."""
    largest, stop = {}, {}
    batch = args.start_batch
    while True:
        alive = [v for v in VARIANTS if v not in stop]
        if not alive:
            break
        if batch > args.max_batch or time.time() > deadline:
            for v in alive:
                stop[v] = f"--max-batch {args.max_batch}" if batch > args.max_batch else "time budget"
            break
        trials = {v: [] for v in alive}
        for r in range(args.rounds):
            for v in (alive if r % 2 == 0 else alive[::-1]):
                if trials[v] and trials[v][-1]["status"] != "ok":
                    continue
                trials[v].append(timed_trial(name, v, work, batch, args.steps, device, seed + 100 * r))
        for v in alive:
            row = merge_rounds(trials[v])
            record(row)
            if row["status"] != "ok":
                stop[v] = "out of memory"
            else:
                largest[v] = batch
        batch *= 2
    return largest, stop


# --------------------------------------------------------------------------- report
def write_reports(out_dir: Path, data: dict) -> None:
    (out_dir / "multi_gpu.json").write_text(json.dumps(data, indent=1, default=str))
    meta = data["meta"]
    lines = ["# Multi-GPU training with gathered documents: vanilla vs lik_plugins", "",
             f"- command: `{meta['command']}`",
             f"- {meta['world_size']} x {meta['device']} ({meta['backend']}); torch {meta['torch']}; "
             f"NCCL_NVLS_ENABLE={meta['nccl_nvls_enable']}",
             "- parity: one step from the same weights and inputs. fp32 (model cast to fp32, no autocast): "
             "vanilla is the oracle, patched is compared with it -- this checks the gradient through the "
             "all-gather, the per-rank labels and the loss scaling. bf16: vanilla, vanilla again (run-to-run "
             "noise) and patched, each as the relative L2 error of the all-reduced gradient against the fp32 "
             "oracle. Both bf16 variants round scores and gradients at bf16, so they sit a few percent from "
             "the oracle and from each other; the bar is patched no further from the oracle than vanilla", ""]
    for name, m in data["models"].items():
        lines += [f"## {name}: {m['shape'].get('model')}", "", f"shape: `{json.dumps(m['shape'])}`", ""]
        p = m.get("parity")
        if p:
            lines += [f"Parity at batch {p['batch_per_rank']} per rank (gradient errors relative to the fp32 vanilla oracle):", "",
                      "| rank | loss fp32 vanilla | loss fp32 patched | grad err fp32 patched | loss bf16 vanilla | "
                      "loss bf16 patched | grad err bf16 vanilla | grad err bf16 patched | bf16 patched vs vanilla | "
                      "bf16 vanilla again vs vanilla | patched routing |",
                      "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
            for r, x in enumerate(p["ranks"]):
                routing = {k: v for k, v in x["routing_patched"].items() if "." in k}
                loss, err = x["loss"], x["grad_rel_err"]
                lines.append(f"| {r} | {loss['fp32_vanilla']:.6f} | {loss['fp32_patched']:.6f} | "
                             f"{err['fp32_patched_vs_oracle']:.2e} | {loss['vanilla']:.6f} | {loss['patched']:.6f} | "
                             f"{err['bf16_vanilla_vs_oracle']:.2e} | {err['bf16_patched_vs_oracle']:.2e} | "
                             f"{err['bf16_patched_vs_vanilla']:.2e} | {err['bf16_vanilla_again_vs_vanilla']:.2e} | "
                             f"`{json.dumps(routing)}` |")
            lines.append("")
        rows = m.get("scaling", [])
        if rows:
            by = {(r["variant"], r["batch_per_rank"]): r for r in rows}
            lines += ["Step time: median over every timed step of every round (slowest rank); speed-up: median of "
                      "the per-round ratios vanilla / patched, their range in brackets; compiles = Triton compiles "
                      "during timed steps (all ranks).", "",
                      "| batch / GPU | vanilla ms | patched ms | speed-up [per-round range] | vanilla peak GiB | "
                      "patched peak GiB | compiles vanilla / patched |",
                      "|---:|---:|---:|---:|---:|---:|---:|"]

            def cell(r, key, fmt):
                if not r:
                    return "-"
                if r["status"] != "ok":
                    return r["status"].upper()
                return "-" if r.get(key) is None else format(r[key], fmt)

            for b in sorted({r["batch_per_rank"] for r in rows}):
                v, q = by.get(("vanilla", b)), by.get(("patched", b))
                speed = "-"
                if v and q and v["status"] == q["status"] == "ok":
                    per_round = [a / c for a, c in zip(v["round_ms"], q["round_ms"])]
                    spread = f" [{min(per_round):.2f}-{max(per_round):.2f}]" if len(per_round) > 1 else ""
                    speed = f"{statistics.median(per_round):.2f}x{spread}"
                lines.append(f"| {b} | {cell(v, 'step_ms', '.1f')} | {cell(q, 'step_ms', '.1f')} | {speed} | "
                             f"{cell(v, 'peak_gib', '.2f')} | {cell(q, 'peak_gib', '.2f')} | "
                             f"{cell(v, 'compiles_timed', 'd')} / {cell(q, 'compiles_timed', 'd')} |")
            largest = m.get("largest_batch_per_rank", {})
            lines += ["", f"Largest batch per GPU that fit: vanilla {largest.get('vanilla')}, "
                          f"patched {largest.get('patched')} (doubling stopped by: "
                          f"{m.get('stop', {})})", ""]
    (out_dir / "multi_gpu.md").write_text("\n".join(lines) + "\n")


# --------------------------------------------------------------------------- main
def worker(args) -> None:
    device = init_distributed(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    out_dir = Path(args.out_dir)
    start = time.time()
    data = {"meta": {
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]), "world_size": world,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
        "backend": dist.get_backend(), "torch": torch.__version__,
        "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"), "tiny": args.tiny,
    }, "models": {}}

    def save():
        if rank == 0:
            out_dir.mkdir(parents=True, exist_ok=True)
            write_reports(out_dir, data)

    models = args.models.split(",")
    listen_to_compiles()
    for index, name in enumerate(models):
        seed = 1000 * rank  # different data on every rank
        t0 = time.time()
        work, shape = WORKLOADS[name](args, device)
        m = data["models"][name] = {"shape": shape, "build_s": time.time() - t0, "scaling": []}
        m["parity"] = parity(name, work, args.parity_batch, seed)
        save()
        deadline = start + args.budget_s * (index + 1) / len(models)

        def record(row, name=name, m=m):
            m["scaling"].append(row)
            save()
            if rank == 0:
                rounds = "/".join(f"{t:.1f}" for t in row.get("round_ms", []))
                print(f"[{name}] {row['variant']:8s} batch/GPU {row['batch_per_rank']:5d}: {row['status']} "
                      f"{row.get('step_ms', float('nan')):9.1f} ms (rounds {rounds}) peak {row.get('peak_gib')} "
                      f"compiles {row.get('compiles_timed')}", flush=True)

        largest, stop = scale(name, work, args, device, seed, deadline, record)
        m["largest_batch_per_rank"], m["stop"] = largest, stop
        set_variant(name, "vanilla")
        os.environ.pop(HOST_ENV[name], None)
        del work
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        save()
    data["meta"]["total_s"] = time.time() - start
    save()
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny configs and short sequences (CPU smoke test)")
    p.add_argument("--nproc", type=int, default=None,
                   help="ranks to spawn when not under torchrun (default: all GPUs; 2 on CPU)")
    p.add_argument("--models", default="colbert,colqwen2")
    p.add_argument("--parity-batch", type=int, default=None, help="batch per rank of the parity step "
                   "(default 16 colbert-size runs, 4 with --tiny)")
    p.add_argument("--start-batch", type=int, default=None, help="default 8 (4 with --tiny)")
    p.add_argument("--max-batch", type=int, default=None, help="default 4096 (8 with --tiny)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per round, after 1 warm-up")
    p.add_argument("--rounds", type=int, default=3, help="turns per variant at each batch size (ABBA order)")
    p.add_argument("--budget-s", type=float, default=480, help="wall-clock budget, split evenly over the models")
    p.add_argument("--attn", default="sdpa", help="ColQwen2 attn_implementation")
    p.add_argument("--collective-timeout-s", type=float, default=300)
    args = p.parse_args(argv)
    args.parity_batch = args.parity_batch or (4 if args.tiny else 16)
    args.start_batch = args.start_batch or (4 if args.tiny else 8)
    args.max_batch = args.max_batch or (8 if args.tiny else 4096)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device; use --device cpu --tiny for the gloo smoke run")
    if "RANK" in os.environ:  # torchrun (or any launcher that sets the env:// variables)
        worker(args)
        return 0
    nproc = args.nproc or (torch.cuda.device_count() if args.device == "cuda" else 2)
    torch.multiprocessing.spawn(_spawned, args=(nproc, free_port(), args), nprocs=nproc, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
