"""Simulate cross-rank rebalancing at 8 to 4,096 ranks: imbalance, bytes moved, plan time.

For each world size W and strategy (none / stripe / balanced / balanced/g8) it draws
``--steps`` global batches of W x B sequence lengths, computes the plan with
``data.rebalance.plan`` (timed, one core) and reports, as medians over the steps:

- imbalance: max rank cost / mean rank cost after the strategy (cost c(L) = a*L + b*L^2
  + b_local*L*min(L, window), ``data.rebalance.plan.Cost``);
- moved/rank: samples that change rank, per rank;
- bytes/rank: bytes one rank receives per step, the most loaded rank (max over ranks).
  ``none`` exchanges nothing. ``stripe`` is counted the way the MLPerf submissions move
  data: every rank all-gathers every other rank's samples. ``balanced`` is this project's
  exchange: the all-gathered header and lengths (4 * W * (7 + B) bytes) plus the samples it
  receives in the all-to-all. Both count a sample in the exchange's packed int32 form,
  4 * (1 + L + 2 * masked) bytes, which favours the all-gather (it would otherwise move
  padded [B, 512] tensors);
- assign_ms: the time one rank spends computing the plan (numpy, one thread). ``balanced``
  computes the whole plan on every rank; ``balanced/g8`` is the hierarchical mode
  (``group_size=8``), where a rank computes only what its group of 8 depends on
  (``data.rebalance.plan.plan_for_rank``), so its imbalance and bytes come from the whole plan
  and its assign_ms from ``plan_for_rank`` of a few ranks.

Lengths come from a prepared data directory (``--data-dir``: MLPerf's fixed HDF5 layout,
lengths = sum of input_mask per row; or the varlength layout, lengths of input_ids), from
the built-in MLPerf-like distribution (``mlperf_like_lengths``, the default), or, for long
context, from WikiText-2's articles (``--lengths wikitext2``: the shipped token counts of its
122 articles, ``bench.article_lengths``, cut at ``--context`` as ``data.prepare --objective
mlm`` cuts documents; 30% of the tokens masked, as ModernBERT trains). ``--model`` picks the
FLOP-derived cost of BERT-large (MLPerf's) or ModernBERT-base (global and sliding-window
layers, ``MODERNBERT_BASE_COST``); ``--cost`` gives measured coefficients instead
(``python -m bench.fit_cost`` prints them).

With ``--slow-fraction`` it simulates heterogeneous ranks instead (``simulate_speeds``): a
fraction of the ranks runs at ``--slow-factor`` of the others' speed (with
``--throttle-period`` P, another such fraction is throttled for P steps, then not for P, and
so on), each rank's measured time is its true time times 1 + ``--noise`` * U(-1, 1), and
``measured`` learns speeds and cost from those times as the trainer does
(``data.rebalance.fit.OnlineModel``, the times arriving two steps late). Reported: the
predicted step time (the slowest rank's true time) over the ideal, total work over total
speed, for ``stripe``, ``balanced`` and ``measured``, median (and 90th percentile) over the
steps after ``--warmup``.

    python -m bench.rebalance_sim [--data-dir DIR] [--json FILE] [--png FILE]
    python -m bench.rebalance_sim --lengths wikitext2 --context 8192 --model modernbert-base \
        --world-sizes 8 64 512 --batch 16
    python -m bench.rebalance_sim --world-sizes 512 --slow-fraction 0.02 --slow-factor 0.7 --noise 0.1
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

import numpy as np

from bench.article_lengths import load as load_article_lengths
from bench.article_lengths import sequence_lengths
from common.files import publishing, write_text
from data.rebalance.fit import OnlineModel
from data.rebalance.plan import (
    DEFAULT_COST,
    HEADER_WORDS,
    STRATEGIES,
    Cost,
    assign,
    check_cost,
    plan_for_rank,
    sample_costs,
)

MAX_PREDICTIONS = 76  # MLPerf: max_predictions_per_seq
MASKED_LM_PROB = 0.15
LONG_MASKED_LM_PROB = 0.3  # ModernBERT's training masking rate


def _modernbert_base_cost() -> Cost:
    """ModernBERT-base's FLOPs per sequence of L tokens, divided by its linear part.

    22 layers of hidden h = 768, GeGLU MLP of I = 1152, global attention in every 3rd layer
    (0, 3, ..., 21: 8 global, 14 local) and a window of 128 in the others. Per token and
    layer: projections QKV + out 8 h^2, MLP 2 h (2 I) + 2 I h = 6 h I; attention scores plus
    the weighted sum 4 h per key seen: L keys in a global layer, about min(L, 128) in a local
    one. Forward and backward scale all three alike, so c(L) / (22 (8 h^2 + 6 h I)) gives
    a = 1, b = 8 * 4h / (22 (8 h^2 + 6 h I)), b_local = 14 * 4h / (...) -- attention of the
    global layers alone equals the linear work at L of about 9,000."""
    h, i, layers, global_layers = 768, 1152, 22, 8
    linear = layers * (8 * h * h + 6 * h * i)
    return Cost(1.0, global_layers * 4 * h / linear, (layers - global_layers) * 4 * h / linear, 128)


MODERNBERT_BASE_COST = _modernbert_base_cost()
MODEL_COSTS = {"bert-large": DEFAULT_COST, "modernbert-base": MODERNBERT_BASE_COST}


def mlperf_like_lengths(rng: np.random.Generator, n: int, max_len: int = 512) -> np.ndarray:
    """n sequence lengths shaped like MLPerf's Wikipedia data at max_seq_length 512.

    A mixture built from how create_pretraining_data cuts documents, not fitted to the real
    files (use --data-dir for those): 20% full-length chunks (a document's chunks are filled
    to 512 until its end), 10% short_seq_prob chunks with a target drawn uniformly, and 70%
    document ends and short articles, skewed short (8 + 504 * Beta(1.2, 2.4)). The mean is
    about 250, i.e. just over 50% of a padded 512 batch is padding, as Krell et al. (2021)
    report for this data set.
    """
    u = rng.random(n)
    tail = 8 + np.floor((max_len - 8) * rng.beta(1.2, 2.4, n)).astype(np.int64)
    short = rng.integers(8, max_len + 1, n)
    return np.where(u < 0.2, max_len, np.where(u < 0.3, short, tail)).astype(np.int64)


def masked_counts(lengths: np.ndarray) -> np.ndarray:
    """create_pretraining_data's number of predictions per sequence."""
    return np.minimum(MAX_PREDICTIONS, np.maximum(1, np.rint(lengths * MASKED_LM_PROB))).astype(np.int64)


def lengths_from_dir(path: str) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, masked counts) of every sample in the HDF5 files of a prepared data directory."""
    import h5py

    if not os.path.isdir(path):
        raise SystemExit(f"rebalance_sim: --data-dir {path}: not a directory")
    pattern = os.path.join(glob.escape(path), "*")  # the directory's name may hold [ or *
    files = sorted(glob.glob(pattern + ".hdf5") + glob.glob(pattern + ".h5"))
    if not files:
        raise SystemExit(f"rebalance_sim: --data-dir {path}: no .hdf5 files")
    lengths, masked = [], []
    for f in files:
        try:
            with h5py.File(f, "r") as h:
                if "input_mask" in h:  # fixed layout: padded rows
                    lengths.append(h["input_mask"][:].astype(np.int64).sum(1))
                    masked.append((h["masked_lm_positions"][:] != 0).sum(1))
                elif "input_ids" in h:  # varlength layout: one array per sample
                    lengths.append(np.fromiter((len(x) for x in h["input_ids"][:]), np.int64))
                    masked.append(np.fromiter((len(x) for x in h["masked_lm_positions"][:]), np.int64))
                else:
                    raise SystemExit(f"rebalance_sim: {f}: neither input_mask (fixed layout) nor input_ids (varlength)")
        except (OSError, KeyError) as e:
            raise SystemExit(f"rebalance_sim: {f}: cannot read: {e}") from None
    L, m = np.concatenate(lengths), np.concatenate(masked)
    if len(L) == 0 or L.min() < 1:
        raise SystemExit(f"rebalance_sim: --data-dir {path}: no samples, or a sample of length 0")
    return L, m


def bytes_received(strategy: str, plan, words: np.ndarray) -> np.ndarray:
    """[W] bytes each rank receives in one step (``words``: [W, B] int32 words per sample)."""
    W, B = words.shape
    if strategy == "none":
        return np.zeros(W, dtype=np.int64)
    if strategy == "stripe":  # the submissions: all-gather everything
        per_rank = words.sum(1)
        return 4 * (per_rank.sum() - per_rank)
    incoming = plan.src_rank != np.arange(W)[:, None]
    recv_words = np.where(incoming, words[plan.src_rank, plan.src_index], 0).sum(1)
    return 4 * (W * (HEADER_WORDS + B) + recv_words)


def simulate(world_sizes, batch: int, steps: int, seed: int, cost, draw, group_size: int) -> list[dict]:
    """One record per (W, variant); variants: none, stripe, balanced (flat), and balanced with
    ``group_size`` (hierarchical, where W > group_size): its assign_ms is one rank's
    ``plan_for_rank``, which is all a rank computes in that mode (the flat modes compute the
    whole plan on every rank)."""
    rng = np.random.default_rng(seed)
    records = []
    for W in world_sizes:
        variants = [(s, None) for s in STRATEGIES if s != "measured"]  # measured: simulate_speeds
        if W > group_size and W % group_size == 0:
            variants.append(("balanced", group_size))
        per = {v: dict(imb=[], before=[], moved=[], bytes=[], ms=[]) for v in variants}
        for _ in range(steps):
            L, m = draw(rng, W * batch)
            L, words = L.reshape(W, batch), (1 + L + 2 * m).reshape(W, batch)
            for s, g in variants:
                t0 = time.perf_counter()
                plan = assign(L, s, cost, group_size=g)
                ms = (time.perf_counter() - t0) * 1e3
                if g is not None:
                    ms = []
                    for r in (0, W // 2, W - 1):
                        t0 = time.perf_counter()
                        plan_for_rank(L, r, s, cost, group_size=g)
                        ms.append((time.perf_counter() - t0) * 1e3)
                    ms = float(np.median(ms))
                p = per[(s, g)]
                p["ms"].append(ms)
                p["imb"].append(plan.imbalance_after)
                p["before"].append(plan.imbalance_before)
                p["moved"].append(plan.moved / W)
                p["bytes"].append(int(bytes_received(s, plan, words).max()))
        for (s, g), p in per.items():
            records.append(
                dict(
                    world_size=W,
                    strategy=s,
                    group_size=g,
                    imbalance=float(np.median(p["imb"])),
                    imbalance_before=float(np.median(p["before"])),
                    moved_per_rank=float(np.median(p["moved"])),
                    bytes_per_rank=int(np.median(p["bytes"])),
                    assign_ms=float(np.median(p["ms"])),
                    batch_per_rank=batch,
                    steps=steps,
                )
            )
    return records


ONSET_SETTLED = 1.05  # a throttling onset is caught up with once measured's step time is within 5% of ideal


def simulate_speeds(
    W: int, batch: int, steps: int, warmup: int, seed: int, cost, draw, slow: tuple, noise: float, measured: tuple
) -> dict:
    """Heterogeneous ranks: predicted step time / ideal per strategy (see the module's doc).

    slow: (fraction, factor, throttle period or 0). measured: (window, bound, rate, max_share), as
    ``data.rebalance_measured``. With a period, ``onset_lag``: the median over the onsets after the warm-up
    of the steps until measured's step time is within ``ONSET_SETTLED`` of ideal (0: at once)."""
    *measured, max_share = measured
    rng = np.random.default_rng(seed)
    fraction, factor, period = slow
    n_slow = int(round(fraction * W))
    picked = rng.permutation(W)
    always, throttled = picked[:n_slow], picked[n_slow : 2 * n_slow] if period else picked[:0]
    online, pending = OnlineModel(cost, W, *measured), []  # measurements arrive 2 steps late
    ratios = {s: [] for s in ("stripe", "balanced", "measured")}
    fit_ms, every = [], []  # every: measured's ratio at each step, warm-up included (the onsets' lag)
    for step in range(warmup + steps):
        speed = np.ones(W)
        speed[always] = factor
        if period and (step // period) % 2 == 1:
            speed[throttled] = factor
        L, _ = draw(rng, W * batch)
        L = L.reshape(W, batch)
        for s in ratios:
            opts = dict(speeds=online.speeds, max_samples=int(batch * max_share)) if s == "measured" else {}
            A = assign(L, s, cost, **opts)
            # [W, C] lengths each rank holds after the plan, 0 past its count (measured: counts differ)
            La = np.where(A.src_rank >= 0, L[A.src_rank, A.src_index], 0)
            work = sample_costs(La, cost).sum(1)
            t = work / speed
            ratio = float(t.max() / (work.sum() / speed.sum()))
            if step >= warmup:
                ratios[s].append(ratio)
        every.append(ratio)
        # the measured plan's times, as the ranks would measure them (noisy), for the model
        t_seen = t * (1 + noise * rng.uniform(-1, 1, W))
        w = cost.window
        feats = np.stack([La.sum(1), (La * La).sum(1), (La * np.minimum(La, w)).sum(1) if w else 0 * La.sum(1)], 1)
        pending.append((feats.astype(np.float64), t_seen))
        if len(pending) > 2:
            f, ts = pending.pop(0)
            for r in range(W):
                online.add(r, f[r], float(ts[r]))
        t0 = time.perf_counter()
        online.refit()
        fit_ms.append((time.perf_counter() - t0) * 1e3)
    out = dict(world_size=W, batch_per_rank=batch, steps=steps, warmup=warmup, noise=noise, slow=list(slow))
    for s, v in ratios.items():
        out[s] = float(np.median(v))
        out[s + "_p90"] = float(np.percentile(v, 90))
    # Throttling's onsets after the warm-up: steps until measured's ratio is back within ONSET_SETTLED
    lags = []
    for s0 in range(period, warmup + steps, 2 * period) if period else ():
        after = [j for j in range(min(period, warmup + steps - s0)) if every[s0 + j] <= ONSET_SETTLED]
        if s0 >= warmup and after:
            lags.append(after[0])
    out["onset_lag"] = float(np.median(lags)) if lags else None
    out["refit_ms"] = float(np.median(fit_ms))
    return out


def _label(r: dict) -> str:
    return r["strategy"] if r["group_size"] is None else f"{r['strategy']}/g{r['group_size']}"


def print_table(records: list[dict]) -> None:
    print(f"{'W':>5} {'strategy':>12} {'imbalance':>10} {'moved/rank':>11} {'bytes/rank':>12} {'assign_ms':>10}")
    for r in records:
        print(
            f"{r['world_size']:>5} {_label(r):>12} {r['imbalance']:>10.4f} {r['moved_per_rank']:>11.1f} "
            f"{r['bytes_per_rank']:>12,} {r['assign_ms']:>10.2f}"
        )
    print()
    by = {(r["world_size"], _label(r)): r for r in records}
    for W in sorted({r["world_size"] for r in records}):
        ag, ours = by[(W, "stripe")]["bytes_per_rank"], by[(W, "balanced")]["bytes_per_rank"]
        stripe, balanced = by[(W, "stripe")]["imbalance"], by[(W, "balanced")]["imbalance"]
        print(
            f"W={W}: all-gather-everything / balanced exchange = {ag / ours:,.0f}x the bytes; "
            f"imbalance stripe {stripe:.4f} -> balanced {balanced:.4f}"
        )


def plot(records: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for label in dict.fromkeys(_label(r) for r in records):
        rs = [r for r in records if _label(r) == label]
        ax1.plot([r["world_size"] for r in rs], [100 * (r["imbalance"] - 1) for r in rs], "o-", label=label)
    ax1.axhline(1.0, color="gray", ls=":", label="goal (1.01)")
    ax1.set(
        xscale="log", yscale="log", xlabel="ranks W", ylabel="max / mean rank cost - 1  (%)", title="imbalance per step"
    )
    ax1.legend(loc="center right")
    for s, label in (("stripe", "all-gather everything (submissions)"), ("balanced", "lengths + moved samples (ours)")):
        rs = [r for r in records if _label(r) == s]
        ax2.plot([r["world_size"] for r in rs], [r["bytes_per_rank"] for r in rs], "o-", label=label)
    ax2.set(
        xscale="log", yscale="log", xlabel="ranks W", ylabel="bytes received per rank per step", title="exchange volume"
    )
    ax2.legend()
    fig.tight_layout()
    with publishing(path) as tmp:
        fig.savefig(tmp, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", help="prepared HDF5 directory (fixed or varlength layout); default: built-in")
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[8, 64, 512, 4096])
    ap.add_argument("--batch", type=int, default=56, help="sequences per rank per step")
    ap.add_argument("--steps", type=int, default=5, help="steps to take the median over")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--lengths",
        choices=("mlperf", "wikitext2"),
        default="mlperf",
        help="without --data-dir: the built-in MLPerf-like distribution, or WikiText-2's articles cut at --context",
    )
    ap.add_argument("--context", type=int, default=8192, help="--lengths wikitext2: the context length")
    ap.add_argument("--model", choices=tuple(MODEL_COSTS), default="bert-large", help="the FLOP-derived cost to use")
    ap.add_argument(
        "--cost",
        type=float,
        nargs="+",
        metavar="X",
        help="A B [B_LOCAL WINDOW]: c(L) = A*L + B*L^2 + B_LOCAL*L*min(L, WINDOW), instead of --model's",
    )
    ap.add_argument("--group-size", type=int, default=8, help="ranks per group for the hierarchical variant")
    ap.add_argument("--slow-fraction", type=float, help="heterogeneous ranks: this fraction runs at --slow-factor")
    ap.add_argument("--slow-factor", type=float, default=0.7, help="the slow ranks' speed (1: as fast as the others)")
    ap.add_argument("--throttle-period", type=int, default=0, help="P: as many more ranks slow for P steps of 2P")
    ap.add_argument("--noise", type=float, default=0.0, help="measured times: true times * (1 + NOISE * U(-1, 1))")
    ap.add_argument("--warmup", type=int, default=24, help="--slow-fraction: steps before the medians start")
    ap.add_argument(
        "--measured",
        type=float,
        nargs=4,
        default=(32, 4.0, 0.1, 2.0),
        metavar=("WINDOW", "BOUND", "RATE", "MAX_SHARE"),
        help="data.rebalance_measured",
    )
    ap.add_argument("--json", help="write one record per (world size, strategy, group size)")
    ap.add_argument("--png", help="write the imbalance and bytes plots")
    args = ap.parse_args(argv)
    for name, v in (
        ("--batch", args.batch),
        ("--steps", args.steps),
        ("--world-sizes", min(args.world_sizes)),
        ("--group-size", args.group_size),
    ):
        if v < 1:
            ap.error(f"{name} must be >= 1")
    try:
        cost = MODEL_COSTS[args.model] if args.cost is None else check_cost(args.cost)
    except ValueError as e:
        ap.error(f"--cost: {e}")

    if args.data_dir:
        pool_L, pool_m = lengths_from_dir(args.data_dir)
        source = f"{args.data_dir} ({len(pool_L):,} samples, mean length {pool_L.mean():.1f})"

        def draw(rng, n):
            i = rng.integers(0, len(pool_L), n)
            return pool_L[i], pool_m[i]
    elif args.lengths == "wikitext2":
        if args.context < 3:
            ap.error("--context must be >= 3")
        pool_L = sequence_lengths(load_article_lengths(), args.context)
        pool_m = np.maximum(1, np.rint(pool_L * LONG_MASKED_LM_PROB)).astype(np.int64)
        source = (
            f"WikiText-2 articles cut at {args.context} ({len(pool_L)} sequences, mean length {pool_L.mean():.0f}, "
            f"{(pool_L == args.context).mean():.0%} full)"
        )

        def draw(rng, n):
            i = rng.integers(0, len(pool_L), n)
            return pool_L[i], pool_m[i]
    else:
        source = "built-in MLPerf-like distribution"

        def draw(rng, n):
            L = mlperf_like_lengths(rng, n)
            return L, masked_counts(L)

    terms = f"a={cost.a:g} b={cost.b:.4g}"
    if cost.b_local:
        terms += f" b_local={cost.b_local:.4g} window={cost.window}"
    print(f"lengths: {source}; B = {args.batch} per rank; cost {terms}; median over {args.steps} steps")
    if args.slow_fraction is not None:
        if not (0 <= args.slow_fraction <= 0.5 and 0 < args.slow_factor <= 1 and args.noise >= 0):
            ap.error("--slow-fraction must be in [0, 0.5], --slow-factor in (0, 1], --noise >= 0")
        slow = (args.slow_fraction, args.slow_factor, args.throttle_period)
        window, bound, rate, max_share = args.measured
        measured = (int(window), bound, rate, max_share)
        print(f"{'W':>5} {'stripe':>8} {'balanced':>9} {'measured':>9} {'(p90)':>7}   predicted step time / ideal")
        records = []
        for W in args.world_sizes:
            r = simulate_speeds(
                W, args.batch, args.steps, args.warmup, args.seed, cost, draw, slow, args.noise, measured
            )
            records.append(r)
            lag = "" if r["onset_lag"] is None else f"   onset lag {r['onset_lag']:g} steps"
            row = f"{r['stripe']:>8.4f} {r['balanced']:>9.4f} {r['measured']:>9.4f} {r['measured_p90']:>7.4f}"
            print(f"{W:>5} {row}{lag}")
        if args.json:
            write_text(args.json, json.dumps(records, indent=1) + "\n")
        return 0
    records = simulate(args.world_sizes, args.batch, args.steps, args.seed, cost, draw, args.group_size)
    print_table(records)
    if args.json:
        write_text(args.json, json.dumps(records, indent=1) + "\n")
    if args.png:
        plot(records, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
