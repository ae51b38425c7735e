"""Fit the rebalancing cost model to layer times measured on this machine.

``data.rebalance.plan.Cost`` prices a sequence of L tokens at
c(L) = a*L + b*L^2 + b_local*L*min(L, window): the per-token work of every layer, the global
attention layers and the sliding-window ones. This script measures those coefficients
instead of deriving them from FLOPs (kernels do not reach the same FLOP/s on matmuls and on
attention, and a windowed kernel skips most of the score blocks):

1. it builds one encoder layer of the model's shape -- the QKV and output projections, the
   attention backend (``--attention``) and the MLP (gated or not) -- and times its forward
   and backward on batches of sequences of each length in ``--lengths`` (about ``--tokens``
   tokens per batch, so every length keeps the device equally busy), once with global
   attention and once with ``--window``; the median of ``--repeats`` runs, per sequence;
2. it fits the per-sequence times by least squares, relative to each time (so the short
   lengths count as much as the long ones): global t(L) = a1*L + b1*L^2, local
   t(L) = a1*L + l1*L*min(L, w), with a1 shared (the projections and MLP do not depend on
   the attention); negative coefficients are clipped to 0 and refitted;
3. it scales to the model -- a = layers * a1, b = global layers * b1, b_local = local
   layers * l1 -- divides by a, and prints the two config values to use, the fit's largest
   relative error, and the measured times.

Norms, dropout, embeddings and the MLM head are left out: they are linear in L, so they
only shift a relative to b, a few percent. Run it on the machine (and with the attention
backend) that trains, e.g. on one GPU::

    python -m bench.fit_cost --device cuda --attention flash_attn --hidden 768 --heads 12 \\
        --intermediate 1152 --gated --layers 22 --global-every 3 --window 128

and put the printed ``data.rebalance_cost=...`` in the run's config. On a CPU with the
``reference`` backend (dense scores with a band mask) local layers cost as much as global
ones, and the fit says so.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

from data.rebalance.plan import Cost, check_cost, sample_costs
from kernels.interface import BackendUnavailable, VarlenLayout
from kernels.registry import get_backend


class _Layer(torch.nn.Module):
    """The parts of an encoder layer whose cost depends on L: projections, attention, MLP."""

    def __init__(self, hidden: int, heads: int, intermediate: int, gated: bool, attention_fn):
        super().__init__()
        self.heads, self.gated = heads, gated
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = torch.nn.Linear(hidden, hidden, bias=False)
        self.mlp_in = torch.nn.Linear(hidden, intermediate * (2 if gated else 1), bias=False)
        self.mlp_out = torch.nn.Linear(intermediate, hidden, bias=False)
        self.attention_fn = attention_fn

    def forward(self, x_NC: torch.Tensor, layout: VarlenLayout) -> torch.Tensor:
        n, c = x_NC.shape
        q_NHD, k_NHD, v_NHD = self.qkv(x_NC).view(n, 3, self.heads, c // self.heads).unbind(1)
        x_NC = x_NC + self.out(self.attention_fn(q_NHD, k_NHD, v_NHD, layout, 0.0, True).reshape(n, c))
        h_NI = self.mlp_in(x_NC)
        if self.gated:
            h_NI, gate_NI = h_NI.chunk(2, dim=-1)
            h_NI = F.gelu(h_NI) * gate_NI
        else:
            h_NI = F.gelu(h_NI)
        return x_NC + self.mlp_out(h_NI)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_layer(layer, length: int, count: int, window: int | None, repeats: int, dtype, device) -> float:
    """Median seconds of one forward + backward over ``count`` sequences of ``length``, per sequence."""
    hidden = layer.qkv.in_features
    cu = torch.arange(0, (count + 1) * length, length, dtype=torch.int32, device=device)
    layout = VarlenLayout(cu_seqlens=cu, max_seqlen=length, window=window)
    x = torch.randn(count * length, hidden, device=device, dtype=dtype, requires_grad=True)
    times = []
    for i in range(repeats + 1):  # the first run compiles / warms the caches and is dropped
        _sync(device)
        t = time.perf_counter()
        layer(x, layout).sum().backward()
        _sync(device)
        if i:
            times.append(time.perf_counter() - t)
    return statistics.median(times) / count


def fit(lengths, t_global, t_local, window: int) -> tuple[float, float, float]:
    """(a1, b1, l1) minimising the relative squared error of both models (see the module
    docstring), all >= 0: a coefficient the unconstrained fit makes negative is fixed at 0."""
    L = np.asarray(lengths, dtype=np.float64)
    zero = np.zeros_like(L)
    X = np.concatenate([np.stack([L, L * L, zero], 1), np.stack([L, zero, L * np.minimum(L, window)], 1)])
    y = np.concatenate([np.asarray(t_global, np.float64), np.asarray(t_local, np.float64)])
    X, y = X / y[:, None], np.ones_like(y)  # relative errors
    free = [0, 1, 2]
    while True:
        coef = np.zeros(3)
        coef[free] = np.linalg.lstsq(X[:, free], y, rcond=None)[0]
        if (coef >= 0).all():
            return tuple(float(c) for c in coef)
        free = [j for j in free if coef[j] > 0]


def model_cost(a1: float, b1: float, l1: float, layers: int, global_layers: int, window: int) -> Cost:
    """The whole model's Cost, divided by a (only ratios matter to the rebalancer)."""
    a, b, bl = layers * a1, global_layers * b1, (layers - global_layers) * l1
    scale = a if a > 0 else max(b, bl)
    return check_cost((a / scale, b / scale, bl / scale, window if bl > 0 else 0))


def config_line(cost: Cost) -> str:
    """The command-line override that puts ``cost`` into a run's config."""
    return f"data.rebalance_cost=[{cost.a:.6g},{cost.b:.6g},{cost.b_local:.6g},{cost.window}]"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fit_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--attention", default="reference", help="attention backend (kernels.registry)")
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--intermediate", type=int, default=1152)
    ap.add_argument("--gated", action="store_true", help="GeGLU MLP (ModernBERT)")
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--global-every", type=int, default=3, help="layer i is global when i %% N == 0 (ModernBERT: 3)")
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024, 2048, 4096, 8192])
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per timed batch (at least one sequence)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="also write the measurements and the fit here")
    args = ap.parse_args(argv)
    if args.hidden % args.heads or min(args.lengths) < 1 or args.window < 1 or args.global_every < 1:
        ap.error("--hidden must be a multiple of --heads; lengths, --window, --global-every >= 1")
    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    torch.manual_seed(0)
    try:
        attention_fn = get_backend(args.attention)
    except (BackendUnavailable, ValueError, KeyError) as e:
        raise SystemExit(f"fit_cost: --attention {args.attention}: {e}") from None
    layer = _Layer(args.hidden, args.heads, args.intermediate, args.gated, attention_fn)
    layer = layer.to(device=device, dtype=dtype)
    rows = []
    try:
        for length in args.lengths:
            count = max(1, args.tokens // length)
            tg = time_layer(layer, length, count, None, args.repeats, dtype, device)
            tl = time_layer(layer, length, count, args.window, args.repeats, dtype, device)
            rows.append({"length": length, "sequences": count, "global_s": tg, "local_s": tl})
    except BackendUnavailable as e:  # e.g. a backend that does not take the window
        raise SystemExit(f"fit_cost: {e}") from None
    lengths = [r["length"] for r in rows]
    a1, b1, l1 = fit(lengths, [r["global_s"] for r in rows], [r["local_s"] for r in rows], args.window)
    global_layers = len(range(0, args.layers, args.global_every))
    cost = model_cost(a1, b1, l1, args.layers, global_layers, args.window)
    print(
        f"one layer ({args.attention}, {args.dtype}, {args.device}): hidden {args.hidden}, {args.heads} heads, "
        f"MLP {args.intermediate}{' gated' if args.gated else ''}; window {args.window}"
    )
    print(f"{'L':>6} {'seqs':>5} {'global ms/seq':>14} {'fit':>7} {'local ms/seq':>13} {'fit':>7}")
    worst = 0.0
    for r in rows:
        L = r["length"]
        fg, fl = a1 * L + b1 * L * L, a1 * L + l1 * L * min(L, args.window)
        worst = max(worst, abs(fg / r["global_s"] - 1), abs(fl / r["local_s"] - 1))
        print(
            f"{L:>6} {r['sequences']:>5} {r['global_s'] * 1e3:>14.4f} {fg / r['global_s'] - 1:>+7.1%} "
            f"{r['local_s'] * 1e3:>13.4f} {fl / r['local_s'] - 1:>+7.1%}"
        )
    print(f"per layer: a1 = {a1:.4g} s/token, b1 = {b1:.4g} s/token^2 (global), l1 = {l1:.4g} s/token^2 (local)")
    print(f"largest relative error of the fit: {worst:.1%}")
    costs = sample_costs(np.array(lengths), cost)
    print(f"model: {args.layers} layers, {global_layers} global; cost relative to L = {lengths[0]}: ", end="")
    print(", ".join(f"{L}: {c / costs[0]:.3g}" for L, c in zip(lengths, costs)))
    print(config_line(cost))
    if args.json:
        from common.files import write_text

        record = {"args": vars(args), "rows": rows, "per_layer": {"a1": a1, "b1": b1, "l1": l1}, "cost": cost._asdict()}
        write_text(args.json, json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
