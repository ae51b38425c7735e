"""The host's wait for the next block at a shard boundary, with the loader's read-ahead on and off.

    python -m bench.shard_gap [--data DIR] [--global-batch 448] [--world-size 8] [--step-ms 40]

One rank of a ``--world-size`` job draws its blocks from ``data.loader.PretrainingLoader``
while a step of ``--step-ms`` is simulated (the host sleeping as if the device computed), and
the time each ``next()`` makes the host wait is recorded. A step that needs a shard not read
yet is where a stall would be: with the read-ahead (``prefetch``, the default; the next
shards are read and checked in a background thread while the current one is used) it has
been read already; without it the step waits for the read. Prints, for both, the median and
the worst wait after the first step (which reads the first shards either way) and the step
it happened at, side by side in one run on the same shards.
Without ``--data`` it writes synthetic shards (``data.synthetic.write_shards``) to a
temporary directory.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from data.loader import PretrainingLoader
from data.synthetic import write_shards


def waits(data: str, args, prefetch: bool) -> list[float]:
    """Seconds the host waited for each of ``--steps`` blocks."""
    loader = PretrainingLoader(
        data, global_batch_size=args.global_batch, rank=0, world_size=args.world_size, seed=0, prefetch=prefetch
    )
    out = []
    with loader:
        it = iter(loader)
        for _ in range(args.steps):
            t0 = time.perf_counter()
            next(it)
            out.append(time.perf_counter() - t0)
            time.sleep(args.step_ms / 1e3)  # the step the device would be computing
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="a directory of prepared shards (default: synthetic ones)")
    parser.add_argument("--global-batch", type=int, default=448)
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--step-ms", type=float, default=40.0)
    parser.add_argument("--shards", type=int, default=48, help="synthetic shards: how many")
    parser.add_argument("--shard-samples", type=int, default=1200, help="synthetic shards: samples per shard")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data
        if data is None:
            write_shards(tmp, [args.shard_samples] * args.shards, seed=0, max_seq_length=512, max_predictions=76)
            data = tmp
        loaders = (("read-ahead", True), ("no read-ahead", False))
        rows = {name: waits(data, args, prefetch) for name, prefetch in loaders}
    per_rank = args.global_batch // args.world_size
    print(f"{args.steps} steps of {args.step_ms:g} ms, {per_rank} samples per rank per step")
    print(f"{'loader':>14} {'first ms':>9} {'median ms':>10} {'worst ms':>9} {'at step':>8}  (after the first step)")
    for name, w in rows.items():
        worst = max(range(1, len(w)), key=w.__getitem__)
        print(f"{name:>14} {1e3 * w[0]:>9.1f} {1e3 * statistics.median(w):>10.2f} {1e3 * w[worst]:>9.1f} {worst:>8}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
