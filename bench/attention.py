"""Attention forward+backward per backend on BERT batches, side by side.

    python bench/attention.py [--data-dir DIR] [--batches 4] [--iters 20] [--json PATH]

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
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    args.backends = [b for b in args.backends.split(",") if b]
    if "reference" not in args.backends:
        args.backends.insert(0, "reference")
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
        report.update(gpu_benchmark(args, sampler))
        ok = all(r["status"] in ("ok", "unavailable") for r in report["results"].values())
    else:
        report["device"] = "cpu"
        print("No CUDA GPU here: checking correctness only (small shapes in Triton's interpreter), no timings.")
        report.update(cpu_correctness(args, sampler))
        ok = all(r["status"] in ("ok", "unavailable") for r in report["results"].values())
    print_table(report)
    if args.json:
        from fileio import write_text

        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, json.dumps(report, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is first imported
    sys.exit(main())
