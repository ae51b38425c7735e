"""Long-document sequence lengths for the benchmarks: WikiText-2's articles, in tokens.

``bench/wikitext2_article_lengths.json`` (shipped, 2 KB) holds the token count of every
article of WikiText-2's ``valid.txt`` and ``test.txt`` (120 articles; an article runs from one
top-level `` = Title = `` heading to the next), tokenised the way ``data.prepare`` tokenises
(BERT's uncased WordPiece, MLPerf's 30,522-entry vocabulary, WikiText's ``@-@`` spacing
undone). It was written by::

    python -m bench.article_lengths /work/shared/data/wikitext-2/valid.txt \\
        /work/shared/data/wikitext-2/test.txt --vocab /work/shared/data/vocab/bert-uncased-vocab.txt \\
        --output bench/wikitext2_article_lengths.json

``sequence_lengths`` turns articles into what ``data.prepare --objective mlm`` trains on:
each article cut into pieces of ``context - 2`` tokens plus [CLS] and [SEP], the last piece
shorter; a batch draws pieces uniformly (the prepared shards are shuffled).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np

SHIPPED = Path(__file__).with_name("wikitext2_article_lengths.json")
_TITLE = re.compile(r"^ = [^=].* = $")  # a top-level heading; sections are " = = ... = = "


def article_token_counts(paths: list[str], vocab: str) -> list[int]:
    """Tokens per article of WikiText-format files (data.prepare's WordPiece tokenisation)."""
    from data.prepare.text import parse_documents
    from data.prepare.tokenization import load_vocab, make_tokenizer

    tok = make_tokenizer(load_vocab(vocab))
    counts = []
    for path in paths:
        articles: list[list[str]] = []
        for line in Path(path).read_text(encoding="utf-8").split("\n"):
            if _TITLE.match(line):
                articles.append([])
            elif articles:
                articles[-1].append(line)
        for lines in articles:
            sentences = [s for doc in parse_documents(lines, "wikitext") for s in doc]
            counts.append(sum(len(e.ids) for e in tok.encode_batch(sentences, add_special_tokens=False)))
    return counts


def load(path: Path = SHIPPED) -> np.ndarray:
    """The article token counts of a lengths file (default: the shipped WikiText-2 one)."""
    return np.asarray(json.loads(Path(path).read_text())["article_tokens"], dtype=np.int64)


def sequence_lengths(articles: np.ndarray, context: int) -> np.ndarray:
    """The samples' lengths when each article is cut into pieces of ``context - 2`` tokens
    and wrapped in [CLS] ... [SEP] (``data.prepare --objective mlm``)."""
    if context < 3:
        raise ValueError(f"context {context}: must be >= 3")
    piece = context - 2
    full, rest = np.divmod(np.asarray(articles, np.int64), piece)
    lengths = np.concatenate([np.repeat(context, int(full.sum())), rest[rest > 0] + 2])
    return np.sort(lengths)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.article_lengths", description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="WikiText-format text files")
    ap.add_argument("--vocab", required=True, help="WordPiece vocab.txt")
    ap.add_argument("--output", required=True, help="JSON file to write")
    args = ap.parse_args(argv)
    counts = article_token_counts(args.files, args.vocab)
    record = {
        "source": [Path(f).name for f in args.files],
        "tokenizer": f"data.prepare.tokenization WordPiece, {Path(args.vocab).name}",
        "articles": len(counts),
        "article_tokens": counts,
    }
    from common.files import write_text

    write_text(args.output, json.dumps(record) + "\n")
    c = np.asarray(counts)
    print(f"{len(c)} articles: tokens min {c.min()}, median {int(np.median(c))}, mean {c.mean():.0f}, max {c.max()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
