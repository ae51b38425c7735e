"""The demo corpus: CPython's bundled documentation text, written in BERT's input format.

``make demo`` needs text on a machine that cannot download any, and every CPython ships
``pydoc_data.topics`` (about 80 documentation topics, 0.5 MB of English prose and code).
Each topic becomes a document; paragraphs are unwrapped and split into sentences, one per
line, with a blank line between documents (``data.prepare --input-format bert``).

    python -m data.demo_corpus OUT.txt
"""

from __future__ import annotations

import os
import re
import sys

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")
_UNDERLINE = re.compile(r"^\s*([*=\-~^])\1{2,}\s*$")


def topic_sentences(text: str) -> list[str]:
    sentences = []
    for paragraph in re.split(r"\n\s*\n", text):
        lines = [ln.strip() for ln in paragraph.splitlines() if ln.strip() and not _UNDERLINE.match(ln)]
        if not lines:
            continue
        joined = " ".join(lines)
        sentences.extend(s.strip() for s in _SENTENCE_END.split(joined) if s.strip())
    return sentences


def write_corpus(path: str) -> int:
    from pydoc_data.topics import topics

    docs = [topic_sentences(topics[name]) for name in sorted(topics)]
    docs = [d for d in docs if len(d) >= 2]
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("\n\n".join("\n".join(d) for d in docs) + "\n")
    os.replace(tmp, path)
    return len(docs)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m data.demo_corpus OUT.txt", file=sys.stderr)
        return 2
    os.makedirs(os.path.dirname(os.path.abspath(argv[0])), exist_ok=True)
    n = write_corpus(argv[0])
    print(f"wrote {n} documents of CPython's documentation to {argv[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
