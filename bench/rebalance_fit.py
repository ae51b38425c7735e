"""The online cost fit against ``bench.fit_cost``'s offline fit, on the same layer and machine.

Offline: ``bench.fit_cost.time_layer`` times the layer's forward + backward at each length
of ``--lengths`` (batches of about ``--tokens`` tokens of one length) and fits
t(L) = a1*L + b1*L^2 by least squares on relative errors, as ``bench.fit_cost`` does.
Online: ``--steps`` training-like steps, each a varlen batch of about ``--tokens`` tokens,
lengths drawn uniformly from half the shortest length to a top length drawn log-uniformly
from the lengths' range (so that the steps differ in their mix of lengths), timed by ``bert.train.step_timer.StepTimer``
(the trainer's hooks) and fed to ``data.rebalance.fit.OnlineModel`` as one rank's window,
starting from the FLOP-derived cost of the layer. Printed: both fits as b/a (a = 1) and
c(L) / c(L_min) at each length, and their largest relative difference (goal: <= 10%).

    python -m bench.rebalance_fit [--steps 50] [--hidden 128] [--lengths 128 256 512 1024]
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch

from bench.fit_cost import _Layer, time_layer
from bert.train.step_timer import StepTimer
from common.files import write_text
from data.rebalance.fit import OnlineModel, length_features
from data.rebalance.plan import Cost, sample_costs
from kernels.interface import VarlenLayout
from kernels.registry import get_backend


def offline(layer, lengths, tokens: int, repeats: int) -> Cost:
    """bench.fit_cost's timing and relative least squares, global attention: (1, b1 / a1)."""
    L = np.asarray(lengths, np.float64)
    cpu = torch.device("cpu")
    t = np.array([time_layer(layer, n, max(1, tokens // n), None, repeats, torch.float32, cpu) for n in lengths])
    X = np.stack([L, L * L], 1) / t[:, None]
    a1, b1 = np.linalg.lstsq(X, np.ones_like(t), rcond=None)[0]
    return Cost(1.0, float(b1 / a1))


def online(layer, lengths, steps: int, tokens: int, configured: Cost, measured: tuple, seed: int) -> Cost:
    """One rank's window of measured steps, fitted as the trainer's rebalancer fits it."""
    rng = np.random.default_rng(seed)
    timer = StepTimer(layer, torch.device("cpu"))
    model = OnlineModel(configured, 1, *measured)
    hidden = layer.qkv.in_features
    lo, hi = min(lengths), max(lengths)
    drawn = {}
    for step in range(steps + 1):
        timer.mark(step)  # what ran since the last mark is the previous step's
        for k, seconds in timer.ready():
            model.add(0, length_features(drawn.pop(k)), seconds)
            model.refit()
        if step == steps:
            break
        # a step's lengths up to a random top length (log-uniform), about --tokens tokens
        top = int(np.exp(rng.uniform(np.log(lo), np.log(hi))))
        L = rng.integers(lo // 2, top + 1, max(1, 2 * tokens // (lo // 2 + top)))
        drawn[step] = L
        cu = torch.tensor(np.concatenate([[0], np.cumsum(L)]), dtype=torch.int32)
        x = torch.randn(int(L.sum()), hidden, requires_grad=True)
        layer(x, VarlenLayout(cu_seqlens=cu, max_seqlen=int(L.max()))).sum().backward()
    last = model.refit()
    residual = last.get("fit_residual", 0.0)
    print(f"online: {last['window_steps']} steps in the window, relative RMS residual {residual:.3f}")
    return Cost(1.0, model.cost.b / model.cost.a)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--attention", default="reference")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024])
    ap.add_argument("--tokens", type=int, default=4096, help="offline: tokens per timed batch")
    ap.add_argument("--repeats", type=int, default=5, help="offline: timed runs per length (median)")
    ap.add_argument("--steps", type=int, default=50, help="online: measured steps")
    ap.add_argument("--measured", type=float, nargs=3, default=(64, 16.0, 0.25), metavar=("WINDOW", "BOUND", "RATE"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write both fits here")
    args = ap.parse_args(argv)
    if args.hidden % args.heads or min(args.lengths) < 1 or args.steps < 8:
        ap.error("--hidden must be a multiple of --heads, lengths >= 1, --steps >= 8")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    layer = _Layer(args.hidden, args.heads, args.intermediate, False, get_backend(args.attention))
    # FLOPs per token: projections 2 * 4h^2, MLP 2 * 2hI; attention 4h per key seen.
    flops = Cost(1.0, 4 * args.hidden / (8 * args.hidden**2 + 4 * args.hidden * args.intermediate))
    window, bound, rate = args.measured
    off = offline(layer, args.lengths, args.tokens, args.repeats)
    on = online(layer, args.lengths, args.steps, args.tokens, flops, (int(window), bound, rate), args.seed)
    L = np.array(args.lengths)
    fits = (("flops", flops), ("offline", off), ("online", on))
    shape = {name: sample_costs(L, c) / sample_costs(L[:1], c)[0] for name, c in fits}
    worst = float(np.max(np.abs(shape["online"] / shape["offline"] - 1)))
    print(f"one layer ({args.attention}, cpu, 1 thread): hidden {args.hidden}, {args.heads} heads, ", end="")
    print(f"MLP {args.intermediate}")
    print(f"b/a: FLOPs {flops.b:.4g}, offline (bench.fit_cost) {off.b:.4g}, online after {args.steps} steps {on.b:.4g}")
    print(f"{'L':>6} {'FLOPs':>8} {'offline':>8} {'online':>8}   c(L) / c({L[0]})")
    for i, n in enumerate(L):
        print(f"{n:>6} {shape['flops'][i]:>8.3f} {shape['offline'][i]:>8.3f} {shape['online'][i]:>8.3f}")
    print(f"b online / offline - 1 = {on.b / off.b - 1:+.1%}; ", end="")
    print(f"c(L) largest relative difference {worst:.1%} (goal <= 10%)")
    if args.json:
        record = dict(args=vars(args), flops=flops._asdict(), offline=off._asdict(), online=on._asdict(), worst=worst)
        write_text(args.json, json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
