"""Static shapes' trade-off: padding against the number of distinct shapes, per token bucket.

    python -m bench.static_shapes                       # MLPerf's 8-GPU H100 recipe, built-in lengths
    python -m bench.static_shapes --batch 56 --steps 6700 --data-dir DIR

For each token bucket (and the default, ``data.static_shapes.auto_token_bucket``) it pads
every micro-batch of a simulated run (``--steps`` x ``--ranks`` micro-batches of ``--batch``
samples, lengths from ``bench.lengths``, masked counts as MLPerf's masking: 15%, at most
``--max-predictions``) and prints the distinct (tokens, masked) shapes and the padding, of
tokens and of masked positions, as a share of the real ones. No model runs: this is the
shape arithmetic the trainer does (``train.static_shapes``), over a whole run.
"""

from __future__ import annotations

import argparse

import numpy as np

from bench.lengths import MAX_LEN, LengthSampler
from data.static_shapes import StaticShapes, auto_token_bucket


def measure(lengths: np.ndarray, max_predictions: int, token_bucket: int, masked_bucket: int) -> dict:
    """lengths [steps, batch] -> distinct shapes and padding shares for one bucket."""
    masked = np.minimum(max_predictions, np.maximum(1, np.rint(lengths * 0.15))).astype(np.int64)
    shapes = StaticShapes(token_bucket, masked_bucket, max(MAX_LEN, token_bucket))
    tokens, counts = lengths.sum(1), masked.sum(1)
    padded = np.array([shapes.padded_sizes(int(t), int(m)) for t, m in zip(tokens, counts)])
    return {
        "token_bucket": token_bucket,
        "distinct_shapes": len({tuple(p) for p in padded.tolist()}),
        "token_padding": float(padded[:, 0].sum() / tokens.sum() - 1),
        "masked_padding": float(padded[:, 1].sum() / counts.sum() - 1),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=96, help="samples per micro-batch (default: 768 / 8 GPUs)")
    parser.add_argument("--steps", type=int, default=3680)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--max-predictions", type=int, default=76)
    parser.add_argument("--masked-bucket", type=int, default=64)
    parser.add_argument("--data-dir", default=None, help="read the lengths of these HDF5 shards instead")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    sampler = LengthSampler(args.data_dir, seed=args.seed)
    n = args.steps * args.ranks
    lengths = np.array(sampler.batch(n * args.batch), dtype=np.int64).reshape(n, args.batch)
    auto = auto_token_bucket(args.batch, MAX_LEN)
    print(f"lengths: {sampler.source}; {n} micro-batches of {args.batch}, mean {lengths.sum(1).mean():.0f} tokens")
    print(f"{'bucket':>8} {'shapes':>7} {'token pad':>10} {'masked pad':>11}")
    for bucket in sorted({256, 512, 768, 1024, 1536, 2048, auto}):
        r = measure(lengths, args.max_predictions, bucket, args.masked_bucket)
        mark = "  <- auto_token_bucket" if bucket == auto else ""
        print(
            f"{bucket:>8} {r['distinct_shapes']:>7} {100 * r['token_padding']:>9.2f}% "
            f"{100 * r['masked_padding']:>10.2f}%{mark}"
        )


if __name__ == "__main__":
    main()
