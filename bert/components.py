"""The trainer's parts, each built from its configuration section.

One factory per section, called by ``bert.trainer.Trainer`` (and by ``bert.export`` for the
model's shape): a field added to a section is read here or by the part itself, never
unpacked on the way. The optimizer (``bert.optim.build_optimizer(cfg.optim, model)``), the
schedule (``bert.schedule.PolyWarmupScheduler(optimizer, cfg.optim, max_steps)``) and AdaGC
(``bert.clipping.AdaGC(named_parameters, cfg.optim.adagc)``) take their section themselves.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from bert import fp8
from bert.clipping import AdaGC
from bert.collectives import Collectives
from bert.config import BertConfig
from bert.config import ConfigError as BertConfigError
from bert.metrics import MetricsWriter
from bert.model import BertForPreTraining
from bert.optim import build_optimizer, skips_on_device
from bert.schedule import PolyWarmupScheduler
from bert.sharded_optim import Sharding, build_sharded_lamb, local_shard
from bert.train_config import (
    CLOSED_EVAL_SAMPLES,
    ConfigError,
    DataSection,
    DebugSection,
    LogSection,
    ModelSection,
    OptimSection,
    RunConfig,
    TrainSection,
    model_shape,
)
from data.batch import to_device

if TYPE_CHECKING:  # mlperf_logging is optional: imported by build_mlperf_logger
    from bert.mlperf_log import MLPerfLogger

_M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def map_large_allocations() -> None:
    """Give every allocation of 128 KiB or more its own mapping, returned to the OS when freed
    (glibc's M_MMAP_THRESHOLD, fixed; nothing where the C library has no ``mallopt``).

    Unpadded batches hold a different number of tokens every step, so every step allocates
    tensors of new sizes. By default glibc raises its mmap threshold (up to 32 MiB) as such
    blocks are freed, then serves them from the heap, whose freed pages it keeps: a 2-rank CPU
    run's resident memory crept up by 5% after its warm-up while Python's heap stayed flat.
    With the threshold fixed it stays flat (bench/soak.py; docs/reliability.md, "Endurance"),
    but every step's large tensors then fault in fresh pages: CPU training runs ~1.5x slower,
    so this is ``train.flat_host_memory``, off by default.
    """
    import ctypes

    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None:
        mallopt(ctypes.c_int(_M_MMAP_THRESHOLD), ctypes.c_int(128 << 10))


def build_model_config(cfg: RunConfig) -> BertConfig:
    """The architecture: model.preset or model.config_file, with model.overrides; a
    data.vocab_file (a vocabulary trained with the data) sets the vocabulary size."""
    config = model_shape(cfg.model)
    if "vocab_size" not in cfg.model.overrides and cfg.data.vocab_file:
        try:
            with open(cfg.data.vocab_file, encoding="utf-8") as f:
                size = sum(1 for line in f if line.strip())
        except OSError as e:
            raise ConfigError(f"data.vocab_file: cannot read {cfg.data.vocab_file!r} ({e.strerror})") from None
        try:
            config = replace(config, vocab_size=size)
        except BertConfigError as e:
            raise ConfigError(f"data.vocab_file: {e}") from None
    if any(w is not None for w in config.layer_windows) and cfg.data.layout != "packed":
        # Local layers hand the backend a windowed layout; the packed layout carries the window
        # in its FlashMask bounds instead.
        from kernels.interface import PaddedLayout, VarlenLayout
        from kernels.registry import refusal

        layout = PaddedLayout if cfg.data.layout == "padded" else VarlenLayout
        reason = refusal(cfg.model.attention, layout, ["window"])
        if reason:
            raise ConfigError(f"model.attention: the model has local (sliding-window) layers; {reason}")
    if cfg.data.max_seq_length > config.max_position_embeddings:
        raise ConfigError(
            f"data.max_seq_length: {cfg.data.max_seq_length} exceeds the model's "
            f"max_position_embeddings ({config.max_position_embeddings})"
        )
    return config


def build_model(
    model: ModelSection, config: BertConfig, train: TrainSection | None = None, device: torch.device | None = None
) -> BertForPreTraining:
    """The model of ``config`` with model.attention (and its options), model.fused_ops,
    model.bias_gelu and model.rotary_kernel; with ``train``, its encoder's linear layers in
    train.fp8 (bert.fp8; a ConfigError when ``device`` cannot run FP8 GEMMs)."""
    built = BertForPreTraining(
        config,
        attention=model.attention,
        fused_ops=model.fused_ops,
        attention_options=model.attention_options,
        bias_gelu=model.bias_gelu,
        rotary_kernel=model.rotary_kernel,
    )
    if train is not None:
        fp8.convert_encoder(built, train.fp8, device)
    return built


@torch.no_grad()
def inject_debug_faults(debug: DebugSection, model: torch.nn.Module, step: int) -> None:
    """debug.*: before update ``step`` (1-based), multiply chosen gradients, or make one non-finite."""
    if step in debug.spike_steps:
        for name, p in model.named_parameters():
            if p.grad is not None and (not debug.spike_params or any(s in name for s in debug.spike_params)):
                p.grad.mul_(debug.spike_factor)
    if step in debug.nonfinite_steps:
        # Sharded: the rank holding the first element of the first gradient writes it.
        grad = local_shard(next(p for p in model.parameters() if p.grad is not None).grad)
        if grad.numel():
            grad.view(-1)[0] = float(debug.nonfinite_value)


def build_collator(data: DataSection, device: torch.device, max_batch_size: int):
    """SampleBlock -> data.layout's batch, by data.backend. DALI collates on this rank's GPU
    when there is one; torch collates on the CPU and the batch is moved with a non-blocking copy."""
    from data.collate import make_collator

    device_id = device.index if data.backend == "dali" and device.type == "cuda" else None
    return make_collator(data.backend, data.layout, data.max_seq_length, device_id, max_batch_size=max_batch_size)


def wrap_model(
    model: torch.nn.Module, section: ModelSection, device: torch.device, coll: Collectives, sharded: bool = False
):
    """(DDP wrapper or None, the module the steps call): DDP when there are several ranks
    (its parameter broadcast guarded) and the model is not sharded (``apply_sharding`` made it
    FSDP2's, which reduces the gradients itself), then torch.compile when model.compile is on."""
    ddp = None
    if coll.world_size > 1 and not sharded:
        with coll.guard("the DDP setup (parameter broadcast)", -1):
            ddp = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[device.index] if device.type == "cuda" else None
            )
    forward = ddp or model
    return ddp, torch.compile(forward) if section.compile else forward


def count_nodes(dist_info, coll: Collectives, device: torch.device) -> int:
    """Nodes in the job (for submission_platform): ranks with local rank 0."""
    first = torch.tensor([int(dist_info.local_rank == 0)], dtype=torch.int64, device=device)
    return max(1, int(coll.all_reduce(first, "the node count", 0)))


def build_adagc(optim: OptimSection, model: torch.nn.Module, sharding: Sharding | None = None) -> AdaGC | None:
    """AdaGC when optim.clip is adagc; None for global-norm clipping and none (the trainer's
    optimizer_step clips by norm itself, clip_global_ being stateless). Sharded: its
    thresholds are kept per tensor on every rank, its norms are the whole tensors'."""
    if optim.clip != "adagc":
        return None
    view = {"local": sharding.local, "norms": sharding.norms} if sharding else {}
    return AdaGC(model.named_parameters(), optim.adagc, optim.max_grad_norm, **view)


def build_optimization(cfg: RunConfig, model: torch.nn.Module, sharding: Sharding | None, device: torch.device):
    """(optimizer, schedule, AdaGC or None, GradScaler or None) from ``cfg.optim`` and ``cfg.train``.
    The schedule keeps its rate in a device tensor where the optimizer can skip on the device
    (not apex's FusedLAMB: bert.optim.skips_on_device). Sharded, it is LAMB on the shards."""
    optimizer = build_sharded_lamb(cfg.optim, model, sharding) if sharding else build_optimizer(cfg.optim, model)
    device_lr = device if skips_on_device(optimizer) else None
    schedule = PolyWarmupScheduler(optimizer, cfg.optim, cfg.train.max_steps, device=device_lr)
    return optimizer, schedule, build_adagc(cfg.optim, model, sharding), build_grad_scaler(cfg.train, sharding)


def build_grad_scaler(train: TrainSection, sharding: Sharding | None):
    """fp16's loss scaler (None otherwise). Sharded, each rank sees only its shards' overflow:
    FSDP's ShardedGradScaler all-reduces the overflow flag, so every rank skips and rescales alike."""
    if train.precision != "fp16":
        return None
    if sharding is None:
        return torch.amp.GradScaler("cuda")
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler("cuda")


def build_rebalancer(cfg: RunConfig, local_batch: int, timeout_s: float):
    """The cross-rank rebalancer of data.rebalance; None for data.rebalance=none.

    ``data.rebalance`` sits below ``bert`` (where the config dataclasses live), so its
    ``Rebalancer`` takes plain values, read from the sections here."""
    data = cfg.data
    if data.rebalance == "none":
        return None
    from data.rebalance import Rebalancer

    return Rebalancer(
        data.rebalance,
        data.rebalance_cost_tuple,
        batch_size=local_batch,
        max_len=data.max_seq_length,
        timeout_s=timeout_s,
        group_size=data.rebalance_group_size,
        ramp=batch_ramp(cfg.train),
    )


def batch_ramp(train: TrainSection):
    """train.batch_size_warmup's ``data.batch_ramp.BatchRamp``, or None when the warm-up is off."""
    if train.batch_size_warmup is None:
        return None
    from data.batch_ramp import BatchRamp

    (start, steps), unit = train.batch_size_warmup, train.global_batch_size // train.grad_accum_steps
    return BatchRamp(unit, start // unit, train.grad_accum_steps, steps)


def build_mlperf_logger(
    log: LogSection, output_dir: str, rank: int, nodes: int, device: torch.device, resume: bool
) -> MLPerfLogger:
    """OUTPUT_DIR/mlperf.log, written by rank 0; the platform is log.platform or the device.
    mlperf_logging is imported here, so that a run's modules import without it; a missing one
    is a one-line ConfigError naming the package."""
    try:
        from bert.mlperf_log import MLPerfLogger
    except ImportError as e:
        raise ConfigError(
            f"log: the MLPerf log (mlperf.log) needs mlperf_logging (pip install -r requirements.txt): {e}"
        ) from None
    platform = log.platform or (torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
    return MLPerfLogger(
        os.path.join(output_dir, "mlperf.log"),
        rank,
        log.division,
        submitter=log.submitter or "unpadded-bert",  # only the open division may leave it empty
        platform=f"{nodes}x{platform}",
        resume=resume,
    )


def build_metrics(log: LogSection, output_dir: str, is_main: bool, resume_step: int | None, config: dict):
    """OUTPUT_DIR/metrics.jsonl (rank 0), with TensorBoard events when log.tensorboard is on.
    ``resume_step``: the checkpoint's step on a resume (later records are dropped), else None."""
    metrics = MetricsWriter(os.path.join(output_dir, "metrics.jsonl"), is_main, resume_step=resume_step)
    if log.tensorboard and is_main:
        from bert.tensorboard_sink import TensorBoardSink

        metrics.sinks.append(
            TensorBoardSink(os.path.join(output_dir, "tensorboard"), config, resume_step, metrics.records)
        )
    return metrics


def pick_device(train: TrainSection, dist_info) -> torch.device:
    """train.device: the rank's CUDA device (launch.distributed's pick) or the CPU."""
    want = train.device
    if want == "cpu" or (want == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("train.device: 'cuda' asked for, but CUDA is not available")
    return dist_info.device if dist_info.device.type == "cuda" else torch.device("cuda", 0)


def check_setup(cfg: RunConfig, world: int, device: torch.device, output_dir: str, is_main: bool) -> None:
    """What the config check cannot see: the number of ranks, the device, the files. Creates
    OUTPUT_DIR/checkpoints on rank 0; reads nothing of the dataset (MLPerf's clock has not started)."""
    t = cfg.train
    if t.global_batch_size % (world * t.grad_accum_steps):
        raise ConfigError(
            f"train.global_batch_size: {t.global_batch_size} is not divisible by ranks x "
            f"train.grad_accum_steps = {world} x {t.grad_accum_steps}"
        )
    if t.precision == "fp16" and device.type != "cuda":
        raise ConfigError("train.precision: fp16 needs CUDA (use bf16 or fp32 on the CPU)")
    for key, path in (("data.train_dir", cfg.data.train_dir), ("data.eval_file", cfg.data.eval_file)):
        if not path or not os.path.exists(path):  # a stat, not a read: the data stays untouched
            raise ConfigError(f"{key}: {path!r} does not exist")
    if is_main:
        try:
            os.makedirs(os.path.join(output_dir, "checkpoints"), exist_ok=True)
            probe = os.path.join(output_dir, ".write-test")
            open(probe, "w").close()
            os.remove(probe)
        except OSError as e:
            raise ConfigError(f"--output-dir: {output_dir!r} is not writable ({e.strerror})") from None


def build_train_loader(cfg: RunConfig, rank: int, world: int, seed: int, vocab_size: int, warn):
    """This rank's share of data.train_dir, shuffled by ``seed``; token ids are checked
    against ``vocab_size`` as they are read; ``warn`` hears of corrupt samples."""
    from data.batch_ramp import RampedLoader
    from data.loader import PretrainingLoader

    # With a batch-size warm-up the loader is planned at the ramp's unit, drawn k units a step.
    ramp = batch_ramp(cfg.train)
    loader = PretrainingLoader(
        cfg.data.train_dir,
        global_batch_size=cfg.train.global_batch_size if ramp is None else ramp.unit,
        rank=rank,
        world_size=world,
        seed=seed,
        backend=cfg.data.backend,
        vocab_size=vocab_size,
        on_corrupt=cfg.data.on_corrupt,
        warn=warn,
    )
    return loader if ramp is None else RampedLoader(loader, ramp)


def build_eval_loader(cfg: RunConfig, rank: int, world: int, vocab_size: int):
    """This rank's share of data.eval_file (eval.max_samples of it, if set)."""
    from data.loader import EvalLoader

    return EvalLoader(
        cfg.data.eval_file,
        rank=rank,
        world_size=world,
        batch_size=cfg.eval.batch_size,
        max_samples=cfg.eval.max_samples,
        vocab_size=vocab_size,
        backend=cfg.data.backend,
    )


def check_data(cfg: RunConfig, model_config: BertConfig, train_loader, eval_loader) -> None:
    """The opened data against the config: the closed division's eval size, a next-sentence
    head against masked-LM-only shards, and the first training shard's lengths and masked
    positions against data.* (ConfigError naming both)."""
    from data.hdf5io import inspect

    data = cfg.data
    if cfg.log.division == "closed" and eval_loader.total_samples != CLOSED_EVAL_SAMPLES:
        raise ConfigError(
            f"data.eval_file: the closed division evaluates on exactly {CLOSED_EVAL_SAMPLES:,} "
            f"samples; {data.eval_file} holds {eval_loader.total_samples:,}"
        )
    info = inspect(train_loader.files[0])
    if model_config.next_sentence and not train_loader.next_sentence:
        # Its labels would read as 0: the NSP head would learn that every pair is consecutive.
        raise ConfigError(
            f"data.train_dir: {info.path} is masked-LM only (no next_sentence_labels), but the model has a "
            "next-sentence head; train a model without one (model.preset=modernbert_*) or prepare "
            "the data with --objective nsp"
        )
    if info.max_seq_length is not None and info.max_seq_length > data.max_seq_length:
        raise ConfigError(
            f"data.max_seq_length: {data.max_seq_length}, but {info.path} holds "
            f"sequences of up to {info.max_seq_length} tokens"
        )
    if info.max_predictions is not None and info.max_predictions > data.max_predictions_per_seq:
        raise ConfigError(
            f"data.max_predictions_per_seq: {data.max_predictions_per_seq}, but "
            f"{info.path} holds up to {info.max_predictions} masked positions per sequence"
        )


def warm_up_blocks(data: DataSection, vocab_size: int, micro_batch: int, cuda: bool) -> list:
    """Synthetic SampleBlocks for ``Trainer.warm_up``: on a GPU one micro-batch at full length
    (the allocator's worst case) and one of mixed lengths (the other length buckets'
    kernels); on a CPU one tiny block."""
    from data.synthetic import random_block

    seq = data.max_seq_length
    predictions = min(data.max_predictions_per_seq, max(1, seq // 8))
    if cuda:
        return [
            random_block(
                micro_batch, seed=0, max_seq_length=seq, max_predictions=predictions, vocab_size=vocab_size, min_len=seq
            ),
            random_block(micro_batch, seed=1, max_seq_length=seq, max_predictions=predictions, vocab_size=vocab_size),
        ]
    short = min(seq, 16)
    return [
        random_block(
            2,
            seed=0,
            max_seq_length=short,
            max_predictions=min(predictions, 2),
            vocab_size=vocab_size,
            min_len=min(8, short),
        )
    ]


def build_static_shapes(cfg: RunConfig, micro_batch: int, model: BertForPreTraining, config: BertConfig):
    """train.static_shapes: the buckets (``data.static_shapes``), or None when off; with
    train.cuda_graphs the encoder then replays graphs (``bert.cuda_graphs``), and a dropout
    the graphs would freeze is a ConfigError (the rest was checked with the config)."""
    from data.static_shapes import MASKED_BUCKET, StaticShapes, auto_token_bucket

    t, seq = cfg.train, cfg.data.max_seq_length
    if not t.static_shapes:
        return None
    bucket = auto_token_bucket(micro_batch, seq) if t.static_token_bucket == "auto" else t.static_token_bucket
    shapes = StaticShapes(bucket, MASKED_BUCKET, max(seq, bucket))
    if t.cuda_graphs:
        from bert.cuda_graphs import EncoderGraphs, graph_safe_dropout

        why = graph_safe_dropout(cfg.model.attention, config.attention_probs_dropout_prob)
        if why:
            raise ConfigError(f"train.cuda_graphs: {why}")
        model.encoder_graphs = EncoderGraphs(model.layers, shapes.max_seqlen, model.rotary)
    return shapes


def micro_batch(batch, block, static, shapes_seen: set, device: torch.device):
    """(the collated ``batch`` of ``block`` padded to its bucket when ``static`` is set, on
    ``device``; its real (tokens, sequences, masked) counts, from the host). Records its shape."""
    real = (batch.num_tokens, len(block), int(block.masked_counts.sum()))
    batch = static.pad(batch) if static else batch
    shapes_seen.add((batch.num_tokens, batch.mlm_positions.numel()))
    return to_device(batch, device), real


def apply_update(optimizer, schedule, found_inf: torch.Tensor, scaler=None) -> None:
    """The update and the schedule's step, skipped where ``found_inf`` (0-dim device bool).

    On the device, without a read, for an optimizer that skips there (``bert.optim``'s Lamb
    and AdamW, the sharded LAMB: ``skips_on_device``) with a device schedule. apex's FusedLAMB
    cannot, so with it the host reads ``found_inf`` (one read per step); fp16's GradScaler
    decides its own skip on the host (``scaler.step`` reads the device)."""
    on_device = skips_on_device(optimizer) and schedule.device is not None
    applied = True if on_device else not bool(found_inf)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    elif on_device:
        optimizer.step(found_inf=found_inf)
    elif applied:
        optimizer.step()
    if on_device:
        schedule.step(found_inf)
    elif applied:
        schedule.step()
