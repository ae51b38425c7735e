"""A step the device never waits on: graphs, static shapes, grouped vs single launch, eval, syncs.

    python -m bench.step_sync [--layers 24] [--seqs 96] [--steps 10] [--data-dir DIR] [--json PATH]

Side by side in one run, on the same batches (``--seqs`` sequences per step, 96 = the
8-GPU H100 recipe's per-GPU batch; lengths from ``bench.lengths``), BERT-large (bf16
autocast, LAMB, global clipping, the device-side skip and schedule of the trainer):

- ``dynamic:triton``  unpadded batches, one varlen launch per layer (no graphs);
- ``dynamic:triton_grouped``  the same with grouped dispatch (planned on the host);
- ``static:triton``  ``data.static_shapes`` padding, eager;
- ``static:triton+graphs``  the same with the encoder in CUDA graphs (``bert.train.cuda_graphs``).

Each reports the median step time as sequences/s, its ratio to ``dynamic:triton``, and the
device reads of a steady-state step counted by ``torch.cuda.set_sync_debug_mode("warn")``
(each synchronising call warns once). Then evaluation: 10,000 samples (``--eval-samples``)
kept on the device (``bert.train.evaluate``), seconds per evaluation, eager and graphed.
Without a GPU it runs a two-step smoke of a tiny model on the CPU (no numbers worth
reporting) and counts reads with ``tools.device_reads`` instead.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
import warnings

import numpy as np
import torch

from bench.lengths import LengthSampler, LengthsError
from bench.train_step import write_report

VARIANTS = ("dynamic:triton", "dynamic:triton_grouped", "static:triton", "static:triton+graphs")
MAX_PREDICTIONS = 76


def make_block(lengths, vocab: int, seed: int):
    """A SampleBlock of these lengths with MLPerf's masking (15%, at most 76 per sequence)."""
    from data.samples import SampleBlock

    rng = np.random.default_rng(seed)
    lens = np.asarray(lengths, dtype=np.int32)
    counts = np.minimum(MAX_PREDICTIONS, np.maximum(1, np.rint(lens * 0.15))).astype(np.int32)
    positions = np.concatenate([np.sort(rng.choice(np.arange(1, n), c, replace=False)) for n, c in zip(lens, counts)])
    return SampleBlock(
        input_ids=rng.integers(5, vocab, int(lens.sum())).astype(np.int32),
        segment_ids=np.zeros(int(lens.sum()), np.int8),
        seq_lens=lens,
        masked_positions=positions.astype(np.int32),
        masked_ids=rng.integers(5, vocab, int(counts.sum())).astype(np.int32),
        masked_counts=counts,
        nsp_labels=rng.integers(0, 2, len(lens)).astype(np.int8),
    )


class Step:
    """One training step as the trainer runs it: host counts, forward, backward, clip, skip, LAMB, schedule."""

    def __init__(self, config, attention: str, shapes, graphs: bool, device, amp_dtype):
        from bert.config import OptimSection
        from bert.model.pretraining import BertForPreTraining
        from bert.optim.optimizers import build_optimizer
        from bert.optim.schedule import WarmupDecaySchedule
        from bert.train.cuda_graphs import EncoderGraphs

        with torch.device(device):
            self.model = BertForPreTraining(config, attention=attention)
        self.model.train()
        if graphs:
            self.model.encoder_graphs = EncoderGraphs(self.model.layers, shapes.max_seqlen)
        section = OptimSection(name="lamb", lr=4.25e-4)
        self.optimizer = build_optimizer(section, self.model)
        self.schedule = WarmupDecaySchedule(self.optimizer, section, max_steps=10_000, device=device)
        self.shapes, self.device, self.amp_dtype = shapes, device, amp_dtype
        self.graphs = graphs

    def batch(self, block):
        from data.collate import collate_unpadded

        batch = collate_unpadded(block)
        if self.shapes is not None:
            batch = self.shapes.pad(batch)
        if self.device.type == "cuda":  # pinned host memory: the copy below is asynchronous
            batch = type(batch)(**{k: v.pin_memory() if torch.is_tensor(v) else v for k, v in vars(batch).items()})
        return batch.to(self.device, non_blocking=True)

    def __call__(self, block, batch) -> None:
        from bert.optim.clipping import clip_global_
        from bert.train.losses import pretraining_loss

        masked, seqs = int(block.masked_counts.sum()), len(block)  # host facts of the data
        with torch.autocast(
            self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None, cache_enabled=False
        ):
            out = self.model(batch)
            loss, _ = pretraining_loss(out.mlm_logits, batch.mlm_labels, out.nsp_logits, batch.nsp_labels, masked, seqs)
        loss.backward()
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = clip_global_(params, 1.0)
        found_inf = ~torch.isfinite(norm)
        self.optimizer.step(found_inf=found_inf)
        self.schedule.step(found_inf)
        self.optimizer.zero_grad(set_to_none=True)


def sync_reads(fn) -> int:
    """Synchronising calls in ``fn()`` on CUDA (set_sync_debug_mode warns once per call)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
            torch.cuda.set_sync_debug_mode("default")
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def cpu_reads(step, block, batch) -> int:
    from tools.device_reads import DeviceReads

    marked = (
        list(step.model.parameters())
        + [step.schedule.lr]
        + [t for s in step.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    )
    with DeviceReads(marked) as reads:
        step(block, batch)
    return reads.total


def run_variant(name, config, blocks, args, device, amp_dtype) -> dict:
    from data.static_shapes import StaticShapes, auto_token_bucket

    layout, attention = name.split(":")
    attention, graphs = attention.removesuffix("+graphs"), attention.endswith("+graphs")
    shapes = None
    if layout == "static":
        bucket = auto_token_bucket(args.seqs, 512)
        shapes = StaticShapes(bucket, 64, max(512, bucket))
    step = Step(config, attention, shapes, graphs, device, amp_dtype)
    batches = [step.batch(b) for b in blocks]
    for i in range(args.warmup):
        step(blocks[i % len(blocks)], batches[i % len(batches)])
    times = []
    for i in range(args.steps):
        block, batch = blocks[i % len(blocks)], batches[i % len(batches)]
        if device.type == "cuda":
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(block, batch)
            torch.cuda.synchronize()
        else:
            t0 = time.perf_counter()
            step(block, batch)
        times.append(time.perf_counter() - t0)
    i = args.steps % len(blocks)
    if device.type == "cuda":
        reads = sync_reads(functools.partial(step, blocks[i], batches[i]))
    else:
        reads = cpu_reads(step, blocks[i], batches[i])
    seconds = statistics.median(times)
    result = {"step_s": seconds, "seqs_per_s": args.seqs / seconds, "device_reads_per_step": reads}
    if shapes is not None:
        result["distinct_shapes"] = len({(b.num_tokens, b.mlm_positions.numel()) for b in batches})
    del step, batches
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def run_eval(config, sampler, args, device, amp_dtype, graphs: bool) -> dict:
    from bert.model.pretraining import BertForPreTraining
    from bert.train.cuda_graphs import EncoderGraphs
    from bert.train.evaluate import DeviceEvalSet, masked_lm_counts
    from data.collate import collate_unpadded
    from data.static_shapes import StaticShapes, auto_token_bucket

    with torch.device(device):
        model = BertForPreTraining(config, attention="triton" if device.type == "cuda" else "padded")
    model.eval()
    bucket = auto_token_bucket(args.eval_batch, 512)
    shapes = StaticShapes(bucket, 64, max(512, bucket))
    if graphs:
        model.encoder_graphs = EncoderGraphs(model.layers, shapes.max_seqlen)
    n = args.eval_samples
    blocks = [
        make_block(sampler.batch(min(args.eval_batch, n - s)), config.vocab_size, 10_000 + s)
        for s in range(0, n, args.eval_batch)
    ]
    cache = DeviceEvalSet(blocks, lambda b: shapes.pad(collate_unpadded(b)), device)
    amp = lambda: torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None, cache_enabled=False)  # noqa: E731
    times = []
    for _ in range(3 if device.type == "cuda" else 1):
        t0 = time.perf_counter()
        counts = masked_lm_counts(model, cache, device, amp).tolist()  # the one read of an evaluation
        times.append(time.perf_counter() - t0)
    return {
        "seconds_per_eval": min(times[1:] or times),
        "samples": n,
        "cache_mb": cache.nbytes / 2**20,
        "total": counts[1],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--seqs", type=int, default=96)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--eval-samples", type=int, default=10_000)
    parser.add_argument("--eval-batch", type=int, default=125)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--data-dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    from bert.model.config import BertConfig

    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    try:
        sampler = LengthSampler(args.data_dir, args.seed)
    except LengthsError as e:
        print(f"bench/step_sync.py: {e}", file=sys.stderr)
        return 2
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        print(
            f"bench/step_sync.py: --variants: unknown {unknown[0]!r}; choose from {', '.join(VARIANTS)}",
            file=sys.stderr,
        )
        return 2
    amp_dtype = torch.bfloat16 if gpu else None
    if gpu:
        torch.backends.cuda.matmul.allow_tf32 = True
        config = BertConfig.preset("large", num_hidden_layers=args.layers)
    else:
        print("No CUDA GPU here: a two-step CPU smoke run of a tiny model, not a measurement.")
        config = BertConfig.preset("tiny", vocab_size=1024)
        args.seqs, args.steps, args.warmup, args.batches, args.eval_samples, args.eval_batch = 4, 2, 1, 1, 8, 4
        variants = ["dynamic:padded", "static:padded"]
    blocks = []
    for i in range(args.batches):
        lengths = sampler.batch(args.seqs)
        if not gpu:
            lengths = [max(4, n // 16) for n in lengths]
        blocks.append(make_block(lengths, config.vocab_size, args.seed + i))
    report = {
        "device": torch.cuda.get_device_name() if gpu else "cpu",
        "layers": config.num_hidden_layers,
        "seqs_per_step": args.seqs,
        "lengths": sampler.source,
        "results": {},
    }
    failed = False
    for v in variants:
        try:
            report["results"][v] = {"status": "ok", **run_variant(v, config, blocks, args, device, amp_dtype)}
        except Exception as e:  # one variant failing must not stop the others; the stage fails
            failed = True
            report["results"][v] = {
                "status": "error",
                "reason": f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}",
            }
        print(v, json.dumps(report["results"][v]))
        write_report(report, args.json)
    base = report["results"].get(variants[0], {}).get("seqs_per_s")
    for v in variants:
        r = report["results"][v]
        if base and r.get("status") == "ok":
            r["ratio_to_" + variants[0]] = r["seqs_per_s"] / base
    for graphs in (False, True) if gpu else (False,):
        key = "eval_graphs" if graphs else "eval"
        try:
            report[key] = run_eval(config, sampler, args, device, amp_dtype, graphs)
        except Exception as e:
            failed = True
            report[key] = {
                "status": "error",
                "reason": f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}",
            }
        print(key, json.dumps(report[key]))
    write_report(report, args.json)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
