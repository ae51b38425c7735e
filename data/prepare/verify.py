"""NVIDIA's per-shard checksums of MLPerf BERT data: ``python -m data.prepare.verify``.

A checksum list has one ``name<TAB>md5`` line per file, the md5 NVIDIA's (``shard_checksum``); the
published ones are in ``data/prepare/checksums/``: [docs/data.md](../docs/data.md#the-real-mlperf-dataset-step-by-step).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

from common.errors import DataError, cli_main
from data.hdf5io import READ_ROWS, check_links, check_storage, open_hdf5
from data.prepare.progress import Pool, progress

CHECKSUM_DIR = Path(__file__).resolve().parent / "checksums"  # NVIDIA's published lists


def shard_checksum(path) -> str:
    """NVIDIA's checksum (``hdf5_md5.py``) of one HDF5 file, fixed or varlength layout: the md5 of
    ``str()`` of the list of each row's md5 of ``str(input_ids[i].tolist())``."""
    digests = []
    with open_hdf5(path) as f:
        if "input_ids" not in f:
            raise DataError(f"{path}: missing key 'input_ids'")
        check_links(path, f)
        ids = f["input_ids"]
        try:
            check_storage(path, "input_ids", ids)
            for a in range(0, ids.shape[0], READ_ROWS):
                digests += [hashlib.md5(str(row.tolist()).encode()).hexdigest() for row in ids[a : a + READ_ROWS]]
        except (OSError, RuntimeError, ValueError, TypeError) as e:
            raise DataError(f"{path}: cannot read input_ids (truncated or corrupt?): {str(e).splitlines()[0]}") from e
    return hashlib.md5(str(digests).encode()).hexdigest()


def read_checksums(path) -> dict[str, str]:
    """A checksum list: ``name<TAB>md5`` (any whitespace) per line -> {name: md5}."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise DataError(f"{path}: cannot read the checksum list ({e.strerror or e})") from e
    out: dict[str, str] = {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2 or len(parts[1]) != 32:
            raise DataError(f"{path}: line {n}: expected 'name<TAB>md5', got {line!r}")
        out[parts[0]] = parts[1].lower()
    if not out:
        raise DataError(f"{path}: the checksum list is empty")
    return out


def _checksum_task(path: str) -> tuple[str, str | None, str | None]:
    try:
        return path, shard_checksum(path), None
    except DataError as e:
        return path, None, str(e)


def verify(paths: list, checksums: dict[str, str], workers: int = 1, desc: str = "checksums") -> list[str]:
    """Problems (one line each) of the files named in ``checksums`` found under ``paths``
    (directories, or files); an empty list means every listed file is there and matches."""
    found: dict[str, Path] = {}
    for p in map(Path, paths):
        if p.is_dir():
            for name in checksums:
                if name not in found and (p / name).is_file():
                    found[name] = p / name
        elif p.is_file():
            found.setdefault(p.name, p)
        else:
            raise DataError(f"{p}: no such file or directory")
    problems = [f"{name}: missing" for name in checksums if name not in found]
    todo = [str(found[name]) for name in checksums if name in found]
    with Pool(workers) as pool:
        results = list(progress(pool.imap(_checksum_task, todo), total=len(todo), desc=desc, unit="file"))
    for path, got, error in results:
        if error is not None:
            problems.append(error)
        elif got != checksums[Path(path).name]:
            problems.append(f"{path}: checksum {got}, expected {checksums[Path(path).name]}")
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m data.prepare.verify", description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", help="directories holding the files, or the files")
    ap.add_argument(
        "--checksums", required=True, help=f"a checksum list (name<TAB>md5 lines), e.g. one of {CHECKSUM_DIR}/*.chk"
    )
    ap.add_argument("--workers", type=int, default=1, help="processes computing checksums")
    args = ap.parse_args(argv)
    if args.workers < 1:
        raise DataError(f"--workers {args.workers}: must be >= 1")
    expected = read_checksums(args.checksums)
    problems = verify(args.paths, expected, args.workers)
    for p in problems:
        print(f"mismatch: {p}" if "checksum" in p else f"error: {p}", file=sys.stderr)
    if problems:
        print(
            f"error: {len(problems)} of {len(expected)} file(s) failed the checks in {args.checksums}", file=sys.stderr
        )
        return 1
    print(f"ok: {len(expected)} file(s) match {args.checksums}")
    return 0


if __name__ == "__main__":
    sys.exit(cli_main(main))
