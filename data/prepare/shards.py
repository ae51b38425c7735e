"""Text -> MLPerf BERT pretraining shards: ``python -m data.prepare``.

Google's ``create_pretraining_data`` with MLPerf's parameters, in stages run in ``--workers``
processes: the vocabulary; tokenising (stage 1); the document shuffle and the eval set (2); pairs
keyed to their shard (3); each shard masked and written (4). No draw depends on a worker, so the
output is byte-identical for any ``--workers``: [docs/data.md](../docs/data.md#preparing-data).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields
from functools import partial
from itertools import chain
from pathlib import Path

import numpy as np

from common.config import option, optional
from common.errors import DataError, cli_main
from common.files import file_digest, publish, write_text
from data.hdf5io import ALL_LAYOUTS, write_file
from data.prepare import text
from data.prepare.mlperf_dataset import EVAL_FILE, prepare_files
from data.prepare.mlperf_reference import RefParams, pair_spans
from data.prepare.progress import Pool, cached, progress, worker_cache
from data.prepare.text import FORMATS, Chunk, find_chunks, iter_sentences, list_inputs, parse_documents, read_chunk
from data.prepare.tokenization import MAX_VOCAB_SIZE, Vocab, encode, load_tokenizer, train_wordpiece, write_vocab
from data.samples import SampleBlock, _gather_ranges, _offsets

OBJECTIVES = ("nsp", "mlm")
VOCAB_FILES = ("vocab.txt", "tokenizer.json")  # the copy in --output-dir: of --vocab / --train-vocab, of --tokenizer
TRAIN_TAG, EVAL_TAG = 0, 1
MASK_ROWS = 4096  # rows masked at once (bounds the [rows, S] scratch arrays)
# Work size (like data.prepare.text.CHUNK_BYTES): it changes how work is split, never the output.
PAIR_TASK_TOKENS = (100_000, 8_000_000)  # document tokens per pairing task: min, max
# Stage 3's per-pair columns (beside "tokens", the pairs' uint16 ids end to end).
PAIR_DTYPES = {"seq_len": np.int32, "len_a": np.int32, "nsp": np.int8, "key": np.int64, "canon": np.int64}


@dataclass(kw_only=True)
class PrepareConfig:
    """Every parameter of a preparation run (the manifest records all but ``workers``, which
    never changes the output), each also an option of ``python -m data.prepare``, in this order
    (``_add_option``): ``flag`` names it when not ``--field-name``; ``reference=False`` marks one
    that ``--reference`` refuses; options of one ``group`` are exclusive, one of them required."""

    inputs: list[str] = option(flag="--input", help="text files or directories")
    input_format: str = option(
        "bert",
        reference=False,
        choices=FORMATS,
        help="bert (default): a sentence per line, blank line between documents; wikitext: a document "
        "per section; text: a document per paragraph",
    )
    eval_inputs: list[str] | None = option(
        None,
        flag="--eval-input",
        reference=False,
        help="make the eval set from these documents, e.g. MLPerf's eval.txt (without it: hold "
        "documents out of --input)",
    )
    vocab: str | None = option(
        None, group="vocab", help="WordPiece vocab.txt (must hold [PAD] [UNK] [CLS] [SEP] [MASK])"
    )
    train_vocab: int | None = option(
        None, group="vocab", reference=False, metavar="SIZE", help="learn a WordPiece vocabulary of SIZE first"
    )
    tokenizer: str | None = option(
        None,
        group="vocab",
        reference=False,
        help="a tokenizers JSON (e.g. ModernBERT's BPE tokenizer.json; must hold [PAD] [UNK] [CLS] [SEP] [MASK])",
    )
    objective: str = option(
        "nsp",
        reference=False,
        choices=OBJECTIVES,
        help="nsp (default): MLPerf's sentence pairs with next-sentence labels; mlm: masked-LM only, each "
        "document whole as [CLS] tokens [SEP], split into pieces of max_seq_length when longer (no "
        "next_sentence_labels in the files; --format varlength or packed)",
    )
    output_dir: str = option(help="gets train/, eval/, vocab.txt (or tokenizer.json), manifest.json")
    max_seq_length: int = option(512, help="tokens per sample, [CLS] and [SEP]s included")
    max_predictions: int = option(76, help="max_predictions_per_seq")
    masked_lm_prob: float = option(0.15, help="share of tokens to predict")
    eval_masked_lm_prob: float | None = option(
        None,
        reference=False,
        help="share of tokens to predict in the eval set (default: --masked-lm-prob; ModernBERT trains at 0.3 "
        "and evaluates at 0.15)",
    )
    short_seq_prob: float = option(0.1, help="chance of a shorter random target length")
    dupe_factor: int = option(10, help="passes over the text, each masked differently")
    seed: int = option(12345, help="fixes every random choice")
    shards: int = option(1, reference=False, help="number of training files")
    eval_samples: int = option(10000, reference=False, help="0: no eval file")
    format: str = option(
        "fixed",
        reference=False,
        choices=ALL_LAYOUTS,
        help="HDF5 layout (packed: sequences packed into rows of max_seq_length, for FlashMask)",
    )
    min_sentences: int = option(
        2, reference=False, help="skip documents with fewer sentences (--objective nsp; mlm keeps every non-empty one)"
    )
    workers: int = option(1, help="processes (the output does not depend on it)")

    def __post_init__(self):
        def need(ok: bool, name: str, what: str):
            if not ok:
                raise DataError(f"{_flag(self.__dataclass_fields__[name])} {getattr(self, name)}: {what}")

        if not self.inputs:
            raise DataError("--input: give at least one file or directory")
        need(self.input_format in FORMATS, "input_format", f"expected one of {', '.join(FORMATS)}")
        if sum(x is not None for x in (self.vocab, self.train_vocab, self.tokenizer)) != 1:
            raise DataError("give exactly one of --vocab FILE and --train-vocab SIZE, or --tokenizer FILE alone")
        need(self.objective in OBJECTIVES, "objective", f"expected one of {', '.join(OBJECTIVES)}")
        need(5 <= self.max_seq_length <= 32767, "max_seq_length", "must lie in [5, 32767]")
        need(1 <= self.max_predictions <= self.max_seq_length, "max_predictions", "must lie in [1, max_seq_length]")
        need(0.0 < self.masked_lm_prob <= 1.0, "masked_lm_prob", "must lie in (0, 1]")
        p = self.eval_masked_lm_prob
        need(p is None or 0.0 < p <= 1.0, "eval_masked_lm_prob", "must lie in (0, 1]")
        need(0.0 <= self.short_seq_prob <= 1.0, "short_seq_prob", "must lie in [0, 1]")
        need(1 <= self.dupe_factor <= 255, "dupe_factor", "must lie in [1, 255]")
        need(self.seed >= 0, "seed", "must be >= 0")
        need(self.shards >= 1, "shards", "must be >= 1")
        need(self.eval_samples >= 0, "eval_samples", "must be >= 0")
        need(self.eval_samples > 0 or not self.eval_inputs, "eval_samples", "must be > 0 with --eval-input")
        need(self.format in ALL_LAYOUTS, "format", f"expected one of {', '.join(ALL_LAYOUTS)}")
        need(
            self.objective == "nsp" or self.format != "fixed",
            "format",
            "--objective mlm writes varlength or packed files (the fixed layout needs next_sentence_labels)",
        )
        need(self.min_sentences >= 1, "min_sentences", "must be >= 1")
        need(self.workers >= 1, "workers", "must be >= 1")

    @property
    def mlm(self) -> bool:
        return self.objective == "mlm"

    @property
    def max_num_tokens(self) -> int:
        """Text tokens per sample: [CLS] A [SEP] B [SEP] (nsp) or [CLS] piece [SEP] (mlm)."""
        return self.max_seq_length - (2 if self.mlm else 3)

    @property
    def vocab_source(self) -> str:
        return self.tokenizer if self.tokenizer is not None else self.vocab


def _flag(f) -> str:
    """The option of a PrepareConfig field."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _add_option(ap: argparse.ArgumentParser, groups: dict, f, hint) -> None:
    """The command-line option of one PrepareConfig field (see ``option``)."""
    meta = {k: v for k, v in f.metadata.items() if v is not None or k != "choices"}
    help, reference, group, flag = meta.pop("help"), meta.pop("reference", True), meta.pop("group", None), _flag(f)
    meta.pop("flag", None)
    kw = {"dest": f.name, **meta}  # dest is the field; what argparse shows is the flag's
    if "choices" not in kw:
        kw.setdefault("metavar", flag.lstrip("-").replace("-", "_").upper())
    hint, _ = optional(hint)  # X | None: an option that may be absent
    if typing.get_origin(hint) is list:
        kw.update(nargs="+", action="extend")
    elif hint in (int, float):
        kw["type"] = hint
    if f.default is MISSING and f.default_factory is MISSING:
        kw["required"] = True
    elif group is not None:  # a member of a required group: given or None
        if group not in groups:
            groups[group] = ap.add_mutually_exclusive_group(required=True)
        ap = groups[group]
    elif not reference:  # None, so that --reference sees whether it was given
        kw["default"] = None
        if f.default is not None and "default" not in help:
            help = f"{help} (default {f.default})"
    else:
        kw["default"] = f.default
    ap.add_argument(flag, help=help, **kw)


@dataclass
class PrepareResult:
    manifest: dict
    seconds: dict = field(default_factory=dict)  # wall time per stage


# ------------------------------------------------------------------ stage 1: tokenise


def _tokenize_chunk(chunk: Chunk, vocab_path: str, cfg: PrepareConfig) -> dict:
    """One chunk's documents as token ids: kept sentences' tokens, their lengths and the
    sentence count of each kept document. With ``--objective mlm`` a document's sentences are
    joined by spaces and tokenised as one "sentence"; a document is kept when it has a token."""
    lines, bad_utf8, first_bad_line = read_chunk(chunk)
    docs = parse_documents(lines, cfg.input_format)
    tok = cached(("tok", vocab_path), lambda: load_tokenizer(vocab_path)[1])
    if cfg.mlm:
        docs = [[" ".join(d)] for d in docs]
    sentences = [s for d in docs for s in d]
    encoded = encode(tok, sentences, vocab_path)
    sent_lens = np.fromiter((len(e.ids) for e in encoded), dtype=np.int64, count=len(encoded))
    keep: list[int] = []  # the kept sentences
    doc_nsent: list[int] = []
    short = i = 0
    for d in docs:
        kept = [k for k in range(i, i + len(d)) if sent_lens[k]]
        i += len(d)
        if len(kept) >= (1 if cfg.mlm else cfg.min_sentences):
            doc_nsent.append(len(kept))
            keep += kept
        else:
            short += 1
    kept_lens = sent_lens[keep]
    flat = np.fromiter(chain.from_iterable(encoded[k].ids for k in keep), dtype=np.uint16, count=int(kept_lens.sum()))
    return {
        "tokens": flat,
        "sent_lens": kept_lens,
        "doc_nsent": np.array(doc_nsent, np.int64),
        "docs_read": len(docs),
        "docs_short": short,
        "bad_utf8": bad_utf8,
        "first_bad_line": first_bad_line,
    }


# --------------------------------------------------------------------- stage 3: pairs


@dataclass(frozen=True)
class _PairTask:
    task_id: int
    tmp: str
    pool_file: str  # .npy of document indices (the train or the eval pool)
    lo: int  # pool positions [lo, hi) of the documents this task starts pairs from
    hi: int
    cfg: PrepareConfig


def _truncate(a0: int, a1: int, b0: int, b1: int, max_num_tokens: int, rng: random.Random):
    """``truncate_seq_pair``: drop tokens one at a time from the longer segment (B on ties),
    each from the front or the back with probability 1/2. The counts per segment follow from
    the lengths; the front/back split of each is binomial, drawn from random bits."""
    la, lb = a1 - a0, b1 - b0
    excess = la + lb - max_num_tokens
    if excess <= 0:
        return a0, a1, b0, b1
    if la - lb >= excess:
        ra, rb = excess, 0
    elif lb - la >= excess:
        ra, rb = 0, excess
    else:  # both shrink until they meet; odd totals leave A one longer
        ra, rb = la - (max_num_tokens + 1) // 2, lb - max_num_tokens // 2
    fa = bin(rng.getrandbits(ra)).count("1") if ra else 0
    fb = bin(rng.getrandbits(rb)).count("1") if rb else 0
    return a0 + fa, a1 - (ra - fa), b0 + fb, b1 - (rb - fb)


def _doc_pairs(pos: int, pool, sent_off, doc_sent_off, rng: random.Random, cfg: PrepareConfig, canon_base: int):
    """Yield the pairs of one pass over the document at pool position ``pos`` (``pair_spans``,
    truncated) as (a0, a1, b0, b1: token offsets, is_random_next, 63-bit random key, canonical id)."""

    def offsets(p: int) -> np.ndarray:  # the document at pool position p: offsets[k] is sentence k's first token
        d = int(pool[p])
        return sent_off[doc_sent_off[d] : doc_sent_off[d + 1] + 1]  # a view: a random B's bisect is O(log n)

    spans = pair_spans(offsets(pos).tolist(), pos, len(pool), offsets, cfg.max_num_tokens, cfg.short_seq_prob, rng)
    inst = 0
    for a0, a1, _, b0, b1, is_random in spans:
        a0, a1, b0, b1 = _truncate(a0, a1, int(b0), int(b1), cfg.max_num_tokens, rng)
        yield a0, a1, b0, b1, int(is_random), rng.getrandbits(63), canon_base + inst
        inst += 1
    if inst >= 1 << 20:
        raise DataError(f"document {int(pool[pos])} gives {inst} pairs in one pass, more than the 2^20 supported")


def _doc_pieces(pos: int, pool, sent_off, doc_sent_off, rng: random.Random, cfg: PrepareConfig, canon_base: int):
    """``--objective mlm``: the document at pool position ``pos`` cut into consecutive pieces of
    ``max_num_tokens`` tokens (the last one shorter), yielded like ``_doc_pairs``' rows, B empty."""
    d, max_num_tokens = int(pool[pos]), cfg.max_num_tokens
    t0, t1 = int(sent_off[doc_sent_off[d]]), int(sent_off[doc_sent_off[d + 1]])
    if (t1 - t0 + max_num_tokens - 1) // max_num_tokens >= 1 << 20:
        raise DataError(f"document {d} gives more than the 2^20 supported pieces")
    for inst, a0 in enumerate(range(t0, t1, max_num_tokens)):
        a1 = min(a0 + max_num_tokens, t1)
        yield a0, a1, a1, a1, 0, rng.getrandbits(63), canon_base + inst


def _pairs(tmp: str, pool, lo: int, hi: int, tag: int, cfg: PrepareConfig) -> dict:
    """All pairs started from pool positions [lo, hi), every pass, for the training (``tag``
    TRAIN_TAG) or the eval pool; sequences built with [CLS] A [SEP] B [SEP] (``--objective
    mlm``: document pieces, [CLS] A [SEP]), the special ids those of the run's vocabulary."""
    toks, sent_off, doc_sent_off = cached(
        ("arrays", tmp),
        lambda: (
            np.memmap(os.path.join(tmp, "tokens.u16"), dtype=np.uint16, mode="r"),
            np.load(os.path.join(tmp, "sent_off.npy"), mmap_mode="r"),
            np.load(os.path.join(tmp, "doc_sent_off.npy"), mmap_mode="r"),
        ),
    )
    cls_id, sep_id = cached(("specials", tmp), lambda: tuple(np.load(os.path.join(tmp, "specials.npy")).tolist()))
    if len(pool) >= 1 << 36:
        raise DataError(f"{len(pool)} documents: more than the 2^36 supported")
    rows: list = []
    for dupe in range(cfg.dupe_factor):
        for pos in range(lo, hi):
            rng = random.Random((cfg.seed << 96) | (tag << 88) | (dupe << 64) | pos)
            canon = (dupe << 56) | (pos << 20)
            rows += (_doc_pieces if cfg.mlm else _doc_pairs)(pos, pool, sent_off, doc_sent_off, rng, cfg, canon)
    a0, a1, b0, b1, nsp, key, canon = (np.array(c) for c in zip(*rows))
    la, lb = a1 - a0, b1 - b0
    seq_len = la + lb + (2 if cfg.mlm else 3)
    starts = _offsets(seq_len)
    out = np.empty(int(starts[-1]), np.uint16)
    out[starts[:-1]] = cls_id
    out[starts[:-1] + la + 1] = sep_id  # mlm: the last token, as below
    out[starts[1:] - 1] = sep_id
    idx, dest = np.arange(len(rows)), np.arange(len(out))
    out[_gather_ranges(dest, starts[:-1] + 1, la, idx)] = _gather_ranges(toks, a0, la, idx)
    out[_gather_ranges(dest, starts[:-1] + la + 2, lb, idx)] = _gather_ranges(toks, b0, lb, idx)
    columns = (seq_len, la, nsp, key, canon)
    return {"tokens": out, **{k: c.astype(t) for (k, t), c in zip(PAIR_DTYPES.items(), columns)}}


def _take(p: dict, rows: np.ndarray) -> dict:
    """The pairs ``rows`` of a pairs dict (``_pairs``), in that order."""
    tokens = _gather_ranges(p["tokens"], _offsets(p["seq_len"]), p["seq_len"], rows)
    return {"tokens": tokens, **{k: p[k][rows] for k in PAIR_DTYPES}}


def _make_pairs(task: _PairTask) -> np.ndarray:
    """One task's pairs written sorted by shard; returns the pairs per shard."""
    pool = cached(("pool", task.pool_file), lambda: np.load(task.pool_file, mmap_mode="r"))
    p = _pairs(task.tmp, pool, task.lo, task.hi, TRAIN_TAG, task.cfg)
    shards = task.cfg.shards
    bucket = ((p["key"] >> 31) * shards) >> 32  # floor(key * shards / 2^63) from the 63-bit key's top 32 bits
    counts = np.bincount(bucket, minlength=shards)
    tok_counts = np.bincount(bucket, weights=p["seq_len"], minlength=shards)
    base = os.path.join(task.tmp, "pairs", f"t{task.task_id:06d}")
    for name, column in _take(p, np.argsort(bucket, kind="stable")).items():
        np.save(f"{base}.{name}.npy", column)
    np.save(base + ".off.npy", _offsets(counts))
    np.save(base + ".tokoff.npy", _offsets(tok_counts.astype(np.int64)))
    return counts


# -------------------------------------------------------------------- stage 4: shards


def mask_pairs(
    p: dict, rng: np.random.Generator, masked_lm_prob: float, max_predictions: int, vocab_size: int, mask_id: int
) -> SampleBlock:
    """Choose and replace the masked tokens of whole pairs, vectorised.

    p: pairs (``_pairs``): "tokens" [sum L] ids of [CLS] A [SEP] B [SEP] sequences, "seq_len",
    "len_a" and "nsp" [n]. Per sample, k = min(max_predictions, max(1, round(L * masked_lm_prob)))
    positions are a uniform random subset of the non-special ones (the k smallest of iid uniform
    keys); each is replaced by [MASK] with probability 0.8, a uniformly random vocabulary id
    with 0.1, or kept with 0.1.
    """
    tokens, n = p["tokens"], len(p["seq_len"])
    lens, la = p["seq_len"].astype(np.int64), p["len_a"].astype(np.int64)
    starts = _offsets(lens)
    chosen_rows = []
    for r0 in range(0, n, MASK_ROWS):
        r1 = min(n, r0 + MASK_ROWS)
        ln, a = lens[r0:r1, None], la[r0:r1, None]
        width = int(ln.max())
        j = np.arange(width)[None, :]
        cand = (j >= 1) & (j < ln - 1) & (j != a + 1)  # not [CLS], either [SEP], or padding
        keys = rng.random((r1 - r0, width))
        keys[~cand] = 2.0
        k = np.minimum(
            np.minimum(max_predictions, np.maximum(1, np.rint(lens[r0:r1] * masked_lm_prob))), cand.sum(1)
        ).astype(np.int64)
        kmax = int(k.max())
        part = np.argpartition(keys, kmax - 1, axis=1)[:, :kmax] if kmax < width else np.argsort(keys, axis=1)
        ranked = np.take_along_axis(part, np.argsort(np.take_along_axis(keys, part, 1), axis=1), 1)[:, :kmax]
        used = np.arange(kmax)[None, :] < k[:, None]
        picked = np.sort(np.where(used, ranked, width + 1), axis=1)  # positions ascending, unused last
        chosen_rows.append((picked[used], k))
    positions = np.concatenate([c[0] for c in chosen_rows]).astype(np.int64)
    counts = np.concatenate([c[1] for c in chosen_rows])
    flat = np.repeat(starts[:-1], counts) + positions
    original = tokens[flat].astype(np.int32)
    u = rng.random(len(flat))
    random_ids = rng.integers(0, vocab_size, len(flat))
    out = tokens.astype(np.int32)
    out[flat] = np.where(u < 0.8, mask_id, np.where(u < 0.9, original, random_ids))
    within = np.arange(len(tokens)) - np.repeat(starts[:-1], lens)
    segment = (within >= np.repeat(la + 2, lens)).astype(np.int8)
    return SampleBlock(
        input_ids=out,
        segment_ids=segment,
        seq_lens=lens.astype(np.int32),
        masked_positions=positions.astype(np.int32),
        masked_ids=original,
        masked_counts=counts.astype(np.int32),
        nsp_labels=p["nsp"].astype(np.int8),
    )


@dataclass(frozen=True)
class _ShardTask:
    index: int
    num_tasks: int
    tmp: str
    out_path: str
    cfg: PrepareConfig
    vocab_size: int
    mask_id: int
    recorded_vocab: int | None  # the files' vocab_size attribute (data.hdf5io.write_varlength)


def _load_bucket(tmp: str, num_tasks: int, j: int) -> dict:
    parts = {k: [] for k in ("tokens", *PAIR_DTYPES)}
    for t in range(num_tasks):
        base = os.path.join(tmp, "pairs", f"t{t:06d}")
        off, tokoff = cached(("off", base), lambda: (np.load(base + ".off.npy"), np.load(base + ".tokoff.npy")))
        lo, hi = int(off[j]), int(off[j + 1])
        if lo == hi:
            continue
        parts["tokens"].append(np.load(base + ".tokens.npy", mmap_mode="r")[tokoff[j] : tokoff[j + 1]])
        for name in PAIR_DTYPES:
            parts[name].append(np.load(f"{base}.{name}.npy", mmap_mode="r")[lo:hi])
    return {k: np.concatenate(v) for k, v in parts.items()}


def _shuffled(p: dict) -> dict:
    """Pairs in key order (ties, practically impossible, by canonical id)."""
    return _take(p, np.lexsort((p["canon"], p["key"])))


def _write_shard(task: _ShardTask) -> dict:
    cfg, p = task.cfg, _load_bucket(task.tmp, task.num_tasks, task.index)
    rng = np.random.default_rng([cfg.seed, 2, task.index])
    block = mask_pairs(_shuffled(p), rng, cfg.masked_lm_prob, cfg.max_predictions, task.vocab_size, task.mask_id)
    return _write(task.out_path, block, cfg, task.recorded_vocab)


def _write(path: str, block: SampleBlock, cfg: PrepareConfig, vocab_size: int | None) -> dict:
    """Write ``block`` in the run's layout (``vocab_size``: the size the file records, or None); its manifest entry."""
    sizes = (cfg.max_seq_length, cfg.max_predictions)
    write_file(path, block, cfg.format, *sizes, next_sentence=not cfg.mlm, vocab_size=vocab_size)
    return {
        "samples": len(block),
        "tokens": block.num_tokens,
        "masked": int(block.masked_counts.sum()),
        "random_next": int(block.nsp_labels.sum()),
        "md5": file_digest(path),
        "bytes": os.path.getsize(path),
    }


# ---------------------------------------------------------------------- orchestration


def _log(msg: str) -> None:
    print(f"prepare: {msg}", file=sys.stderr, flush=True)


def _prepare_output_dir(out: Path) -> Path:
    try:
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / f".prepare-tmp-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        for sub in ("pairs", "train", "eval"):
            (tmp / sub).mkdir(parents=True)
        return tmp
    except OSError as e:
        raise DataError(f"{out}: the output directory cannot be written ({e.strerror or e})") from e


def _split_tasks(doc_tokens: np.ndarray, pool: np.ndarray, target_tokens: int) -> list[tuple[int, int]]:
    """Pool positions cut into ranges of about target_tokens tokens."""
    cum = np.cumsum(doc_tokens[pool])
    cuts = np.searchsorted(cum, np.arange(target_tokens, int(cum[-1]), target_tokens), side="right")
    edges = np.unique(np.concatenate([[0], cuts, [len(pool)]]))
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:]) if b > a]


def _hold_out(cfg: PrepareConfig, tmp: str, order: np.ndarray, doc_tokens: np.ndarray):
    """The fewest leading documents of ``order`` whose pairs number at least eval_samples, and
    at least two (a random next segment comes from another document), from at most half of
    the documents. Returns (their count, their pairs)."""
    k, limit = cfg.eval_samples, len(order) // 2
    if limit < 2:
        raise DataError(
            f"too little text for --eval-samples {k}: the eval set is held out from at most half of "
            f"the documents and needs 2 of them, but there are {len(order)} usable documents"
        )
    per_doc = np.maximum(1, np.ceil(doc_tokens[order] / cfg.max_num_tokens)).astype(np.int64) * cfg.dupe_factor
    held = max(2, int(np.searchsorted(np.cumsum(per_doc), k)) + 1)
    while True:
        held = min(held, limit)
        p = _pairs(tmp, np.ascontiguousarray(order[:held]), 0, held, EVAL_TAG, cfg)
        n = len(p["seq_len"])
        if n >= k:
            return held, p
        if held == limit:
            raise DataError(
                f"too little text for --eval-samples {k}: holding out half of the {len(order)} "
                f"documents gives only {n} pairs"
            )
        held = int(held * 1.2 * k / max(n, 1)) + 1


def _pick_eval(cfg: PrepareConfig, p: dict, vocab: Vocab) -> SampleBlock:
    """The eval samples: the pairs in key order, picked at stride int(i * N / K), masked."""
    k, n = cfg.eval_samples, len(p["seq_len"])
    picked = _take(_shuffled(p), (np.arange(k, dtype=np.int64) * n) // k)
    prob = cfg.masked_lm_prob if cfg.eval_masked_lm_prob is None else cfg.eval_masked_lm_prob
    rng = np.random.default_rng([cfg.seed, 3])
    return mask_pairs(picked, rng, prob, cfg.max_predictions, len(vocab), vocab.mask_id)


@dataclass
class _Run:
    """One ``prepare`` call's state shared by its stages: temporary directory, workers, vocabulary, stage wall times."""

    cfg: PrepareConfig
    tmp: Path
    workers: Pool
    log: typing.Callable
    seconds: dict = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)
    vocab: Vocab | None = None
    vocab_file: Path | None = None

    @property
    def unit(self) -> str:
        return "pieces" if self.cfg.mlm else "pairs"  # what stage 3 makes

    @property
    def recorded_vocab(self) -> int | None:
        """The vocabulary size the files record, where it matters (MLPerf's files have none)."""
        return len(self.vocab) if self.cfg.mlm or len(self.vocab) > MAX_VOCAB_SIZE else None

    def lap(self, stage: str) -> float:
        """Record the wall time since the previous lap as ``stage``'s."""
        now = time.perf_counter()
        self.seconds[stage], self.started = now - self.started, now
        return self.seconds[stage]


@dataclass
class _Corpus:
    """Stage 1's result; the token ids and offsets are files in the run's directory."""

    n_docs: int
    n_train_docs: int
    n_sentences: int
    n_tokens: int
    doc_tokens: np.ndarray  # [documents] tokens of each document
    stats: dict  # docs_read, docs_short
    bad_utf8: dict  # path -> [replaced sequences, first line]


def _vocabulary(run: _Run, files: list[Path]) -> None:
    """A copy of the given vocabulary, or one learnt from the input."""
    cfg = run.cfg
    run.vocab_file = run.tmp / VOCAB_FILES[cfg.tokenizer is not None]
    if cfg.vocab_source is not None:
        run.vocab, _ = load_tokenizer(cfg.vocab_source, is_json=cfg.tokenizer is not None)
        shutil.copyfile(cfg.vocab_source, run.vocab_file)
    else:
        sentences = progress(iter_sentences(files, cfg.input_format), desc="vocabulary", unit=" sentences")
        write_vocab(run.vocab_file, train_wordpiece(sentences, cfg.train_vocab))
        sentences.close()
        run.vocab, _ = load_tokenizer(run.vocab_file)
        run.log(f"learnt a vocabulary of {len(run.vocab)} pieces (asked for {cfg.train_vocab})")
        run.lap("train_vocab")
    if len(run.vocab) > MAX_VOCAB_SIZE and cfg.format == "fixed":
        raise DataError(
            f"{cfg.vocab_source}: {len(run.vocab)} entries, but the fixed layout stores ids as int16 (at most "
            f"{MAX_VOCAB_SIZE}); use --format varlength or packed"
        )
    np.save(run.tmp / "specials.npy", np.array([run.vocab.cls_id, run.vocab.sep_id]))


def _tokenize(run: _Run, files: list[Path], eval_files: list[Path]) -> _Corpus:
    """Stage 1: every input chunk tokenised (the --eval-input documents after the others)."""
    cfg = run.cfg
    chunks = [c for f in files + eval_files for c in find_chunks(f, cfg.input_format, text.CHUNK_BYTES)]
    n_train_chunks = sum(c.path in {str(f) for f in files} for c in chunks)
    tokenize = partial(_tokenize_chunk, vocab_path=str(run.vocab_file), cfg=cfg)
    too_short = "no token" if cfg.mlm else f"fewer than {cfg.min_sentences} sentences"
    sent_lens, doc_nsent = [], []
    stats = {"docs_read": 0, "docs_short": 0}
    bad_utf8: dict[str, list[int]] = {}
    with (
        open(run.tmp / "tokens.u16", "wb") as fh,
        progress(total=sum(c.end - c.start for c in chunks), desc="tokenize", unit="B") as bar,
    ):
        for i, r in enumerate(run.workers.imap(tokenize, chunks)):
            bar.update(chunks[i].end - chunks[i].start)
            fh.write(r["tokens"].tobytes())
            sent_lens.append(r["sent_lens"])
            doc_nsent.append(r["doc_nsent"])
            for k in stats:
                stats[k] += r[k]
            if r["bad_utf8"]:
                bad_utf8.setdefault(chunks[i].path, [0, r["first_bad_line"]])[0] += r["bad_utf8"]
    for path, (count, line) in bad_utf8.items():
        run.log(f"warning: {path}: {count} invalid UTF-8 byte sequence(s) replaced with U+FFFD (first at line {line})")
    n_train_docs = sum(len(d) for d in doc_nsent[:n_train_chunks])
    sent_lens, doc_nsent = np.concatenate(sent_lens), np.concatenate(doc_nsent)
    n_docs = len(doc_nsent)
    for what, n, names in (("", n_train_docs, cfg.inputs), ("eval ", n_docs - n_train_docs, cfg.eval_inputs)):
        if names and n < 2:
            raise DataError(
                f"{', '.join(names)}: {n} usable {what}document(s) (need 2; {stats['docs_short']} had {too_short})"
            )
    if stats["docs_short"]:
        run.log(f"skipped {stats['docs_short']} of {stats['docs_read']} documents with {too_short}")
    sent_off, doc_sent_off = _offsets(sent_lens), _offsets(doc_nsent)
    np.save(run.tmp / "sent_off.npy", sent_off)
    np.save(run.tmp / "doc_sent_off.npy", doc_sent_off)
    doc_tokens = sent_off[doc_sent_off[1:]] - sent_off[doc_sent_off[:-1]]
    run.log(
        f"{n_docs} documents, {len(sent_lens)} sentences, {int(sent_off[-1])} tokens "
        f"({len(chunks)} chunk(s), {run.lap('tokenize'):.1f} s)"
    )
    return _Corpus(n_docs, n_train_docs, len(sent_lens), int(sent_off[-1]), doc_tokens, stats, bad_utf8)


def _eval_set(run: _Run, corpus: _Corpus, order: np.ndarray, has_eval_files: bool) -> tuple[int, dict | None]:
    """Stage 2's eval set, from the --eval-input documents or the first documents of ``order``,
    written; returns (training documents held out, its manifest entry or None)."""
    cfg = run.cfg
    if not cfg.eval_samples:
        return 0, None
    held = 0
    if has_eval_files:
        eval_docs = corpus.n_docs - corpus.n_train_docs
        pool = corpus.n_train_docs + np.random.default_rng([cfg.seed, 4]).permutation(eval_docs)
        p = _pairs(str(run.tmp), pool, 0, len(pool), EVAL_TAG, cfg)
        if len(p["seq_len"]) < cfg.eval_samples:
            raise DataError(
                f"{', '.join(cfg.eval_inputs)}: gives {len(p['seq_len'])} pairs, fewer than "
                f"--eval-samples {cfg.eval_samples}"
            )
    else:
        held, p = _hold_out(cfg, str(run.tmp), order, corpus.doc_tokens)
        eval_docs = held
    written = _write(str(run.tmp / "eval" / EVAL_FILE), _pick_eval(cfg, p, run.vocab), cfg, run.recorded_vocab)
    run.lap("eval")
    run.log(
        f"eval: {cfg.eval_samples} samples from {len(p['seq_len'])} {run.unit} of {eval_docs} "
        f"{'--eval-input' if has_eval_files else 'held-out'} documents"
    )
    return held, {"file": f"eval/{EVAL_FILE}", "pool_samples": len(p["seq_len"]), "documents": eval_docs, **written}


def _train_pairs(run: _Run, corpus: _Corpus, pool: np.ndarray) -> int:
    """Stage 3: the training pool's pairs, in task files grouped by shard; returns the task count."""
    cfg = run.cfg
    pool_file = str(run.tmp / "train_pool.npy")
    np.save(pool_file, pool)
    target = int(np.clip(int(corpus.doc_tokens[pool].sum()) // 64, *PAIR_TASK_TOKENS))
    tasks = [
        _PairTask(i, str(run.tmp), pool_file, lo, hi, cfg)
        for i, (lo, hi) in enumerate(_split_tasks(corpus.doc_tokens, pool, target))
    ]
    per_task = progress(run.workers.imap(_make_pairs, tasks), total=len(tasks), desc="pairs", unit=" task")
    counts = sum(per_task, np.zeros(cfg.shards, np.int64))
    run.log(
        f"train: {int(counts.sum())} {run.unit} from {len(pool)} documents ({len(tasks)} task(s), "
        f"{run.lap('pairs'):.1f} s)"
    )
    if int(counts.min()) == 0:
        raise DataError(
            f"only {int(counts.sum())} training samples for --shards {cfg.shards}: "
            f"shard {int(np.argmin(counts))} would be empty"
        )
    return len(tasks)


def _write_shards(run: _Run, n_pair_tasks: int) -> tuple[list[str], list[dict]]:
    """Stage 4: each shard shuffled, masked and written; returns (file names, their descriptions)."""
    cfg = run.cfg
    names = [f"part_{j:05d}_of_{cfg.shards:05d}.hdf5" for j in range(cfg.shards)]
    vocab = (len(run.vocab), run.vocab.mask_id, run.recorded_vocab)
    tasks = [
        _ShardTask(j, n_pair_tasks, str(run.tmp), str(run.tmp / "train" / names[j]), cfg, *vocab)
        for j in range(cfg.shards)
    ]
    info = list(progress(run.workers.imap(_write_shard, tasks), total=len(tasks), desc="shards", unit=" shard"))
    run.lap("shards")
    return names, info


def _manifest(run: _Run, inputs: list[Path], corpus: _Corpus, evals: dict | None, n_train_docs: int, shards) -> dict:
    names, info = shards
    return {
        "version": 1,
        "parameters": {k: v for k, v in asdict(run.cfg).items() if k not in ("workers", "output_dir")},
        "inputs": [{"path": str(f), "bytes": f.stat().st_size} for f in inputs],
        "vocab": {"file": run.vocab_file.name, "size": len(run.vocab), "md5": file_digest(run.vocab_file)},
        "documents": {
            "read": corpus.stats["docs_read"],
            "skipped_short": corpus.stats["docs_short"],
            "usable": corpus.n_docs,
            "eval": evals["documents"] if evals else 0,
            "train": n_train_docs,
        },
        "sentences": corpus.n_sentences,
        "tokens": corpus.n_tokens,
        "invalid_utf8_replaced": {p: c for p, (c, _) in sorted(corpus.bad_utf8.items())},
        "train": {
            **{k: sum(s[k] for s in info) for k in ("samples", "tokens", "masked", "random_next")},
            "files": [{"name": f"train/{n}", **s} for n, s in zip(names, info)],
        },
        **({"eval": evals} if evals else {}),
    }


def prepare(cfg: PrepareConfig, log=_log) -> PrepareResult:
    """Run all stages; returns the manifest (also written to output_dir/manifest.json)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    files = list_inputs(cfg.inputs)
    eval_files = list_inputs(cfg.eval_inputs) if cfg.eval_inputs else []
    if set(files) & set(eval_files):
        raise DataError(f"{sorted(set(files) & set(eval_files))[0]}: given both as --input and as --eval-input")
    out = Path(cfg.output_dir)
    run = _Run(cfg, _prepare_output_dir(out), Pool(cfg.workers), log)
    try:
        _vocabulary(run, files)
        corpus = _tokenize(run, files, eval_files)
        # Stage 2: shuffle the documents; the eval set comes from --eval-input or held-out ones.
        order = np.random.default_rng([cfg.seed, 0]).permutation(corpus.n_train_docs)
        held, eval_entry = _eval_set(run, corpus, order, bool(eval_files))
        pool = np.ascontiguousarray(order[held:])
        shards = _write_shards(run, _train_pairs(run, corpus, pool))
        manifest = _manifest(run, files + eval_files, corpus, eval_entry, len(pool), shards)
        _install(out, run.tmp, shards[0], eval_entry is not None, manifest, run.vocab_file.name)
        run.lap("install")
        return PrepareResult(manifest, run.seconds)
    finally:
        run.workers.close()
        worker_cache.clear()  # memory maps and tokenizer of this run's temporary files
        shutil.rmtree(run.tmp, ignore_errors=True)


def _install(out: Path, tmp: Path, names: list[str], has_eval: bool, manifest: dict, vocab_name: str) -> None:
    """Move the finished files into place; remove shards of an earlier run that do not belong."""
    try:
        (out / "train").mkdir(exist_ok=True)
        for old in (out / "train").glob("part_*_of_*.hdf5"):
            if old.name not in names:
                old.unlink()
        for n in names:
            publish(tmp / "train" / n, out / "train" / n)
        if has_eval:
            (out / "eval").mkdir(exist_ok=True)
            publish(tmp / "eval" / EVAL_FILE, out / "eval" / EVAL_FILE)
        publish(tmp / vocab_name, out / vocab_name)
        for other in VOCAB_FILES:  # an earlier run's other kind of vocabulary no longer describes the data
            if other != vocab_name:
                (out / other).unlink(missing_ok=True)
        write_text(out / "manifest.json", json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    except OSError as e:
        raise DataError(f"{out}: cannot install the prepared files ({e.strerror or e})") from e


def build_parser(config: type[PrepareConfig] = PrepareConfig) -> argparse.ArgumentParser:
    """``python -m data.prepare``'s options: the fields of ``config``, in order, and ``--reference``."""
    ap = argparse.ArgumentParser(
        prog="python -m data.prepare",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    hints, groups = typing.get_type_hints(config), {}
    for f in fields(config):
        _add_option(ap, groups, f, hints[f.name])
        if f.name == "inputs":  # the mode switch, next to what it reads
            ap.add_argument(
                "--reference",
                action="store_true",
                help="MLPerf's reference create_pretraining_data.py, sample for sample: one fixed-layout "
                "OUTPUT_DIR/<input name>.hdf5 per input file, each made with a fresh random.Random(seed) "
                "(data.prepare.mlperf_reference); takes --vocab, the sizes, --dupe-factor, --seed and --workers only",
            )
    return ap


def refused_by_reference(args: argparse.Namespace, config: type[PrepareConfig] = PrepareConfig) -> list[str]:
    """The options given in ``args`` that ``--reference`` does not take."""
    given = [f for f in fields(config) if getattr(args, f.name) is not None]
    return [_flag(f) for f in given if not f.metadata.get("reference", True)]


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.reference:
        return _main_reference(args)
    given = {f.name: getattr(args, f.name) for f in fields(PrepareConfig) if getattr(args, f.name) is not None}
    cfg = PrepareConfig(**given)  # an option not given takes the field's default
    start = time.perf_counter()
    m = prepare(cfg).manifest
    out = Path(cfg.output_dir)
    evals = f", {m['eval']['samples']} eval samples to {out / 'eval' / EVAL_FILE}" if "eval" in m else ""
    print(
        f"wrote {m['train']['samples']} training samples in {cfg.shards} file(s) to {out / 'train'}{evals} "
        f"({time.perf_counter() - start:.1f} s)"
    )
    return 0


def _main_reference(args) -> int:
    """``--reference``: one reference-identical fixed-layout file per input file."""
    if refused := refused_by_reference(args):
        raise DataError(
            f"--reference does not take {refused[0]} (it writes one fixed-layout file "
            f"per input file, as the reference script does)"
        )
    if args.workers < 1:
        raise DataError(f"--workers {args.workers}: must be >= 1")
    params = RefParams(**{f.name: getattr(args, f.name) for f in fields(RefParams)})
    files = list_inputs(args.inputs)
    start = time.perf_counter()
    with Pool(args.workers) as pool:
        outs = prepare_files(files, Path(args.output_dir), args.vocab, params, pool, skip_existing=False)
    print(f"wrote {len(outs)} reference file(s) to {args.output_dir} ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(cli_main(main))
