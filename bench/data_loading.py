"""Data pipeline throughput: preparation samples/s per worker, loader + collation sequences/s.

    python -m bench.data_loading                                 # WikiText-2 from ../shared/data
    python -m bench.data_loading --input DIR --input-format bert --vocab VOCAB
    python -m bench.data_loading --data /tmp/wt2 --skip-prepare  # loader only, on prepared data

Preparation runs ``data.prepare`` on the input with 1 worker and with ``--workers`` workers
(same output, checked) and reports samples/s and samples/s per worker. The loader part
runs one rank of a ``--world-size`` job with the MLPerf 8-GPU global batch (448) pinned to
one CPU core (prefetch thread included), and reports sequences/s for the loader alone and
with each collation, against the goal: 10x the ~1,000 sequences/s one H200 trains on. The
padded collation pads to the data's own max_seq_length (read from the shards), so the loader
part runs on any prepared set; ``--max-seq-length`` is what preparation writes (default 128).

(Named ``data_loading``, not ``data``: run by path, a ``bench/data.py`` shadowed the ``data``
package.)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

# Only light imports at the top: preparation's worker processes re-import this script.
from common.errors import cli_main
from data.prepare.shards import PrepareConfig, prepare

REPO = Path(__file__).resolve().parents[1]

GOAL = 10_000  # sequences/s: 10x what one H200 consumes in the MLPerf recipe
SHARED = REPO.parent / "shared" / "data"


def bench_prepare(args, out_root: Path) -> Path:
    rows = []
    trees = []
    for workers in sorted({1, args.workers}):
        out = out_root / f"prep_w{workers}"
        cfg = PrepareConfig(
            inputs=args.input,
            output_dir=str(out),
            input_format=args.input_format,
            vocab=args.vocab,
            max_seq_length=args.max_seq_length,
            max_predictions=args.max_predictions,
            shards=args.shards,
            eval_samples=args.eval_samples,
            workers=workers,
        )
        t = time.perf_counter()
        r = prepare(cfg, log=lambda m: None)
        total = time.perf_counter() - t
        n = r.manifest["train"]["samples"] + r.manifest.get("eval", {}).get("samples", 0)
        rows.append((workers, n, total, r.seconds))
        trees.append({p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()})
    same = all(t == trees[0] for t in trees)
    print(
        f"\npreparation: {', '.join(args.input)} ({args.input_format}), max_seq_length {args.max_seq_length}, "
        f"dupe_factor 10, {args.shards} shards"
    )
    print(f"{'workers':>8} {'samples':>9} {'seconds':>8} {'samples/s':>10} {'per worker':>11}   stages (s)")
    for workers, n, total, sec in rows:
        stages = ", ".join(f"{k} {v:.1f}" for k, v in sec.items())
        print(f"{workers:>8} {n:>9} {total:>8.1f} {n / total:>10.0f} {n / total / workers:>11.0f}   {stages}")
    print(f"output identical across worker counts: {same}")
    return out_root / "prep_w1"


def data_max_seq_length(train: Path) -> int:
    """The longest sequence the shards in ``train`` may hold: their ``max_seq_length`` (the
    fixed layout's row length, the varlength and packed files' attribute), or, for a file
    without the attribute, its longest sample."""
    from data.hdf5io import inspect, list_files, read_file

    longest = 0
    for path in list_files(train):  # a DataError naming the directory when it holds no shards
        s = inspect(path).max_seq_length
        longest = max(longest, s if s is not None else int(read_file(path).seq_lens.max(initial=0)))
    return longest


def bench_loader(args, data: Path) -> None:
    train = data / "train"
    seq_len = data_max_seq_length(train)  # before importing torch: bad data fails fast

    import torch

    from data.loader import PretrainingLoader, make_collator

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    if args.one_core and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    cases = [
        ("loader only (SampleBlock)", None),
        ("loader + collate_unpadded", ("torch", "unpadded")),
        ("loader + collate_padded", ("torch", "padded")),
        ("loader + DALI (CPU pipeline)", ("dali", "unpadded")),
    ]
    g, w = args.global_batch, args.world_size
    print(
        f"\nloader: {train}, global batch {g}, rank 0 of {w} ({g // w} sequences per step), "
        f"{'one core' if args.one_core else 'all cores'}, {args.steps} steps (shard reads included), "
        f"max_seq_length {seq_len} (from the data)"
    )
    print(f"{'what':<32} {'seq/s':>9} {'tokens/s':>11} {'vs goal':>8}")
    for name, coll in cases:
        if coll and coll[0] == "dali" and args.no_dali:
            continue
        loader = PretrainingLoader(train, g, 0, w, seed=1)
        collate = make_collator(coll[0], coll[1], seq_len, max_batch_size=g // w) if coll else None
        it = iter(loader)
        next(it)  # the first shard read is start-up, not throughput
        seqs = toks = 0
        t = time.perf_counter()
        for _ in range(args.steps):
            block = next(it)
            if collate is not None:
                collate(block)
            seqs += len(block)
            toks += block.num_tokens
        dt = time.perf_counter() - t
        loader.close()
        print(f"{name:<32} {seqs / dt:>9.0f} {toks / dt:>11.0f} {seqs / dt / GOAL:>7.1f}x")
    # The whole global batch on one process (what a single-rank run reads).
    loader = PretrainingLoader(train, g, 0, 1, seed=1)
    collate = make_collator("torch", "unpadded")
    it = iter(loader)
    next(it)
    steps = max(1, args.steps * w // g * (g // w) // 8)
    t = time.perf_counter()
    seqs = 0
    for _ in range(steps):
        block = next(it)
        collate(block)
        seqs += len(block)
    dt = time.perf_counter() - t
    loader.close()
    print(f"{'world size 1 + collate_unpadded':<32} {seqs / dt:>9.0f} {'':>11} {seqs / dt / GOAL:>7.1f}x")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.data_loading", description=__doc__.split("\n\n")[0])
    ap.add_argument("--input", nargs="+", default=[str(SHARED / "wikitext-2")])
    ap.add_argument("--input-format", default="wikitext")
    ap.add_argument("--vocab", default=str(SHARED / "vocab" / "bert-uncased-vocab.txt"))
    ap.add_argument(
        "--max-seq-length",
        type=int,
        default=128,
        help="what preparation writes; the loader part reads the length from the data",
    )
    ap.add_argument("--max-predictions", type=int, default=20)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--eval-samples", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--data", help="a prepared directory for the loader part (default: what preparation wrote)")
    ap.add_argument("--skip-prepare", action="store_true")
    ap.add_argument("--global-batch", type=int, default=448)
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--all-cores", dest="one_core", action="store_false")
    ap.add_argument("--no-dali", action="store_true")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        data = Path(args.data) if args.data else None
        if not args.skip_prepare:
            prepared = bench_prepare(args, Path(tmp))
            data = data or prepared
        if data is None:
            ap.error("--skip-prepare needs --data")
        bench_loader(args, data)
    return 0


if __name__ == "__main__":
    sys.exit(cli_main(main))
