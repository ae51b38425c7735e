"""Training throughput against transformers' BertForPreTraining (or ModernBertForMaskedLM for
a ModernBERT ``--model``), side by side in one run.

    python bench/throughput.py --data /tmp/wt2-512                      # CPU, small BERT, batch 16
    python bench/throughput.py --data DIR --model large --batch-size 56 --precision bf16   # GPU

On one prepared data directory and one model configuration, every variant trains (forward,
backward, global-norm clipping at 1.0, LAMB step) on the SAME ``--batches`` batches of
``--batch-size`` sequences, in interleaved rounds (variant order rotated every round); the
time of a variant is the median of its rounds after ``--warmup-rounds``. Variants:

    transformers      transformers.BertForPreTraining, batches padded to max_seq_length, the
                      attention of --hf-attention (sdpa: transformers' default), MLM head over
                      every position, loss at the masked ones (labels -100 elsewhere)
    padded            this project's model on PaddedBatch (collate_padded), SDPA attention
                      (``padded`` backend), MLM head at the masked positions only
    unpadded/NAME     this project's model on UnpaddedBatch (collate_unpadded) with attention
                      backend NAME: reference everywhere; padded (pad -> SDPA -> unpad inside
                      attention), triton, triton_grouped on CUDA
    packed/NAME       PackedBatch rows of max_seq_length holding whole sequences (first-fit
                      decreasing, ``data.packing``) with attention NAME: flashmask (its Triton
                      kernel; listed by default, runs on CUDA) or reference (the dense mask of
                      the FlashMask bounds, in PyTorch; ask for it with --variants)

Every variant starts from the same weights (transformers' initialisation, loaded into this
project's model with ``bert.checkpoint.pretrained.load_hf_state_dict``), and before timing the first
batch's loss of each (dropout off) is checked against transformers' (1e-4 relative in fp32):
the variants compute the same function. Collation happens before timing; only training is
timed. Sequences/s and tokens/s (real tokens, for every variant) are reported with their
ratio to transformers, next to the padding limit: padded tokens / real tokens of the
batches, the speed-up that removing padding alone can give when cost is linear in tokens.

A default variant that cannot run here (backend not registered or unavailable) is listed
with the reason and not timed; one named in ``--variants`` that cannot run is an error.
``--profile`` prints torch.profiler's top operators for one step of each variant.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bert.model.config import PRESETS, BertConfig
from bert.model.hf import read_config
from common.files import publishing, write_text
from kernels.interface import BackendUnavailable
from kernels.registry import backend_names, get_backend

REPO = Path(__file__).resolve().parents[1]

GOAL_VS_LIMIT = 0.9  # unpadded / padded >= 0.9 x padding limit
GOAL_VS_HF = 8.0  # unpadded >= 8 x transformers (BertForPreTraining)
GOAL_VS_HF_MODERN = 3.0  # issue 27: unpadded with windows >= 3 x ModernBertForMaskedLM, lengths up to 2,048


class BenchError(RuntimeError):
    """Bad input or a variant that cannot run; the message is the CLI's one line."""


@dataclass
class Variant:
    name: str
    model: torch.nn.Module | None = None
    inputs: list = field(default_factory=list)
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None
    optimizer: torch.optim.Optimizer | None = None
    skipped: str | None = None  # why the variant is not timed
    times: list[float] = field(default_factory=list)  # seconds per round, warm-up excluded
    check_loss: float | None = None


# ---- data -------------------------------------------------------------------------------


def load_blocks(data: Path, batch_size: int, batches: int, seed: int, vocab_size: int):
    """``batches`` consecutive training batches of the loader, and the data-wide lengths."""
    from common.errors import DataError
    from data.hdf5io import inspect, list_files, read_file
    from data.loader import PretrainingLoader

    train = data / "train" if (data / "train").is_dir() else data
    try:
        files = list_files(train)
        info = inspect(files[0])
        loader = PretrainingLoader(train, batch_size, seed=seed, prefetch=False, vocab_size=vocab_size)
        it = iter(loader)
        blocks = [next(it) for _ in range(batches)]
        loader.close()
        lengths = np.concatenate([read_file(f).seq_lens for f in files]).astype(np.int64)
    except DataError as e:
        raise BenchError(str(e)) from None
    return blocks, info, lengths


LONG_MASKED_LM_PROB = 0.3  # ModernBERT's training masking rate


def long_document_blocks(context: int, batch_size: int, batches: int, seed: int, vocab_size: int):
    """``batches`` batches of WikiText-2's articles cut at ``context`` (``--lengths wikitext2``).

    Lengths: ``bench.article_lengths`` (the shipped token counts of WikiText-2's 122 articles,
    each cut into pieces of ``context`` as ``data.prepare --objective mlm`` cuts documents),
    drawn uniformly with ``seed``. Tokens are random ids (speed does not depend on them), 30%
    of each sequence's inner tokens masked (ModernBERT's rate); returns (blocks, the pool's lengths)."""
    from bench.article_lengths import load, sequence_lengths
    from data.samples import SampleBlock

    pool = sequence_lengths(load(), context)
    rng = np.random.default_rng(seed)
    blocks = []
    for _ in range(batches):
        lens = rng.choice(pool, batch_size).astype(np.int32)
        counts = np.maximum(1, np.rint((lens - 2) * LONG_MASKED_LM_PROB)).astype(np.int32)
        positions = [np.sort(rng.choice(np.arange(1, n - 1), c, replace=False)) for n, c in zip(lens, counts)]
        blocks.append(
            SampleBlock(
                input_ids=rng.integers(5, vocab_size, int(lens.sum())).astype(np.int32),
                segment_ids=np.zeros(int(lens.sum()), np.int32),
                seq_lens=lens,
                masked_positions=np.concatenate(positions).astype(np.int32),
                masked_ids=rng.integers(5, vocab_size, int(counts.sum())).astype(np.int32),
                masked_counts=counts,
                nsp_labels=np.zeros(batch_size, np.int32),
            )
        )
    return blocks, pool.astype(np.int64)


# ---- variants ---------------------------------------------------------------------------


def hf_loss(model, inp):
    return model(**inp).loss


def our_loss(model, batch):
    from bert.train.losses import pretraining_loss

    out = model(batch)
    loss, _ = pretraining_loss(
        out.mlm_logits,
        batch.mlm_labels,
        out.nsp_logits,
        batch.nsp_labels,
        batch.mlm_labels.numel(),
        batch.nsp_labels.numel(),
    )
    return loss


def hf_inputs(padded, device, bert: bool = True) -> dict:
    """transformers' arguments for a PaddedBatch: labels -100 except at the masked positions
    (``bert`` False: ModernBertForMaskedLM's, which has no token types and no NSP)."""
    b, s = padded.input_ids.shape
    labels = torch.full((b * s,), -100, dtype=torch.long)
    labels[padded.mlm_positions] = padded.mlm_labels
    inputs = {
        "input_ids": padded.input_ids.to(device),
        "attention_mask": padded.attention_mask.long().to(device),
        "labels": labels.view(b, s).to(device),
    }
    if bert:
        inputs.update(token_type_ids=padded.segment_ids.to(device), next_sentence_label=padded.nsp_labels.to(device))
    return inputs


def hf_model_for(config: BertConfig, hf_attention: str):
    """transformers' model of ``config``: BertForPreTraining, or ModernBertForMaskedLM for a
    ModernBERT configuration (its default dense prediction over every position)."""
    import transformers

    if config.is_bert:
        return transformers.BertForPreTraining(
            transformers.BertConfig(**config.to_dict(), attn_implementation=hf_attention)
        )
    from bert.model.hf_modernbert import config_to_hf

    hf_config = transformers.ModernBertConfig(**config_to_hf(config), attn_implementation=hf_attention)
    return transformers.ModernBertForMaskedLM(hf_config)


def default_variants(device: torch.device) -> list[str]:
    names = ["transformers", "padded", "unpadded/reference"]
    if device.type == "cuda":
        names += ["unpadded/padded", "unpadded/triton", "unpadded/triton_grouped"]
    names += ["packed/flashmask"]
    return names


def build_variants(
    names: list[str], explicit: bool, config: BertConfig, blocks, seq_len: int, device, hf_attention: str, seed: int
) -> list[Variant]:
    from bert.config import OptimSection
    from bert.model.hf import load_hf_state_dict
    from bert.model.pretraining import BertForPreTraining
    from bert.optim.optimizers import build_optimizer
    from data.collate import collate_padded, collate_unpadded
    from data.loader import make_collator

    torch.manual_seed(seed)
    hf_model = hf_model_for(config, hf_attention)
    weights = {k: v.clone() for k, v in hf_model.state_dict().items()}
    padded = [collate_padded(b, seq_len) for b in blocks]
    variants = []
    for name in names:
        v = Variant(name)
        layout, _, backend = name.partition("/")
        try:
            if name == "transformers":
                v.model, v.loss_fn = hf_model, hf_loss
                v.inputs = [hf_inputs(p, device, config.is_bert) for p in padded]
            elif name == "padded":
                v.model, v.loss_fn = BertForPreTraining(config, attention="padded"), our_loss
                v.inputs = [p.to(device) for p in padded]
            elif layout == "unpadded" and backend:
                if backend not in backend_names():
                    raise BackendUnavailable(f"attention backend {backend!r} is not registered")
                get_backend(backend)  # raises with the reason when it cannot run here
                v.model, v.loss_fn = BertForPreTraining(config, attention=backend), our_loss
                v.inputs = [collate_unpadded(b).to(device) for b in blocks]
            elif layout == "packed" and backend:
                if backend not in backend_names():
                    raise BackendUnavailable(f"attention backend {backend!r} is not registered")
                get_backend(backend)
                collate_packed = make_collator("torch", "packed", seq_len)  # first-fit decreasing rows
                v.model, v.loss_fn = BertForPreTraining(config, attention=backend), our_loss
                v.inputs = [collate_packed(b).to(device) for b in blocks]
            else:
                raise BenchError(
                    f"--variants: unknown variant {name!r}; choose from transformers, padded, "
                    f"unpadded/BACKEND, packed/BACKEND (backends: {', '.join(backend_names())})"
                )
        except BackendUnavailable as e:
            if explicit:
                raise BenchError(f"--variants {name}: {e}") from None
            v.skipped = str(e)
            variants.append(v)
            continue
        if v.model is not hf_model:
            load_hf_state_dict(v.model, weights)
        v.model.to(device)
        v.optimizer = build_optimizer(OptimSection(name="lamb", lr=1e-4), v.model)
        variants.append(v)
    return variants


# ---- measurement ------------------------------------------------------------------------


def autocast(device, precision: str):
    if precision == "fp32":
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=torch.bfloat16)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(v: Variant, inp, device, precision: str) -> None:
    from bert.optim.clipping import clip_global_

    with autocast(device, precision):
        loss = v.loss_fn(v.model, inp)
    loss.backward()
    clip_global_([p for p in v.model.parameters() if p.grad is not None], 1.0)
    v.optimizer.step()
    v.optimizer.zero_grad(set_to_none=True)


@torch.no_grad()
def check_same_function(variants: list[Variant], device, precision: str) -> None:
    """Each variant's first-batch loss (eval mode, same weights) against transformers'."""
    ref = None
    for v in variants:
        if v.skipped:
            continue
        v.model.eval()
        with autocast(device, precision):
            v.check_loss = float(v.loss_fn(v.model, v.inputs[0]))
        v.model.train()
        if v.name == "transformers":
            ref = v.check_loss
    tol = 1e-4 if precision == "fp32" else 2e-2
    for v in variants:
        if v.check_loss is not None and ref is not None and abs(v.check_loss - ref) > tol * abs(ref):
            raise BenchError(
                f"variant {v.name}: first-batch loss {v.check_loss:.6f} differs from transformers' "
                f"{ref:.6f} by more than {tol:g} relative; the variants do not compute the same thing"
            )


def measure(variants: list[Variant], rounds: int, warmup_rounds: int, device, precision: str, log) -> None:
    active = [v for v in variants if not v.skipped]
    for r in range(warmup_rounds + rounds):
        shift = r % len(active)
        for v in active[shift:] + active[:shift]:  # rotate the order: no variant always runs first
            sync(device)
            t = time.perf_counter()
            for inp in v.inputs:
                train_step(v, inp, device, precision)
            sync(device)
            dt = time.perf_counter() - t
            if r >= warmup_rounds:
                v.times.append(dt)
        if r < warmup_rounds:
            log(f"  warm-up round {r + 1}/{warmup_rounds} done")
        else:
            log(
                f"  round {r - warmup_rounds + 1}/{rounds}: "
                + ", ".join(f"{v.name} {v.times[-1]:.2f}s" for v in active)
            )


def profile(v: Variant, device, precision: str, rows: int = 15) -> str:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        train_step(v, v.inputs[0], device, precision)
        sync(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows)


# ---- report -----------------------------------------------------------------------------


def results(variants: list[Variant], blocks, seq_len: int, goal_vs_hf: float = GOAL_VS_HF) -> dict:
    seqs = sum(len(b) for b in blocks)
    real = sum(b.num_tokens for b in blocks)
    limit = seqs * seq_len / real
    timed = {v.name: statistics.median(v.times) for v in variants if v.times}
    hf = timed.get("transformers")
    padded = timed.get("padded")
    rows = []
    for v in variants:
        row = {"variant": v.name, "skipped": v.skipped, "check_loss": v.check_loss}
        if v.name in timed:
            t = timed[v.name]
            row.update(
                seconds_median=t,
                seconds_min=min(v.times),
                seconds_max=max(v.times),
                seq_per_s=seqs / t,
                tokens_per_s=real / t,
                vs_transformers=hf / t if hf else None,
                vs_padded=padded / t if padded else None,
            )
        rows.append(row)
    goals = {}
    unpadded = [r for r in rows if r["variant"].startswith("unpadded/") and "seq_per_s" in r]
    if unpadded and padded:
        best = max(unpadded, key=lambda r: r["seq_per_s"])
        goals["unpadded_vs_padded"] = {
            "variant": best["variant"],
            "measured": best["vs_padded"],
            "goal": GOAL_VS_LIMIT * limit,
            "met": best["vs_padded"] >= GOAL_VS_LIMIT * limit,
        }
    if unpadded and hf:
        best = max(unpadded, key=lambda r: r["seq_per_s"])
        goals["unpadded_vs_transformers"] = {
            "variant": best["variant"],
            "measured": best["vs_transformers"],
            "goal": goal_vs_hf,
            "met": best["vs_transformers"] >= goal_vs_hf,
            # Round r of every variant runs within one interleaved round: the ratio per round
            # shows the spread that the machine's load leaves in the median.
            "round_ratios": [
                h / t
                for h, t in zip(
                    next(v.times for v in variants if v.name == "transformers"),
                    next(v.times for v in variants if v.name == best["variant"]),
                )
            ],
        }
    return {
        "sequences": seqs,
        "real_tokens": real,
        "padded_tokens": seqs * seq_len,
        "padding_limit": limit,
        "rows": rows,
        "goals": goals,
    }


def table(res: dict) -> str:
    head = f"{'variant':<22} {'seq/s':>8} {'tokens/s':>9} {'vs transformers':>16} {'vs padded':>10} {'spread':>8}"
    lines = [head, "-" * len(head)]
    for r in res["rows"]:
        if "seq_per_s" not in r:
            lines.append(f"{r['variant']:<22} not run: {r['skipped']}")
            continue
        spread = (r["seconds_max"] - r["seconds_min"]) / r["seconds_median"]
        vs_hf = "n/a" if r["vs_transformers"] is None else f"{r['vs_transformers']:.2f}x"
        vs_p = "n/a" if r["vs_padded"] is None else f"{r['vs_padded']:.2f}x"
        lines.append(
            f"{r['variant']:<22} {r['seq_per_s']:>8.2f} {r['tokens_per_s']:>9.0f} {vs_hf:>16} {vs_p:>10} "
            f"{100 * spread:>7.0f}%"
        )
    lines.append(f"padding limit (padded / real tokens of these batches): {res['padding_limit']:.3f}")
    for key, g in res["goals"].items():
        what = (
            "vs this project's padded, goal >= 0.9 x padding limit"
            if key == "unpadded_vs_padded"
            else f"vs transformers, goal >= {g['goal']:g}x"
        )
        per_round = f" (rounds: {', '.join(f'{x:.2f}x' for x in g['round_ratios'])})" if "round_ratios" in g else ""
        lines.append(
            f"goal {g['variant']} {what}: measured {g['measured']:.2f}x{per_round}, goal {g['goal']:.2f}x -> "
            f"{'met' if g['met'] else 'MISSED'}"
        )
    return "\n".join(lines)


def plot(res: dict, path: Path, title: str) -> None:
    goal_vs_hf = res["goals"].get("unpadded_vs_transformers", {}).get("goal", GOAL_VS_HF)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in res["rows"] if "seq_per_s" in r]
    names = [r["variant"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax1.bar(names, [r["vs_transformers"] or 0 for r in rows], color="tab:blue")
    ax1.axhline(goal_vs_hf, color="tab:red", linestyle="--", label=f"goal {goal_vs_hf:g}x")
    ax1.set_ylabel("training sequences/s vs transformers")
    ax2.bar(names, [r["vs_padded"] or 0 for r in rows], color="tab:green")
    ax2.axhline(res["padding_limit"], color="black", linestyle="--", label=f"padding limit {res['padding_limit']:.2f}")
    ax2.axhline(
        GOAL_VS_LIMIT * res["padding_limit"], color="tab:red", linestyle=":", label=f"goal {GOAL_VS_LIMIT:g} x limit"
    )
    ax2.set_ylabel("vs this project's padded layout")
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", rotation=30)
        ax.grid(axis="y", alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    with publishing(path, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=100)
    plt.close(fig)


# ---- CLI --------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--data", help="a prepared data directory (with train/) or a shard directory")
    ap.add_argument(
        "--lengths",
        choices=("wikitext2",),
        help="instead of --data: WikiText-2's article lengths cut at --context, random tokens, 30%% masked",
    )
    ap.add_argument("--context", type=int, default=2048, help="--lengths: the context length")
    ap.add_argument("--model", default="small", choices=sorted(PRESETS), help="bert.config preset")
    ap.add_argument("--model-config", help="bert_config.json / config.json (overrides --model)")
    ap.add_argument("--vocab-size", type=int, help="override the model's vocabulary size")
    ap.add_argument("--layers", type=int, help="keep the model's first N layers (their layer types too)")
    ap.add_argument("--max-seq-length", type=int, help="pad to this length (default: the data's)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--batches", type=int, default=4, help="distinct batches, each trained on once per round")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds (the median is reported)")
    ap.add_argument("--warmup-rounds", type=int, default=1)
    ap.add_argument(
        "--variants",
        nargs="+",
        help="default: transformers padded unpadded/reference "
        "(+ unpadded/padded unpadded/triton unpadded/triton_grouped on CUDA) packed/flashmask; "
        "also packed/reference",
    )
    ap.add_argument(
        "--hf-attention", default="sdpa", choices=("sdpa", "eager"), help="transformers' attention implementation"
    )
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16"), help="bf16: autocast for all")
    ap.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="write the results here (default: results/throughput.json)")
    ap.add_argument("--png", help="write the chart here (default: next to --json)")
    ap.add_argument("--profile", action="store_true", help="print torch.profiler's top operators per variant")
    args = ap.parse_args(argv)
    for name in ("batch_size", "batches", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup_rounds < 0:
        ap.error("--warmup-rounds must be >= 0")
    if (args.data is None) == (args.lengths is None):
        ap.error("give one of --data DIR or --lengths wikitext2")
    if args.context < 3:
        ap.error("--context must be >= 3")
    if args.layers is not None and args.layers < 1:
        ap.error("--layers must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    try:
        if args.threads:
            torch.set_num_threads(args.threads)
        return _main(args)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(threads)  # main() may run inside a longer-lived process (tests)


def _main(args) -> int:
    from common.errors import ConfigError

    def log(msg: str) -> None:
        print(msg, flush=True)

    if args.device == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device cuda: CUDA is not available here")
    device = torch.device(
        "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    )
    try:
        config = read_config(args.model_config) if args.model_config else BertConfig.preset(args.model)
        if args.vocab_size:
            config = replace(config, vocab_size=args.vocab_size)
        if args.layers:
            types = config.layer_types[: args.layers]
            config = replace(config, num_hidden_layers=args.layers, layer_types=types)
    except ConfigError as e:
        raise BenchError(str(e)) from None
    if args.lengths:
        data = f"WikiText-2 article lengths (bench/wikitext2_article_lengths.json) cut at {args.context}"
        blocks, lengths = long_document_blocks(
            args.context, args.batch_size, args.batches, args.seed, config.vocab_size
        )
        seq_len = args.max_seq_length or args.context
    else:
        data = Path(args.data)
        if not data.is_dir():
            raise BenchError(f"--data: {data} is not a directory")
        blocks, info, lengths = load_blocks(data, args.batch_size, args.batches, args.seed, config.vocab_size)
        seq_len = args.max_seq_length or info.max_seq_length or int(lengths.max())
    if seq_len > config.max_position_embeddings:
        raise BenchError(
            f"--max-seq-length: {seq_len} exceeds the model's max_position_embeddings "
            f"({config.max_position_embeddings})"
        )
    if int(max(b.seq_lens.max() for b in blocks)) > seq_len:
        raise BenchError(f"--max-seq-length: {seq_len} is shorter than the longest sequence of the batches")
    data_limit = len(lengths) * seq_len / int(lengths.sum())

    explicit = args.variants is not None
    names = args.variants or default_variants(device)
    load_start = os.getloadavg()
    log(
        f"throughput: {device}{'' if device.type == 'cuda' else f' ({torch.get_num_threads()} threads)'}, "
        f"{args.precision}, model {args.model_config or args.model} ({config.num_hidden_layers} layers, hidden "
        f"{config.hidden_size}, {config.num_attention_heads} heads, intermediate {config.intermediate_size}, vocab "
        f"{config.vocab_size}), batch {args.batch_size} x {args.batches} batches, padded to {seq_len}, "
        f"{args.rounds} rounds + {args.warmup_rounds} warm-up; load average {load_start[0]:.1f}"
    )
    variants = build_variants(names, explicit, config, blocks, seq_len, device, args.hf_attention, args.seed)
    if not any(v.name == "transformers" and not v.skipped for v in variants):
        log("note: transformers is not among the variants; the vs-transformers column stays empty")
    check_same_function(variants, device, args.precision)
    log(
        "check: every variant's first-batch loss matches transformers' ("
        + ", ".join(f"{v.name} {v.check_loss:.5f}" for v in variants if v.check_loss is not None)
        + ")"
    )
    measure(variants, args.rounds, args.warmup_rounds, device, args.precision, log)
    load_end = os.getloadavg()

    res = results(variants, blocks, seq_len, GOAL_VS_HF if config.is_bert else GOAL_VS_HF_MODERN)
    res["data_padding_limit"] = data_limit
    res["setup"] = {
        "command": " ".join(["python", "bench/throughput.py", *sys.argv[1:]]),
        "data": str(data),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "precision": args.precision,
        "model": config.to_dict(),
        "batch_size": args.batch_size,
        "batches": args.batches,
        "seq_len": seq_len,
        "rounds": args.rounds,
        "warmup_rounds": args.warmup_rounds,
        "hf_attention": args.hf_attention,
        "transformers_version": __import__("transformers").__version__,
        "torch_version": torch.__version__,
        "load_average_start": load_start,
        "load_average_end": load_end,
    }
    print()
    print(table(res))
    print(
        f"padding limit of the whole training set: {data_limit:.3f}; load average (1 min) {load_start[0]:.1f} at "
        f"start, {load_end[0]:.1f} at end on {os.cpu_count()} CPUs"
    )
    if args.profile:
        for v in variants:
            if not v.skipped:
                print(f"\nprofile of one step: {v.name}\n{profile(v, device, args.precision)}")
    out = Path(args.json) if args.json else REPO / "results" / "throughput.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text(out, json.dumps(res, indent=1) + "\n")
    png = Path(args.png) if args.png else out.with_suffix(".png")
    title = (
        f"{device} {args.precision}: {config.num_hidden_layers}x{config.hidden_size} BERT, batch "
        f"{args.batch_size}, padded to {seq_len}, transformers attention {args.hf_attention}"
    )
    plot(res, png, title)
    print(f"wrote {out}, {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
