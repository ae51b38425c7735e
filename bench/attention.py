"""Attention forward+backward per backend on BERT batches, side by side.

    python bench/attention.py [--data-dir DIR] [--batches 4] [--iters 20] [--window W] [--json PATH]

Each batch is 56 sequences (MLPerf's per-GPU batch) x 16 heads x 64 dims with lengths from
a prepared data directory or the built-in MLPerf-like distribution (``bench/lengths.py``).
For every batch all backends run in turn on the same q, k, v (``reference``, ``padded``,
``torch_varlen``, ``flash_attn``, ``triton``, ``triton_grouped``; the unavailable ones are
listed with the reason), each timed over ``--iters`` forward+backward passes with CUDA
events after warm-up. Reported per backend: median milliseconds, TFLOP/s and the ratio of
``padded``'s time to its own (above 1 = faster than the padded baseline), plus the largest
difference from ``reference``'s output and gradients on the first batch.

FLOPs are the useful ones of the real lengths, as flash-attention counts them: forward
4 * sum(L^2) * H * D, backward 2.5 times that; padding work is not counted, so ``padded``'s
TFLOP/s is an effective rate.

Without a GPU it says so and checks correctness only: small shapes through Triton's
interpreter, each backend against ``reference``; exit status 1 if one disagrees.

``--backends`` names the backends to run, and each must run: one that is unavailable here
fails the benchmark (exit status 1), as does one that errs or disagrees. Without it, every
backend is tried and the unavailable ones are only listed; ``--optional`` names backends that
may be unavailable without failing it (the library backends in ``bench/gpu_check.sh``).

``--window W`` (a sliding window, |i - j| <= W // 2, on every backend that implements one)
adds the tile work of the Triton kernels at lengths 512 and 8,192 (``--window-lengths``):
the fraction of (query block, key block) tiles each pass computes, counted by the kernels
themselves (in Triton's interpreter without a GPU), beside the band's ideal for the tile
shape (the tiles that hold any pair |i - j| <= W // 2) and the band's share of all (i, j).
On a GPU it also times, at each of those lengths (as many sequences as fill
``--window-tokens``), the ``triton`` kernels' forward+backward windowed and full (the ratio
windowed / full; ``--max-window-ratio`` fails the run above it), and with
``--baseline-kernels FILE`` (an earlier ``kernels/jit_kernels.py``, e.g. from ``git show``)
the full ones against that file's kernels on the same inputs (``--max-baseline-ratio``):
"no slower than before", side by side in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.lengths import LengthSampler, LengthsError

BACKENDS = ("reference", "padded", "torch_varlen", "flash_attn", "triton", "triton_grouped")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def attention_flops(lengths, heads: int, dim: int) -> float:
    fwd = 4.0 * sum(n * n for n in lengths) * heads * dim
    return fwd * 3.5  # forward + backward (2.5 x forward)


def make_batch(lengths, heads, dim, dtype, device, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    t = sum(lengths)
    q, k, v, dout = (torch.randn(t, heads, dim, generator=g).to(device=device, dtype=dtype) for _ in range(4))
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32, device=device)
    return (q, k, v), dout, cu


def fwd_bwd(fn, qkv, dout, layout, dropout):
    q, k, v = (x.detach().requires_grad_() for x in qkv)
    out = fn(q, k, v, layout, dropout, True)
    out.backward(dout)
    return out, (q.grad, k.grad, v.grad)


def load_backends(names):
    from kernels.interface import BackendUnavailable
    from kernels.registry import get_backend

    loaded, unavailable = {}, {}
    for name in names:
        try:
            loaded[name] = get_backend(name)
        except BackendUnavailable as e:
            unavailable[name] = str(e)
    return loaded, unavailable


def failures(results: dict, required) -> list[str]:
    """The backends that fail a benchmark: every one that is not ok, except an unavailable one
    that was not required (named on the command line)."""
    return [
        name
        for name, r in results.items()
        if r["status"] != "ok" and not (r["status"] == "unavailable" and name not in required)
    ]


# ------------------------------------------------------------------------ sliding-window tiles


def band_ideal(length: int, window: int, block_m: int, block_n: int) -> float:
    """The fraction of one sequence's (query block, key block) tiles that hold any pair
    |i - j| <= window // 2: what a kernel with these tiles cannot avoid computing."""
    r0 = torch.arange(0, length, block_m)
    c0 = torch.arange(0, length, block_n)
    r1, c1 = (r0 + block_m).clamp(max=length) - 1, (c0 + block_n).clamp(max=length) - 1
    gap = torch.maximum(c0[None, :] - r1[:, None], r0[:, None] - c1[None, :]).clamp(min=0)  # [NM, NN]
    return float((gap <= window // 2).double().mean())


def band_density(length: int, window: int) -> float:
    """The band's share of all (i, j) of a sequence."""
    i = torch.arange(length)
    seen = (i + window // 2).clamp(max=length - 1) - (i - window // 2).clamp(min=0) + 1
    return float(seen.sum()) / length**2


def window_tiles(window: int, lengths, dtype, dim: int, device) -> dict:
    """Per length and pass: the tiles the kernels compute with the window (their own counts,
    at the GPU's tiles for dtype x dim), the ideal for the tile shape, the band's density."""
    from kernels import tiles
    from kernels.varlen_attention import Call, tile_counts

    block_d = max(16, 1 << (dim - 1).bit_length())
    preset = tiles.preset_from_env()
    blocks = {n: tiles.attention_tiles(n, block_d, dtype.itemsize, False, preset) for n in ("fwd", "dkdv", "dq")}
    out = {}
    for length in lengths:
        q = torch.zeros(length, 1, 16, device=device)  # one head: the work is per (sequence, head)
        cu = torch.tensor([0, length], dtype=torch.int32, device=device)
        counts = tile_counts(q, q, q, Call(cu, length, window=window, softmax_scale=0.25), blocks)
        out[str(length)] = {
            "band_density": band_density(length, window),
            **{
                name: {
                    "tiles": [bm, bn],
                    "computed": (c.partial + c.unmasked) / c.total,
                    "ideal": band_ideal(length, window, bm, bn),
                }
                for name, (c, (bm, bn)) in counts.items()
            },
        }
    return out


def cuda_ms(fn, warmup: int, iters: int) -> float:
    """Median CUDA-event time of ``fn`` in ms over ``iters`` calls after ``warmup`` (also bench/fp8.py's)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def window_timing(args, lengths) -> dict:
    """GPU: the triton kernels' forward+backward per length, windowed and full (and the full
    one with ``--baseline-kernels``' kernels), median milliseconds and ratios."""
    from kernels.runtime import jit_kernels, load
    from kernels.varlen_attention import varlen_attention

    dtype, device = DTYPES[args.dtype], torch.device("cuda")
    baseline = load(interpret=False, source=Path(args.baseline_kernels)) if args.baseline_kernels else None
    out = {}
    for length in lengths:
        n = max(1, args.window_tokens // length)
        qkv, dout, cu = make_batch([length] * n, args.heads, args.dim, dtype, device, seed=args.seed)
        q, k, v = (x.detach().requires_grad_() for x in qkv)

        def run(window=None):
            q.grad = k.grad = v.grad = None
            varlen_attention(q, k, v, cu, length, window=window).backward(dout)

        full = cuda_ms(run, args.warmup, args.iters)
        windowed = cuda_ms(lambda: run(args.window), args.warmup, args.iters)
        row = {"sequences": n, "full_ms": full, "window_ms": windowed, "window_ratio": windowed / full}
        if baseline is not None:
            row.update(_kernel_ms(jit_kernels(device), baseline, qkv, dout, cu, n, length, args))
        out[str(length)] = row
    return out


def _kernel_ms(new, old, qkv, dout, cu, n, length, args) -> dict:
    """The plain varlen kernels' launches (forward, dK/dV, dQ), this tree's against ``old``'s
    (whose launchers take the sequences unpacked), on the same inputs."""
    q, k, v = (x.detach() for x in qkv)
    out, lse = torch.empty_like(q), torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    grads = [torch.empty_like(q) for _ in range(3)]
    scale = q.shape[-1] ** -0.5
    seqs = new.Sequences(cu, None, 0, n, length)
    rng = torch.zeros(2, dtype=torch.int64, device=q.device)  # the device (seed, offset) pair; no dropout

    def run_new():
        new.attn_fwd(q, k, v, out, lse, seqs, scale, 0.0, rng)
        new.attn_bwd(dout, q, k, v, lse, lse, *grads, seqs, scale, 0.0, rng)

    def run_old():
        old.attn_fwd(q, k, v, out, lse, cu, None, 0, n, length, scale, 0.0, 0, 0)
        old.attn_bwd(dout, q, k, v, lse, lse, *grads, cu, None, 0, n, length, scale, 0.0, 0, 0)

    new_ms, old_ms = cuda_ms(run_new, args.warmup, args.iters), cuda_ms(run_old, args.warmup, args.iters)
    return {"kernels_ms": new_ms, "baseline_kernels_ms": old_ms, "baseline_ratio": new_ms / old_ms}


def print_window(report: dict) -> None:
    w = report["window"]
    print(f"window {w['window']} (|i - j| <= {w['window'] // 2}): tiles computed / all, beside the band's ideal")
    for length, row in w["tiles"].items():
        passes = "  ".join(
            f"{name} {c['tiles'][0]}x{c['tiles'][1]} {c['computed']:.1%} (ideal {c['ideal']:.1%})"
            for name, c in row.items()
            if name != "band_density"
        )
        print(f"  length {length:>5s}: {passes}; the band is {row['band_density']:.1%} of (i, j)")
    for length, row in w.get("timing", {}).items():
        line = (
            f"  length {length:>5s} x {row['sequences']}: fwd+bwd full {row['full_ms']:.3f} ms, windowed "
            f"{row['window_ms']:.3f} ms, ratio {row['window_ratio']:.3f}"
        )
        if "baseline_ratio" in row:
            line += (
                f"; plain kernels {row['kernels_ms']:.3f} ms vs baseline {row['baseline_kernels_ms']:.3f} ms, "
                f"ratio {row['baseline_ratio']:.3f}"
            )
        print(line)


def max_diff(a, b) -> float:
    out, grads = a
    out_r, grads_r = b
    return max(
        float((x.detach().float() - y.detach().float()).abs().max()) for x, y in zip((out, *grads), (out_r, *grads_r))
    )


def gpu_benchmark(args, sampler) -> dict:
    from kernels.interface import VarlenLayout

    device = torch.device("cuda")
    dtype = DTYPES[args.dtype]
    backends, unavailable = load_backends(args.backends)
    times: dict[str, list[float]] = {n: [] for n in backends}
    flops: dict[str, list[float]] = {n: [] for n in backends}
    errors: dict[str, str] = {}
    diffs: dict[str, float] = {}
    batches = []
    for b in range(args.batches):
        lengths = sampler.batch(args.seqs)
        batches.append({"mean_len": sum(lengths) / len(lengths), "max_len": max(lengths), "tokens": sum(lengths)})
        qkv, dout, cu = make_batch(lengths, args.heads, args.dim, dtype, device, seed=args.seed + b)
        layout = VarlenLayout(cu, max(lengths))
        work = attention_flops(lengths, args.heads, args.dim)
        ref = None
        for name, fn in backends.items():
            if name in errors:
                continue
            try:
                result = fwd_bwd(fn, qkv, dout, layout, args.dropout)
                if b == 0 and args.dropout == 0.0:
                    if name == "reference":
                        ref = result
                    elif ref is not None:
                        diffs[name] = max_diff(result, ref)
                del result
                for _ in range(args.warmup):
                    fwd_bwd(fn, qkv, dout, layout, args.dropout)
                torch.cuda.synchronize()
                for _ in range(args.iters):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    fwd_bwd(fn, qkv, dout, layout, args.dropout)
                    end.record()
                    end.synchronize()
                    ms = start.elapsed_time(end)
                    times[name].append(ms)
                    flops[name].append(work / (ms * 1e-3) / 1e12)
            except Exception as e:  # one backend failing must not stop the others
                errors[name] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    results = {}
    base = statistics.median(times["padded"]) if times.get("padded") else None
    for name in args.backends:
        if name in unavailable:
            results[name] = {"status": "unavailable", "reason": unavailable[name]}
        elif name in errors:
            results[name] = {"status": "error", "reason": errors[name]}
        else:
            ms = statistics.median(times[name])
            results[name] = {
                "status": "ok",
                "median_ms": ms,
                "tflops": statistics.median(flops[name]),
                "speedup_vs_padded": (base / ms) if base else None,
                "max_diff_vs_reference": diffs.get(name),
            }
    return {"batches": batches, "results": results}


def cpu_correctness(args, sampler) -> dict:
    """No GPU: compare backends on small shapes in Triton's interpreter."""
    from kernels.interface import VarlenLayout

    lengths = [max(1, n // 8) for n in sampler.batch(6)]  # the distribution, scaled down
    qkv, dout, cu = make_batch(lengths, 2, 64, torch.float32, torch.device("cpu"), seed=args.seed)
    layout = VarlenLayout(cu, max(lengths))
    backends, unavailable = load_backends(args.backends)
    ref = fwd_bwd(backends.pop("reference"), qkv, dout, layout, 0.0)
    results = {"reference": {"status": "ok"}}
    for name in args.backends:
        if name in unavailable:
            results[name] = {"status": "unavailable", "reason": unavailable[name]}
        elif name in backends:
            t0 = time.perf_counter()
            diff = max_diff(fwd_bwd(backends[name], qkv, dout, layout, 0.0), ref)
            results[name] = {
                "status": "ok" if diff <= 1e-4 else "mismatch",
                "max_diff_vs_reference": diff,
                "seconds": time.perf_counter() - t0,
            }
    return {"lengths": lengths, "results": results}


def print_table(report: dict) -> None:
    for name, r in report["results"].items():
        if r["status"] != "ok":
            print(f"  {name:15s} {r['status']}: {r.get('reason', '')}")
        elif "median_ms" in r:
            ratio = f"{r['speedup_vs_padded']:.2f}x" if r["speedup_vs_padded"] else "-"
            diff = "-" if r["max_diff_vs_reference"] is None else f"{r['max_diff_vs_reference']:.2e}"
            print(
                f"  {name:15s} {r['median_ms']:9.3f} ms  {r['tflops']:7.1f} TFLOP/s  {ratio:>7s} vs padded  "
                f"max diff vs reference {diff}"
            )
        else:
            diff = r.get("max_diff_vs_reference")
            print(f"  {name:15s} ok" + ("" if diff is None else f"  max diff vs reference {diff:.2e}"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Attention forward+backward per backend, side by side.")
    parser.add_argument("--data-dir", help="read sequence lengths from the HDF5 shards here")
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seqs", type=int, default=56)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument(
        "--dropout",
        type=float,
        default=0.0,
        help="attention dropout while timing (torch_varlen has none: it refuses p > 0)",
    )
    parser.add_argument(
        "--backends", help="comma-separated; each named one must run here (default: all, unavailable ones listed)"
    )
    parser.add_argument("--optional", default="", help="comma-separated backends that may be unavailable")
    parser.add_argument("--window", type=int, help="also count (and on a GPU time) the Triton kernels' window work")
    parser.add_argument("--window-lengths", type=int, nargs="+", default=[512, 8192])
    parser.add_argument("--window-tokens", type=int, default=32768, help="tokens per timed windowed batch")
    parser.add_argument("--window-only", action="store_true", help="with --window: skip the per-backend table")
    parser.add_argument("--max-window-ratio", type=float, nargs="+", help="fail above these, one per length")
    parser.add_argument(
        "--baseline-kernels", help="an earlier kernels/jit_kernels.py to time the plain kernels against"
    )
    parser.add_argument("--max-baseline-ratio", type=float, help="fail when this tree's plain kernels are slower")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    required = set() if args.backends is None else {b for b in args.backends.split(",") if b}
    required -= {b for b in args.optional.split(",") if b}
    args.backends = list(BACKENDS) if args.backends is None else [b for b in args.backends.split(",") if b]
    args.backends += [b for b in args.optional.split(",") if b and b not in args.backends]
    if "reference" not in args.backends:
        args.backends.insert(0, "reference")
    if args.window is not None and args.window < 1:
        print(f"bench/attention.py: --window must be >= 1, got {args.window}", file=sys.stderr)
        return 2
    try:
        sampler = LengthSampler(args.data_dir, args.seed)
    except LengthsError as e:
        print(f"bench/attention.py: {e}", file=sys.stderr)
        return 2
    gpu = torch.cuda.is_available()
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "host": platform.node(),
        "torch": torch.__version__,
        "lengths": sampler.source,
        "dtype": args.dtype,
        "dropout": args.dropout,
        "shape": {"seqs": args.seqs, "heads": args.heads, "dim": args.dim},
    }
    try:
        import triton

        report["triton"] = triton.__version__
    except ImportError:
        report["triton"] = None
    if gpu:
        report["device"] = torch.cuda.get_device_name()
        print(
            f"{report['device']}: {args.batches} batches x {args.seqs} sequences x {args.heads} heads x "
            f"{args.dim} dims, {args.dtype}, lengths from the {sampler.source}"
        )
        if not args.window_only:
            report.update(gpu_benchmark(args, sampler))
    else:
        report["device"] = "cpu"
        print("No CUDA GPU here: checking correctness only (small shapes in Triton's interpreter), no timings.")
        if not args.window_only:
            report.update(cpu_correctness(args, sampler))
    failed = failures(report.get("results", {}), required)
    if "results" in report:
        print_table(report)
    if failed:
        print(f"bench/attention.py: failed: {', '.join(failed)}", file=sys.stderr)
    if args.window is not None:
        failed += window_report(args, report, gpu)
    if args.json:
        from common.files import write_text

        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, json.dumps(report, indent=1))
    return 1 if failed else 0


def window_report(args, report: dict, gpu: bool) -> list[str]:
    """Adds the window's tile work (and GPU timings) to the report; returns what failed."""
    from kernels.interface import BackendUnavailable

    device = torch.device("cuda" if gpu else "cpu")
    report["window"] = {"window": args.window}
    try:
        report["window"]["tiles"] = window_tiles(args.window, args.window_lengths, DTYPES[args.dtype], args.dim, device)
        if gpu:
            report["window"]["timing"] = window_timing(args, args.window_lengths)
    except BackendUnavailable as e:
        print(f"bench/attention.py: window: {e}", file=sys.stderr)
        return ["window"]
    print_window(report)
    failed = []
    limits = args.max_window_ratio or []
    for i, length in enumerate(args.window_lengths):
        row = report["window"].get("timing", {}).get(str(length))
        if row is None:
            continue
        if i < len(limits) and row["window_ratio"] > limits[i]:
            failed.append(f"window ratio {row['window_ratio']:.3f} > {limits[i]} at length {length}")
        ratio = row.get("baseline_ratio")
        if args.max_baseline_ratio and ratio is not None and ratio > args.max_baseline_ratio:
            failed.append(f"plain kernels {ratio:.3f}x the baseline's time at length {length}")
    if limits and not gpu:
        print("bench/attention.py: no GPU: the window's time limits are not measured here")
    for line in failed:
        print(f"bench/attention.py: failed: {line}", file=sys.stderr)
    return failed


if __name__ == "__main__":
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is first imported
    sys.exit(main())
