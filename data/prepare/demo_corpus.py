"""The demo corpus: CPython's bundled documentation text, written in BERT's input format.

``python -m data.prepare.demo_corpus OUT.txt``: ``make demo`` needs text offline, and every
CPython ships ``pydoc_data.topics``, a document per topic (docs/training.md).
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from common.files import write_text

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")
_UNDERLINE = re.compile(r"^\s*([*=\-~^])\1{2,}\s*$")


def topic_sentences(text: str) -> list[str]:
    sentences = []
    for paragraph in re.split(r"\n\s*\n", text):
        lines = [ln.strip() for ln in paragraph.splitlines() if ln.strip() and not _UNDERLINE.match(ln)]
        sentences.extend(s.strip() for s in _SENTENCE_END.split(" ".join(lines)) if s.strip())
    return sentences


def write_corpus(path: str) -> int:
    from pydoc_data.topics import topics

    docs = [topic_sentences(topics[name]) for name in sorted(topics)]
    docs = [d for d in docs if len(d) >= 2]
    write_text(path, "\n\n".join("\n".join(d) for d in docs) + "\n")
    return len(docs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m data.prepare.demo_corpus", description=__doc__.split("\n\n")[0])
    ap.add_argument("out", metavar="OUT.txt", help="the corpus file to write (its directory is created)")
    out = ap.parse_args(argv).out
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    n = write_corpus(out)
    print(f"wrote {n} documents of CPython's documentation to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
