"""FlashMask attention on packed BERT batches, side by side with the alternatives.

    python bench/flashmask.py [--data-dir DIR] [--batches 4] [--iters 20] [--json PATH]

Each batch is 56 sequences (MLPerf's per-GPU batch) with lengths from a prepared data
directory or the built-in MLPerf-like distribution (``bench/lengths.py``), packed first-fit
decreasing into rows of 512 (``data.packing``; ``--seq-len`` changes it, longer sequences are
cut to it), 16 heads x 64 dims, bf16. The mask is the
packed layout's bidirectional document mask (``kernels.masks.document_mask``).

On a GPU, forward+backward of, on the same q, k, v:
- ``flashmask``: this repository's kernel (bounds [R, 1, 512, 2]; per-block min/max inside);
- ``flex_attention``: torch's, compiled, with the equivalent block mask (``create_block_mask``
  of "same sequence, not padding", built once per batch and not timed, as a training step
  builds it once for all layers) -- the paper's comparison;
- ``sdpa_dense``: ``scaled_dot_product_attention`` with the dense [R, 1, 512, 512] mask;
- ``triton_varlen``: the varlen kernel on the same sequences unpadded (no packing), for
  reference.
Reported per backend: median milliseconds, TFLOP/s of useful work (flash-attention's count
over the real sequences: forward 4 * sum(L^2) * H * D, backward 2.5 times that), and the ratio
to flex_attention (goal: flashmask >= 1.1x), plus the largest difference from sdpa_dense on
the real rows of the first batch. Also the fraction of tiles the kernel skipped.

``--backends`` names the backends to run, and each must run: one that is unavailable here
(``flex_attention`` on a torch without it) fails the benchmark, exit status 1; without it every
backend is tried and the unavailable ones are only listed. ``--optional`` names backends that
may be unavailable without failing it.

Without a GPU: the skipped fraction of tiles, counted by the kernels themselves (debug mode,
in Triton's interpreter) at the GPU's tile sizes for bf16 x 64 dims, checked against the dense
mask's count, for forward, dK/dV and dQ; and the packing density. Exit status 1 when a count
disagrees with the dense mask or (GPU) a backend disagrees with sdpa_dense.
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

import numpy as np
import torch

from bench.attention import attention_flops, failures
from bench.lengths import LengthSampler, LengthsError
from data.packing import first_fit_decreasing

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BACKENDS = ("flashmask", "flex_attention", "sdpa_dense", "triton_varlen")


def draw(sampler, n: int, seq_len: int) -> list[int]:
    """n lengths, those longer than a row cut to it (the built-in distribution is for 512)."""
    return [min(x, seq_len) for x in sampler.batch(n)]


def pack(lengths: list[int], seq_len: int) -> tuple[list[list[int]], torch.Tensor]:
    """Rows of sequence lengths (placement order) and the [R, S] sequence index (-1: padding)."""
    row, offset, rows = first_fit_decreasing(lengths, seq_len)
    per_row: list[list[int]] = [[] for _ in range(rows)]
    for i in np.lexsort((offset, row)).tolist():
        per_row[int(row[i])].append(int(lengths[i]))
    doc = torch.full((rows, seq_len), -1, dtype=torch.int32)
    for r, lens in enumerate(per_row):
        at = 0
        for d, n in enumerate(lens):
            doc[r, at : at + n] = d
            at += n
    return per_row, doc


def tile_report(per_row, seq_len, tiles: dict, backward: bool, device) -> dict:
    """Tile counts of each kernel pass (debug mode) next to the dense mask's, at ``tiles``."""
    from kernels.flashmask import flashmask_tile_counts
    from kernels.masks import document_mask, reference_tile_counts

    spec = document_mask(per_row, seq_len)
    bounds = spec.startend_row_indices.to(device)
    q = torch.zeros(bounds.shape[0], seq_len, 1, 16, device=device)  # one head: the mask is shared by all
    counts = flashmask_tile_counts(
        q, q, q, bounds, False, tiles={n: t[:2] for n, t in tiles.items()}, backward=backward
    )
    out = {}
    for name, (got, (bm, bn)) in counts.items():
        want = reference_tile_counts(spec.startend_row_indices, False, seq_len, 1, bm, bn)
        out[name] = {
            "tiles": [bm, bn],
            "skipped": got.skipped,
            "partial": got.partial,
            "unmasked": got.unmasked,
            "checked": got.checked,
            "total": got.total,
            "skipped_fraction": got.skipped / got.total,
            "exact": tuple(got[:3]) == tuple(want[:3]),
        }
    return out


def cpu_report(args, sampler) -> dict:
    """No GPU: the kernels' own tile counts, in the interpreter, at the GPU's tile sizes."""
    from kernels.flashmask import tile_sizes

    tiles = tile_sizes(args.dim, DTYPES[args.dtype].itemsize, interpreted=False)
    batches = []
    totals: dict[str, list[int]] = {}
    for _ in range(args.batches):
        lengths = draw(sampler, args.seqs, args.seq_len)
        per_row, _ = pack(lengths, args.seq_len)
        t0 = time.perf_counter()
        counts = tile_report(per_row, args.seq_len, tiles, not args.forward_only, torch.device("cpu"))
        rows = len(per_row)
        batches.append(
            {
                "sequences": len(lengths),
                "rows": rows,
                "tokens": sum(lengths),
                "packing_density": sum(lengths) / (rows * args.seq_len),
                "mask_density": sum(n * n for n in lengths) / (rows * args.seq_len**2),
                "counts": counts,
                "seconds": time.perf_counter() - t0,
            }
        )
        for name, c in counts.items():
            t = totals.setdefault(name, [0, 0, 0, 0, 0])
            for i, key in enumerate(("skipped", "partial", "unmasked", "checked", "total")):
                t[i] += c[key]
    summary = {
        name: {
            "tiles": tiles[name][:2],
            "skipped_fraction": t[0] / t[4],
            "partial_fraction": t[1] / t[4],
            "unmasked_fraction": t[2] / t[4],
            "decided_by_min_max": 1 - (t[3] - t[1]) / t[4],
        }
        for name, t in totals.items()
    }
    exact = all(c["exact"] for b in batches for c in b["counts"].values())
    return {"batches": batches, "summary": summary, "exact": exact}


def gpu_report(args, sampler) -> dict:
    import torch.nn.functional as F

    from kernels.flashmask import flashmask_attention, tile_sizes
    from kernels.masks import document_mask
    from kernels.varlen_attention import varlen_attention

    device = torch.device("cuda")
    dtype = DTYPES[args.dtype]
    s, h, d = args.seq_len, args.heads, args.dim
    flex = None
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        flex = torch.compile(flex_attention, dynamic=False)
    except ImportError as e:
        flex_reason = f"torch {torch.__version__} has no flex_attention ({e})"
    times: dict[str, list[float]] = {n: [] for n in args.backends}
    flops: dict[str, list[float]] = {n: [] for n in args.backends}
    errors: dict[str, str] = {}
    diffs: dict[str, float] = {}
    batches = []
    mask_ms: list[float] = []

    def timed(fn, q, k, v, dout):
        for _ in range(args.warmup):
            q.grad = k.grad = v.grad = None
            fn(q, k, v).backward(dout)
        torch.cuda.synchronize()
        out = []
        for _ in range(args.iters):
            q.grad = k.grad = v.grad = None
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(q, k, v).backward(dout)
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end))
        return out

    for bi in range(args.batches):
        lengths = draw(sampler, args.seqs, args.seq_len)
        per_row, doc = pack(lengths, s)
        r = len(per_row)
        g = torch.Generator(device="cpu").manual_seed(args.seed + bi)
        q, k, v, dout = (torch.randn(r, s, h, d, generator=g).to(device=device, dtype=dtype) for _ in range(4))
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        bounds = document_mask(per_row, s).startend_row_indices.to(device)
        doc = doc.to(device)
        real = doc >= 0  # [R, S]
        same = (doc[:, :, None] == doc[:, None, :]) & real[:, None, :]  # [R, S, S] visible
        dense = (same | torch.eye(s, dtype=torch.bool, device=device))[:, None]  # padding rows see themselves
        work = attention_flops(lengths, h, d)
        batches.append(
            {"sequences": len(lengths), "rows": r, "tokens": sum(lengths), "packing_density": sum(lengths) / (r * s)}
        )
        fns = {}
        fns["flashmask"] = lambda q_, k_, v_: flashmask_attention(q_, k_, v_, bounds)
        if flex is not None:

            def mask_mod(b, hh, qi, ki):
                return (doc[b, qi] == doc[b, ki]) & (doc[b, ki] >= 0)

            torch.cuda.synchronize()
            t0 = time.perf_counter()
            block_mask = create_block_mask(mask_mod, r, None, s, s, device=device)
            torch.cuda.synchronize()
            mask_ms.append((time.perf_counter() - t0) * 1e3)
            fns["flex_attention"] = lambda q_, k_, v_: flex(
                q_.transpose(1, 2), k_.transpose(1, 2), v_.transpose(1, 2), block_mask=block_mask
            ).transpose(1, 2)
        fns["sdpa_dense"] = lambda q_, k_, v_: F.scaled_dot_product_attention(
            q_.transpose(1, 2), k_.transpose(1, 2), v_.transpose(1, 2), attn_mask=dense
        ).transpose(1, 2)
        flat_index = real.reshape(-1).nonzero().squeeze(1)
        cu = torch.tensor(
            [0] + np.cumsum([n for row in per_row for n in row]).tolist(), dtype=torch.int32, device=device
        )
        fns["triton_varlen"] = lambda q_, k_, v_: varlen_attention(
            *(x.reshape(r * s, h, d)[flat_index] for x in (q_, k_, v_)), cu, max(lengths)
        )
        ref = None
        for name in args.backends:
            if name in errors or name not in fns:
                continue
            try:
                out = fns[name](q, k, v).detach()
                if bi == 0:
                    if name == "sdpa_dense":
                        ref = out
                    elif ref is not None and name != "triton_varlen":
                        diffs[name] = float((out.float() - ref.float())[real].abs().max())
                grad = dout if name != "triton_varlen" else dout.reshape(r * s, h, d)[flat_index]
                ms = timed(fns[name], q, k, v, grad)
                times[name] += ms
                flops[name] += [work / (t * 1e-3) / 1e12 for t in ms]
            except Exception as e:  # one backend failing must not stop the others
                errors[name] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    results = {}
    flex_ms = statistics.median(times["flex_attention"]) if times.get("flex_attention") else None
    for name in args.backends:
        if name == "flex_attention" and flex is None:
            results[name] = {"status": "unavailable", "reason": flex_reason}
        elif name in errors:
            results[name] = {"status": "error", "reason": errors[name]}
        elif times.get(name):
            ms = statistics.median(times[name])
            results[name] = {
                "status": "ok",
                "median_ms": ms,
                "tflops": statistics.median(flops[name]),
                "ratio_vs_flex": (flex_ms / ms) if flex_ms else None,
                "max_diff_vs_sdpa_dense": diffs.get(name),
            }
    tiles = tile_sizes(d, dtype.itemsize, interpreted=False)
    per_row, _ = pack(draw(sampler, args.seqs, s), s)
    counts = tile_report(per_row, s, tiles, True, device)
    return {"batches": batches, "results": results, "flex_block_mask_ms": mask_ms, "tile_counts": counts}


def print_cpu(report: dict) -> None:
    dens = [b["packing_density"] for b in report["batches"]]
    print(
        f"  {len(report['batches'])} batches, packing density (real tokens / R*S) {statistics.mean(dens):.3f}, "
        f"dense-mask density {statistics.mean(b['mask_density'] for b in report['batches']):.3f}"
    )
    for name, s in report["summary"].items():
        print(
            f"  {name:5s} tiles {s['tiles'][0]}x{s['tiles'][1]}: skipped {s['skipped_fraction']:.1%}  "
            f"partial {s['partial_fraction']:.1%}  unmasked {s['unmasked_fraction']:.1%}  "
            f"classified by the bounds' min/max alone {s['decided_by_min_max']:.1%}"
        )
    print(f"  counts equal the dense mask's: {'yes' if report['exact'] else 'NO'}")


def print_gpu(report: dict) -> None:
    for name, r in report["results"].items():
        if r["status"] != "ok":
            print(f"  {name:15s} {r['status']}: {r.get('reason', '')}")
            continue
        ratio = "-" if r["ratio_vs_flex"] is None else f"{r['ratio_vs_flex']:.2f}x"
        diff = "-" if r["max_diff_vs_sdpa_dense"] is None else f"{r['max_diff_vs_sdpa_dense']:.2e}"
        print(
            f"  {name:15s} {r['median_ms']:9.3f} ms  {r['tflops']:7.1f} TFLOP/s  {ratio:>7s} vs flex_attention  "
            f"max diff vs sdpa_dense {diff}"
        )
    if report["flex_block_mask_ms"]:
        print(
            f"  flex_attention's create_block_mask: {statistics.median(report['flex_block_mask_ms']):.2f} ms "
            f"per batch (not in its time)"
        )
    for name, c in report["tile_counts"].items():
        print(
            f"  flashmask {name:5s} tiles {c['tiles'][0]}x{c['tiles'][1]}: skipped {c['skipped_fraction']:.1%} "
            f"(exact: {c['exact']})"
        )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="FlashMask attention on packed batches, side by side.")
    parser.add_argument("--data-dir", help="read sequence lengths from the HDF5 shards here (fixed or varlength)")
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seqs", type=int, default=56, help="sequences per batch (MLPerf: 56 per GPU)")
    parser.add_argument("--seq-len", type=int, default=512, help="packed row length (max_seq_length)")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument(
        "--backends", help="comma-separated; each named one must run here (default: all, unavailable ones listed)"
    )
    parser.add_argument("--optional", default="", help="comma-separated backends that may be unavailable")
    parser.add_argument("--forward-only", action="store_true", help="CPU: count the forward's tiles only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    required = set() if args.backends is None else {b for b in args.backends.split(",") if b}
    required -= {b for b in args.optional.split(",") if b}
    args.backends = list(BACKENDS) if args.backends is None else [b for b in args.backends.split(",") if b]
    args.backends += [b for b in args.optional.split(",") if b and b not in args.backends]
    unknown = sorted(set(args.backends) - set(BACKENDS))
    if unknown:
        print(f"bench/flashmask.py: --backends: unknown {unknown}; choose from {list(BACKENDS)}", file=sys.stderr)
        return 2
    try:
        sampler = LengthSampler(args.data_dir, args.seed)
    except LengthsError as e:
        print(f"bench/flashmask.py: {e}", file=sys.stderr)
        return 2
    if args.seq_len < 1 or args.seqs < 1 or args.batches < 1:
        print("bench/flashmask.py: --seq-len, --seqs and --batches must be >= 1", file=sys.stderr)
        return 2
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "host": platform.node(),
        "torch": torch.__version__,
        "lengths": sampler.source,
        "dtype": args.dtype,
        "shape": {"seqs": args.seqs, "seq_len": args.seq_len, "heads": args.heads, "dim": args.dim},
    }
    if torch.cuda.is_available():
        report["device"] = torch.cuda.get_device_name()
        print(
            f"{report['device']}: {args.batches} batches of {args.seqs} sequences packed into rows of "
            f"{args.seq_len}, {args.heads} heads x {args.dim} dims, {args.dtype}, lengths from the {sampler.source}"
        )
        report.update(gpu_report(args, sampler))
        print_gpu(report)
        failed = failures(report["results"], required)
        failed += [f"{name} tile counts" for name, c in report["tile_counts"].items() if not c["exact"]]
    else:
        report["device"] = "cpu"
        print(
            f"No CUDA GPU here: tile counts only (the kernels in Triton's interpreter, debug mode), "
            f"{args.batches} batches of {args.seqs} sequences from the {sampler.source}, rows of {args.seq_len}, "
            f"GPU tiles for {args.dtype} x {args.dim} dims."
        )
        from kernels.interface import BackendUnavailable

        try:
            report.update(cpu_report(args, sampler))
        except BackendUnavailable as e:
            print(f"bench/flashmask.py: {e}", file=sys.stderr)
            return 1
        print_cpu(report)
        failed = [] if report["exact"] else ["tile counts"]
    if args.json:
        from common.files import write_text

        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, json.dumps(report, indent=1))
    if failed:
        print(f"bench/flashmask.py: failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is first imported
    sys.exit(main())
