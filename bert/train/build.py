"""The trainer's parts, each built from its configuration section: factories only.

A field added to a section is read here or by the part itself, never unpacked on the way. Backend facts come from
``kernels.registry``, never from a backend's name.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from bert.config import CLOSED_EVAL_SAMPLES, DataSection, LogSection, ModelSection, RunConfig, TrainSection
from bert.distributed.collectives import Collectives
from bert.model import fp8
from bert.model.config import BertConfig
from bert.model.pretraining import BertForPreTraining
from bert.optim.clipping import AdaGC
from bert.optim.optimizers import build_optimizer, skips_on_device
from bert.optim.schedule import WarmupDecaySchedule
from bert.optim.shard import Sharding, build_sharded_lamb
from bert.report.metrics import MetricsWriter
from bert.report.tensorboard import TensorBoardSink
from bert.train.cuda_graphs import EncoderGraphs
from common.errors import ConfigError
from data.batch_ramp import BatchRamp, RampedLoader
from data.hdf5io import inspect
from data.loader import EvalLoader, PretrainingLoader, make_collator
from data.rebalance.exchange import Rebalancer
from data.static_shapes import MASKED_BUCKET, StaticShapes, auto_token_bucket
from data.synthetic import random_block

if TYPE_CHECKING:  # mlperf_logging is optional: imported by build_mlperf_logger
    from bert.report.mlperf_log import MLPerfLogger


def build_device(cfg: RunConfig, dist_info, output_dir: str) -> torch.device:
    """train.device: the rank's CUDA device (launch.distributed's pick) or the CPU, after the checks the config cannot
    make (ranks, device, files). Creates OUTPUT_DIR/checkpoints on rank 0; reads no data (MLPerf's clock is not on)."""
    t, world = cfg.train, dist_info.world_size
    if t.device == "cpu" or (t.device == "auto" and not torch.cuda.is_available()):
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        raise ConfigError("train.device: 'cuda' asked for, but CUDA is not available")
    else:
        device = dist_info.device if dist_info.device.type == "cuda" else torch.device("cuda", 0)
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
    if dist_info.rank == 0:
        try:
            os.makedirs(os.path.join(output_dir, "checkpoints"), exist_ok=True)
            probe = os.path.join(output_dir, ".write-test")
            open(probe, "w").close()
            os.remove(probe)
        except OSError as e:
            raise ConfigError(f"--output-dir: {output_dir!r} is not writable ({e.strerror})") from e
    return device


def build_model(
    model: ModelSection, config: BertConfig, train: TrainSection, device: torch.device, context=None
) -> BertForPreTraining:
    """The model of ``config`` and the model.* backends, its encoder's linear layers in train.fp8 (a ConfigError when
    ``device`` cannot run FP8 GEMMs); with ``context`` (``ContextGroups``), its attention split across that group."""
    built = BertForPreTraining(
        config,
        attention=model.attention,
        fused_ops=model.fused_ops,
        attention_options=model.attention_options,
        bias_gelu=model.bias_gelu,
        rotary_kernel=model.rotary_kernel,
        context_parallel=context is not None,
        context_group=None if context is None else context.group,
    )
    fp8.convert_encoder(built, train.fp8, device)
    return built


def build_graphs(cfg: RunConfig, micro_batch: int, model: BertForPreTraining):
    """(train.static_shapes' buckets (``data.static_shapes``) or None, train.cuda_graphs'
    ``bert.train.cuda_graphs.EncoderGraphs`` for ``model`` or None); the config checked what graphs can replay."""
    t, seq = cfg.train, cfg.data.max_seq_length
    if not t.static_shapes:
        return None, None
    bucket = auto_token_bucket(micro_batch, seq) if t.static_token_bucket == "auto" else t.static_token_bucket
    shapes = StaticShapes(bucket, MASKED_BUCKET, max(seq, bucket))
    return shapes, EncoderGraphs(model.layers, shapes.max_seqlen, model.rotary) if t.cuda_graphs else None


def build_forward(
    model: torch.nn.Module, section: ModelSection, device: torch.device, coll: Collectives, sharded: bool = False
):
    """(DDP wrapper or None, the module the steps call): DDP over several ranks unless the model is
    sharded (FSDP2 reduces the gradients itself), then torch.compile when model.compile is on."""
    ddp = None
    if coll.world_size > 1 and not sharded:
        with coll.guard("the DDP setup (parameter broadcast)", -1):
            ids = [device.index] if device.type == "cuda" else None
            ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
    forward = ddp or model
    return ddp, torch.compile(forward) if section.compile else forward


def build_optimization(cfg: RunConfig, model: torch.nn.Module, sharding: Sharding | None, device: torch.device):
    """(optimizer, schedule, AdaGC or None, fp16's GradScaler or None) from ``cfg.optim`` and ``cfg.train``. The
    schedule's rate is a device tensor where the optimizer skips on the device (not apex's FusedLAMB). Sharded: LAMB on
    the shards, AdaGC with whole-tensor norms, FSDP's ShardedGradScaler (every rank skips alike)."""
    o = cfg.optim
    optimizer = build_sharded_lamb(o, model, sharding) if sharding else build_optimizer(o, model)
    device_lr = device if skips_on_device(optimizer) else None
    schedule = WarmupDecaySchedule(optimizer, o, cfg.train.max_steps, device=device_lr)
    view = {"local": sharding.local, "norms": sharding.norms} if sharding else {}
    adagc = AdaGC(model.named_parameters(), o.adagc, o.max_grad_norm, **view) if o.clip == "adagc" else None
    return optimizer, schedule, adagc, build_grad_scaler(cfg.train, sharding)


def build_grad_scaler(train: TrainSection, sharding: Sharding | None):
    """fp16's loss scaler (None otherwise); sharded, FSDP's ShardedGradScaler."""
    if train.precision != "fp16":
        return None
    return torch.amp.GradScaler("cuda") if sharding is None else ShardedGradScaler("cuda")


def build_collator(data: DataSection, device: torch.device, max_batch_size: int):
    """SampleBlock -> data.layout's batch, by data.backend. DALI collates on this rank's GPU
    when there is one; torch collates on the CPU and the batch is moved with a non-blocking copy."""
    device_id = device.index if data.backend == "dali" and device.type == "cuda" else None
    return make_collator(data.backend, data.layout, data.max_seq_length, device_id, max_batch_size=max_batch_size)


def build_rebalancer(cfg: RunConfig, local_batch: int, timeout_s: float):
    """data.rebalance's cross-rank rebalancer (None for none), given plain values: ``data`` sits below ``bert``."""
    data = cfg.data
    if data.rebalance == "none":
        return None
    return Rebalancer(
        data.rebalance,
        tuple(data.rebalance_cost),  # data.rebalance.plan.Cost's fields
        batch_size=local_batch,
        max_len=data.max_seq_length,
        timeout_s=timeout_s,
        group_size=data.rebalance_group_size,
        ramp=build_batch_ramp(cfg.train),
        measured=data.rebalance_measured[:3],
        max_share=data.rebalance_measured[3],
        min_samples=cfg.train.grad_accum_steps,  # one sample per micro-batch at least
        # dist.context_parallel: long samples go to CP groups, which split them (place_context)
        context=tuple(cfg.dist.context_parallel) if cfg.dist.context_size > 1 else None,
    )


def build_batch_ramp(train: TrainSection):
    """train.batch_size_warmup's ``data.batch_ramp.BatchRamp``, or None when the warm-up is off."""
    if train.batch_size_warmup is None:
        return None
    (start, steps), unit = train.batch_size_warmup, train.global_batch_size // train.grad_accum_steps
    return BatchRamp(unit, start // unit, train.grad_accum_steps, steps)


class _NoMLPerfLog:
    """log.mlperf=false: every MLPerfLogger call accepted and dropped."""

    _open: dict = {}

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def build_mlperf_logger(
    log: LogSection, output_dir: str, rank: int, nodes: int, device: torch.device, resume: bool
) -> MLPerfLogger:
    """OUTPUT_DIR/mlperf.log, written by rank 0; the platform is log.platform or the device. mlperf_logging is optional:
    without it, a one-line ConfigError naming the package and log.mlperf=false (no MLPerf log: calls dropped)."""
    if not log.mlperf:
        return _NoMLPerfLog()
    try:
        from bert.report.mlperf_log import MLPerfLogger
    except ImportError as e:
        raise ConfigError(
            "log: the MLPerf log (mlperf.log) needs mlperf_logging (pip install -r requirements.txt;"
            f" log.mlperf=false trains without it): {e}"
        ) from e
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
        sink = TensorBoardSink(os.path.join(output_dir, "tensorboard"), config, resume_step, metrics.records)
        metrics.sinks.append(sink)
    return metrics


def build_loaders(cfg: RunConfig, rank: int, world: int, seed: int, model_config: BertConfig, warn, eval_loader=None):
    """(train loader, eval loader), the eval one built unless given, checked against the config
    (``_check_data``); both check every token id against the model's vocabulary."""
    vocab = model_config.vocab_size
    train = build_train_loader(cfg, rank, world, seed, vocab, warn)
    evals = eval_loader or build_eval_loader(cfg, rank, world, vocab)
    try:
        _check_data(cfg, model_config, train, evals)
    except ConfigError:
        train.close()  # its read-ahead thread
        raise
    return train, evals


def build_train_loader(cfg: RunConfig, rank: int, world: int, seed: int, vocab_size: int, warn):
    """This rank's share of data.train_dir, shuffled by ``seed``; ``warn`` hears of corrupt samples."""
    # With a batch-size warm-up the loader is planned at the ramp's unit, drawn k units a step.
    ramp = build_batch_ramp(cfg.train)
    loader = PretrainingLoader(
        cfg.data.train_dir,
        global_batch_size=cfg.train.global_batch_size if ramp is None else ramp.unit,
        rank=rank,
        world_size=world,
        seed=seed,
        backend=cfg.data.backend,
        vocab_size=vocab_size,
        max_seq_length=cfg.data.max_seq_length,
        on_corrupt=cfg.data.on_corrupt,
        warn=warn,
    )
    return loader if ramp is None else RampedLoader(loader, ramp)


def build_eval_loader(cfg: RunConfig, rank: int, world: int, vocab_size: int):
    """This rank's share of data.eval_file (eval.max_samples of it, if set)."""
    return EvalLoader(
        cfg.data.eval_file,
        rank=rank,
        world_size=world,
        batch_size=cfg.eval.batch_size,
        max_samples=cfg.eval.max_samples,
        vocab_size=vocab_size,
        backend=cfg.data.backend,
        max_seq_length=cfg.data.max_seq_length,
    )


def _check_data(cfg: RunConfig, model_config: BertConfig, train_loader, eval_loader) -> None:
    """The opened data against the config: the closed division's eval size, a next-sentence head against masked-LM-only
    shards, and the first training shard's lengths and masked positions against data.* (ConfigError naming both)."""
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


def build_warm_up_blocks(data: DataSection, vocab_size: int, micro_batch: int, cuda: bool) -> list:
    """Synthetic SampleBlocks for ``Trainer.warm_up``: on a GPU one micro-batch at full length (the
    allocator's worst case) and one of mixed lengths (the other buckets' kernels); on a CPU one tiny block."""
    seq = data.max_seq_length
    predictions = min(data.max_predictions_per_seq, max(1, seq // 8))
    if not cuda:
        short = min(seq, 16)
        kw = dict(max_seq_length=short, max_predictions=min(predictions, 2), vocab_size=vocab_size)
        return [random_block(2, seed=0, min_len=min(8, short), **kw)]
    kw = dict(max_seq_length=seq, max_predictions=predictions, vocab_size=vocab_size)
    return [random_block(micro_batch, seed=0, min_len=seq, **kw), random_block(micro_batch, seed=1, **kw)]
