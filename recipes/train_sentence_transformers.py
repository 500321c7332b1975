"""Train a small multi-vector (ColBERT-style) model with sentence-transformers 6.x's own trainer,
through ``lik_plugins.patch_sentence_transformers()``.

Offline and CPU-friendly: the encoder is a tiny random BERT with a word-level vocabulary built
from the training text (or ``--model`` for a real checkpoint), the data are query/passage pairs
from the docstrings of Python's standard library.  The run is done twice -- sentence-transformers
as is, then patched -- and the script prints both loss curves, their largest difference, the
routing counts and the held-out MaxSim accuracy.

    python recipes/train_sentence_transformers.py                     # tiny, CPU, ~1 min
    python recipes/train_sentence_transformers.py --model <dir or hub id> --steps 200 --batch-size 64
    LIK_PATCH=sentence_transformers python my_train.py                # the same without code changes
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TQDM_DISABLE", "1")  # quiet: the trainer's model-card widget progress bar

import _common  # noqa: E402  (standard-library docstring pairs, shared with the PyLate recipes)

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *__import__("string").punctuation]  # skiplist ids exist


def tiny_encoder(path: str, texts: list[str], seed: int) -> str:
    """A random 2-layer BERT and a word-level tokenizer over ``texts``, saved to ``path``."""
    import torch
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    words = sorted({w for t in texts for w in pre_tokenizers.BertPreTokenizer().pre_tokenize_str(t.lower()) for w in [w[0]]})
    vocab = {tok: i for i, tok in enumerate(dict.fromkeys(SPECIAL + words))}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tk.normalizer = normalizers.BertNormalizer(lowercase=True)
    tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tk.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])]
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", pad_token="[PAD]",
                                        cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=len(vocab), hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=128, max_position_embeddings=128)
    BertModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def load_model(path: str, args):
    import string

    import torch
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask

    torch.manual_seed(args.seed)
    transformer = Transformer(path, query_length=args.query_length, document_length=args.document_length)
    hidden = transformer.get_embedding_dimension()
    dense = Dense(hidden, args.embedding_size, bias=False, activation_function=None, module_input_name="token_embeddings")
    return MultiVectorEncoder(
        modules=[transformer, dense, MultiVectorMask(skiplist_words=list(string.punctuation)),
                 Normalize(module_input_name="token_embeddings")],
        device=args.device,
    )


def run(encoder: str, train_rows: list[dict], held_out: list[dict], args, patched: bool) -> dict:
    import torch
    from transformers.trainer_callback import PrinterCallback
    from sentence_transformers import MultiVectorEncoderTrainer, MultiVectorEncoderTrainingArguments
    from sentence_transformers.multi_vector_encoder.losses import MultiVectorMultipleNegativesRankingLoss

    import lik_plugins

    lik_plugins.unpatch_sentence_transformers()
    if patched:
        lik_plugins.patch_sentence_transformers()
    lik_plugins.reset_routing_counts()
    model = load_model(encoder, args)
    loss = MultiVectorMultipleNegativesRankingLoss(model)
    losses: list[float] = []
    hook = loss.register_forward_hook(lambda _m, _i, out: losses.append(float(out.detach())))
    dataset = _common.triplets(train_rows)
    with tempfile.TemporaryDirectory() as out_dir:
        training_args = MultiVectorEncoderTrainingArguments(
            output_dir=out_dir, per_device_train_batch_size=args.batch_size, max_steps=args.steps,
            learning_rate=args.lr, report_to="none", use_cpu=args.device == "cpu", save_strategy="no",
            logging_strategy="no", disable_tqdm=True, seed=args.seed, dataloader_num_workers=0,
        )
        start = time.perf_counter()
        trainer = MultiVectorEncoderTrainer(model=model, args=training_args, train_dataset=dataset, loss=loss)
        trainer.remove_callback(PrinterCallback)  # quiet: no metrics dict printed at the end
        trainer.train()
        seconds = time.perf_counter() - start
    hook.remove()
    with torch.no_grad():
        q = model.encode_query([r["query"] for r in held_out], show_progress_bar=False)
        d = model.encode_document([r["passage"] for r in held_out], show_progress_bar=False)
        scores = model.similarity(q, d)
    accuracy = float((scores.argmax(dim=1) == torch.arange(len(held_out), device=scores.device)).float().mean())
    routing = lik_plugins.routing_counts()
    lik_plugins.unpatch_sentence_transformers()
    return {"losses": losses, "seconds": seconds, "accuracy": accuracy, "routing": routing}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="encoder checkpoint (default: a tiny random BERT, offline)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--query-length", type=int, default=16)
    p.add_argument("--document-length", type=int, default=48)
    p.add_argument("--embedding-size", type=int, default=32)
    p.add_argument("--eval-queries", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, help="write both runs to this file")
    args = p.parse_args(argv)

    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    if args.threads:
        torch.set_num_threads(args.threads)
    pairs = _common.docstring_pairs()
    train_pairs, held_out = _common.split(pairs)
    train_rows = _common.with_hard_negatives(train_pairs, seed=args.seed)[: args.steps * args.batch_size]
    held_out = held_out[: args.eval_queries]
    with tempfile.TemporaryDirectory() as tmp:
        texts = [r[k] for r in pairs for k in ("query", "passage")]
        encoder = args.model or tiny_encoder(os.path.join(tmp, "encoder"), texts, args.seed)
        runs = {name: run(encoder, train_rows, held_out, args, patched=name == "patched") for name in ("vanilla", "patched")}
    vanilla, patched = runs["vanilla"], runs["patched"]
    diff = max((abs(a - b) for a, b in zip(vanilla["losses"], patched["losses"])), default=float("nan"))
    print(f"loss curves: {len(vanilla['losses'])} steps, largest |vanilla - patched| = {diff:.2e}")
    for i, (a, b) in enumerate(zip(vanilla["losses"], patched["losses"])):
        print(f"  step {i + 1:3d}  vanilla {a:.6f}  patched {b:.6f}")
    print(f"train time: vanilla {vanilla['seconds']:.2f} s, patched {patched['seconds']:.2f} s")
    print(f"held-out top-1 accuracy ({len(held_out)} queries): vanilla {vanilla['accuracy']:.3f}, patched {patched['accuracy']:.3f}")
    print(f"routing (patched): {json.dumps(patched['routing'])}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(runs, fh, indent=1)
    return runs


if __name__ == "__main__":
    main()
