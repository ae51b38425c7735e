"""HDF5 readers and writers for MLPerf BERT's two file layouts, validated on open.

Fixed layout (MLPerf's ``create_pretraining_data`` output), N samples per file:
    input_ids (N, S) int16, input_mask (N, S) int8, segment_ids (N, S) int8,
    masked_lm_positions (N, P) int16, masked_lm_ids (N, P) int16, next_sentence_labels (N,) int8.
    Real tokens are a prefix of each row (input_mask 1); masked slots are filled from the left
    in increasing position order and the rest are 0 (position 0 is [CLS], never masked).
Varlength layout (MLPerf's ``convert_fixed2variable``): input_ids, segment_ids,
    masked_lm_positions, masked_lm_ids as (N,) variable-length int16 / int8 / int16 / int16
    arrays, no input_mask, masked lists trimmed at the first 0, next_sentence_labels (N,) int8.
    Files written here also carry ``max_seq_length`` and ``max_predictions`` attributes so
    ``data.convert`` can go back to the fixed layout without being told them.

Readers return ``data.samples.SampleBlock``. Every check names the file and, for values, the
first bad sample (its row in the file): keys, dtypes, shapes, token ids inside the
vocabulary, the input_mask prefix, segment ids and labels in range, masked positions
strictly increasing and inside their sequence. Writers write to a temporary name in the
same directory and rename it when complete, and produce byte-identical files for identical
content (no timestamps).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from data.errors import DataError
from data.samples import SampleBlock, _offsets

FIXED_KEYS = ("input_ids", "input_mask", "segment_ids", "masked_lm_positions", "masked_lm_ids",
              "next_sentence_labels")
VARLENGTH_KEYS = ("input_ids", "segment_ids", "masked_lm_positions", "masked_lm_ids", "next_sentence_labels")
FIXED_DTYPES = {"input_ids": np.int16, "input_mask": np.int8, "segment_ids": np.int8,
                "masked_lm_positions": np.int16, "masked_lm_ids": np.int16, "next_sentence_labels": np.int8}
LAYOUTS = ("fixed", "varlength")


@dataclass(frozen=True)
class FileInfo:
    path: str
    layout: str  # "fixed" | "varlength"
    num_samples: int
    max_seq_length: int | None  # S of the fixed layout (or the varlength file's attribute)
    max_predictions: int | None


def _fail(path, msg: str):
    raise DataError(f"{path}: {msg}")


def _open(path) -> h5py.File:
    try:
        return h5py.File(path, "r")
    except FileNotFoundError:
        _fail(path, "no such file")
    except OSError as e:
        _fail(path, f"not a readable HDF5 file (truncated or corrupt?): {str(e).splitlines()[0]}")


def _layout_of(path, f: h5py.File) -> str:
    keys = set(f.keys())
    if "input_ids" not in keys:
        _fail(path, "missing key 'input_ids'")
    ds = f["input_ids"]
    if not isinstance(ds, h5py.Dataset):
        _fail(path, "'input_ids' is not a dataset")
    layout = "varlength" if h5py.check_vlen_dtype(ds.dtype) is not None else "fixed"
    for key in FIXED_KEYS if layout == "fixed" else VARLENGTH_KEYS:
        if key not in keys:
            _fail(path, f"missing key {key!r} ({layout} layout)")
        if not isinstance(f[key], h5py.Dataset):
            _fail(path, f"{key!r} is not a dataset")
    return layout


def _check_int_dtype(path, key: str, dtype: np.dtype, expected) -> None:
    if not np.issubdtype(dtype, np.integer):
        _fail(path, f"{key} has dtype {dtype}, expected an integer type "
                    f"({np.dtype(expected).name} in the MLPerf layout)")


def _info(path, f: h5py.File) -> FileInfo:
    layout = _layout_of(path, f)
    nsp = f["next_sentence_labels"]
    _check_int_dtype(path, "next_sentence_labels", nsp.dtype, np.int8)
    if not (nsp.ndim == 1 or (nsp.ndim == 2 and nsp.shape[1] == 1)):
        _fail(path, f"next_sentence_labels has shape {nsp.shape}, expected (N,)")
    n = nsp.shape[0]
    if layout == "fixed":
        ids = f["input_ids"]
        if ids.ndim != 2:
            _fail(path, f"input_ids has shape {ids.shape}, expected (N, max_seq_length)")
        s = ids.shape[1]
        mpos = f["masked_lm_positions"]
        if mpos.ndim != 2:
            _fail(path, f"masked_lm_positions has shape {mpos.shape}, expected (N, max_predictions)")
        p = mpos.shape[1]
        for key in FIXED_KEYS[:-1]:
            ds = f[key]
            _check_int_dtype(path, key, ds.dtype, FIXED_DTYPES[key])
            want = (n, s) if key in ("input_ids", "input_mask", "segment_ids") else (n, p)
            if ds.shape != want:
                _fail(path, f"{key} has shape {ds.shape}, expected {want}")
        return FileInfo(str(path), layout, n, s, p)
    for key in VARLENGTH_KEYS[:-1]:
        ds = f[key]
        base = h5py.check_vlen_dtype(ds.dtype)
        if base is None:
            _fail(path, f"{key} has dtype {ds.dtype}, expected a variable-length integer array (varlength layout)")
        _check_int_dtype(path, key, base, FIXED_DTYPES[key])
        if ds.shape != (n,):
            _fail(path, f"{key} has shape {ds.shape}, expected ({n},)")
    s = f.attrs.get("max_seq_length")
    p = f.attrs.get("max_predictions")
    return FileInfo(str(path), layout, n, None if s is None else int(s), None if p is None else int(p))


def inspect(path) -> FileInfo:
    """Layout, sample count and sizes from the file's metadata (reads no sample data)."""
    with _open(path) as f:
        return _info(path, f)


def read_file(path, vocab_size: int | None = None, start: int = 0, stop: int | None = None) -> SampleBlock:
    """Read samples [start, stop) of a fixed or varlength file into a validated SampleBlock."""
    try:
        with _open(path) as f:
            info = _info(path, f)
            stop = info.num_samples if stop is None else min(stop, info.num_samples)
            start = min(start, stop)
            if info.layout == "fixed":
                arrays = {k: f[k][start:stop] for k in FIXED_KEYS}
                return from_fixed_arrays(path, vocab_size=vocab_size, first_row=start, **arrays)
            arrays = {k: f[k][start:stop] for k in VARLENGTH_KEYS}
            return _from_varlength(path, arrays, vocab_size, start)
    except OSError as e:  # a dataset that cannot be read: truncated file, damaged chunk
        _fail(path, f"cannot read sample data (truncated or corrupt?): {str(e).splitlines()[0]}")


def _first(bad: np.ndarray) -> int:
    return int(np.flatnonzero(bad)[0])


def from_fixed_arrays(path, input_ids, input_mask, segment_ids, masked_lm_positions, masked_lm_ids,
                      next_sentence_labels, vocab_size: int | None = None, first_row: int = 0) -> SampleBlock:
    """Fixed-layout arrays -> validated SampleBlock (``path`` and ``first_row`` name errors)."""
    ids = np.asarray(input_ids)
    mask = np.asarray(input_mask)
    seg = np.asarray(segment_ids)
    mpos = np.asarray(masked_lm_positions).astype(np.int64)
    mids = np.asarray(masked_lm_ids)
    nsp = np.asarray(next_sentence_labels).reshape(-1)
    n, s = ids.shape
    p = mpos.shape[1]

    def sample_fail(bad_rows: np.ndarray, what: str):
        row = _first(bad_rows)
        _fail(path, f"sample {first_row + row}: {what(row) if callable(what) else what}")

    bad = ~np.isin(mask, (0, 1)).all(1)
    if bad.any():
        sample_fail(bad, "input_mask holds values other than 0 and 1")
    lens = mask.sum(1, dtype=np.int64)
    real = np.arange(s)[None, :] < lens[:, None]
    bad = (real != (mask == 1)).any(1)
    if bad.any():
        sample_fail(bad, "input_mask is not a prefix of ones (real tokens must come first)")
    bad = lens < 1
    if bad.any():
        sample_fail(bad, "the sequence is empty (input_mask is all 0)")
    ids_real = ids[real]
    seg_real = seg[real]
    _check_tokens(path, ids_real, seg_real, lens, vocab_size, first_row)

    used_slot = mpos != 0
    counts = np.where(used_slot.all(1), p, np.argmin(used_slot, axis=1)) if p else np.zeros(n, np.int64)
    prefix = np.arange(p)[None, :] < counts[:, None]
    bad = (used_slot & ~prefix).any(1)
    if bad.any():
        sample_fail(bad, lambda r: f"masked_lm_positions has a nonzero entry after the first 0: {mpos[r].tolist()}")
    positions = mpos[prefix]
    labels = np.asarray(mids)[prefix]
    _check_masked(path, positions, labels, counts, lens, vocab_size, first_row)
    _check_nsp(path, nsp, first_row)
    return SampleBlock(
        input_ids=ids_real.astype(np.int32), segment_ids=seg_real.astype(np.int8),
        seq_lens=lens.astype(np.int32), masked_positions=positions.astype(np.int32),
        masked_ids=labels.astype(np.int32), masked_counts=counts.astype(np.int32),
        nsp_labels=nsp.astype(np.int8))


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
    for key, objs in (("segment_ids", seg),):
        bad = _lengths(objs) != lens
        if bad.any():
            r = _first(bad)
            _fail(path, f"sample {first_row + r}: {key} has {len(objs[r])} entries, input_ids has {lens[r]}")
    bad = lens < 1
    if bad.any():
        _fail(path, f"sample {first_row + _first(bad)}: the sequence is empty")
    counts = _lengths(mpos)
    bad = _lengths(mids) != counts
    if bad.any():
        r = _first(bad)
        _fail(path, f"sample {first_row + r}: masked_lm_ids has {len(mids[r])} entries, "
                    f"masked_lm_positions has {counts[r]}")
    flat_ids = _flat(ids, np.int32)
    flat_seg = _flat(seg, np.int8)
    _check_tokens(path, flat_ids, flat_seg, lens, vocab_size, first_row)
    positions = _flat(mpos, np.int64)
    labels = _flat(mids, np.int64)
    _check_masked(path, positions, labels, counts, lens, vocab_size, first_row)
    _check_nsp(path, nsp, first_row)
    return SampleBlock(
        input_ids=flat_ids, segment_ids=flat_seg, seq_lens=lens.astype(np.int32),
        masked_positions=positions.astype(np.int32), masked_ids=labels.astype(np.int32),
        masked_counts=counts.astype(np.int32), nsp_labels=nsp.astype(np.int8))


def _sample_of(flat_index: int, counts: np.ndarray) -> int:
    return int(np.searchsorted(np.cumsum(counts), flat_index, side="right"))


def _check_tokens(path, ids, seg, lens, vocab_size, first_row) -> None:
    hi = vocab_size if vocab_size is not None else np.iinfo(np.int16).max + 1
    bad = (ids < 0) | (ids >= hi)
    if bad.any():
        i = _first(bad)
        r = _sample_of(i, lens)
        limit = f"the vocabulary's {vocab_size} entries" if vocab_size is not None else "[0, 32768)"
        _fail(path, f"sample {first_row + r}: input_ids holds {int(ids[i])}, outside {limit}")
    bad = (seg != 0) & (seg != 1)
    if bad.any():
        i = _first(bad)
        _fail(path, f"sample {first_row + _sample_of(i, lens)}: segment_ids holds {int(seg[i])}, expected 0 or 1")


def _check_masked(path, positions, labels, counts, lens, vocab_size, first_row) -> None:
    if positions.size == 0:
        return
    owner = np.repeat(np.arange(len(counts)), counts)
    bad = (positions < 1) | (positions >= lens[owner])
    if bad.any():
        i = _first(bad)
        r = int(owner[i])
        _fail(path, f"sample {first_row + r}: masked position {int(positions[i])} is "
                    f"{'[CLS] or negative' if positions[i] < 1 else 'past the sequence end'} "
                    f"({int(lens[r])} tokens)")
    same = owner[1:] == owner[:-1]
    bad = same & (positions[1:] <= positions[:-1])
    if bad.any():
        r = int(owner[1:][bad][0])
        _fail(path, f"sample {first_row + r}: masked positions are not strictly increasing")
    hi = vocab_size if vocab_size is not None else np.iinfo(np.int16).max + 1
    bad = (labels < 0) | (labels >= hi)
    if bad.any():
        i = _first(bad)
        _fail(path, f"sample {first_row + int(owner[i])}: masked_lm_ids holds {int(labels[i])}, outside "
                    f"{'the vocabulary' if vocab_size is not None else '[0, 32768)'}")


def _check_nsp(path, nsp, first_row) -> None:
    bad = (nsp != 0) & (nsp != 1)
    if bad.any():
        i = _first(bad)
        _fail(path, f"sample {first_row + i}: next_sentence_labels is {int(nsp[i])}, expected 0 or 1")


def to_fixed_arrays(block: SampleBlock, max_seq_length: int, max_predictions: int, where: str = "") -> dict:
    """SampleBlock -> the six fixed-layout arrays (with MLPerf's dtypes)."""
    n = len(block)
    lens = block.seq_lens.astype(np.int64)
    counts = block.masked_counts.astype(np.int64)
    if n and int(lens.max()) > max_seq_length:
        r = int(np.argmax(lens))
        raise DataError(f"{where}sample {r} has {int(lens[r])} tokens, more than max_seq_length {max_seq_length}")
    if n and int(counts.max()) > max_predictions:
        r = int(np.argmax(counts))
        raise DataError(f"{where}sample {r} has {int(counts[r])} masked positions, more than max_predictions "
                        f"{max_predictions}")
    rows = np.repeat(np.arange(n), lens)
    cols = np.arange(len(rows)) - np.repeat(_offsets(lens)[:-1], lens)
    out = {
        "input_ids": np.zeros((n, max_seq_length), np.int16),
        "input_mask": np.zeros((n, max_seq_length), np.int8),
        "segment_ids": np.zeros((n, max_seq_length), np.int8),
        "masked_lm_positions": np.zeros((n, max_predictions), np.int16),
        "masked_lm_ids": np.zeros((n, max_predictions), np.int16),
        "next_sentence_labels": block.nsp_labels.astype(np.int8),
    }
    out["input_ids"][rows, cols] = block.input_ids
    out["input_mask"][rows, cols] = 1
    out["segment_ids"][rows, cols] = block.segment_ids
    mrows = np.repeat(np.arange(n), counts)
    mcols = np.arange(len(mrows)) - np.repeat(_offsets(counts)[:-1], counts)
    out["masked_lm_positions"][mrows, mcols] = block.masked_positions
    out["masked_lm_ids"][mrows, mcols] = block.masked_ids
    return out


class _AtomicFile:
    """An HDF5 file written under a temporary name and renamed to ``path`` on success."""

    def __init__(self, path):
        self.path = Path(path)
        self.tmp = self.path.with_name(f".{self.path.name}.tmp{os.getpid()}")

    def __enter__(self) -> h5py.File:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.f = h5py.File(self.tmp, "w", libver="earliest", track_order=False)
        except OSError as e:
            raise DataError(f"{self.path}: cannot write ({e.strerror or str(e).splitlines()[0]})") from None
        return self.f

    def __exit__(self, exc_type, exc, tb):
        try:
            self.f.close()
            if exc_type is None:
                os.replace(self.tmp, self.path)
        except OSError as e:
            self.tmp.unlink(missing_ok=True)
            raise DataError(f"{self.path}: cannot write ({e.strerror or e})") from None
        finally:
            if exc_type is not None:
                self.tmp.unlink(missing_ok=True)
        return False


def _dataset(f: h5py.File, name: str, data, dtype=None):
    f.create_dataset(name, data=data, dtype=dtype, track_times=False)


def write_fixed(path, block: SampleBlock, max_seq_length: int, max_predictions: int) -> None:
    """Write ``block`` in MLPerf's fixed layout."""
    arrays = to_fixed_arrays(block, max_seq_length, max_predictions, where=f"{path}: ")
    with _AtomicFile(path) as f:
        for key in FIXED_KEYS:
            _dataset(f, key, arrays[key])


def _split(flat: np.ndarray, counts: np.ndarray, dtype) -> np.ndarray:
    out = np.empty(len(counts), dtype=object)
    out[:] = np.split(flat.astype(dtype), _offsets(counts)[1:-1]) if len(counts) else []
    return out


def write_varlength(path, block: SampleBlock, max_seq_length: int | None = None,
                    max_predictions: int | None = None) -> None:
    """Write ``block`` in MLPerf's variable-length layout."""
    n = len(block)
    lens = block.seq_lens.astype(np.int64)
    counts = block.masked_counts.astype(np.int64)
    for limit, values, what in ((max_seq_length, lens, "tokens"), (max_predictions, counts, "masked positions")):
        if limit is not None and n and int(values.max()) > limit:
            r = int(np.argmax(values))
            raise DataError(f"{path}: sample {r} has {int(values[r])} {what}, more than {limit}")
    with _AtomicFile(path) as f:
        for key, flat, cnt, dtype in (("input_ids", block.input_ids, lens, np.int16),
                                      ("segment_ids", block.segment_ids, lens, np.int8),
                                      ("masked_lm_positions", block.masked_positions, counts, np.int16),
                                      ("masked_lm_ids", block.masked_ids, counts, np.int16)):
            ds = f.create_dataset(key, (n,), dtype=h5py.vlen_dtype(np.dtype(dtype)), track_times=False)
            if n:
                ds[...] = _split(flat, cnt, dtype)
        _dataset(f, "next_sentence_labels", block.nsp_labels.astype(np.int8))
        if max_seq_length is not None:
            f.attrs["max_seq_length"] = np.int32(max_seq_length)
        if max_predictions is not None:
            f.attrs["max_predictions"] = np.int32(max_predictions)


def write_file(path, block: SampleBlock, layout: str, max_seq_length: int, max_predictions: int) -> None:
    if layout == "fixed":
        write_fixed(path, block, max_seq_length, max_predictions)
    elif layout == "varlength":
        write_varlength(path, block, max_seq_length, max_predictions)
    else:
        raise DataError(f"--format {layout!r}: expected one of {', '.join(LAYOUTS)}")


def md5sum(path) -> str:
    h = hashlib.md5()
    with open(path, "rb") as fh:
        for piece in iter(lambda: fh.read(1 << 22), b""):
            h.update(piece)
    return h.hexdigest()


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
