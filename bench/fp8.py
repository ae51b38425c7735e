"""FP8 against bf16, and the FFN-in's three bias+GELU implementations, side by side.

    python bench/fp8.py [--rows 14003] [--iters 20] [--steps 15] [--layers N] [--json PATH]

Three parts, each timed with CUDA events (medians), the JSON rewritten after each:

- ``ffn_in``: GELU(x @ W.T + b) at BERT-large's FFN-in ([rows, 1024] x [4096, 1024], bf16),
  forward+backward and forward only, for ``eager`` (F.linear with bias, then GELU),
  ``triton`` (F.linear, then the fused Triton bias+GELU) and ``epilogue`` (bias and GELU in
  the GEMM, ``kernels.ops.gemm_epilogue``); ratios against eager, and the fastest named
  (``model.bias_gelu``'s choice).
- ``gemm``: the encoder's four linear layers (QKV, attention output, FFN in, FFN out) at
  ``--rows`` tokens (default 14,003: 56 sequences of BERT's mean length, and not a multiple
  of 16, so the weight-gradient GEMM's padding is in the time), forward+backward in bf16
  autocast against FP8 tensorwise and rowwise (``bert.model.fp8``), eager.
- ``train_step``: BERT-large training steps (``bench/train_step.py``'s loop: 56 sequences,
  unpadded, ``triton_grouped`` attention, fused ops, bf16 autocast, LAMB) with ``train.fp8``
  off, tensorwise and rowwise: sequences/s and the ratio to bf16 (the goal: FP8 >= 1.3x).

Without a GPU it says so and checks correctness only (tiny shapes, Triton's interpreter):
each bias+GELU implementation and each FP8 linear against fp32 within its stated bound,
and two FP8 training steps of a tiny model; exit status 1 if any disagrees.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from bench.attention import cuda_ms
from common.files import write_text

RECIPES = ("off", "tensorwise", "rowwise")
# Norm-wise relative error of an FP8 GEMM against fp32 (tests/bert/model/test_fp8.py states why).
FP8_BOUND = {"y": 0.06, "dx": 0.10, "dw": 0.10}
ENCODER = {"qkv": (1024, 3072), "attn_out": (1024, 1024), "ffn_in": (1024, 4096), "ffn_out": (4096, 1024)}


def ffn_in_impls():
    from kernels.ops.fused import bias_gelu
    from kernels.ops.gemm_epilogue import linear_bias_gelu

    return {
        "eager": lambda x, w, b: F.gelu(F.linear(x, w, b)),
        "triton": lambda x, w, b: bias_gelu(F.linear(x, w), b),
        "epilogue": linear_bias_gelu,
    }


def _leaves(shapes, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*s, generator=g) / (s[-1] ** 0.5 if len(s) == 2 else 1)).to(device, dtype) for s in shapes]


def bench_ffn_in(args, gpu: bool) -> dict:
    rows, c, i = (args.rows, 1024, 4096) if gpu else (37, 48, 96)
    device = "cuda" if gpu else "cpu"
    # As in the model under bf16 autocast: bf16 activations, fp32 parameters.
    x, w, b, dy = _leaves([(rows, c), (i, c), (i,), (rows, i)], torch.float32, device, 0)
    x, dy = x.to(torch.bfloat16 if gpu else torch.float32), dy.to(torch.bfloat16 if gpu else torch.float32)
    x.requires_grad_(), w.requires_grad_(), b.requires_grad_()
    amp = torch.autocast(device, dtype=torch.bfloat16, enabled=gpu)
    results = {}
    ref = None
    for name, impl in ffn_in_impls().items():

        def fn(x, w, b, impl=impl):
            with amp:
                return impl(x, w, b)

        def fwd_bwd(fn=fn):
            for t in (x, w, b):
                t.grad = None
            y = fn(x, w, b)
            y.backward(dy.to(y.dtype))
            return y

        if gpu:
            with torch.no_grad():
                fwd = cuda_ms(lambda fn=fn: fn(x, w, b), args.warmup, args.iters)
            results[name] = {"fwd_bwd_ms": cuda_ms(fwd_bwd, args.warmup, args.iters), "fwd_ms": fwd}
        else:
            got = [fwd_bwd().detach()] + [t.grad.clone() for t in (x, w, b)]
            if ref is None:
                ref = got
            diff = max(float((a - r).abs().max()) for a, r in zip(got, ref))
            results[name] = {"status": "ok" if diff <= 1e-4 else "mismatch", "max_diff_vs_eager": diff}
    if gpu:
        base = results["eager"]
        for r in results.values():
            r["fwd_bwd_speedup_vs_eager"] = base["fwd_bwd_ms"] / r["fwd_bwd_ms"]
            r["fwd_speedup_vs_eager"] = base["fwd_ms"] / r["fwd_ms"]
        results["fastest_fwd_bwd"] = min(ffn_in_impls(), key=lambda n: results[n]["fwd_bwd_ms"])
    return results


class _Encoder(nn.Module):
    """One linear layer where bert.model.fp8 looks for the encoder (``layers``)."""

    def __init__(self, c: int, o: int):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(c, o)])


def _linear(c: int, o: int, recipe: str, device, seed: int) -> nn.Linear:
    from bert.model.fp8 import convert_encoder

    torch.manual_seed(seed)
    enc = _Encoder(c, o).to(device)
    convert_encoder(enc, recipe, device=torch.device(device))
    return enc.layers[0]


def bench_gemm(args, gpu: bool) -> dict:
    rows = args.rows if gpu else 37
    shapes = ENCODER if gpu else {"small": (48, 80)}
    device = "cuda" if gpu else "cpu"
    results = {}
    for name, (c, o) in shapes.items():
        x, dy = _leaves([(rows, c), (rows, o)], torch.float32, device, 1)
        x.requires_grad_()
        entry = {}
        grads = {}
        for recipe in RECIPES:
            lin = _linear(c, o, recipe, device, seed=2)

            def fwd_bwd(lin=lin):
                x.grad = lin.weight.grad = None
                with torch.autocast(device, dtype=torch.bfloat16, enabled=gpu):
                    y = lin(x)
                y.backward(dy.to(y.dtype))
                return y

            if gpu:
                entry[recipe] = {"fwd_bwd_ms": cuda_ms(fwd_bwd, args.warmup, args.iters)}
            else:
                y = fwd_bwd().detach().float()
                grads[recipe] = {"y": y, "dx": x.grad.clone(), "dw": lin.weight.grad.clone()}
        if gpu:
            for recipe in RECIPES[1:]:
                entry[recipe]["speedup_vs_bf16"] = entry["off"]["fwd_bwd_ms"] / entry[recipe]["fwd_bwd_ms"]
        else:
            for recipe in RECIPES[1:]:
                errs = {
                    k: float((grads[recipe][k] - grads["off"][k]).norm() / grads["off"][k].norm()) for k in FP8_BOUND
                }
                ok = all(errs[k] <= FP8_BOUND[k] for k in FP8_BOUND)
                entry[recipe] = {"status": "ok" if ok else "mismatch", "relative_error_vs_fp32": errs}
        results[name] = entry
    return results


def bench_train_step(args, gpu: bool) -> dict:
    import numpy as np

    from bench.lengths import LengthSampler
    from bench.train_step import make_batch, run_variant
    from bert.model.config import BertConfig

    sampler = LengthSampler(args.data_dir, 0)
    if gpu:
        overrides = {} if args.layers is None else {"num_hidden_layers": args.layers}
        config = BertConfig.preset("large", **overrides)
        variant, seqs = "unpadded:triton_grouped+fused", 56
    else:
        config = BertConfig.preset("tiny", vocab_size=1024)
        variant, seqs = "unpadded:reference", 4
        args.steps, args.warmup = 2, 0
        sampler.rng = np.random.default_rng(0)
    batches = []
    for i in range(2 if gpu else 1):
        lengths = sampler.batch(seqs)
        if not gpu:
            lengths = [max(2, n // 16) for n in lengths]
        batches.append(make_batch(lengths, config.vocab_size, i))
    run_args = argparse.Namespace(optimizer="lamb", warmup=args.warmup, steps=args.steps)
    device = torch.device("cuda" if gpu else "cpu")
    results = {}
    for recipe in RECIPES:
        seconds = run_variant(variant, config, batches, run_args, device, fp8=recipe)
        results[recipe] = {"status": "ok", "step_s": seconds, "seqs_per_s": seqs / seconds}
    for recipe in RECIPES[1:]:
        results[recipe]["speedup_vs_bf16"] = results["off"]["step_s"] / results[recipe]["step_s"]
    results["variant"] = f"{variant}, {config.num_hidden_layers} layers, {seqs} sequences"
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=14003, help="tokens per GEMM (56 x BERT's mean length)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=15, help="timed training steps per FP8 setting")
    parser.add_argument("--layers", type=int, help="BERT-large with this many layers (shorter runs)")
    parser.add_argument("--parts", default="ffn_in,gemm,train_step")
    parser.add_argument("--data-dir", help="read sequence lengths from the HDF5 shards here")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    parts = {"ffn_in": bench_ffn_in, "gemm": bench_gemm, "train_step": bench_train_step}
    chosen = [p for p in args.parts.split(",") if p]
    unknown = [p for p in chosen if p not in parts]
    if unknown:
        print(f"bench/fp8.py: --parts: {unknown[0]!r} is not one of {list(parts)}", file=sys.stderr)
        return 2
    gpu = torch.cuda.is_available()
    if not gpu:
        print("No CUDA GPU here: checking correctness only (tiny shapes, Triton's interpreter), no timings.")
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "device": torch.cuda.get_device_name() if gpu else "cpu",
        "torch": torch.__version__,
        "results": {},
    }
    ok = True
    for name in chosen:
        try:
            report["results"][name] = parts[name](args, gpu)
        except Exception as e:  # one part failing (say, no FP8 on this GPU) must not stop the others
            msg = (str(e).strip().splitlines() or [""])[0]
            report["results"][name] = {"status": "error", "reason": f"{type(e).__name__}: {msg}"}
            ok = False
        print(f"{name}: {json.dumps(report['results'][name], indent=1)}")
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            write_text(Path(args.json), json.dumps(report, indent=1))
    ok = ok and "mismatch" not in json.dumps(report["results"])
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")
    sys.exit(main())
