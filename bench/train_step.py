"""BERT training-step throughput, unpadded against padded, side by side.

    python bench/train_step.py [--preset large] [--steps 10] [--data-dir DIR] [--json PATH]

Every variant trains the same model (BERT-large by default, bf16 autocast, MLPerf's LAMB)
for ``--warmup`` + ``--steps`` steps on the same batches of 56 sequences (lengths from a
prepared data directory or the built-in MLPerf-like distribution) and reports the median
step time as sequences/s and real tokens/s:

- ``padded``: the MLPerf fixed layout, every sequence padded to 512 tokens, SDPA attention
  with a key mask (``attention=padded``);
- ``unpadded:<backend>``: the flat ``UnpaddedBatch`` with that attention backend, and
  ``+fused`` for the fused bias+GELU and bias+dropout+residual+LayerNorm kernels;
- ``packed:<backend>``: the same sequences packed into rows of 512 (``PackedBatch``,
  first-fit decreasing), e.g. ``packed:flashmask``.

Each result also gives the model FLOP utilisation (MFU): the real tokens' training FLOPs
(``model_flops``) per second over the GPU's dense bf16 peak (H100/H200 989 TFLOP/s, A100
312). The JSON is rewritten after every variant, so a timeout keeps the finished ones.

Ratios are against ``padded``. Without a GPU it says so and only runs two steps of a tiny
model on CPU, to check that the script works (no numbers worth reporting).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from bench.lengths import LengthSampler, LengthsError

DEFAULT_VARIANTS = (
    "unpadded:triton_grouped+fused",
    "padded",
    "packed:flashmask",
    "unpadded:triton",
    "unpadded:triton_grouped",
    "unpadded:padded",
    "unpadded:flash_attn",
)
# Dense bf16 tensor-core peak per GPU (TFLOP/s), for model FLOP utilisation (MFU).
PEAK_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0}
MAX_PREDICTIONS = 76


def make_batch(lengths, vocab_size: int, seed: int):
    """An UnpaddedBatch with MLPerf's masking density (15%, at most 76 per sequence)."""
    from data.batch import unpad

    rng = np.random.default_rng(seed)
    b, s = len(lengths), 512
    ids = np.zeros((b, s), np.int64)
    seg = np.zeros((b, s), np.int64)
    mask = np.zeros((b, s), np.int64)
    mpos = np.zeros((b, MAX_PREDICTIONS), np.int64)
    mids = np.zeros((b, MAX_PREDICTIONS), np.int64)
    for i, n in enumerate(lengths):
        ids[i, :n] = rng.integers(1, vocab_size, n)
        seg[i, n // 2 : n] = 1
        mask[i, :n] = 1
        k = min(MAX_PREDICTIONS, max(1, round(0.15 * (n - 1)))) if n > 1 else 0
        if k:
            mpos[i, :k] = np.sort(rng.choice(np.arange(1, n), size=k, replace=False))
            mids[i, :k] = rng.integers(1, vocab_size, k)
    return unpad(ids, seg, mask, mpos, mids, rng.integers(0, 2, b))


def parse_variant(v: str):
    """(attention backend, fused ops, layout) of 'padded', 'unpadded:<backend>[+fused]' or
    'packed:<backend>[+fused]' (packed: rows of 512 holding whole sequences, first-fit)."""
    if v == "padded":
        return "padded", False, "padded"
    layout, _, backend = v.partition(":")
    if layout not in ("unpadded", "packed") or not backend:
        raise ValueError(
            f"--variants: {v!r} is not 'padded', 'unpadded:<backend>[+fused]' or 'packed:<backend>[+fused]'"
        )
    fused = backend.endswith("+fused")
    return backend.removesuffix("+fused"), fused, layout


def to_packed(batch, seq_len: int = 512):
    """The same sequences as a PackedBatch (data.packing's first-fit-decreasing rows)."""
    from data.packing import collate_packed
    from data.samples import SampleBlock

    cu = batch.cu_seqlens.long()
    lens = (cu[1:] - cu[:-1]).numpy()
    seq_of_mask = torch.searchsorted(cu, batch.mlm_positions, right=True) - 1  # [M] owning sequence
    counts = np.bincount(seq_of_mask.numpy(), minlength=len(lens))
    block = SampleBlock(
        input_ids=batch.input_ids.numpy(),
        segment_ids=batch.segment_ids.numpy(),
        seq_lens=lens,
        masked_positions=(batch.mlm_positions - cu[seq_of_mask]).numpy(),
        masked_ids=batch.mlm_labels.numpy(),
        masked_counts=counts,
        nsp_labels=batch.nsp_labels.numpy(),
    )
    return collate_packed(block, seq_len)


def model_flops(config, batch) -> float:
    """Training FLOPs of one step (forward + backward = 3x forward) on the real tokens only:
    the encoder's matmuls (2 x weights per token), attention (4 x L^2 x hidden per layer and
    sequence), and the MLM head on the masked positions. Padding is never counted."""
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    lens = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).double()
    tokens, masked = float(lens.sum()), batch.mlm_positions.numel()
    encoder = layers * (2 * (4 * h * h + 2 * h * i) * tokens + 4 * h * float((lens**2).sum()))
    head = 2 * (h * h + h * config.vocab_size) * masked
    return 3.0 * (encoder + head)


def run_variant(variant, config, batches, args, device, fp8: str = "off"):
    """Median seconds of one training step; ``fp8``: ``train.fp8`` (bench/fp8.py compares them)."""
    from bert.config import OptimSection
    from bert.model.fp8 import convert_encoder
    from bert.model.pretraining import BertForPreTraining
    from bert.optim.optimizers import build_optimizer
    from data.batch import pad

    backend, fused, layout = parse_variant(variant)
    with torch.device(device):
        model = BertForPreTraining(config, attention=backend, fused_ops=fused)
    convert_encoder(model, fp8, device=device)
    model.train()
    optimizer = build_optimizer(OptimSection(name=args.optimizer, lr=4.25e-4), model)
    convert = {"padded": lambda b: pad(b, 512), "packed": to_packed, "unpadded": lambda b: b}[layout]
    inputs = [convert(b).to(device) for b in batches]
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step(batch):
        with amp:
            out = model(batch)
            loss = F.cross_entropy(out.mlm_logits.float(), batch.mlm_labels) + F.cross_entropy(
                out.nsp_logits.float(), batch.nsp_labels
            )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for i in range(args.warmup):
        step(inputs[i % len(inputs)])
    times = []
    for i in range(args.steps):
        batch = inputs[i % len(inputs)]
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step(batch)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            step(batch)
            times.append(time.perf_counter() - t0)
    del step  # the closure holds the model and optimizer: free them before emptying the cache
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return statistics.median(times)


def write_report(report: dict, path: str | None) -> None:
    if path:
        from common.files import write_text

        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_text(Path(path), json.dumps(report, indent=1))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="BERT training-step throughput, unpadded vs padded.")
    parser.add_argument("--preset", default="large")
    parser.add_argument("--layers", type=int, help="override the preset's layer count (shorter runs)")
    parser.add_argument("--seqs", type=int, default=56)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batches", type=int, default=4, help="distinct batches, cycled")
    parser.add_argument("--optimizer", choices=("lamb", "adamw"), default="lamb")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    parser.add_argument("--data-dir", help="read sequence lengths from the HDF5 shards here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    from bert.model.config import BertConfig
    from kernels.interface import BackendUnavailable

    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    variants = [v for v in args.variants.split(",") if v]
    try:
        for v in variants:
            parse_variant(v)
        sampler = LengthSampler(args.data_dir, args.seed)
    except (ValueError, LengthsError) as e:
        print(f"bench/train_step.py: {e}", file=sys.stderr)
        return 2
    overrides = {} if args.layers is None else {"num_hidden_layers": args.layers}
    if gpu:
        config = BertConfig.preset(args.preset, **overrides)
        print(
            f"{torch.cuda.get_device_name()}: {args.preset} ({config.num_hidden_layers} layers), "
            f"{args.seqs} sequences per step, bf16 autocast, {args.optimizer}, lengths from the {sampler.source}"
        )
    else:
        print("No CUDA GPU here: a two-step CPU smoke run of a tiny model, not a measurement.")
        config = BertConfig.preset("tiny", vocab_size=1024)
        args.seqs, args.steps, args.warmup, args.batches = 4, 2, 0, 1
        variants = ["padded", "unpadded:reference", "packed:reference"]
        sampler.rng = np.random.default_rng(args.seed)
    batches = []
    for i in range(args.batches):
        lengths = sampler.batch(args.seqs)
        if not gpu:
            lengths = [max(2, n // 16) for n in lengths]
        batches.append(make_batch(lengths, config.vocab_size, args.seed + i))
    real_tokens = statistics.mean(b.num_tokens for b in batches)
    flops = statistics.mean(model_flops(config, b) for b in batches)
    peak = next((v for k, v in PEAK_TFLOPS.items() if gpu and k in torch.cuda.get_device_name()), None)
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "host": platform.node(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if gpu else "cpu",
        "preset": args.preset if gpu else "tiny",
        "layers": config.num_hidden_layers,
        "seqs_per_step": args.seqs,
        "mean_real_tokens": real_tokens,
        "lengths": sampler.source,
        "optimizer": args.optimizer,
        "model_tflop_per_step": flops / 1e12,
        "peak_tflops": peak,
        "results": {},
    }
    for v in variants:
        try:
            seconds = run_variant(v, config, batches, args, device)
            report["results"][v] = {
                "status": "ok",
                "step_s": seconds,
                "seqs_per_s": args.seqs / seconds,
                "real_tokens_per_s": real_tokens / seconds,
                "mfu": (flops / seconds / 1e12 / peak) if peak else None,
            }
        except BackendUnavailable as e:
            report["results"][v] = {"status": "unavailable", "reason": str(e)}
        except Exception as e:  # one variant failing (say, out of memory) must not stop the others
            msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
            report["results"][v] = {"status": "error", "reason": f"{type(e).__name__}: {msg}"}
            if gpu:
                torch.cuda.empty_cache()
        write_report(report, args.json)  # after every variant: a timeout keeps what has run
    base = report["results"].get("padded", {}).get("step_s")
    for v, r in report["results"].items():
        if r["status"] == "ok":
            r["speedup_vs_padded"] = base / r["step_s"] if base else None
            ratio = f"{r['speedup_vs_padded']:.2f}x" if base else "-"
            mfu = f"MFU {r['mfu']:.1%}" if r.get("mfu") is not None else ""
            print(
                f"  {v:32s} {r['step_s'] * 1e3:9.1f} ms/step  {r['seqs_per_s']:8.1f} seq/s  "
                f"{r['real_tokens_per_s']:10.0f} tok/s  {ratio:>6s} vs padded  {mfu}"
            )
        else:
            print(f"  {v:32s} {r['status']}: {r['reason']}")
    write_report(report, args.json)
    return 0 if all(r["status"] in ("ok", "unavailable") for r in report["results"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
