"""Fine-tune an exported model with transformers, against the same architecture from scratch.

    python -m bert.checkpoint.export results/demo --output results/demo-hf
    python bench/finetune.py results/demo-hf

The task (built from the text ``make demo`` pretrains on, CPython's ``pydoc_data.topics``):
which documentation topic a paragraph comes from, among the ``--topics`` topics with the most
paragraphs of at least ``--min-words`` words (by default 4: specialnames, compound, types,
string-methods). Classes are balanced (every topic gives as many paragraphs as the smallest
of them), and each topic's paragraphs are split at random (``--seed``) into fine-tuning and
held-out test paragraphs, so the accuracy is measured on paragraphs the classifier never
saw; chance is 1 / topics. Pretraining saw these paragraphs as unlabelled text (the demo
corpus is this text), never the topic labels: the comparison asks what masked-LM
pretraining on in-domain text buys a classifier.

Both arms are ``AutoModelForSequenceClassification`` with the exported ``config.json``, the
exported tokenizer, the same classifier-head initialisation, data order, optimizer (AdamW),
learning rate, epochs and batch size; one starts from the exported weights
(``from_pretrained``), the other from random weights (``from_config``). Prints both test
accuracies (and writes them to ``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import time
from pathlib import Path

from common.files import write_text


class FinetuneError(RuntimeError):
    """Bad input; the message is the one line the CLI prints."""


def topic_paragraphs(min_words: int) -> dict[str, list[str]]:
    """Every pydoc topic's paragraphs (unwrapped) of at least ``min_words`` words."""
    from pydoc_data.topics import topics

    out = {}
    for name in sorted(topics):
        paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", topics[name])]
        out[name] = [p for p in paragraphs if len(p.split()) >= min_words]
    return out


def make_task(num_topics: int, min_words: int, test_share: float, seed: int):
    """(topic names, train [(text, label)], test [(text, label)]): balanced, split per topic."""
    paragraphs = topic_paragraphs(min_words)
    names = sorted(paragraphs, key=lambda n: (-len(paragraphs[n]), n))[:num_topics]
    per_class = min(len(paragraphs[n]) for n in names)
    n_test = max(1, round(per_class * test_share))
    if per_class - n_test < 1:
        raise FinetuneError(f"--topics {num_topics}: the smallest topic has only {per_class} paragraphs")
    rng = random.Random(seed)
    train, test = [], []
    for label, name in enumerate(names):
        chosen = rng.sample(paragraphs[name], per_class)
        test += [(p, label) for p in chosen[:n_test]]
        train += [(p, label) for p in chosen[n_test:]]
    rng.shuffle(train)
    return names, train, test


def _batches(items, batch_size):
    for i in range(0, len(items), batch_size):
        yield items[i : i + batch_size]


def finetune(model, tokenizer, train, test, args) -> float:
    """Train ``model`` on ``train`` (fixed order, AdamW) and return its accuracy on ``test``."""
    import torch

    def encode(batch):
        return tokenizer(
            [t for t, _ in batch], padding=True, truncation=True, max_length=args.max_length, return_tensors="pt"
        )

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    torch.manual_seed(args.seed)  # dropout masks: the same draws for both arms
    model.train()
    for _ in range(args.epochs):
        for batch in _batches(train, args.batch_size):
            labels = torch.tensor([label for _, label in batch])
            loss = model(**encode(batch), labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    model.eval()
    correct = 0
    with torch.no_grad():
        for batch in _batches(test, 64):
            pred = model(**encode(batch)).logits.argmax(-1)
            correct += int((pred == torch.tensor([label for _, label in batch])).sum())
    return correct / len(test)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("hf_dir", metavar="HF_DIR", help="a directory written by python -m bert.checkpoint.export")
    ap.add_argument("--topics", type=int, default=4, help="classes: the topics with the most paragraphs")
    ap.add_argument("--min-words", type=int, default=12, help="shorter paragraphs are left out")
    ap.add_argument("--test-share", type=float, default=1 / 3, help="share of each topic's paragraphs held out")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--max-length", type=int, default=128, help="tokens per paragraph ([CLS] and [SEP] included)")
    ap.add_argument("--seed", type=int, default=0, help="task split, head initialisation, data order, dropout")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args(argv)
    for name in ("topics", "min_words", "epochs", "batch_size", "max_length", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.topics < 2:
        ap.error("--topics must be >= 2")
    if not 0 < args.test_share < 1:
        ap.error("--test-share must lie in (0, 1)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from bert.model.fp8 import import_torchao_quietly

    import_torchao_quietly()  # transformers imports torchao when it is installed; its load warnings are noise here
    try:
        return _main(args)
    except FinetuneError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _main(args) -> int:
    hf = Path(args.hf_dir)
    if not (hf / "config.json").is_file() or not (hf / "vocab.txt").is_file():
        raise FinetuneError(
            f"{hf}: no config.json and vocab.txt (write it with python -m bert.checkpoint.export RUN_DIR --output {hf})"
        )
    import torch
    from transformers import (
        AutoConfig,
        AutoModelForSequenceClassification,
        AutoTokenizer,
    )
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # "newly initialized classifier weights" is the point here
    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    names, train, test = make_task(args.topics, args.min_words, args.test_share, args.seed)
    tokenizer = AutoTokenizer.from_pretrained(str(hf), local_files_only=True)
    config = AutoConfig.from_pretrained(str(hf), num_labels=len(names), local_files_only=True)
    print(
        f"task: which of {len(names)} pydoc topics ({', '.join(names)}) a paragraph comes from; "
        f"{len(train)} fine-tuning / {len(test)} held-out paragraphs, balanced (chance {1 / len(names):.3f})"
    )
    print(
        f"budget (both arms): {args.epochs} epochs x batch {args.batch_size}, AdamW lr {args.lr}, "
        f"max length {args.max_length}, seed {args.seed}"
    )
    results = {}
    for arm in ("pretrained", "random init"):
        start = time.time()
        torch.manual_seed(args.seed)  # the classifier head (and, for random init, every weight)
        if arm == "pretrained":
            model = AutoModelForSequenceClassification.from_pretrained(str(hf), config=config, local_files_only=True)
        else:
            model = AutoModelForSequenceClassification.from_config(config)
        # The same new head in both arms: transformers' init (normal, initializer_range), seeded.
        g = torch.Generator().manual_seed(args.seed)
        with torch.no_grad():
            w = model.classifier.weight
            w.copy_(torch.randn(w.shape, generator=g) * config.initializer_range)
            model.classifier.bias.zero_()
        acc = finetune(model, tokenizer, train, test, args)
        results[arm] = {"test_accuracy": acc, "seconds": time.time() - start}
        print(f"  {arm:<12} held-out accuracy {acc:.3f}  ({time.time() - start:.1f} s)", flush=True)
    gain = results["pretrained"]["test_accuracy"] - results["random init"]["test_accuracy"]
    print(
        f"fine-tuning comparison: pretrained {results['pretrained']['test_accuracy']:.3f} vs random init "
        f"{results['random init']['test_accuracy']:.3f} ({gain:+.3f}; chance {1 / len(names):.3f})"
    )
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        write_text(
            args.json,
            json.dumps(
                {
                    "hf_dir": str(hf),
                    "topics": names,
                    "train": len(train),
                    "test": len(test),
                    "args": vars(args),
                    "results": results,
                },
                indent=2,
            )
            + "\n",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
