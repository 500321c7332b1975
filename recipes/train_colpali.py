"""Train a ColQwen2 retriever with hard negatives on lik_plugins' kernels, side by side
with colpali-engine's own code.

Default: offline on CPU, a tiny randomly initialised ColQwen2 built from a config and
synthetic query / page token sequences (no download).  On a GPU, ``--model`` takes a
real checkpoint (e.g. ``vidore/colqwen2-base``) and trains LoRA adapters as colpali's
recipes do; pages are then synthetic text pages too (bring your own dataset for real
work).

    python recipes/train_colpali.py                       # tiny model, CPU, hard negatives
    python recipes/train_colpali.py --smooth-max          # colpali's use_smooth_max=True
    python recipes/train_colpali.py --model vidore/colqwen2-base --device cuda --batch 32

Each run trains twice from the same seed — colpali unpatched, then patched with
``lik_plugins.patch_colpali_engine()`` — and prints both loss curves, the time per step
and the largest weight difference at the end.
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import lik_plugins  # noqa: E402


def tiny_colqwen2():
    from transformers import Qwen2VLConfig

    from colpali_engine.models import ColQwen2

    config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4},
        ),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, patch_size=14, spatial_merge_size=2),
        image_token_id=250, video_token_id=251, vision_start_token_id=252, vocab_size=256,
    )
    return ColQwen2(config), 240


def real_colqwen2(name: str, device: str):
    from peft import LoraConfig, get_peft_model

    from colpali_engine.models import ColQwen2

    model = ColQwen2.from_pretrained(name, torch_dtype=torch.bfloat16, device_map=device)
    lora = LoraConfig(
        r=32, lora_alpha=32, lora_dropout=0.1, init_lora_weights="gaussian", bias="none", task_type="FEATURE_EXTRACTION",
        target_modules=r"(.*(model)(?!.*visual).*(down_proj|gate_proj|up_proj|k_proj|q_proj|v_proj|o_proj).*$|.*(custom_text_proj).*$)",
    )
    return get_peft_model(model, lora), model.config.text_config.vocab_size - 1000


def synthetic_batch(step: int, batch: int, n_neg: int, lq: int, ld: int, vocab: int, device):
    """Right-padded token ids: queries of lq tokens, pages of ld, n_neg hard negatives per query
    (pages sharing a prefix with the positive, so they are actually hard)."""
    g = torch.Generator().manual_seed(1000 + step)

    def seqs(n, length):
        ids = torch.randint(3, vocab, (n, length), generator=g)
        keep = torch.randint(length // 2, length + 1, (n, 1), generator=g)
        mask = (torch.arange(length) < keep).long()
        return ids * mask, mask

    q, qm = seqs(batch, lq)
    d, dm = seqs(batch, ld)
    n, nm = seqs(batch * n_neg, ld)
    n = n.view(batch, n_neg, ld)
    n[:, :, : ld // 3] = d[:, None, : ld // 3]
    nm = nm.view(batch, n_neg, ld)
    nm[:, :, : ld // 3] = dm[:, None, : ld // 3]
    return [t.to(device) for t in (q, qm, d, dm, n, nm)]


def train(args, patched: bool):
    from colpali_engine.loss import ColbertPairwiseNegativeCELoss

    torch.manual_seed(args.seed)
    model, vocab = real_colqwen2(args.model, args.device) if args.model else tiny_colqwen2()
    model.to(args.device).train()
    loss_fn = ColbertPairwiseNegativeCELoss(use_smooth_max=args.smooth_max, in_batch_term_weight=0.5)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    if patched:
        lik_plugins.patch_colpali_engine()
    else:
        lik_plugins.unpatch_colpali_engine()
    lik_plugins.reset_routing_counts()
    losses, times = [], []
    label = "patched " if patched else "original"
    for step in range(args.steps):
        q, qm, d, dm, n, nm = synthetic_batch(step, args.batch, args.n_neg, args.lq, args.ld, vocab, args.device)
        start = time.perf_counter()
        qe = model(input_ids=q, attention_mask=qm)
        de = model(input_ids=d, attention_mask=dm)
        ne = model(input_ids=n.flatten(0, 1), attention_mask=nm.flatten(0, 1)).view(args.batch, args.n_neg, args.ld, -1)
        loss = loss_fn(query_embeddings=qe, doc_embeddings=de, neg_doc_embeddings=ne, offset=0)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
        print(f"  [{label}] step {step + 1:3d}/{args.steps}  loss {losses[-1]:.6f}  {times[-1] * 1e3:7.1f} ms", flush=True)
    routing = lik_plugins.routing_counts()
    lik_plugins.unpatch_colpali_engine()
    params = {k: v.detach().float().cpu() for k, v in model.named_parameters() if v.requires_grad}
    return losses, times, routing, params


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a ColQwen2 checkpoint (GPU); default: tiny random ColQwen2")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--n-neg", type=int, default=3)
    parser.add_argument("--lq", type=int, default=16)
    parser.add_argument("--ld", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smooth-max", action="store_true", help="colpali's use_smooth_max=True (fused smooth max)")
    args = parser.parse_args(argv)

    what = args.model or "tiny random ColQwen2"
    print(f"ColbertPairwiseNegativeCELoss(use_smooth_max={args.smooth_max}) on {what}, {args.device}, "
          f"batch {args.batch} x {args.n_neg} hard negatives, {args.steps} steps")
    print("colpali-engine, unpatched:")
    base = train(args, patched=False)
    print("colpali-engine, patched with lik_plugins:")
    ours = train(args, patched=True)

    print("\nstep   original loss    patched loss     |diff|")
    for i, (a, b) in enumerate(zip(base[0], ours[0])):
        print(f"{i + 1:4d}   {a:13.6f}   {b:13.6f}   {abs(a - b):.2e}")
    skip = 1 if args.steps > 1 else 0  # the first step pays for compilation / warm-up
    t_base = sum(base[1][skip:]) / max(1, len(base[1]) - skip)
    t_ours = sum(ours[1][skip:]) / max(1, len(ours[1]) - skip)
    diff = max((ours[3][k] - v).abs().max().item() for k, v in base[3].items())
    print(f"\nmean step time: original {t_base * 1e3:.1f} ms, patched {t_ours * 1e3:.1f} ms ({t_base / t_ours:.2f}x)")
    print(f"largest weight difference after training: {diff:.2e}")
    served = {k: v for k, v in ours[2].items() if k.startswith("colpali.")}
    print(f"routing (patched run): {served}")


if __name__ == "__main__":
    main()
