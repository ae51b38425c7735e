"""The fused elementwise kernels against eager PyTorch, forward+backward, side by side.

    python bench/fused_ops.py [--rows 14000] [--iters 20] [--json PATH]

Two ops at BERT-large's shapes (``--rows`` tokens: 56 sequences of about 250 real tokens):
bias+GELU on [rows, 4096] and bias+dropout+residual+LayerNorm on [rows, 1024] (dropout 0.1),
bf16 activations with fp32 parameters as under autocast. Each is timed with CUDA events over
``--iters`` forward+backward passes after warm-up; reported: median milliseconds for the
fused kernel and for the eager reference (``kernels.ops.fused.*_reference``) and their ratio
(above 1 = fused is faster). The JSON is rewritten after each op.

Without a GPU it says so and checks correctness only: small shapes in Triton's interpreter,
fused against eager (dropout off), exit status 1 if they disagree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from common.files import write_text


def _ops(hidden: int, inter: int, dropout: float):
    """name -> (fused fn, reference fn, input shapes), each fn taking (x, bias, residual, w, b)."""
    from kernels.ops import fused as fo

    return {
        "bias_gelu": (
            lambda x, b, r, w, lb: fo.bias_gelu(x, b),
            lambda x, b, r, w, lb: fo.bias_gelu_reference(x, b),
            inter,
        ),
        "bias_dropout_add_layer_norm": (
            lambda x, b, r, w, lb: fo.bias_dropout_add_layer_norm(x, b, r, w, lb, dropout, 1e-12, True),
            lambda x, b, r, w, lb: fo.bias_dropout_add_layer_norm_reference(x, b, r, w, lb, dropout, 1e-12, True),
            hidden,
        ),
    }


def _inputs(rows: int, n: int, dtype, device, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g).to(device=device, dtype=dtype).requires_grad_()
    res = torch.randn(rows, n, generator=g).to(device=device, dtype=dtype).requires_grad_()
    params = [torch.randn(n, generator=g).to(device).requires_grad_() for _ in range(3)]  # fp32, as under autocast
    return x, params[0], res, params[1], params[2]


def _fwd_bwd(fn, inputs):
    for t in inputs:
        t.grad = None
    out = fn(*inputs)
    out.backward(torch.ones_like(out))
    return out


def _grads(inputs):
    return [torch.zeros_like(t) if t.grad is None else t.grad.clone() for t in inputs]  # unused inputs: 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=14000)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    gpu = torch.cuda.is_available()
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "device": torch.cuda.get_device_name() if gpu else "cpu",
        "rows": args.rows if gpu else 40,
        "results": {},
    }
    ok = True
    if not gpu:
        print("No CUDA GPU here: checking correctness only (small shapes in Triton's interpreter), no timings.")
    for name, (fused, ref, n) in _ops(1024 if gpu else 96, 4096 if gpu else 160, 0.1 if gpu else 0.0).items():
        if gpu:
            inputs = _inputs(args.rows, n, torch.bfloat16, "cuda", 0)
            times = {}
            for label, fn in (("fused", fused), ("eager", ref)):
                for _ in range(args.warmup):
                    _fwd_bwd(fn, inputs)
                torch.cuda.synchronize()
                samples = []
                for _ in range(args.iters):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    _fwd_bwd(fn, inputs)
                    end.record()
                    end.synchronize()
                    samples.append(start.elapsed_time(end))
                times[label] = statistics.median(samples)
            r = {"fused_ms": times["fused"], "eager_ms": times["eager"], "speedup": times["eager"] / times["fused"]}
            print(f"  {name:28s} fused {r['fused_ms']:.3f} ms  eager {r['eager_ms']:.3f} ms  {r['speedup']:.2f}x")
        else:
            inputs = _inputs(40, n, torch.float32, "cpu", 0)
            got = [_fwd_bwd(fused, inputs).detach()] + _grads(inputs)
            want = [_fwd_bwd(ref, inputs).detach()] + _grads(inputs)
            diff = max(float((a - b).abs().max()) for a, b in zip(got, want))
            r = {"status": "ok" if diff <= 1e-4 else "mismatch", "max_diff_vs_eager": diff}
            ok = ok and r["status"] == "ok"
            print(f"  {name:28s} {r['status']} (max difference {diff:.2e})")
        report["results"][name] = r
        if args.json:
            write_text(Path(args.json), json.dumps(report, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is first imported
    sys.exit(main())
