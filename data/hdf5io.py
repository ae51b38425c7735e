"""HDF5 readers and writers for MLPerf BERT's layouts: fixed, varlength and packed.

Readers return a validated ``data.samples.SampleBlock`` (a packed file's samples are its
sequences); every error is a DataError naming the file and, for values, the first bad sample.
Files are refused before anything is read when unsafe (``open_hdf5``, ``check_storage``,
``check_links``) and read READ_ROWS samples at a time. Writers publish whole files, byte-identical
for identical content. The layouts, their attributes and the checks: docs/data.md#the-formats.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from common.errors import DataError
from common.files import UnsafeFile, open_checked, publishing
from data.samples import SampleBlock, _check_most, _offsets, _within

FIXED_KEYS = ("input_ids", "input_mask", "segment_ids", "masked_lm_positions", "masked_lm_ids", "next_sentence_labels")
VARLENGTH_KEYS = ("input_ids", "segment_ids", "masked_lm_positions", "masked_lm_ids", "next_sentence_labels")
FIXED_DTYPES = {
    "input_ids": np.int16,
    "input_mask": np.int8,
    "segment_ids": np.int8,
    "masked_lm_positions": np.int16,
    "masked_lm_ids": np.int16,
    "next_sentence_labels": np.int8,
}
PACKED = "packed"
PACKED_KEYS = (
    "input_ids",
    "segment_ids",
    "packed_input_len",
    "masked_lm_positions",
    "masked_lm_ids",
    "packed_masked_lm_len",
    "next_sentence_labels",
)
PACKED_DTYPES = {**FIXED_DTYPES, "packed_input_len": np.int16, "packed_masked_lm_len": np.int16}
ALL_LAYOUTS = ("fixed", "varlength", PACKED)  # what data.prepare.convert writes
MAX_SHARD_BYTES = 1 << 40
READ_ROWS = 16384  # samples read and validated at a time
MAX_CHUNK_BYTES = 64 << 20  # an HDF5 storage chunk is decompressed whole
MAX_COMPRESSION = 1024  # declared bytes per stored byte of a compressed dataset (gzip's limit is ~1032)


@dataclass(frozen=True)
class FileInfo:
    path: str
    layout: str  # "fixed" | "varlength" | "packed"
    num_samples: int  # sequences (a packed file: over all its packs)
    max_seq_length: int | None  # S of the fixed layout (or the varlength / packed file's attribute)
    max_predictions: int | None
    num_packs: int | None = None  # rows of a packed file
    next_sentence: bool = True  # False: a masked-LM-only file (no next_sentence_labels; labels read as 0)
    vocab_size: int | None = None  # the file's vocab_size attribute, when written with one


def _fail(path, msg: str):
    raise DataError(f"{path}: {msg}")


_READ_ERRORS = (OSError, RuntimeError, ValueError, TypeError)  # h5py, on a truncated file, damaged chunk or heap


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _refuse(path, bad: np.ndarray, what, first: int = 0, unit: str = "sample", owner=None) -> None:
    """DataError ``path: {unit} {first + r}: what`` for the first i where ``bad`` holds, r = i
    or ``owner[i]`` (``what``: a text, or a function of i)."""
    if bad.any():
        i = int(np.argmax(bad))  # the first bad one
        r = i if owner is None else int(owner[i])
        _fail(path, f"{unit} {first + r}: {what(i) if callable(what) else what}")


def open_hdf5(path) -> h5py.File:
    """``path`` opened for reading once ``fileio.open_checked`` passed it (a regular file of a
    bounded size: a FIFO or a device is refused, never waited on); DataError otherwise."""
    try:
        open_checked(path, max_bytes=MAX_SHARD_BYTES, what="HDF5 file").close()
        return h5py.File(path, "r")
    except FileNotFoundError:
        _fail(path, "no such file")
    except UnsafeFile as e:
        raise DataError(str(e)) from e
    except OSError as e:
        _fail(path, f"not a readable HDF5 file (truncated or corrupt?): {str(e).splitlines()[0]}")


def check_links(path, f: h5py.File) -> None:
    """Refuse a key that is a link into another file (h5py would open that file to follow it)."""
    for key in f:
        if isinstance(f.get(key, getlink=True), h5py.ExternalLink):
            _fail(path, f"{key!r} links to {f.get(key, getlink=True).filename!r}, outside this file; refused")


def _layout_of(path, f: h5py.File) -> str:
    check_links(path, f)
    keys = set(f.keys())
    if "input_ids" not in keys:
        _fail(path, "missing key 'input_ids'")
    ds = f["input_ids"]
    if not isinstance(ds, h5py.Dataset):
        _fail(path, "'input_ids' is not a dataset")
    layout = "varlength" if h5py.check_vlen_dtype(ds.dtype) is not None else "fixed"
    if "packed_input_len" in keys:
        layout = PACKED
    for key in {"fixed": FIXED_KEYS, "varlength": VARLENGTH_KEYS, PACKED: PACKED_KEYS}[layout]:
        if key == "next_sentence_labels" and layout != "fixed" and not _has_nsp(path, f):
            continue
        if key not in keys:
            _fail(path, f"missing key {key!r} ({layout} layout)")
        if not isinstance(f[key], h5py.Dataset):
            _fail(path, f"{key!r} is not a dataset")
        check_storage(path, key, f[key])
    return layout


def check_storage(path, key: str, ds: h5py.Dataset) -> None:
    """Refuse, before anything is read, data kept outside the file, scalars, and shapes
    that declare more bytes than the file stores (or a chunk too large to decompress)."""
    if ds.is_virtual or ds.external:
        where = "a virtual dataset" if ds.is_virtual else f"stored in the external file {ds.external[0][0]!r}"
        _fail(path, f"{key!r} is {where}, not in this file; refused")
    if ds.ndim == 0:
        _fail(path, f"{key!r} is a scalar, expected one entry per sample")
    item = ds.id.get_type().get_size()
    declared, stored = ds.size * item, ds.id.get_storage_size()
    if declared > stored * (MAX_COMPRESSION if ds.id.get_create_plist().get_nfilters() else 1):
        _fail(path, f"{key!r} declares shape {ds.shape} ({declared:,} bytes) but the file stores {stored:,}; refused")
    if ds.chunks is not None and int(np.prod(ds.chunks)) * item > MAX_CHUNK_BYTES:
        _fail(path, f"{key!r} has storage chunks of {ds.chunks} (over {MAX_CHUNK_BYTES >> 20} MiB each); refused")


def _has_nsp(path, f: h5py.File) -> bool:
    """False for a masked-LM-only file: attribute next_sentence = 0 (and no labels key)."""
    value = f.attrs.get("next_sentence")
    if value is None:
        return True
    if np.ndim(value) != 0 or not np.issubdtype(np.asarray(value).dtype, np.integer) or int(value) not in (0, 1):
        _fail(path, f"attribute next_sentence is {value!r}, expected 0 or 1")
    if not value and "next_sentence_labels" in f:
        _fail(path, "attribute next_sentence is 0 but the file has next_sentence_labels")
    return bool(value)


def _check_int_dtype(path, key: str, dtype: np.dtype, expected) -> None:
    if not np.issubdtype(dtype, np.integer):
        name = np.dtype(expected).name
        _fail(path, f"{key} has dtype {dtype}, expected an integer type ({name} in the MLPerf layout)")


def _info(path, f: h5py.File) -> FileInfo:
    try:
        return _read_info(path, f)
    except DataError:
        raise
    except (OSError, RuntimeError, KeyError, ValueError, TypeError) as e:  # damaged metadata h5py cannot parse
        _fail(path, f"not a readable HDF5 file (truncated or corrupt?): {_first_line(e)}")


def _read_info(path, f: h5py.File) -> FileInfo:
    layout = _layout_of(path, f)
    extra = {"vocab_size": _int_attr(path, f, "vocab_size")}
    if layout != "fixed":
        extra["next_sentence"] = _has_nsp(path, f)
    if layout == PACKED:
        r = _check_vlen(path, f, [k for k in PACKED_KEYS if k in f], PACKED)  # next_sentence_labels may be absent
        n = int(_pack_offsets(f)[-1]) if r else 0
        s, p = (f.attrs.get(k) for k in ("max_seq_length", "max_predictions"))
        return FileInfo(str(path), PACKED, n, None if s is None else int(s), None if p is None else int(p), r, **extra)
    if extra.get("next_sentence", True):
        nsp = f["next_sentence_labels"]
        _check_int_dtype(path, "next_sentence_labels", nsp.dtype, np.int8)
        if not (nsp.ndim == 1 or (nsp.ndim == 2 and nsp.shape[1] == 1)):
            _fail(path, f"next_sentence_labels has shape {nsp.shape}, expected (N,)")
        n = nsp.shape[0]
    else:
        n = f["input_ids"].shape[0]
    if layout == "varlength":
        _check_vlen(path, f, VARLENGTH_KEYS[:-1], layout, n)
        s, p = (_int_attr(path, f, name) for name in ("max_seq_length", "max_predictions"))
        return FileInfo(str(path), layout, n, s, p, **extra)
    for key, size in (("input_ids", "max_seq_length"), ("masked_lm_positions", "max_predictions")):
        if f[key].ndim != 2:
            _fail(path, f"{key} has shape {f[key].shape}, expected (N, {size})")
    s, p = f["input_ids"].shape[1], f["masked_lm_positions"].shape[1]
    for key in FIXED_KEYS[:-1]:
        ds = f[key]
        _check_int_dtype(path, key, ds.dtype, FIXED_DTYPES[key])
        want = (n, s) if key in ("input_ids", "input_mask", "segment_ids") else (n, p)
        if ds.shape != want:
            _fail(path, f"{key} has shape {ds.shape}, expected {want}")
    return FileInfo(str(path), layout, n, s, p)  # vocab_size: not kept for the fixed layout


def _check_vlen(path, f: h5py.File, keys, layout: str, n: int | None = None) -> int | None:
    """Each key a variable-length integer dataset of shape (n,) (n None: that of the first key); n."""
    like = " like input_ids" if n is None else ""
    for key in keys:
        ds = f[key]
        base = h5py.check_vlen_dtype(ds.dtype)
        if base is None:
            _fail(path, f"{key} has dtype {ds.dtype}, expected a variable-length integer array ({layout} layout)")
        _check_int_dtype(path, key, base, PACKED_DTYPES[key])
        n = ds.shape[0] if n is None else n
        if ds.shape != (n,):
            _fail(path, f"{key} has shape {ds.shape}, expected ({n},){like}")
    return n


def _int_attr(path, f: h5py.File, name: str) -> int | None:
    value = f.attrs.get(name)
    if value is None:
        return None
    if np.ndim(value) != 0 or not np.issubdtype(np.asarray(value).dtype, np.integer) or int(value) < 1:
        _fail(path, f"attribute {name} is {value!r}, expected a positive integer")
    return int(value)


def _pack_offsets(f: h5py.File) -> np.ndarray:
    """[R+1] index of each pack's first sequence (packed_input_len read READ_ROWS packs at a time)."""
    ds = f["packed_input_len"]
    counts = [_lengths(ds[a : a + READ_ROWS]) for a in range(0, ds.shape[0], READ_ROWS)]
    return _offsets(np.concatenate(counts) if counts else np.zeros(0, np.int64))


def inspect(path) -> FileInfo:
    """Layout, sample count and sizes from the file's metadata (reads no sample data)."""
    with open_hdf5(path) as f:
        return _info(path, f)


def read_file(
    path, vocab_size: int | None = None, start: int = 0, stop: int | None = None, max_seq_length: int | None = None
) -> SampleBlock:
    """Read samples [start, stop) of a fixed, varlength or packed file (samples: sequences) into a
    validated SampleBlock; a sequence longer than ``max_seq_length`` is an error naming it."""
    with open_hdf5(path) as f:
        reader = _Reader(path, f, vocab_size, max_seq_length)
        stop = reader.info.num_samples if stop is None else min(stop, reader.info.num_samples)
        parts = [reader.read(a, min(a + READ_ROWS, stop)) for a in range(start, stop, READ_ROWS)]
    return parts[0] if len(parts) == 1 else SampleBlock.concat(parts)


class _Reader:
    """Validated reads of sample ranges of one open file, with the checks that span the file: sequence
    lengths against ``max_seq_length`` and (variable-length layouts) no more tokens than file bytes."""

    def __init__(self, path, f: h5py.File, vocab_size: int | None, max_seq_length: int | None):
        self.path, self.f, self.max_seq_length = path, f, max_seq_length
        self.info = _info(path, f)
        self.vocab_size = self.info.vocab_size if vocab_size is None else vocab_size
        self.seq_off = _pack_offsets(f) if self.info.layout == PACKED else None
        self.tokens, self.bytes = 0, f.id.get_filesize()

    def read(self, start: int, stop: int) -> SampleBlock:
        block = self._read_packed(start, stop) if self.info.layout == PACKED else self._read_rows(start, stop)
        limit = self.max_seq_length
        if limit is not None and len(block) and int(block.seq_lens.max()) > limit:
            r = int(np.argmax(block.seq_lens > limit))
            _fail(self.path, f"sample {start + r} has {block.seq_lens[r]} tokens, more than max_seq_length {limit}")
        self.tokens += int(block.seq_lens.sum())
        if self.info.layout != "fixed" and self.tokens > self.bytes:
            _fail(self.path, f"sample {stop - 1}: {self.tokens:,} tokens so far, more than its {self.bytes:,} bytes")
        return block

    def _read_rows(self, start: int, stop: int) -> SampleBlock:
        """Samples [start, stop) of a fixed or varlength file."""
        keys = FIXED_KEYS if self.info.layout == "fixed" else VARLENGTH_KEYS
        if not self.info.next_sentence:
            keys = keys[:-1]
        try:
            arrays = {k: self.f[k][start:stop] for k in keys}
            arrays.setdefault("next_sentence_labels", np.zeros(stop - start, np.int8))
        except _READ_ERRORS as e:
            rows = f"sample {start}" if stop - start == 1 else f"samples {start}..{stop - 1}"
            _fail(self.path, f"cannot read sample data (truncated or corrupt?) in {rows}: {_first_line(e)}")
        if self.info.layout == "fixed":
            return from_fixed_arrays(self.path, arrays, self.vocab_size, start)
        return _from_varlength(self.path, arrays, self.vocab_size, start)

    def _read_packed(self, start: int, stop: int) -> SampleBlock:
        """Unpack the packs holding sequences [start, stop) and return those sequences."""
        seq_off, next_sentence = self.seq_off, self.info.next_sentence  # [R+1]
        p0 = max(int(np.searchsorted(seq_off, start, side="right")) - 1, 0)
        p1 = max(int(np.searchsorted(seq_off, stop, side="left")), p0)
        try:
            arrays = {k: self.f[k][p0:p1] for k in PACKED_KEYS if next_sentence or k != "next_sentence_labels"}
        except _READ_ERRORS as e:
            rows = f"samples {start}..{stop - 1}"
            _fail(self.path, f"cannot read sample data (truncated or corrupt?) in {rows}: {_first_line(e)}")
        if not next_sentence:  # masked-LM only: a label 0 per sequence
            seqs = np.diff(seq_off)[p0:p1]
            arrays["next_sentence_labels"] = _split(np.zeros(int(seqs.sum()), np.int8), seqs, np.int8)
        first = int(seq_off[p0])
        block = from_packed_arrays(self.path, arrays, self.vocab_size, self.info.max_seq_length, p0, first)
        return block.select(np.arange(start - first, stop - first))


def read_valid(
    path, vocab_size: int | None = None, max_seq_length: int | None = None
) -> tuple[SampleBlock, np.ndarray, list[str]]:
    """The samples of a file that can be read and pass validation, for ``data.on_corrupt=skip``
    (docs/data.md#loading): (block of the valid samples in file order, their rows in the file
    [n] int64, one message per invalid sample naming file and sample). A file that cannot be
    opened at all gives no samples and one message."""
    parts, rows, problems = [], [np.zeros(0, np.int64)], []  # valid blocks, their rows, one message per bad sample
    try:
        with open_hdf5(path) as f:
            reader = _Reader(path, f, vocab_size, max_seq_length)
            n = reader.info.num_samples
            todo = [(a, min(a + READ_ROWS, n)) for a in reversed(range(0, n, READ_ROWS))]
            while todo:
                start, stop = todo.pop()  # never empty: a range is halved only when it holds 2 or more
                try:
                    parts.append(reader.read(start, stop))
                    rows.append(np.arange(start, stop, dtype=np.int64))
                except DataError as e:
                    if stop - start == 1:
                        problems.append(str(e))
                    else:
                        mid = (start + stop) // 2
                        todo += [(mid, stop), (start, mid)]  # the lower half first: file order
    except DataError as e:  # the file cannot be opened, or its metadata is refused
        return SampleBlock.empty(), np.zeros(0, np.int64), [str(e)]
    return SampleBlock.concat(parts), np.concatenate(rows), problems


def from_fixed_arrays(path, arrays: dict, vocab_size: int | None = None, first_row: int = 0) -> SampleBlock:
    """Fixed-layout arrays (``FIXED_KEYS`` -> array) -> validated SampleBlock (``path``, ``first_row``: for errors)."""
    ids, mask, seg, mids = (np.asarray(arrays[k]) for k in ("input_ids", "input_mask", "segment_ids", "masked_lm_ids"))
    mpos = np.asarray(arrays["masked_lm_positions"]).astype(np.int64)
    nsp = np.asarray(arrays["next_sentence_labels"]).reshape(-1)
    n, s = ids.shape
    p = mpos.shape[1]
    _refuse(path, ~np.isin(mask, (0, 1)).all(1), "input_mask holds values other than 0 and 1", first_row)
    lens = mask.sum(1, dtype=np.int64)
    real = np.arange(s)[None, :] < lens[:, None]
    bad = (real != (mask == 1)).any(1)
    _refuse(path, bad, "input_mask is not a prefix of ones (real tokens must come first)", first_row)
    _refuse(path, lens < 1, "the sequence is empty (input_mask is all 0)", first_row)
    ids_real, seg_real = ids[real], seg[real]
    _check_tokens(path, ids_real, seg_real, lens, vocab_size, first_row)

    used_slot = mpos != 0
    counts = np.where(used_slot.all(1), p, np.argmin(used_slot, axis=1)) if p else np.zeros(n, np.int64)
    prefix = np.arange(p)[None, :] < counts[:, None]
    bad = (used_slot & ~prefix).any(1)
    _refuse(
        path, bad, lambda r: f"masked_lm_positions has a nonzero entry after the first 0: {mpos[r].tolist()}", first_row
    )
    return _block(path, ids_real, seg_real, lens, mpos[prefix], mids[prefix], counts, nsp, vocab_size, first_row)


def _lengths(objs: np.ndarray) -> np.ndarray:
    return np.fromiter((len(a) for a in objs), dtype=np.int64, count=len(objs))


def _flat(objs: np.ndarray, dtype) -> np.ndarray:
    if len(objs) == 0:
        return np.zeros(0, dtype)
    return np.concatenate(list(objs)).astype(dtype, copy=False)


def _from_varlength(path, arrays: dict, vocab_size: int | None, first_row: int) -> SampleBlock:
    ids, seg, mpos, mids = (arrays[k] for k in VARLENGTH_KEYS[:-1])
    nsp = np.asarray(arrays["next_sentence_labels"]).reshape(-1)
    lens = _lengths(ids)
    bad = _lengths(seg) != lens
    _refuse(path, bad, lambda r: f"segment_ids has {len(seg[r])} entries, input_ids has {lens[r]}", first_row)
    _refuse(path, lens < 1, "the sequence is empty", first_row)
    counts = _lengths(mpos)
    bad = _lengths(mids) != counts
    _refuse(
        path, bad, lambda r: f"masked_lm_ids has {len(mids[r])} entries, masked_lm_positions has {counts[r]}", first_row
    )
    flat_ids, flat_seg = _flat(ids, np.int32), _flat(seg, np.int8)
    _check_tokens(path, flat_ids, flat_seg, lens, vocab_size, first_row)
    positions, labels = _flat(mpos, np.int64), _flat(mids, np.int64)
    return _block(path, flat_ids, flat_seg, lens, positions, labels, counts, nsp, vocab_size, first_row)


def from_packed_arrays(
    path, arrays: dict, vocab_size: int | None = None, max_seq_length: int | None = None, first_pack=0, first_sample=0
) -> SampleBlock:
    """Packed-layout arrays (``PACKED_KEYS`` -> an object array of one array per pack) -> validated
    SampleBlock of the sequences; ``first_pack`` / ``first_sample`` number the errors."""
    tokens_per_pack, seqs_per_pack = _lengths(arrays["input_ids"]), _lengths(arrays["packed_input_len"])
    lens = _flat(arrays["packed_input_len"], np.int64)  # [n] sequence lengths
    seq_pack = np.repeat(np.arange(len(seqs_per_pack)), seqs_per_pack)  # [n] pack of each sequence

    def refuse_pack(bad: np.ndarray, what):
        _refuse(path, bad, what, first_pack, "pack")

    def per_pack_sum(values: np.ndarray) -> np.ndarray:
        return np.bincount(seq_pack, weights=values, minlength=len(seqs_per_pack)).astype(np.int64)

    seg_packs = arrays["segment_ids"]
    bad = _lengths(seg_packs) != tokens_per_pack
    refuse_pack(bad, lambda r: f"segment_ids has {len(seg_packs[r])} entries, input_ids has {tokens_per_pack[r]}")
    summed = per_pack_sum(lens)
    bad = summed != tokens_per_pack
    refuse_pack(bad, lambda r: f"packed_input_len sums to {summed[r]}, input_ids has {tokens_per_pack[r]} tokens")
    if max_seq_length is not None:
        bad = tokens_per_pack > max_seq_length
        refuse_pack(bad, lambda r: f"holds {tokens_per_pack[r]} tokens, more than max_seq_length {max_seq_length}")
    for key in ("packed_masked_lm_len", "next_sentence_labels"):
        bad = _lengths(arrays[key]) != seqs_per_pack
        refuse_pack(bad, lambda r: f"{key} has {len(arrays[key][r])} entries for {seqs_per_pack[r]} sequences")
    _refuse(path, lens < 1, "the sequence is empty (packed_input_len 0)", first_sample)
    counts = _flat(arrays["packed_masked_lm_len"], np.int64)
    _refuse(path, counts < 0, "packed_masked_lm_len is negative", first_sample)
    slots = per_pack_sum(counts)
    for key in ("masked_lm_positions", "masked_lm_ids"):
        bad = _lengths(arrays[key]) != slots
        refuse_pack(bad, lambda r: f"{key} has {len(arrays[key][r])} entries, packed_masked_lm_len sums to {slots[r]}")
    ids, seg = _flat(arrays["input_ids"], np.int32), _flat(seg_packs, np.int8)
    _check_tokens(path, ids, seg, lens, vocab_size, first_sample)
    # Positions within the pack -> within the sequence: subtract the sequence's start in its pack.
    seq_start = _offsets(lens)[:-1] - np.repeat(_offsets(tokens_per_pack)[:-1], seqs_per_pack)
    positions = _flat(arrays["masked_lm_positions"], np.int64) - np.repeat(seq_start, counts)
    labels, nsp = _flat(arrays["masked_lm_ids"], np.int64), _flat(arrays["next_sentence_labels"], np.int64)
    return _block(path, ids, seg, lens, positions, labels, counts, nsp, vocab_size, first_sample)


def _check_tokens(path, ids, seg, lens, vocab_size, first_row) -> None:
    hi = vocab_size if vocab_size is not None else np.iinfo(np.int16).max + 1
    limit = f"the vocabulary's {vocab_size} entries" if vocab_size is not None else "[0, 32768)"
    for key, values, bad, what in (
        ("input_ids", ids, (ids < 0) | (ids >= hi), f"outside {limit}"),
        ("segment_ids", seg, (seg != 0) & (seg != 1), "expected 0 or 1"),
    ):
        if bad.any():
            i = int(np.argmax(bad))
            sample = int(np.searchsorted(np.cumsum(lens), i, side="right"))  # the sample token i is in
            _fail(path, f"sample {first_row + sample}: {key} holds {int(values[i])}, {what}")


def _block(path, ids, seg, lens, positions, labels, counts, nsp, vocab_size, first_row) -> SampleBlock:
    """The masked-position and NSP checks every layout ends with, then the SampleBlock."""
    owner = np.repeat(np.arange(len(counts)), counts)  # [M] the sample of each masked position
    bad = (positions < 1) | (positions >= lens[owner])
    if bad.any():
        i = int(np.argmax(bad))
        r = int(owner[i])
        where = "[CLS] or negative" if positions[i] < 1 else "past the sequence end"
        _fail(path, f"sample {first_row + r}: masked position {int(positions[i])} is {where} ({int(lens[r])} tokens)")
    bad = (owner[1:] == owner[:-1]) & (positions[1:] <= positions[:-1])
    _refuse(path, bad, "masked positions are not strictly increasing", first_row, owner=owner[1:])
    hi = vocab_size if vocab_size is not None else np.iinfo(np.int16).max + 1
    outside = "the vocabulary" if vocab_size is not None else "[0, 32768)"
    bad = (labels < 0) | (labels >= hi)
    _refuse(path, bad, lambda i: f"masked_lm_ids holds {int(labels[i])}, outside {outside}", first_row, owner=owner)
    bad = (nsp != 0) & (nsp != 1)
    _refuse(path, bad, lambda i: f"next_sentence_labels is {int(nsp[i])}, expected 0 or 1", first_row)
    return SampleBlock(
        input_ids=ids.astype(np.int32, copy=False),
        segment_ids=seg.astype(np.int8, copy=False),
        seq_lens=lens.astype(np.int32),
        masked_positions=positions.astype(np.int32),
        masked_ids=labels.astype(np.int32),
        masked_counts=counts.astype(np.int32),
        nsp_labels=nsp.astype(np.int8),
    )


def to_fixed_arrays(block: SampleBlock, max_seq_length: int, max_predictions: int, where: str = "") -> dict:
    """SampleBlock -> the six fixed-layout arrays (with MLPerf's dtypes)."""
    n = len(block)
    lens, counts = block.seq_lens.astype(np.int64), block.masked_counts.astype(np.int64)
    _check_most(where, lens, max_seq_length, "tokens", "max_seq_length ")
    _check_most(where, counts, max_predictions, "masked positions", "max_predictions ")
    tokens = np.repeat(np.arange(n), lens), _within(lens)  # (row, column) of each token
    masked = np.repeat(np.arange(n), counts), _within(counts)  # (row, column) of each masked position
    out = {}
    for key, width, at, values in (
        ("input_ids", max_seq_length, tokens, block.input_ids),
        ("input_mask", max_seq_length, tokens, 1),
        ("segment_ids", max_seq_length, tokens, block.segment_ids),
        ("masked_lm_positions", max_predictions, masked, block.masked_positions),
        ("masked_lm_ids", max_predictions, masked, block.masked_ids),
    ):
        out[key] = np.zeros((n, width), FIXED_DTYPES[key])
        out[key][at] = values
    return {**out, "next_sentence_labels": block.nsp_labels.astype(FIXED_DTYPES["next_sentence_labels"])}


@contextlib.contextmanager
def _publishing_hdf5(path) -> Iterator[h5py.File]:
    """An HDF5 file written under a temporary name, published as ``path`` on success; OS errors: DataError."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with publishing(path, suffix="") as tmp, h5py.File(tmp, "w", libver="earliest", track_order=False) as f:
            yield f
    except OSError as e:
        raise DataError(f"{path}: cannot write ({e.strerror or str(e).splitlines()[0]})") from e


def write_fixed(path, block: SampleBlock, max_seq_length: int, max_predictions: int) -> None:
    write_fixed_arrays(path, to_fixed_arrays(block, max_seq_length, max_predictions, where=f"{path}: "))


def write_fixed_arrays(path, arrays: dict) -> None:
    """Write the six fixed-layout arrays as given (cast to MLPerf's dtypes), in MLPerf's key order."""
    with _publishing_hdf5(path) as f:
        for key in FIXED_KEYS:
            data = np.asarray(arrays[key]).astype(FIXED_DTYPES[key], copy=False)
            f.create_dataset(key, data=data, track_times=False)


def _split(flat: np.ndarray, counts: np.ndarray, dtype) -> np.ndarray:
    out = np.empty(len(counts), dtype=object)
    out[:] = np.split(flat.astype(dtype), _offsets(counts)[1:-1]) if len(counts) else []
    return out


def _write_rows(f: h5py.File, rows: int, columns) -> None:
    """One (rows,) variable-length dataset per (key, flat values, values per row, dtype). Pieces
    all of one length are written one by one: h5py would make them a 2-D array, which does not fit."""
    for key, flat, counts, dtype in columns:
        ds = f.create_dataset(key, (rows,), dtype=h5py.vlen_dtype(np.dtype(dtype)), track_times=False)
        pieces = _split(np.asarray(flat), counts, dtype)
        if len({len(p) for p in pieces}) == 1:
            for i, piece in enumerate(pieces):
                ds[i] = piece
        elif rows:
            ds[...] = pieces


def id_dtype(vocab_size: int | None) -> type:
    """How token ids are stored: MLPerf's int16, or int32 for a vocabulary int16 cannot index."""
    return np.int32 if vocab_size is not None and vocab_size > np.iinfo(np.int16).max + 1 else np.int16


def _write_extras(f: h5py.File, next_sentence: bool, vocab_size: int | None) -> None:
    """The attributes of a masked-LM-only file and of one written with its vocabulary's size."""
    if not next_sentence:
        f.attrs["next_sentence"] = np.int8(0)
    if vocab_size is not None:
        f.attrs["vocab_size"] = np.int32(vocab_size)


def write_varlength(
    path,
    block: SampleBlock,
    max_seq_length: int | None = None,
    max_predictions: int | None = None,
    *,
    next_sentence: bool = True,
    vocab_size: int | None = None,
) -> None:
    """Write ``block`` in MLPerf's variable-length layout (``next_sentence=False``: masked-LM
    only, without next_sentence_labels; ``vocab_size`` is recorded and sets the id dtype)."""
    lens, counts = block.seq_lens.astype(np.int64), block.masked_counts.astype(np.int64)
    _check_most(f"{path}: ", lens, max_seq_length, "tokens")
    _check_most(f"{path}: ", counts, max_predictions, "masked positions")
    ids = id_dtype(vocab_size)
    with _publishing_hdf5(path) as f:
        columns = (
            ("input_ids", block.input_ids, lens, ids),
            ("segment_ids", block.segment_ids, lens, np.int8),
            ("masked_lm_positions", block.masked_positions, counts, np.int16),
            ("masked_lm_ids", block.masked_ids, counts, ids),
        )
        _write_rows(f, len(block), columns)
        if next_sentence:
            f.create_dataset("next_sentence_labels", data=block.nsp_labels.astype(np.int8), track_times=False)
        _write_extras(f, next_sentence, vocab_size)
        if max_seq_length is not None:
            f.attrs["max_seq_length"] = np.int32(max_seq_length)
        if max_predictions is not None:
            f.attrs["max_predictions"] = np.int32(max_predictions)


def write_packed(
    path,
    block: SampleBlock,
    max_seq_length: int,
    max_predictions: int | None = None,
    *,
    next_sentence: bool = True,
    vocab_size: int | None = None,
) -> None:
    """Write ``block`` in the packed layout: its sequences packed first-fit decreasing into
    packs of at most ``max_seq_length`` tokens (``data.packing``), pack after pack
    (``next_sentence`` and ``vocab_size`` as for ``write_varlength``)."""
    # Imported here: data.packing brings torch (1.4 s), which the offline data tools never need.
    from data.packing import first_fit_decreasing

    _check_most(f"{path}: ", block.masked_counts, max_predictions, "masked positions")
    try:
        row, offset, num_packs = first_fit_decreasing(block.seq_lens, max_seq_length)
    except DataError as e:
        raise DataError(f"{path}: {e}") from e
    order = np.lexsort((offset, row))  # sequences pack after pack, in their order within the pack
    packed = block.select(order)
    lens, counts = packed.seq_lens.astype(np.int64), packed.masked_counts.astype(np.int64)
    seqs_per_pack = np.bincount(row, minlength=num_packs).astype(np.int64)
    pack_of_seq = np.repeat(np.arange(num_packs), seqs_per_pack)
    tokens_per_pack = np.bincount(pack_of_seq, weights=lens, minlength=num_packs).astype(np.int64)
    slots_per_pack = np.bincount(pack_of_seq, weights=counts, minlength=num_packs).astype(np.int64)
    positions = packed.masked_positions.astype(np.int64) + np.repeat(offset[order], counts)  # within the pack
    dtypes = {**PACKED_DTYPES, "input_ids": id_dtype(vocab_size), "masked_lm_ids": id_dtype(vocab_size)}
    columns = (
        ("input_ids", packed.input_ids, tokens_per_pack),
        ("segment_ids", packed.segment_ids, tokens_per_pack),
        ("packed_input_len", lens, seqs_per_pack),
        ("masked_lm_positions", positions, slots_per_pack),
        ("masked_lm_ids", packed.masked_ids, slots_per_pack),
        ("packed_masked_lm_len", counts, seqs_per_pack),
        ("next_sentence_labels", packed.nsp_labels, seqs_per_pack),
    )
    with _publishing_hdf5(path) as f:
        _write_rows(f, num_packs, [(*c, dtypes[c[0]]) for c in (columns if next_sentence else columns[:-1])])
        f.attrs["max_seq_length"] = np.int32(max_seq_length)
        if max_predictions is not None:
            f.attrs["max_predictions"] = np.int32(max_predictions)
        _write_extras(f, next_sentence, vocab_size)


def write_file(
    path,
    block: SampleBlock,
    layout: str,
    max_seq_length: int,
    max_predictions: int,
    *,
    next_sentence: bool = True,
    vocab_size: int | None = None,
) -> None:
    """Write ``block`` in ``layout``; ``next_sentence`` / ``vocab_size`` as for ``write_varlength``
    (the fixed layout always holds labels, and ids as int16: ``vocab_size`` is not recorded there)."""
    extras = {"next_sentence": next_sentence, "vocab_size": vocab_size}
    if layout == "fixed":
        if not next_sentence:
            raise DataError(f"{path}: the fixed layout needs next_sentence_labels (write varlength or packed)")
        write_fixed(path, block, max_seq_length, max_predictions)
    elif layout == "varlength":
        write_varlength(path, block, max_seq_length, max_predictions, **extras)
    elif layout == PACKED:
        write_packed(path, block, max_seq_length, max_predictions, **extras)
    else:
        raise DataError(f"--format {layout!r}: expected one of {', '.join(ALL_LAYOUTS)}")


def list_files(path_or_files) -> list[Path]:
    """A directory's ``*.hdf5`` files in sorted order, or the given file(s)."""
    if isinstance(path_or_files, (str, os.PathLike)):
        p = Path(path_or_files)
        if p.is_dir():
            files = sorted(x for x in p.iterdir() if x.suffix in (".hdf5", ".h5") and not x.name.startswith("."))
            if not files:
                raise DataError(f"{p}: no .hdf5 files in this directory")
            return files
        if not p.exists():
            raise DataError(f"{p}: no such file or directory")
        return [p]
    files = [Path(x) for x in path_or_files]
    if not files:
        raise DataError("no input files given")
    for p in files:
        if not p.is_file():
            raise DataError(f"{p}: no such file")
    return files
