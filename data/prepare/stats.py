"""Describe prepared HDF5 data: ``python -m data.prepare.stats DIR_OR_FILES [--png FILE]``.

Prints the sample count, a length histogram, the padding ratio (token slots of a padded batch per
real token), masked tokens per sample and the random-next share; ``--png`` draws the histogram.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from common.errors import DataError, cli_main
from common.files import publishing
from data.hdf5io import inspect, list_files, read_file


def _manifest_near(path: Path) -> dict | None:
    for d in (path, path.parent, path.parent.parent):
        m = d / "manifest.json"
        if m.is_file():
            try:
                return json.loads(m.read_text())
            except (OSError, ValueError) as e:
                raise DataError(f"{m}: cannot read the manifest ({e})") from e
    return None


def shard_stats(
    files: list[Path], max_seq_length: int | None = None, vocab_size: int | None = None, bins: int = 16
) -> dict:
    """Statistics over all samples of ``files`` (each read and validated)."""
    infos, columns = [], []
    for f in files:
        infos.append(inspect(f))
        block = read_file(f, vocab_size=vocab_size)
        columns.append((block.seq_lens.astype(np.int64), block.masked_counts.astype(np.int64), block.nsp_labels))
    lens, masked, nsp = (np.concatenate(c) for c in zip(*columns))
    seq_from_files = {info.max_seq_length for info in infos} - {None}
    if max_seq_length is None:
        if len(seq_from_files) > 1:
            raise DataError(f"the files have different max_seq_length {sorted(seq_from_files)}; pass --max-seq-length")
        max_seq_length = seq_from_files.pop() if seq_from_files else int(lens.max())
    n = len(lens)
    if n == 0:
        raise DataError(f"{files[0]}: no samples")
    tokens = int(lens.sum())
    edges = np.linspace(0, max_seq_length, bins + 1).round().astype(np.int64)
    counts = np.histogram(lens, bins=edges + 0.5)[0] if max_seq_length >= bins else np.bincount(lens)[1:]
    return {
        "files": len(files),
        "layouts": sorted({info.layout for info in infos}),
        "samples": n,
        "tokens": tokens,
        "max_seq_length": int(max_seq_length),
        "length": {
            "mean": float(lens.mean()),
            "median": float(np.median(lens)),
            "min": int(lens.min()),
            "max": int(lens.max()),
        },
        "padding_ratio": max_seq_length * n / tokens,
        "masked_per_sample": {"mean": float(masked.mean()), "min": int(masked.min()), "max": int(masked.max())},
        "masked_fraction": float(masked.sum() / tokens),
        "random_next_fraction": float(nsp.mean()),
        "histogram": {"edges": edges.tolist(), "counts": counts.tolist()},
    }


def format_report(name: str, s: dict) -> str:
    lines = [
        f"{name}: {s['files']} file(s), {'/'.join(s['layouts'])} layout, {s['samples']} samples, {s['tokens']} tokens",
        f"sequence length: mean {s['length']['mean']:.1f}, median {s['length']['median']:.0f}, "
        f"min {s['length']['min']}, max {s['length']['max']} (max_seq_length {s['max_seq_length']})",
        f"padding ratio (max_seq_length x samples / tokens): {s['padding_ratio']:.3f} "
        f"({100 * (1 - 1 / s['padding_ratio']):.1f}% of a padded batch is padding)",
        f"masked tokens per sample: mean {s['masked_per_sample']['mean']:.2f}, min {s['masked_per_sample']['min']}, "
        f"max {s['masked_per_sample']['max']} ({100 * s['masked_fraction']:.1f}% of tokens)",
        f"random next segment: {100 * s['random_next_fraction']:.1f}% of samples",
        "sequence length histogram:",
    ]
    edges, counts = s["histogram"]["edges"], s["histogram"]["counts"]
    top = max(counts) or 1
    for lo, hi, c in zip(edges[:-1], edges[1:], counts):
        bar = "#" * round(40 * c / top)
        lines.append(f"  {lo + 1:>5}-{hi:<5} {bar:<40} {c:>9} {100 * c / s['samples']:5.1f}%")
    return "\n".join(lines)


def plot(s: dict, png: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    edges, counts = np.array(s["histogram"]["edges"]), np.array(s["histogram"]["counts"])
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(edges[:-1] + 0.5, counts, width=np.diff(edges), align="edge", edgecolor="black", linewidth=0.4)
    ax.set(xlabel="sequence length (tokens)", ylabel="samples")
    ax.set_title(
        f"{title}: {s['samples']} samples, mean {s['length']['mean']:.1f}, padding ratio {s['padding_ratio']:.2f}",
        fontsize=9,
    )
    fig.tight_layout()
    try:
        with publishing(png, suffix=".png") as tmp:
            fig.savefig(tmp, dpi=120)
    except OSError as e:
        raise DataError(f"{png}: cannot write ({e.strerror or e})") from e
    finally:
        plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m data.prepare.stats", description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", help="a directory of .hdf5 files, or files")
    ap.add_argument("--png", help="also write the length histogram as a PNG")
    ap.add_argument("--max-seq-length", type=int, help="default: the fixed layout's row length, or the manifest's")
    ap.add_argument("--bins", type=int, default=16)
    ap.add_argument("--max-files", type=int, help="read only this many files, evenly spaced")
    args = ap.parse_args(argv)
    files = list_files(args.paths[0]) if len(args.paths) == 1 else list_files(args.paths)
    if args.max_files and len(files) > args.max_files:
        files = [files[i] for i in np.linspace(0, len(files) - 1, args.max_files).round().astype(int)]
    manifest = _manifest_near(Path(args.paths[0]))
    vocab_size = manifest["vocab"]["size"] if manifest else None
    seq = args.max_seq_length or (manifest["parameters"]["max_seq_length"] if manifest else None)
    s = shard_stats(files, max_seq_length=seq, vocab_size=vocab_size, bins=args.bins)
    print(format_report(args.paths[0] if len(args.paths) == 1 else f"{len(files)} files", s))
    if args.png:
        plot(s, args.png, Path(args.paths[0]).name)
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(cli_main(main))
