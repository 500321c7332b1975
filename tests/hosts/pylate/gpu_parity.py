"""GPU parity of the PyLate integration: patched vs vanilla losses and gradients.

    PYTHONPATH=src:tests python tests/hosts/pylate/gpu_parity.py OUT.json

For ``Contrastive``, ``CachedContrastive`` and ``Distillation``, in fp32 and bf16, one
forward + backward of the real PyLate loss on a random offline ColBERT (BERT 4x256,
embedding 128, Lq=32, Ld=128, batch 16, one hard negative / three KD candidates):

* fp32: patched vs vanilla (IEEE fp32 einsum), loss and every parameter gradient
  (bar: 5e-4 relative loss, 5e-3 relative gradient norm -- TF32-level; ``ieee_level``
  says whether it is also within 1e-5);
* bf16: the bar follows the host -- our distance to the fp32 vanilla oracle must stay
  within 2x PyLate's own bf16 distance to it (plus a small floor), since MaxSim's
  argmax ties make bit-equality meaningless in bf16.

Prints a table and writes a JSON summary (``ok`` per case and overall); exits 1 if any
case fails.  Not collected by pytest (needs a CUDA device).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from support import pylate_tiny as tiny  # noqa: E402

BATCH = 16
DEVICE = os.environ.get("LIK_PARITY_DEVICE", "cuda")  # "cpu": a smoke run of this script only
KINDS = ("contrastive", "cached", "distillation")


def build_encoder(path: str) -> str:
    from transformers import BertConfig, BertModel

    tiny.save_tiny_encoder(path)  # tokenizer (+ a tiny model we overwrite)
    torch.manual_seed(0)
    config = BertConfig.from_pretrained(path)
    config.update(dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=512,
                       max_position_embeddings=256))
    BertModel(config).save_pretrained(path)
    return path


def load(path: str, dtype: torch.dtype):
    from pylate import models

    torch.manual_seed(0)
    model = models.ColBERT(model_name_or_path=path, device=DEVICE, embedding_size=128, query_length=32,
                           document_length=128)
    return model.to(dtype)


def batch(model, kind: str):
    g = torch.Generator().manual_seed(1)
    words = tiny.WORDS

    def text(n):
        idx = torch.randint(len(words), (n,), generator=g).tolist()
        return " ".join(words[i] for i in idx) + " ."

    queries = [text(6 + i % 5) for i in range(BATCH)]
    to = lambda f: {k: v.to(DEVICE) for k, v in f.items()}  # noqa: E731
    if kind == "distillation":
        docs = [text(20 + (7 * i) % 90) for i in range(BATCH * 3)]
        labels = torch.rand(BATCH, 3, generator=g).to(DEVICE)
        return [to(model.tokenize(queries, is_query=True, pad=True)), to(model.tokenize(docs, is_query=False, pad=True))], labels
    pos = [text(20 + (7 * i) % 90) for i in range(BATCH)]
    neg = [text(30 + (11 * i) % 80) for i in range(BATCH)]
    feats = [model.tokenize(queries, is_query=True, pad=True), model.tokenize(pos, is_query=False, pad=True),
             model.tokenize(neg, is_query=False, pad=True)]
    return [to(f) for f in feats], None


def step(path: str, kind: str, dtype: torch.dtype) -> dict:
    model = load(path, dtype)
    loss = tiny.make_loss(kind, model)
    if kind == "cached":
        loss.mini_batch_size = 4
        loss.score_mini_batch_size = 4  # 1.5.0+: query chunks
    feats, labels = batch(model, kind)
    model.zero_grad(set_to_none=True)
    value = loss(feats, labels)
    value.backward()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": float(value.detach().float()), "grads": grads}


def distance(a: dict, b: dict) -> dict:
    num = sum(float((a["grads"][k] - b["grads"][k]).pow(2).sum()) for k in b["grads"])
    den = sum(float(b["grads"][k].pow(2).sum()) for k in b["grads"])
    worst = max(float((a["grads"][k] - b["grads"][k]).abs().max()) for k in b["grads"])
    missing = sorted(set(b["grads"]) ^ set(a["grads"]))
    return {"loss_abs": abs(a["loss"] - b["loss"]), "grad_rel": (num / max(den, 1e-30)) ** 0.5,
            "grad_max_abs": worst, "missing_grads": missing}


def main(out_path: str) -> int:
    import pylate

    os.environ.pop("PYLATE_SCORES_BACKEND", None)
    os.environ.pop("LIK_DISABLE", None)
    import lik_plugins
    from lik_plugins import patch_pylate, reset_routing_counts, routing_counts, unpatch_pylate

    torch.backends.cuda.matmul.allow_tf32 = False  # an IEEE fp32 oracle on PyLate's side
    expected_path = "triton" if DEVICE == "cuda" else "torch-chunked"
    summary = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE, "torch": torch.__version__, "pylate": pylate.__version__,
               "lik_plugins": lik_plugins.__version__, "cases": []}
    with tempfile.TemporaryDirectory() as tmp:
        path = build_encoder(os.path.join(tmp, "enc"))
        for kind in KINDS:
            unpatch_pylate()
            # PyLate's own einsum path, even where flash-maxsim / LIK are installed (1.5.1+)
            os.environ["PYLATE_SCORES_BACKEND"] = "torch"
            oracle = step(path, kind, torch.float32)
            vanilla_bf16 = step(path, kind, torch.bfloat16)
            del os.environ["PYLATE_SCORES_BACKEND"]
            patch_pylate()
            results = {}
            for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
                reset_routing_counts()
                t0 = time.perf_counter()
                results[name] = step(path, kind, dtype)
                results[name]["routing"] = {k: v for k, v in routing_counts().items() if k.startswith("pylate.")}
                results[name]["seconds"] = time.perf_counter() - t0
            unpatch_pylate()

            fp32 = distance(results["fp32"], oracle)
            # the bar allows TF32 products inside the kernel (~1e-3 relative per dot product)
            fp32_ok = (fp32["loss_abs"] <= 5e-4 * max(1.0, abs(oracle["loss"])) and fp32["grad_rel"] <= 5e-3
                       and not fp32["missing_grads"])
            fp32["ieee_level"] = fp32["loss_abs"] <= 1e-5 * max(1.0, abs(oracle["loss"])) and fp32["grad_rel"] <= 1e-5
            ours = distance(results["bf16"], oracle)
            host = distance(vanilla_bf16, oracle)
            bf16_ok = (ours["loss_abs"] <= 2 * host["loss_abs"] + 1e-2 and ours["grad_rel"] <= 2 * host["grad_rel"] + 1e-3
                       and not ours["missing_grads"])
            routed = all(set(p) <= {expected_path} for r in results.values() for p in r["routing"].values()) and all(
                r["routing"] for r in results.values())
            for name, dist, ok, ref in (("fp32", fp32, fp32_ok, None), ("bf16", ours, bf16_ok, host)):
                case = {"loss": kind, "dtype": name, "ok": bool(ok and routed), "routed_to_triton": routed,
                        "oracle_loss": oracle["loss"], "patched_loss": results[name]["loss"],
                        "patched_vs_oracle": dist, "routing": results[name]["routing"]}
                if ref is not None:
                    case["vanilla_bf16_vs_oracle"] = ref
                    case["vanilla_bf16_loss"] = vanilla_bf16["loss"]
                summary["cases"].append(case)
                print(f"{kind:13s} {name}  loss {results[name]['loss']:.6f} (oracle {oracle['loss']:.6f})  "
                      f"grad rel err {dist['grad_rel']:.2e}" + (f" (PyLate bf16: {ref['grad_rel']:.2e})" if ref else "")
                      + f"  {'OK' if case['ok'] else 'FAIL'}", flush=True)
    summary["ok"] = all(c["ok"] for c in summary["cases"])
    with open(out_path, "w") as fh:
        json.dump(summary, fh, indent=1)
    print("all ok" if summary["ok"] else "FAILURES", flush=True)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: PYTHONPATH=src:tests python tests/hosts/pylate/gpu_parity.py OUT.json")
    if DEVICE == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_parity.py needs a CUDA device")
    sys.exit(main(sys.argv[1]))
