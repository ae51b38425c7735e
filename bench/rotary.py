"""The rotary kernel against its PyTorch reference, forward+backward on q and k, side by side.

    python bench/rotary.py [--tokens 65536] [--heads 12] [--head-dim 64] [--iters 20] [--json PATH]

q and k are strided views of one fused QKV output ``[T, 3, H, D]`` in bf16, as in the model
(ModernBERT-base: 12 heads of 64), positions restarting every 1,024 tokens. Timed with CUDA
events over ``--iters`` forward+backward passes after warm-up; reported: median milliseconds
of ``kernels.ops.rotary.apply_rotary`` and of ``apply_rotary_reference``, their ratio (above 1 =
the kernel is faster), and the kernel's effective bandwidth (bytes of q and k read and
written, plus the gradients). That time is what applying rotary inside the attention kernel
would save at most, since the attention kernel reads q and k anyway.

Without a GPU it says so and checks correctness only: small shapes in Triton's interpreter,
kernel against reference, exit status 1 if they disagree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

from common.files import write_text


def _inputs(tokens: int, heads: int, head_dim: int, dtype, device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, 3, heads, head_dim, generator=g).to(device=device, dtype=dtype).requires_grad_()
    pos = (torch.arange(tokens) % 1024).to(device)
    return qkv, pos


def _fwd_bwd(fn, qkv, pos, cos, sin):
    qkv.grad = None
    q, k = fn(qkv[:, 0], cos, sin, pos), fn(qkv[:, 1], cos, sin, pos)
    torch.autograd.backward((q, k), (torch.ones_like(q), torch.ones_like(k)))
    return q, k


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    gpu = torch.cuda.is_available()
    if not gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from kernels.ops.rotary import apply_rotary, apply_rotary_reference, rotary_tables

    device = "cuda" if gpu else "cpu"
    tokens = args.tokens if gpu else 67
    cos, sin = (t.to(device) for t in rotary_tables(args.head_dim, 10000.0, 1024))
    qkv, pos = _inputs(tokens, args.heads, args.head_dim, torch.bfloat16 if gpu else torch.float32, device)
    q, k = _fwd_bwd(apply_rotary, qkv, pos, cos, sin)
    grad = qkv.grad.clone()
    q_ref, k_ref = _fwd_bwd(apply_rotary_reference, qkv, pos, cos, sin)
    tol = 2e-2 if gpu else 1e-5
    err = max((q - q_ref).abs().max().item(), (k - k_ref).abs().max().item(), (grad - qkv.grad).abs().max().item())
    report = {"device": torch.cuda.get_device_name() if gpu else "cpu (interpreter)", "max_abs_diff": err}
    if err > tol:
        print(f"rotary: kernel and reference differ by {err:.3g} (tolerance {tol})", file=sys.stderr)
        return 1
    if not gpu:
        print(f"rotary: no GPU; checked the kernel against the reference in the interpreter (max diff {err:.2e})")
    else:
        times = {}
        for name, fn in (("triton", apply_rotary), ("torch", apply_rotary_reference)):
            for _ in range(args.warmup):
                _fwd_bwd(fn, qkv, pos, cos, sin)
            samples = []
            for _ in range(args.iters):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                _fwd_bwd(fn, qkv, pos, cos, sin)
                end.record()
                torch.cuda.synchronize()
                samples.append(start.elapsed_time(end))
            times[name] = statistics.median(samples)
        moved = 8 * tokens * args.heads * args.head_dim * qkv.element_size()  # q, k and their grads: read + write
        report.update(
            triton_ms=times["triton"],
            torch_ms=times["torch"],
            ratio=times["torch"] / times["triton"],
            triton_gb_per_s=moved / times["triton"] / 1e6,
        )
        print(
            f"rotary fwd+bwd, {tokens} tokens x {args.heads} x {args.head_dim} bf16: triton {times['triton']:.3f} ms, "
            f"torch {times['torch']:.3f} ms, ratio {report['ratio']:.2f}x, {report['triton_gb_per_s']:.0f} GB/s"
        )
    if args.json:
        write_text(Path(args.json), json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
