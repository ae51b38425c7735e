"""Convert between the fixed, varlength and packed HDF5 layouts: ``python -m data.prepare.convert``.

``python -m data.prepare.convert IN OUT --to varlength|fixed|packed``, IN and OUT files or directories
of .hdf5; lossless, every input validated: [docs/data.md](../docs/data.md#preparing-data).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from common.errors import DataError, cli_main
from data.hdf5io import ALL_LAYOUTS, PACKED, id_dtype, inspect, list_files, read_file, write_file


def convert_file(
    src,
    dst,
    to: str,
    max_seq_length: int | None = None,
    max_predictions: int | None = None,
    vocab_size: int | None = None,
) -> int:
    """Convert one file; returns its sample count."""
    if to not in ALL_LAYOUTS:
        raise DataError(f"--to {to!r}: expected one of {', '.join(ALL_LAYOUTS)}")
    info = inspect(src)
    s, p = max_seq_length or info.max_seq_length, max_predictions or info.max_predictions
    if to == "fixed" and (s is None or p is None):
        raise DataError(
            f"{src}: the file does not record max_seq_length / max_predictions; "
            f"pass --max-seq-length and --max-predictions"
        )
    if to == PACKED and s is None:
        raise DataError(f"{src}: the file does not record max_seq_length; pass --max-seq-length (the pack length)")
    if to == "fixed" and id_dtype(info.vocab_size) is not np.int16:
        raise DataError(f"{src}: a vocabulary of {info.vocab_size} entries does not fit the fixed layout's int16 ids")
    block = read_file(src, vocab_size=vocab_size)
    # A masked-LM-only file stays one (write_file refuses it for the fixed layout, which needs labels).
    write_file(dst, block, to, s, p, next_sentence=info.next_sentence, vocab_size=info.vocab_size)
    return len(block)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m data.prepare.convert", description=__doc__.split("\n\n")[0])
    ap.add_argument("input", help="an .hdf5 file or a directory of them")
    ap.add_argument("output", help="the output file, or directory (created) for a directory input")
    ap.add_argument("--to", required=True, choices=ALL_LAYOUTS)
    ap.add_argument(
        "--max-seq-length",
        type=int,
        help="fixed layout row length / packed layout pack length (default: recorded in the file)",
    )
    ap.add_argument("--max-predictions", type=int, help="fixed layout masked slots (default: recorded in the file)")
    ap.add_argument("--vocab-size", type=int, help="also check token ids against this vocabulary size")
    args = ap.parse_args(argv)
    src, dst = Path(args.input), Path(args.output)
    if src.resolve() == dst.resolve():
        raise DataError(f"{dst}: the output is the input; write elsewhere")
    if src.is_dir():
        pairs = [(f, dst / f.name) for f in list_files(src)]
    else:
        if not src.exists():
            raise DataError(f"{src}: no such file or directory")
        pairs = [(src, dst / src.name if dst.is_dir() else dst)]
    sizes = (args.max_seq_length, args.max_predictions, args.vocab_size)
    total = sum(convert_file(a, b, args.to, *sizes) for a, b in pairs)
    print(f"converted {len(pairs)} file(s), {total} samples, to the {args.to} layout in {dst}")
    return 0


if __name__ == "__main__":
    sys.exit(cli_main(main))
