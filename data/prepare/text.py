"""Raw text -> documents of sentences, the first step of ``data.prepare``.

Formats (``--input-format``): ``bert``, ``wikitext`` (WikiText's escapes undone, ``<unk>`` ->
``[UNK]``) and ``text``, as docs/data.md#preparing-data describes. Files are read through
``fileio.open_checked``, invalid UTF-8 replaced and counted, and cut at document boundaries
into chunks (``find_chunks``) that depend only on the file's bytes.
"""

from __future__ import annotations

import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path

from common.errors import DataError
from common.files import UnsafeFile, open_checked

FORMATS = ("bert", "wikitext", "text")
CHUNK_BYTES = 4 << 20

_BLANK_LINE = re.compile(rb"\n[ \t\r\f\v]*\n")
_HEADING_LINE_BYTES = re.compile(rb"\n[ \t]*=[^\n]*=[ \t\r]*\n")
_HEADING = re.compile(r"^\s*(=+)\s.*\s\1\s*$")
_NON_SPACE = re.compile(rb"\S")

# A sentence end: ., ! or ? (and any closing quotes or brackets), whitespace, then what can start a sentence.
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*\s+(?=[\"'(\[]?\s?[A-Z0-9])")
_ABBREVIATIONS = frozenset(
    """mr mrs ms dr prof st jr sr vs etc e.g i.e no nos vol vols fig figs gen col lt
sgt capt cpt rev inc ltd co corp dept est approx jan feb mar apr jun jul aug sep sept oct nov dec mt ft
op cf al ed eds pp u.s u.k""".split()
)


@dataclass(frozen=True)
class Chunk:
    """Bytes [start, end) of a file, beginning at a document boundary on line ``first_line``."""

    path: str
    start: int
    end: int
    first_line: int


def decode_lines(raw: bytes) -> tuple[list[str], int, int]:
    """UTF-8 bytes -> (lines, invalid sequences replaced, index of the first line holding one or -1)."""
    try:
        return raw.decode("utf-8").split("\n"), 0, -1
    except UnicodeDecodeError:
        pass
    lines, bad, first_bad = [], 0, -1
    for i, line in enumerate(raw.split(b"\n")):
        lines.append(line.decode("utf-8", errors="replace"))
        # One U+FFFD per invalid sequence; those the text already held survive "ignore".
        if n := lines[-1].count("\ufffd") - line.decode("utf-8", errors="ignore").count("\ufffd"):
            bad += n
            first_bad = i if first_bad < 0 else first_bad
    return lines, bad, first_bad


def list_inputs(paths: list[str]) -> list[Path]:
    """Files named, and every non-hidden file under directories named, in sorted order."""
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            found = sorted(
                f
                for f in path.rglob("*")
                if f.is_file() and not any(part.startswith(".") for part in f.relative_to(path).parts)
            )
            if not found:
                raise DataError(f"{path}: empty input (the directory holds no files)")
            files.extend(found)
        elif path.exists():  # a FIFO or a device is refused by find_chunks, naming what it is
            files.append(path)
        else:
            raise DataError(f"{path}: no such file or directory")
    return files


def find_chunks(path: Path, fmt: str, chunk_bytes: int = CHUNK_BYTES) -> list[Chunk]:
    """Cut a file into chunks of about ``chunk_bytes`` at document boundaries."""
    try:
        with open_checked(path, what="input") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size == 0:
                raise DataError(f"{path}: empty input (no text)")
            mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        with mm:
            if _NON_SPACE.search(mm) is None:
                raise DataError(f"{path}: empty input (only whitespace)")
            boundary = _HEADING_LINE_BYTES if fmt == "wikitext" else _BLANK_LINE
            chunks, start, line = [], 0, 1
            while start < size:
                end = size
                if size - start > chunk_bytes:
                    m = boundary.search(mm, start + chunk_bytes)
                    if m is not None:
                        # A blank line ends a document; a heading line starts one.
                        end = m.start() + 1 if fmt == "wikitext" else m.end()
                chunks.append(Chunk(str(path), start, end, line))
                line += mm[start:end].count(b"\n")
                start = end
            return chunks
    except UnsafeFile as e:
        raise DataError(str(e)) from e
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from e


def read_chunk(chunk: Chunk) -> tuple[list[str], int, int]:
    """The chunk's lines, invalid UTF-8 replaced, and the file line number of the first line that had some (or -1)."""
    try:
        with open_checked(chunk.path, what="input") as fh:
            fh.seek(chunk.start)
            raw = fh.read(chunk.end - chunk.start)
    except UnsafeFile as e:
        raise DataError(str(e)) from e
    except OSError as e:
        raise DataError(f"{chunk.path}: cannot read ({e.strerror or e})") from e
    lines, bad, first = decode_lines(raw)
    return lines, bad, (chunk.first_line + first if first >= 0 else -1)


def split_sentences(paragraph: str) -> list[str]:
    """Prose cut into sentences at ., ! or ? before a capital or a digit, not after abbreviations or initials."""
    out, start = [], 0
    for m in _SENTENCE_END.finditer(paragraph):
        before = paragraph[start : m.start()].rstrip()
        word = before.rsplit(None, 1)[-1].lower() if before else ""
        if len(word) == 1 and word.isalpha() or word in _ABBREVIATIONS:
            continue
        if piece := paragraph[start : m.end()].strip():
            out.append(piece)
        start = m.end()
    if tail := paragraph[start:].strip():
        out.append(tail)
    return out


def parse_documents(lines: list[str], fmt: str) -> list[list[str]]:
    """Documents as lists of sentences; empty documents are dropped here."""
    docs: list[list[str]] = []
    cur: list[str] = []
    if fmt == "wikitext":
        for line in lines:
            if _HEADING.match(line):  # a heading ends the document before it
                if cur:
                    docs.append(cur)
                cur = []
            elif s := line.strip():  # WikiText's escapes undone
                s = s.replace(" @-@ ", "-").replace(" @,@ ", ",").replace(" @.@ ", ".").replace("<unk>", "[UNK]")
                cur.extend(split_sentences(s))
        if cur:
            docs.append(cur)
    elif fmt in ("bert", "text"):  # a blank line ends a paragraph: a document of lines, or of its sentences
        for line in [*lines, ""]:
            if s := line.strip():
                cur.append(s)
            elif cur:
                docs.append(cur if fmt == "bert" else split_sentences(" ".join(cur)))
                cur = []
    else:
        raise DataError(f"--input-format {fmt!r}: expected one of {', '.join(FORMATS)}")
    return docs


def iter_sentences(files: list[Path], fmt: str):
    """Every sentence of the input, in order (used to learn a vocabulary)."""
    for path in files:
        for chunk in find_chunks(path, fmt):
            for doc in parse_documents(read_chunk(chunk)[0], fmt):
                yield from doc
