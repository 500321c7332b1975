"""An offline tiny ColBERT and a few training steps, for the PyLate integration tests.

Works with every supported PyLate release (1.3.3 - 1.6.x): the tokenizer is an
in-memory WordPiece vocabulary, the encoder a random 2-layer BERT saved to a folder,
so nothing is downloaded.  Also used as a script by ``run_pylate_release.py`` to check
older PyLate releases in a subprocess.
"""
from __future__ import annotations

import os
import string
from typing import NamedTuple

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

WORDS = (
    "the a of and to in is was for on with as by at from cat dog fish bird tree river "
    "mountain city music song paper model kernel score query document train loss fast "
    "slow red blue green small large water fire light dark sun moon"
).split()


class Triple(NamedTuple):
    """A query, a document that answers it and one that does not."""

    query: str
    positive: str
    negative: str


TRIPLES = [
    Triple("what does the cat eat", "the cat eats fish, and the dog eats too.", "the river runs to the city."),
    Triple("where is the river", "the river is in the mountain; it runs to the city.", "a song was on the paper."),
    Triple("what is a kernel", "a kernel is fast: it computes a score.", "the bird sat on a tree."),
    Triple("which light is dark", "the moon light is dark at the river.", "the fish was red and blue."),
    Triple("what does the model train", "the model trains a loss with a query and a document.", "the sun is large."),
    Triple("what is green", "the tree is green, the water is blue.", "the dog was slow."),
    Triple("is the fire small", "the fire was small and red!", "the city had music."),
    Triple("what sat on the tree", "a small bird sat on the tree.", "a kernel computes scores fast."),
]


def _vocab() -> dict[str, int]:
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[unused0]", "[unused1]"]
    tokens += list(string.punctuation)  # the skiplist ids must exist: holes inside documents
    tokens += list(string.ascii_lowercase) + [f"##{c}" for c in string.ascii_lowercase]
    tokens += [w for w in WORDS if w not in tokens]
    return {token: i for i, token in enumerate(dict.fromkeys(tokens))}


def save_tiny_encoder(path: str, seed: int = 0) -> str:
    """A random 2-layer BERT and a WordPiece tokenizer saved to ``path`` (no download)."""
    import torch
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    vocab = _vocab()
    tk = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    tk.normalizer = normalizers.BertNormalizer(lowercase=True)
    tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tk.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    BertModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def load_colbert(path: str, seed: int = 0):
    """A PyLate ColBERT on top of the saved encoder (projection seeded)."""
    import torch
    from pylate import models

    torch.manual_seed(seed)
    return models.ColBERT(
        model_name_or_path=path, device="cpu", embedding_size=16, query_length=8, document_length=24
    )


def contrastive_dataset():
    from datasets import Dataset

    return Dataset.from_dict({"query": [t.query for t in TRIPLES], "positive": [t.positive for t in TRIPLES],
                              "negative": [t.negative for t in TRIPLES]})


def distillation_dataset():
    from datasets import Dataset

    docs = [[t.positive, t.negative, TRIPLES[(i + 1) % len(TRIPLES)].positive] for i, t in enumerate(TRIPLES)]
    scores = [[0.9, 0.1, 0.3 + 0.05 * i] for i in range(len(TRIPLES))]
    return Dataset.from_dict({"query": [t.query for t in TRIPLES], "documents": docs, "scores": scores})


def make_loss(kind: str, model):
    from pylate import losses

    if kind == "contrastive":
        return losses.Contrastive(model=model)
    if kind == "cached":
        return losses.CachedContrastive(model=model, mini_batch_size=2)
    if kind == "distillation":
        return losses.Distillation(model=model)
    raise ValueError(kind)


def train(model, loss, kind: str, out_dir: str, steps: int = 2) -> list[float]:
    """``steps`` optimiser steps with ``SentenceTransformerTrainer``; returns every loss value."""
    from pylate import utils
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments

    values: list[float] = []
    hook = loss.register_forward_hook(lambda _m, _i, out: values.append(float(out.detach())))
    args = SentenceTransformerTrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=4,
        max_steps=steps,
        learning_rate=1e-3,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
    )
    dataset = distillation_dataset() if kind == "distillation" else contrastive_dataset()
    trainer = SentenceTransformerTrainer(
        model=model,
        args=args,
        train_dataset=dataset,
        loss=loss,
        data_collator=utils.ColBERTCollator(tokenize_fn=model.tokenize),
    )
    trainer.train()
    hook.remove()
    return values


def parameters(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def max_param_diff(a: dict, b: dict) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def run_scenario(encoder_dir: str, work_dir: str, kinds=("contrastive", "cached", "distillation")) -> dict:
    """Vanilla vs patched vs ``LIK_DISABLE=1`` training for each loss, plus rerank,
    ``model.similarity`` and the two evaluators; returns a JSON-able summary."""
    import torch

    import lik_plugins
    from lik_plugins import patch_pylate, reset_routing_counts, routing_counts, unpatch_pylate

    summary: dict = {"losses": {}}
    for kind in kinds:
        unpatch_pylate()
        model = load_colbert(encoder_dir)
        vanilla = train(model, make_loss(kind, model), kind, work_dir)
        vanilla_params = parameters(model)
        start = parameters(load_colbert(encoder_dir))

        # loss built *before* the patch: instance capture points
        model = load_colbert(encoder_dir)
        loss = make_loss(kind, model)
        patch_pylate()
        reset_routing_counts()
        patched = train(model, loss, kind, work_dir)
        counts = routing_counts()
        patched_params = parameters(model)

        os.environ["LIK_DISABLE"] = "1"
        try:
            reset_routing_counts()
            model = load_colbert(encoder_dir)
            disabled = train(model, make_loss(kind, model), kind, work_dir)
            disabled_counts = routing_counts()
        finally:
            del os.environ["LIK_DISABLE"]
        unpatch_pylate()
        summary["losses"][kind] = {
            "vanilla": vanilla,
            "patched": patched,
            "disabled": disabled,
            "param_diff": max_param_diff(vanilla_params, patched_params),
            "params_moved": sum(int(not torch.equal(start[k], vanilla_params[k])) for k in start),
            "counts": counts,
            "disabled_counts": disabled_counts,
        }

    # inference-side capture points on a model built before the patch
    from pylate import evaluation, rank

    model = load_colbert(encoder_dir)
    queries = [t.query for t in TRIPLES[:3]]
    docs = [[t.positive, t.negative] for t in TRIPLES[:3]]
    q_emb = model.encode(queries, is_query=True)
    d_emb = [model.encode(d, is_query=False) for d in docs]
    ids = [["p", "n"] for _ in docs]

    def inference() -> dict:
        out = {"rerank": [[(r["id"], round(float(r["score"]), 5)) for r in row] for row in rank.rerank(ids, q_emb, d_emb)]}
        a = model.encode(queries, is_query=True, convert_to_tensor=True)
        b = torch.nn.utils.rnn.pad_sequence(
            list(model.encode([t.positive for t in TRIPLES[:3]], is_query=False, convert_to_tensor=True)),
            batch_first=True,
        )
        out["similarity"] = model.similarity(a, b).tolist()
        triplet = evaluation.ColBERTTripletEvaluator(anchors=[t.query for t in TRIPLES],
                                                     positives=[t.positive for t in TRIPLES],
                                                     negatives=[t.negative for t in TRIPLES])
        out["triplet"] = {k: float(v) for k, v in triplet(model).items()}
        ds = distillation_dataset()
        distil = evaluation.ColBERTDistillationEvaluator(
            queries=ds["query"], documents=ds["documents"], scores=ds["scores"]
        )
        out["distillation"] = {k: float(v) for k, v in distil(model).items()}
        return out

    reset_routing_counts()
    summary["inference_vanilla"] = inference()
    summary["inference_vanilla_counts"] = routing_counts()
    patch_pylate()
    patch_pylate()  # twice is harmless
    reset_routing_counts()
    summary["inference_patched"] = inference()
    summary["inference_counts"] = routing_counts()
    summary["backend"] = backend_matrix()
    unpatch_pylate()
    summary["version"] = __import__("pylate").__version__
    summary["lik_plugins"] = lik_plugins.__version__
    return summary


def backend_matrix() -> dict:
    """Which path serves ``colbert_scores`` (CPU) for each ``PYLATE_SCORES_BACKEND`` value,
    or which error it raises: the same meanings on every release."""
    import torch
    from pylate import scores

    from lik_plugins import reset_routing_counts, routing_counts

    Q, D = torch.randn(2, 3, 8), torch.randn(3, 4, 8)
    out = {}
    saved = os.environ.pop("PYLATE_SCORES_BACKEND", None)
    try:
        for value in ("auto", "torch", "lik", "flash", "bogus"):
            for how in ("env", "arg"):
                reset_routing_counts()
                try:
                    if how == "env":
                        os.environ["PYLATE_SCORES_BACKEND"] = value
                        scores.colbert_scores(Q, D)
                    else:
                        os.environ.pop("PYLATE_SCORES_BACKEND", None)
                        scores.colbert_scores(Q, D, backend=value)
                    out[f"{how}:{value}"] = sorted(routing_counts().get("pylate.colbert_scores", {}))
                except Exception as exc:  # noqa: BLE001 - recorded for the test
                    out[f"{how}:{value}"] = type(exc).__name__
    finally:
        os.environ.pop("PYLATE_SCORES_BACKEND", None)
        if saved is not None:
            os.environ["PYLATE_SCORES_BACKEND"] = saved
    return out


if __name__ == "__main__":  # python pylate_tiny.py OUT.json
    import json
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        encoder = save_tiny_encoder(os.path.join(tmp, "encoder"))
        result = run_scenario(encoder, os.path.join(tmp, "work"))
    with open(sys.argv[1], "w") as fh:
        json.dump(result, fh, indent=1, default=str)
